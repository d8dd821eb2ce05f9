//! Subject → decode → view: the [`Sink`] every source delivers to (the Core loop and the JetStream consumers)
//! applies one live display event to its thread's view.
//!
//! One loop per source applies the events, so no thread's cost may grow with the thread: inserting into a view is
//! amortised O(1) whatever the order and repetition of its events ([`crate::view`]), and an event for a view that
//! a read is rendering waits beside the view instead of blocking the loop ([`ViewCache::apply`]).
//!
//! What became of each message and how late it came are this path's metrics ([`IngestMetrics`], at the end).
//!
//! Traces ([design 5](../../docs/design.md#5)): never a span per event. While tracing is off an event costs one check
//! more, no header is read and nothing is kept. While it is on, the publisher's context a decoded event's message
//! carries (`traceparent`) is kept beside the event in its view, unread ([`PublisherContext`]: reading it costs
//! more than the path's budget), and the events [`trace::sample_ingest`] chooses, before any span exists, are
//! applied inside a short root `process` span linked (never parented) to that context.

use std::sync::Arc;

use async_nats::HeaderMap;
use prometheus::{Histogram, IntCounter};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::Sink;
use crate::cache::ViewCache;
use crate::decode::{Decoded, decode_payload};
use crate::metrics::Registrar;
use crate::subject::DeliveryKey;
use crate::telemetry::{RateLimit, trace};
use crate::view::{Inserted, PublisherContext};

/// Applies live display events to the views.
#[derive(Clone)]
pub struct Ingest {
    views: ViewCache,
    metrics: Arc<IngestMetrics>,
    /// Log rate limits for messages that are not display-event subjects and payloads that are not JSON.
    bad_subject_log: Arc<RateLimit>,
    malformed_log: Arc<RateLimit>,
}

impl Ingest {
    pub fn new(views: ViewCache, metrics: Arc<IngestMetrics>) -> Self {
        Self {
            views,
            metrics,
            bad_subject_log: Arc::default(),
            malformed_log: Arc::default(),
        }
    }

    /// One event by its display-event subject, payload and headers, received at `arrived`
    /// ([`crate::decode::ViewEvent::arrived`]).
    pub async fn handle_event(
        &self,
        subject: &str,
        payload: &[u8],
        headers: Option<&HeaderMap>,
        arrived: u32,
    ) {
        let outcome = if !trace::enabled() {
            // Tracing off: no header is read and nothing is kept.
            self.apply(subject, payload, arrived, || None).await
        } else if trace::sample_ingest() {
            let publisher = headers.and_then(trace::publisher_context);
            let span = tracing::info_span!(
                parent: None,
                trace::INGEST_SPAN,
                otel.kind = "consumer",
                messaging.system = "nats",
                "messaging.operation.type" = "process",
                messaging.operation.name = "process",
                messaging.destination.name = subject,
            );
            // Before the span is entered (and so started): the sampler and the exporter see the link.
            if let Some(publisher) = &publisher {
                span.add_link(publisher.clone());
            }
            // Kept as every event's is, from the context the propagator has just read rather than by finding the
            // header a second time.
            let kept = publisher.as_ref().map(PublisherContext::from);
            self.apply(subject, payload, arrived, move || kept)
                .instrument(span)
                .await
        } else {
            self.apply(subject, payload, arrived, || {
                headers.and_then(PublisherContext::from_headers)
            })
            .await
        };
        if let Some(outcome) = outcome {
            self.metrics.event(outcome);
        }
    }

    /// The message's outcome, or `None` when its view counts it (it waits for the view's holder). `publisher`
    /// gives the context to keep beside the event: asked only once the event is decoded, so no header is read for
    /// a message that is dropped.
    async fn apply(
        &self,
        subject: &str,
        payload: &[u8],
        arrived: u32,
        publisher: impl FnOnce() -> Option<PublisherContext>,
    ) -> Option<EventOutcome> {
        let key = match DeliveryKey::parse_subject(subject) {
            Ok(key) => key,
            Err(error) => {
                if self.bad_subject_log.allow() {
                    tracing::warn!(%error, "dropping a message whose subject is not a display-event subject");
                }
                return Some(EventOutcome::BadSubject);
            }
        };
        Some(match decode_payload(key, payload) {
            Err(error) => {
                if self.malformed_log.allow() {
                    // Metadata only: never the payload.
                    let key = &error.key;
                    tracing::warn!(
                        thread_id = key.thread_id(),
                        display_id = key.display_id(),
                        run_id = key.run_id(),
                        event_id = key.event_id(),
                        event_name = key.event_name(),
                        %error,
                        "dropping a display event whose payload cannot be read"
                    );
                }
                EventOutcome::Malformed
            }
            Ok(Decoded::Irrelevant) => EventOutcome::Irrelevant,
            Ok(Decoded::Event(mut event)) => {
                event.arrived = arrived;
                if let Ok(created_at) = event.created_at {
                    self.metrics.lag(created_at);
                }
                match self.views.apply(event, publisher()).await {
                    // An orphan is counted as such by the cache.
                    Some(Inserted::Added | Inserted::Orphaned) => EventOutcome::Relevant,
                    Some(Inserted::Duplicate) => EventOutcome::Duplicate,
                    // Counted by the view's holder when it applies the event.
                    None => return None,
                }
            }
        })
    }
}

