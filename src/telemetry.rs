//! Logging: one `tracing` subscriber, JSON or text, filtered by `RUST_LOG` (default `info`), installed once.
//! Unless `RUST_LOG` names the NATS client (`async_nats`), the client logs warnings only and its connector nothing:
//! the worker logs each connection event itself, a failure at WARN with the redacted address and its kind,
//! rate-limited ([`crate::source::connect::ConnectionLog`]), where the client would log every event at INFO and
//! every failed attempt (every few seconds, without end) at ERROR. The client is never given credentials in an
//! address, so its own lines, when asked for, hold none.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// How log lines are written (`HISTORY_VIEW_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
    Auto,
}

/// The logging settings (help heading "Logging").
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Logging")]
#[deny(missing_docs)]
pub struct LogSettings {
    /// Log format: json, text, or auto (text on a terminal, json otherwise). Filtering follows RUST_LOG (default
    /// info).
    #[arg(
        id = "log_format",
        value_name = "LOG_FORMAT",
        long = "log-format",
        env = "HISTORY_VIEW_LOG_FORMAT",
        default_value = "auto",
        value_enum
    )]
    pub format: LogFormat,
}

/// Installs the global subscriber writing to `sink`. Returns false when one was installed already (tests build
/// several applications in one process), which is not an error.
pub fn init<W>(format: LogFormat, sink: W) -> bool
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let names_the_client =
        std::env::var("RUST_LOG").is_ok_and(|value| value.contains("async_nats"));
    if !names_the_client {
        for directive in ["async_nats=warn", "async_nats::connector=off"] {
            filter = filter.add_directive(directive.parse().expect("a valid directive"));
        }
    }
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(sink);
    let result = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
    } else {
        builder.try_init()
    };
    result.is_ok()
}

/// Lets at most one log line per second through for one kind of repeated warning, so a flood of bad input or a
/// misconfiguration cannot flood the log (the metric next to the line still counts every occurrence).
#[derive(Debug, Default)]
pub struct RateLimit(std::sync::atomic::AtomicU64);

impl RateLimit {
    /// Whether a line may be logged now.
    pub fn allow(&self) -> bool {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.0.swap(now, std::sync::atomic::Ordering::Relaxed) != now
    }
}
