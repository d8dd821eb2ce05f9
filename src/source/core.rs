//! Core NATS (`HISTORY_VIEW_SOURCE=core`): the subscription loop ([`run`], each message to the [`Sink`], as the
//! JetStream consumers deliver theirs) and the connection [`Watcher`], which confirms the subscription by a round trip and turns possible losses into gaps
//! ([`Coverage`]); with the JetStream source the watcher only logs, counts and keeps readiness, and a loss makes
//! the consumers resume ([`super::CatchUp::connection_lost`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::{Event, Message, Subscriber};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::connect::ConnectionLog;
use super::ingest::{EventOutcome, IngestMetrics};
use super::{Sink, Source, SourceMetrics};
use crate::coverage::{Coverage, Stamp};
use crate::freshness::{Freshness, Part};
use crate::readiness::Readiness;
use crate::telemetry::RateLimit;

/// Most messages still buffered in the subscription that are applied after a stop request; the rest are left
/// (the views are dropped with the process anyway).
const DRAIN_LIMIT: usize = 10_000;

/// How often the watcher checks whether a connected but unconfirmed subscription needs a probe, and how long a
/// probe may stay unanswered before another is sent.
const PROBE_INTERVAL: Duration = Duration::from_millis(250);
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Consumes `subscriber` into `sink` until `stop` is cancelled or the subscription ends. After a stop,
/// unsubscribes and applies what was already buffered (bounded by [`DRAIN_LIMIT`]).
///
///
/// With `probes`, the replies to the worker's round-trip probes come through this loop too: a reply is handed to
/// the watcher only once the display-event subscription has been found empty after it arrived. The client puts a
/// connection's messages in their subscriptions' queues in the order the server sent them, so by then every event
/// received before the reply has been applied (or waits beside its view, applied before any read of it): the
/// probe's send time is an instant every answer from memory covers ([`crate::freshness`]).
///
/// Returns normally only on a stop request; `Err(())` when the subscription ended by itself.
pub async fn run(
    sink: impl Sink,
    readiness: Readiness,
    mut subscriber: Subscriber,
    mut probes: Option<Probes>,
    stop: CancellationToken,
) -> Result<(), ()> {
    readiness.set_subscribed(true);
    let mut reply: Option<u64> = None;
    // One cancellation future for the whole loop: a new one per message would register with the token and
    // deregister again (a lock each) for every event.
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            biased;
            () = &mut stopped => break,
            message = subscriber.next() => match message {
                Some(message) => apply(&sink, &message).await,
                None => {
                    readiness.set_subscribed(false);
                    tracing::error!("the NATS subscription ended");
                    return Err(());
                }
            },
            // Polled only after the subscription was found empty in this round, which began after the reply
            // arrived.
            () = std::future::ready(()), if reply.is_some() => {
                if let (Some(sequence), Some(probes)) = (reply.take(), probes.as_ref()) {
                    // Full: the watcher is behind on replies; the next probe's reply serves as well.
                    let _ = probes.applied.try_send(sequence);
                }
            }
            message = next_reply(&mut probes), if reply.is_none() => match message {
                Some(message) => {
                    reply = std::str::from_utf8(&message.payload).ok().and_then(|s| s.parse().ok());
                }
                None => {
                    tracing::error!("the subscription confirmation probe ended");
                    probes = None;
                }
            },
        }
    }
    readiness.set_subscribed(false);
    // Stop intake first, then apply what already arrived.
    if let Err(error) = subscriber.unsubscribe().await {
        tracing::debug!(%error, "unsubscribe on shutdown failed");
    }
    let mut drained = 0;
    while drained < DRAIN_LIMIT {
        match tokio::time::timeout(std::time::Duration::from_millis(50), subscriber.next()).await {
            Ok(Some(message)) => apply(&sink, &message).await,
            _ => break,
        }
        drained += 1;
    }
    Ok(())
}

