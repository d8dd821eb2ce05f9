//! Logging and traces: one `tracing` subscriber, installed once: log lines, JSON or text, filtered by `RUST_LOG`
//! (default `info`), and the OpenTelemetry layer when tracing is on ([`trace`]).
//! Unless `RUST_LOG` names the NATS client (`async_nats`), the client logs warnings only and its connector nothing:
//! the worker logs each connection event itself, a failure at WARN with the redacted address and its kind,
//! rate-limited ([`crate::source::connect::ConnectionLog`]), where the client would log every event at INFO and
//! every failed attempt (every few seconds, without end) at ERROR. The client is never given credentials in an
//! address, so its own lines, when asked for, hold none.

#[cfg(test)]
pub mod testing;
pub mod trace;

use std::io::IsTerminal;
use std::sync::OnceLock;

use opentelemetry::trace::TraceContextExt;
use tracing::dispatcher::WeakDispatch;
use tracing_subscriber::filter::{FilterExt, Targets, filter_fn};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

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

/// Installs the global subscriber writing to `sink`, with the OpenTelemetry layer when tracing is on (`tracer`).
/// Returns false when one was installed already (tests build several applications in one process), which is not
/// an error.
///
/// `RUST_LOG` filters the log lines only: the worker's spans go to the OpenTelemetry layer whatever it says, and
/// to no layer when tracing is off, so that they cost nothing then ([`trace`]). A JSON line logged inside a span
/// carries its `trace_id` and `span_id`.
pub fn init<W>(format: LogFormat, sink: W, tracer: Option<opentelemetry_sdk::trace::Tracer>) -> bool
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
    // Log lines are events: no span is enabled for the log layer, whatever RUST_LOG says.
    let lines = filter.and(filter_fn(|metadata| metadata.is_event()));
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    let log_layer = if json {
        let mut layer = json_subscriber::layer()
            .with_writer(sink)
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false);
        let inner = layer.inner_layer_mut();
        inner.add_dynamic_field("trace_id", |_, ctx| {
            current_ids(ctx).map(|(trace, _)| serde_json::Value::String(trace))
        });
        inner.add_dynamic_field("span_id", |_, ctx| {
            current_ids(ctx).map(|(_, span)| serde_json::Value::String(span))
        });
        layer.with_filter(lines).boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(sink)
            .with_filter(lines)
            .boxed()
    };
    // The worker's spans, at any level, and nothing else.
    let otel_layer = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_level(false)
            .with_target(false)
            // Neither the code location, the thread nor busy and idle times per span: cost on every span, and
            // nothing a trace backend needs to follow a read.
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target("chat_history_view", tracing::Level::TRACE))
    });
    let installed = tracing_subscriber::registry()
        .with(log_layer)
        .with(otel_layer)
        .try_init()
        .is_ok();
    if installed {
        let _ = DISPATCH.set(tracing::dispatcher::get_default(|dispatch| {
            dispatch.downgrade()
        }));
    }
    installed
}

/// The global dispatcher, which the JSON layer asks for the current span's OpenTelemetry context: inside the
/// dispatch of a log line, `tracing` hands out no dispatcher.
static DISPATCH: OnceLock<WeakDispatch> = OnceLock::new();

/// The trace and span ids of the current span, when tracing is on and a span is current.
fn current_ids<S>(ctx: &tracing_subscriber::layer::Context<'_, S>) -> Option<(String, String)>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    if !trace::enabled() {
        return None;
    }
    let id = ctx.current_span().id()?.clone();
    let dispatch = DISPATCH.get()?.upgrade()?;
    let cx = tracing_opentelemetry::get_otel_context(&id, &dispatch)?;
    let span = cx.span();
    let context = span.span_context();
    context.is_valid().then(|| {
        (
            context.trace_id().to_string(),
            context.span_id().to_string(),
        )
    })
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
