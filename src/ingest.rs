//! The live path: the NATS subscription loop (subject → decode → view) and the connection watcher that turns
//! possible gaps into view downgrades.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use async_nats::{Event, Message, Subscriber};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cache::Views;
use crate::decode::{Decoded, decode_payload};
use crate::health::Readiness;
use crate::metrics::{EventOutcome, Metrics};
use crate::subject::DeliveryKey;
use crate::view::Inserted;

/// Most messages still buffered in the subscription that are applied after a stop request; the rest are left
/// (the views are dropped with the process anyway).
const DRAIN_LIMIT: usize = 10_000;

/// Applies live display events to the views.
#[derive(Clone)]
pub struct Ingest {
    views: Views,
    metrics: Metrics,
    readiness: Readiness,
    /// Log rate limits for messages that are not display-event subjects and payloads that are not JSON.
    bad_subject_log: Arc<RateLimit>,
    malformed_log: Arc<RateLimit>,
}

/// Logs at most one line per second for a kind of bad input, so a flood cannot flood the log.
#[derive(Default)]
struct RateLimit(AtomicU64);

impl RateLimit {
    fn allow(&self) -> bool {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.0.swap(now, Ordering::Relaxed) != now
    }
}

impl Ingest {
    pub fn new(views: Views, metrics: Metrics, readiness: Readiness) -> Self {
        Self {
            views,
            metrics,
            readiness,
            bad_subject_log: Arc::default(),
            malformed_log: Arc::default(),
        }
    }

    /// Consumes `subscriber` until `stop` is cancelled or the subscription ends. After a stop, unsubscribes and
    /// applies what was already buffered (bounded by [`DRAIN_LIMIT`]).
    ///
    /// Returns normally only on a stop request; `Err(())` when the subscription ended by itself.
    pub async fn run(self, mut subscriber: Subscriber, stop: CancellationToken) -> Result<(), ()> {
        self.readiness.set_subscribed(true);
        loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => break,
                message = subscriber.next() => match message {
                    Some(message) => self.handle(message).await,
                    None => {
                        self.readiness.set_subscribed(false);
                        tracing::error!("the NATS subscription ended");
                        return Err(());
                    }
                },
            }
        }
        self.readiness.set_subscribed(false);
        // Stop intake first, then apply what already arrived.
        if let Err(error) = subscriber.unsubscribe().await {
            tracing::debug!(%error, "unsubscribe on shutdown failed");
        }
        let mut drained = 0;
        while drained < DRAIN_LIMIT {
            match tokio::time::timeout(std::time::Duration::from_millis(50), subscriber.next())
                .await
            {
                Ok(Some(message)) => self.handle(message).await,
                _ => break,
            }
            drained += 1;
        }
        Ok(())
    }

    /// One message: subject → delivery key → family filter and decode → its thread's view.
    pub async fn handle(&self, message: Message) {
        let outcome = self.apply(&message.subject, &message.payload).await;
        self.metrics.event(outcome);
    }

    async fn apply(&self, subject: &str, payload: &[u8]) -> EventOutcome {
        let key = match DeliveryKey::parse_subject(subject) {
            Ok(key) => key,
            Err(error) => {
                if self.bad_subject_log.allow() {
                    tracing::warn!(%error, "dropping a message whose subject is not a display-event subject");
                }
                return EventOutcome::BadSubject;
            }
        };
        match decode_payload(key, payload) {
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
                    Inserted::Added => EventOutcome::Relevant,
                    Inserted::Duplicate => EventOutcome::Duplicate,
                }
            }
        }
    }

    /// Reacts to NATS connection events until `stop` is cancelled: every possible gap (disconnect, reconnect, slow
    /// consumer, client or server error) downgrades all views; readiness follows the connection.
    pub async fn watch_connection(
        self,
        mut events: mpsc::Receiver<Event>,
        stop: CancellationToken,
    ) {
        loop {
            let event = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                event = events.recv() => match event {
                    Some(event) => event,
                    None => return,
                },
            };
            let (label, gap) = match &event {
                Event::Connected => {
                    self.set_connected(true);
                    ("connected", true)
                }
                Event::Disconnected => {
                    self.set_connected(false);
                    ("disconnected", true)
                }
                Event::Closed => {
                    self.set_connected(false);
                    ("closed", true)
                }
                Event::SlowConsumer(_) => ("slow_consumer", true),
                Event::ServerError(_) => ("server_error", true),
                Event::ClientError(_) => ("client_error", true),
                Event::LameDuckMode => ("lame_duck_mode", false),
                Event::Draining => ("draining", false),
            };
            self.metrics.nats_connection_event(label);
            if gap {
                self.views.downgrade_all();
            }
            tracing::info!(event = %event, views_downgraded = gap, "NATS connection event");
        }
    }
}

impl Ingest {
    /// Records the connection state where readiness and hydration look for it.
    pub fn set_connected(&self, connected: bool) {
        self.readiness.set_connected(connected);
        self.views.set_live(connected);
    }
}

/// A sender for [`async_nats::ConnectOptions::event_callback`]: events go into a bounded channel; when it is full
/// a downgrade is already pending, so dropping the event loses nothing.
pub fn connection_events() -> (mpsc::Sender<Event>, mpsc::Receiver<Event>) {
    mpsc::channel(64)
}
