//! Subject → decode → view: applies one live display event, whatever source delivered it (Core NATS or a
//! JetStream consumer, [`crate::source`]), to its thread's view.
//!
//! One loop per source applies the events, so no thread's cost may grow with the thread: inserting into a view is
//! amortised O(1) whatever the order and repetition of its events ([`crate::view`]), and an event for a view that
//! a read is rendering waits beside the view instead of blocking the loop ([`ViewCache::apply`]).

use std::sync::Arc;

use async_nats::Message;

use crate::cache::ViewCache;
use crate::coverage::Coverage;
use crate::decode::{Decoded, decode_payload};
use crate::freshness::Freshness;
use crate::metrics::{EventOutcome, Metrics};
use crate::readiness::Readiness;
use crate::source::Sink;
use crate::subject::DeliveryKey;
use crate::telemetry::RateLimit;
use crate::view::Inserted;

/// Applies live display events to the views.
#[derive(Clone)]
pub struct Ingest {
    views: ViewCache,
    pub(crate) metrics: Metrics,
    pub(crate) readiness: Readiness,
    pub(crate) coverage: Coverage,
    /// Moved by the watcher when a probe's reply has been applied.
    pub(crate) freshness: Freshness,
    /// Log rate limits for messages that are not display-event subjects and payloads that are not JSON.
    pub(crate) bad_subject_log: Arc<RateLimit>,
    malformed_log: Arc<RateLimit>,
}

impl Ingest {
    pub fn new(
        views: ViewCache,
        metrics: Metrics,
        readiness: Readiness,
        coverage: Coverage,
        freshness: Freshness,
    ) -> Self {
        Self {
            views,
            metrics,
            readiness,
            coverage,
            freshness,
            bad_subject_log: Arc::default(),
            malformed_log: Arc::default(),
        }
    }

    /// The covered-through instant this ingest path moves.
    pub fn freshness(&self) -> &Freshness {
        &self.freshness
    }

    /// One message: subject → delivery key → family filter and decode → its thread's view.
    pub async fn handle(&self, message: Message) {
        self.handle_event(&message.subject, &message.payload).await;
    }

    /// One event by its display-event subject and payload.
    pub async fn handle_event(&self, subject: &str, payload: &[u8]) {
        if let Some(outcome) = self.apply(subject, payload).await {
            self.metrics.event(outcome);
        }
    }

    /// The message's outcome, or `None` when its view counts it (it waits for the view's holder).
    async fn apply(&self, subject: &str, payload: &[u8]) -> Option<EventOutcome> {
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
            Ok(Decoded::Event(event)) => {
                if let Ok(created_at) = event.created_at {
                    self.metrics.ingest_lag(created_at);
                }
                match self.views.apply(event).await {
                    Some(Inserted::Added) => EventOutcome::Relevant,
                    Some(Inserted::Duplicate) => EventOutcome::Duplicate,
                    // Counted by the view's holder when it applies the event.
                    None => return None,
                }
            }
        })
    }
}

impl Sink for Ingest {
    async fn apply(&self, subject: &str, payload: &[u8]) {
        self.handle_event(subject, payload).await;
    }
}
