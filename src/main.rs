//! The `chat-history-view` binary: parse the configuration, start logging and the trace exporter, build the
//! application, run it until SIGINT or SIGTERM, report how it ended.

use std::process::ExitCode;

use chat_history_view::config::Config;
use chat_history_view::startup::Application;
use chat_history_view::{shutdown, telemetry};

/// Chosen: jemalloc, with a background thread returning freed pages to the system after a second (its settings are
/// in `.cargo/config.toml`). Under glibc's malloc, the memory of large store reads stayed resident after they ended
/// (up to 90 MiB of 170 MiB ten seconds later); mimalloc kept all of it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::load();
    let (exporter, tracer) = match telemetry::trace::build(&config.trace) {
        Ok(built) => built.unzip(),
        Err(error) => {
            eprintln!("cannot start the trace exporter: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    telemetry::init(config.log.format, std::io::stdout, tracer);
    config.trace.announce();
    let result = async {
        let application = Application::build(config).await?;
        application.run_until_stopped(shutdown::signal()).await
    }
    .await;
    if let Some(exporter) = exporter {
        exporter.shutdown();
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "chat-history-view failed");
            ExitCode::FAILURE
        }
    }
}
