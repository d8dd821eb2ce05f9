//! Spans recorded in memory, for unit tests: the worker's `tracing` spans through the same OpenTelemetry layer as
//! in production ([`super::init`]), over a provider that samples everything and keeps each span as it ends. The
//! subscriber is the thread's default while the [`Recording`] lives, so a test on tokio's current-thread runtime
//! records every task it runs, and tests running beside it on other threads record nothing of it.
//!
//! Nothing here turns tracing on for the process: [`super::trace::enabled`] stays false, so the code paths that
//! check it (the HTTP middleware, `inject`) behave as with tracing off.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{Context, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, Span, SpanData, SpanProcessor};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;

/// The spans ended so far.
#[derive(Debug, Clone, Default)]
struct Ended(Arc<Mutex<Vec<SpanData>>>);

impl SpanProcessor for Ended {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Records the worker's spans on this thread until dropped.
pub struct Recording {
    ended: Ended,
    _provider: SdkTracerProvider,
    _default: tracing::subscriber::DefaultGuard,
}

/// The process's default subscriber in unit tests: it records nothing and never lets `tracing` cache a callsite as
/// disabled. `tracing` caches whether a span is enabled when its callsite first runs; with one thread-local
/// subscriber registered (a [`Recording`]) and no global one, a callsite first reached on another thread (a test
/// beside the recording one) asks that thread's default (none) and is cached as never enabled, on every thread:
/// the recording test then misses its spans. With this subscriber as the global default, every callsite is
/// "sometimes", asked span by span of the current thread's subscriber.
struct Undecided;

impl tracing::Subscriber for Undecided {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        false
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, _: &tracing::Event<'_>) {}

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

/// Makes [`Undecided`] the global default, once; tests that reach the worker's spans call it before their first
/// span (the cache's scene does), so no callsite is cached as disabled before it is in place.
pub fn undecided_default() {
    static SET: std::sync::Once = std::sync::Once::new();
    SET.call_once(|| {
        // Fails only if a global default is already set, which then decides the interest itself.
        let _ = tracing::subscriber::set_global_default(Undecided);
    });
}

/// Starts recording the worker's spans on this thread.
pub fn record() -> Recording {
    undecided_default();
    let ended = Ended::default();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(ended.clone())
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("test"))
        .with_level(false)
        .with_target(false)
        .with_filter(Targets::new().with_target("chat_history_view", tracing::Level::TRACE));
    let subscriber = tracing_subscriber::registry().with(layer);
    Recording {
        ended,
        _provider: provider,
        _default: tracing::subscriber::set_default(subscriber),
    }
}

impl Recording {
    /// Every span ended so far, in the order they ended.
    pub fn spans(&self) -> Vec<SpanData> {
        self.ended
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The spans named `name` ended so far.
    pub fn named(&self, name: &str) -> Vec<SpanData> {
        self.spans()
            .into_iter()
            .filter(|span| span.name == name)
            .collect()
    }

    /// The one span named `name`; panics, listing what was recorded, when there is not exactly one.
    pub fn one(&self, name: &str) -> SpanData {
        let mut named = self.named(name);
        assert_eq!(
            named.len(),
            1,
            "one span {name:?} expected; recorded: {:?}",
            self.spans().iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        named.remove(0)
    }
}

/// The value of `span`'s attribute `key`, if it has one.
pub fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

/// Whether `child`'s parent is `parent` (same trace, parent span id).
pub fn is_child_of(child: &SpanData, parent: &SpanData) -> bool {
    child.span_context.trace_id() == parent.span_context.trace_id()
        && child.parent_span_id == parent.span_context.span_id()
}