/// One Core message to the sink, stamped with its arrival at the worker
/// ([`crate::decode::ViewEvent::arrived`]: the ingest clock on Core NATS).
async fn apply(sink: &impl Sink, message: &Message) {
    let arrived = crate::decode::arrival(std::time::SystemTime::now());
    sink.apply(
        &message.subject,
        &message.payload,
        message.headers.as_ref(),
        arrived,
    )
    .await;
}

/// The connection watcher's state: what it keeps current, and where it counts.
#[derive(Clone)]
pub struct Watcher {
    pub readiness: Readiness,
    pub coverage: Coverage,
    /// Moved when a probe's reply has been applied.
    pub freshness: Freshness,
    pub metrics: Arc<SourceMetrics>,
    /// Where subjects the client skipped count (as `bad_subject`).
    pub ingest: Arc<IngestMetrics>,
    /// Log rate limit for messages whose subject is not UTF-8.
    bad_subject_log: Arc<RateLimit>,
}

impl Watcher {
    pub fn new(
        readiness: Readiness,
        coverage: Coverage,
        freshness: Freshness,
        metrics: Arc<SourceMetrics>,
        ingest: Arc<IngestMetrics>,
    ) -> Self {
        Self {
            readiness,
            coverage,
            freshness,
            metrics,
            ingest,
            bad_subject_log: Arc::default(),
        }
    }

    /// Watches the connection until `stop` is cancelled: logs and counts connection events, keeps readiness's
    /// connection state, and sends the worker's round-trip probes on `probe` (its own inbox subject): after every
    /// (re)connect until one comes back, which confirms the subscription (a probe comes back only after the server
    /// has processed everything sent before it, the re-sent subscription included; a `Connected` event comes before
    /// the subscription is re-sent), and every [`crate::freshness::Freshness::prove_every`] after that, whose replies, handed over by
    /// the ingest loop once it has applied what came before them (`applied`), move the covered-through instant.
    /// Gaps are recorded earlier, in the connection callback ([`on_connection_event`]).
    ///
    /// Without a probe (the JetStream source, which starts coverage itself), it only logs, counts and keeps state.
    pub async fn watch_connection(
        self,
        client: async_nats::Client,
        probe: Option<(String, mpsc::Receiver<u64>)>,
        mut events: mpsc::Receiver<Event>,
        mut log: ConnectionLog,
        stop: CancellationToken,
    ) {
        let (probe_subject, mut applied) = match probe {
            Some((subject, applied)) => (subject, Some(applied)),
            None => (String::new(), None),
        };
        // Probes sent and not answered yet, oldest first (bounded: a link that answers none is soon a gap).
        let mut sent: VecDeque<SentProbe> = VecDeque::new();
        let mut last_sent: Option<SentProbe> = None;
        let mut sequence = 0u64;
        let mut skipped = 0u64;
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let send_probe = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                event = events.recv() => match event {
                    Some(event) => self.connection_event(&event, &mut log) && applied.is_some(),
                    None => return,
                },
                answered = next_applied(&mut applied) => {
                    let Some(answered) = answered else {
                        return;
                    };
                    while let Some(probe) = sent.front().copied().filter(|p| p.sequence <= answered) {
                        sent.pop_front();
                        if probe.sequence != answered || probe.connection != self.coverage.connection() {
                            continue;
                        }
                        if self.coverage.confirm_live(probe.connection, self.coverage.now()) {
                            tracing::info!("NATS subscription confirmed: live coverage starts");
                        }
                        self.freshness.covered(Part::Probe, probe.stamp);
                    }
                    false
                }
                _ = tick.tick() => {
                    skipped = self.count_skipped(&client, skipped);
                    let last = last_sent.filter(|p| p.connection == self.coverage.connection());
                    let every = if self.coverage.is_live() { self.freshness.prove_every() } else { PROBE_TIMEOUT };
                    applied.is_some()
                        && client.connection_state() == async_nats::connection::State::Connected
                        && last.is_none_or(|p| p.at.elapsed() >= every)
                }
            };
            if send_probe {
                sequence += 1;
                let probe = SentProbe {
                    sequence,
                    connection: self.coverage.connection(),
                    at: std::time::Instant::now(),
                    stamp: self.coverage.now(),
                };
                match client
                    .publish(probe_subject.clone(), sequence.to_string().into())
                    .await
                {
                    Ok(()) => {
                        if sent.len() == MAX_UNANSWERED {
                            sent.pop_front();
                        }
                        sent.push_back(probe);
                        last_sent = Some(probe);
                    }
                    Err(error) => tracing::debug!(%error, "cannot send the subscription probe"),
                }
            }
        }
    }

    /// Counts as bad subjects the messages the NATS client skipped since `before` (of all it skipped) because
    /// their subject is not UTF-8 (the patched async-nats skips them instead of failing the connection; see
    /// `vendor/async-nats/PATCH.md`). Returns the new total.
    fn count_skipped(&self, client: &async_nats::Client, before: u64) -> u64 {
        let total = client
            .statistics()
            .skipped_non_utf8_messages
            .load(Ordering::Relaxed);
        if total > before {
            self.ingest.events(EventOutcome::BadSubject, total - before);
            if self.bad_subject_log.allow() {
                tracing::warn!(
                    messages = total - before,
                    "dropping messages whose subject is not UTF-8"
                );
            }
        }
        total
    }

    /// Logs (failures rate-limited, [`ConnectionLog`]), counts and reflects one connection event; returns whether
    /// a confirmation probe is due.
    fn connection_event(&self, event: &Event, log: &mut ConnectionLog) -> bool {
        match event {
            Event::Connected => self.readiness.set_connected(true),
            Event::Disconnected | Event::Closed => self.readiness.set_connected(false),
            _ => {}
        }
        self.metrics.nats_connection_event(event);
        log.log(event, is_gap(event), std::time::Instant::now());
        matches!(event, Event::Connected)
    }
}