impl Sink for Ingest {
    async fn apply(
        &self,
        subject: &str,
        payload: &[u8],
        headers: Option<&HeaderMap>,
        arrived: u32,
    ) {
        self.handle_event(subject, payload, headers, arrived).await;
    }
}

/// What became of one message received from NATS (the `outcome` of `history_view_events_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// Decoded and added to its thread's view.
    Relevant,
    /// Outside the projectable families (or not a display event): dropped after reading its parents.
    Irrelevant,
    /// Its delivery key was already held.
    Duplicate,
    /// The payload could not be read at all.
    Malformed,
    /// The subject is not a 9-token display-event subject (or not UTF-8).
    BadSubject,
}

impl EventOutcome {
    /// Every outcome, in declaration order (the order of [`IngestMetrics::events`]).
    const ALL: [EventOutcome; 5] = [
        EventOutcome::Relevant,
        EventOutcome::Irrelevant,
        EventOutcome::Duplicate,
        EventOutcome::Malformed,
        EventOutcome::BadSubject,
    ];

    fn label(self) -> &'static str {
        match self {
            EventOutcome::Relevant => "relevant",
            EventOutcome::Irrelevant => "irrelevant",
            EventOutcome::Duplicate => "duplicate",
            EventOutcome::Malformed => "malformed",
            EventOutcome::BadSubject => "bad_subject",
        }
    }
}

/// Ingest lag buckets, in seconds: from a local publisher to a backlog of minutes.
const LAG_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];

/// The ingest path's metrics: what became of each message, and how late it arrived. Counted here, by the view's
/// holder for an event that waited beside its view ([`crate::cache::AppliedEvents`]), and by the connection
/// watcher for subjects the client skipped (`core.rs`).
pub struct IngestMetrics {
    /// `history_view_events_total` resolved per outcome once, so counting an event is one atomic add.
    events: [IntCounter; EventOutcome::ALL.len()],
    lag_seconds: Histogram,
}

impl IngestMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let events = registrar.counter_vec(
            "history_view_events_total",
            "Display-event messages received from NATS (Core or JetStream), by outcome: relevant (decoded and added \
             to its thread's view), irrelevant (outside the projectable families, or not a display event: dropped \
             after reading its head), duplicate (its delivery key already held), malformed (its payload cannot be \
             read), bad_subject (not a 9-token display-event subject, or not UTF-8).",
            &["outcome"],
        );
        Self {
            events: EventOutcome::ALL.map(|outcome| events.with_label_values(&[outcome.label()])),
            lag_seconds: registrar.histogram(
                "history_view_ingest_lag_seconds",
                "Seconds from a display event's created_at to its receipt here, per event of the projectable \
                 families decoded (a receipt before created_at, by clock skew, counts as 0).",
                LAG_BUCKETS,
            ),
        }
    }

    /// The counter of one outcome, for whoever else counts it (a view's holder: [`crate::cache::AppliedEvents`]).
    pub fn counter(&self, outcome: EventOutcome) -> IntCounter {
        self.events[outcome as usize].clone()
    }

    pub fn event(&self, outcome: EventOutcome) {
        self.events[outcome as usize].inc();
    }

    pub fn events(&self, outcome: EventOutcome, n: u64) {
        self.events[outcome as usize].inc_by(n);
    }

    /// Records how long after its `created_at` (ns since the epoch) an event was received.
    pub fn lag(&self, created_at_ns: i64) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        // Test fixtures and clock skew give lags below zero or absurdly large; both are clamped rather than dropped.
        let lag = (now.saturating_sub(created_at_ns)).max(0) as f64 / 1e9;
        self.lag_seconds.observe(lag);
    }
}