/// The next probe reply; never, without a probe subscription.
async fn next_reply(probes: &mut Option<Probes>) -> Option<Message> {
    match probes {
        Some(probes) => probes.replies.next().await,
        None => std::future::pending().await,
    }
}

/// The next probe reply the ingest loop has applied everything before; never, without probes.
async fn next_applied(applied: &mut Option<mpsc::Receiver<u64>>) -> Option<u64> {
    match applied {
        Some(applied) => applied.recv().await,
        None => std::future::pending().await,
    }
}

/// The ingest loop's end of the worker's round-trip probes: their replies, and where it hands over the sequence
/// of each reply once everything received before it is applied.
pub struct Probes {
    pub replies: Subscriber,
    pub applied: mpsc::Sender<u64>,
}

/// The worker's own subscription for round-trip probes, on a subject nothing else uses (an inbox subject, so
/// aihub's persister, which stores `agent.>`, never sees it).
pub struct ProbeSubscription {
    pub subject: String,
    pub subscriber: Subscriber,
}

impl ProbeSubscription {
    /// Subscribes to a fresh inbox subject of `client`.
    ///
    /// # Errors
    /// The client cannot send the subscription.
    pub async fn new(client: &async_nats::Client) -> Result<Self, async_nats::SubscribeError> {
        let subject = client.new_inbox();
        let subscriber = client.subscribe(subject.clone()).await?;
        Ok(Self {
            subject,
            subscriber,
        })
    }

    /// Splits it into the watcher's end (the subject, and the applied replies) and the ingest loop's.
    pub fn split(self) -> ((String, mpsc::Receiver<u64>), Probes) {
        let (applied, answered) = mpsc::channel(16);
        (
            (self.subject, answered),
            Probes {
                replies: self.subscriber,
                applied,
            },
        )
    }
}

/// Probes kept waiting for their reply; older ones are forgotten.
const MAX_UNANSWERED: usize = 16;

/// A probe in flight.
#[derive(Debug, Clone, Copy)]
struct SentProbe {
    sequence: u64,
    /// The coverage's connection epoch when it was sent.
    connection: u64,
    at: std::time::Instant,
    /// When it was sent (the covered-through instant it proves once answered).
    stamp: Stamp,
}

/// Whether a connection event means events may have been missed.
fn is_gap(event: &Event) -> bool {
    match event {
        Event::Disconnected
        | Event::Closed
        | Event::SlowConsumer(_)
        | Event::ServerError(_)
        | Event::ClientError(_) => true,
        Event::Connected | Event::LameDuckMode | Event::Draining => false,
    }
}

/// The connection callback's work ([`async_nats::ConnectOptions::event_callback`]): records a possible loss at once
/// (before any queue, so a complete view is not served after it), then hands the event to the watcher. An event the
/// watcher's queue has no room for is itself a possible loss: it might have been one.
///
/// On Core NATS a possible loss is a gap (a disconnect also uncovers until the next confirmation). On JetStream it is
/// not: every consumer resumes from the last message it applied, its resume decides whether it was a gap, and its
/// stream is behind until it has caught up ([`crate::catch_up::CatchUp`]; answers from memory stop once its checks
/// prove nothing for the window, [`crate::freshness::Freshness::serves`]); with the Core witness on, the witness's
/// own losses are gaps.
pub fn on_connection_event(
    coverage: &Coverage,
    source: Source,
    witness: bool,
    watcher: &mpsc::Sender<Event>,
    event: Event,
) {
    let now = coverage.now();
    let lost = |disconnected: bool| match source {
        Source::Core if disconnected => coverage.disconnected(now),
        Source::Core => coverage.gap(now),
        Source::JetStream => {
            coverage.catch_up().connection_lost();
            if witness {
                // The Core witness's own sightings may be lost (a slow consumer, the link down): what it did not
                // see it cannot judge, so every view is partial, as on Core NATS.
                coverage.gap(now);
            }
        }
    };
    match event {
        Event::Disconnected | Event::Closed => lost(true),
        Event::Connected if witness && source == Source::JetStream => {
            // The witness's subscription is sent again right after this: what was published before it reached the
            // server was not witnessed. A gap a margin later covers that moment.
            coverage.gap(now.plus(WITNESS_RESUBSCRIBED));
        }
        ref other if is_gap(other) => lost(false),
        _ => {}
    }
    match watcher.try_send(event) {
        // Closed: the service is stopping.
        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
        Err(mpsc::error::TrySendError::Full(_)) => lost(false),
    }
}

/// After a reconnect, how long the Core witness's subscription is taken to need to be in place again (async-nats
/// sends the subscriptions right after it reports the connection; the server processes them in order).
const WITNESS_RESUBSCRIBED: Duration = Duration::from_secs(1);

/// The queue between the connection callback and the watcher.
pub fn connection_events() -> (mpsc::Sender<Event>, mpsc::Receiver<Event>) {
    mpsc::channel(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(coverage: &Coverage, witness: bool, event: Event) {
        let (tx, _rx) = connection_events();
        on_connection_event(coverage, Source::JetStream, witness, &tx, event);
    }

    #[tokio::test(start_paused = true)]
    async fn the_witnesss_own_losses_are_gaps_of_every_view_and_without_it_the_streams_resume() {
        let coverage = Coverage::new(Duration::from_secs(2));
        let gaps = coverage.gaps();
        event(&coverage, false, Event::SlowConsumer(1));
        event(&coverage, false, Event::Disconnected);
        assert_eq!(
            coverage.gaps(),
            gaps,
            "the streams keep what was published: no gap"
        );

        event(&coverage, true, Event::SlowConsumer(1));
        let after_slow = coverage.gaps();
        assert_ne!(after_slow, gaps, "a sighting the witness lost");
        event(&coverage, true, Event::Disconnected);
        let after_cut = coverage.gaps();
        assert_ne!(
            after_cut, after_slow,
            "sightings lost while the link is down"
        );
        let reconnected = coverage.now();
        event(&coverage, true, Event::Connected);
        assert!(
            coverage.gaps() >= reconnected.plus(WITNESS_RESUBSCRIBED).nanos(),
            "and until its subscription is in place again"
        );
    }
}
