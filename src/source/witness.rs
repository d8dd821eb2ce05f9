//! The Core witness (`HISTORY_VIEW_JETSTREAM_WITNESS`): with the JetStream source, a Core NATS subscription to the
//! display-event subjects sees every event aihub publishes, whether or not a consumed stream captured it. An event
//! seen on Core that no stream delivered within a grace window after the source was known to have applied
//! everything stored by then ([`crate::freshness`]) never reached a stream (no stream for its class, a stream full
//! with `discard: new`, a leader that lost its quorum, a stream without a leader): its thread's views are made
//! partial (a per-thread gap, [`Coverage::thread_gap`]), so the next read hydrates from the store, which aihub's
//! persister fills within the bound ([design 2.1.3](../../docs/design.md#2.1.3)).
//!
//! Identities are the full subject (the 8-field delivery identity), hashed: aihub's JetStream publish retries show
//! Core every attempt while the stream keeps one by `Nats-Msg-Id`, so counting is by identity, never by number. Core
//! usually delivers before the stream has stored the message; in a cluster the stream's delivery may come first, so
//! what streams delivered is kept for two rotations of [`DELIVERED_ROTATION`].
//!
//! One mutex (the witnessed queue and the delivered sets), taken alone for a few steps per event.

use std::collections::{HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::coverage::{Coverage, bucket};
use crate::freshness::Freshness;
use crate::partition::Partitioning;
use crate::source::SourceMetrics;
use crate::subject::DeliveryKey;

/// An event seen on Core is judged once the source has applied everything stored this long after it arrived: the
/// time a stream takes to store a message published a moment before, and a server clock a little behind.
pub const GRACE: Duration = Duration::from_millis(500);
/// How often what was witnessed is judged.
const JUDGE_EVERY: Duration = Duration::from_millis(250);
/// What streams delivered is remembered for two rotations of this (a Core retry of an event a stream kept once may
/// come seconds after the first attempt).
const DELIVERED_ROTATION: Duration = Duration::from_secs(10);
/// At most this many witnessed events wait to be judged (about 24 MiB); beyond it the oldest are given up, which
/// is a gap for every view (counted).
const MAX_WAITING: usize = 1 << 20;

/// The witness. Cloning is cheap.
#[derive(Clone)]
pub struct Witness {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    hasher: foldhash::quality::RandomState,
    coverage: Coverage,
    freshness: Freshness,
    metrics: Arc<SourceMetrics>,
    /// Partitioned workers witness only the threads they own.
    partitioning: Option<Partitioning>,
}

struct Witnessed {
    identity: u64,
    arrived: SystemTime,
    bucket: usize,
}

#[derive(Default)]
struct State {
    /// Seen on Core, oldest first.
    waiting: VecDeque<Witnessed>,
    /// Identities streams delivered in this rotation and the one before.
    delivered: HashSet<u64, foldhash::fast::FixedState>,
    delivered_before: HashSet<u64, foldhash::fast::FixedState>,
    rotated: Option<SystemTime>,
}

impl Witness {
    pub fn new(
        coverage: Coverage,
        freshness: Freshness,
        metrics: Arc<SourceMetrics>,
        partitioning: Option<Partitioning>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                hasher: foldhash::quality::RandomState::default(),
                coverage,
                freshness,
                metrics,
                partitioning,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Changed by single pushes, pops and inserts: a panic cannot leave it torn.
        self.inner
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// An event seen on Core at `at`.
    pub fn seen(&self, subject: &str, at: SystemTime) {
        let Some(thread) = thread_of(subject) else {
            return;
        };
        if let Some(partitioning) = &self.inner.partitioning
            && !partitioning.owns(thread)
        {
            return;
        }
        let identity = self.inner.hasher.hash_one(subject);
        let mut state = self.lock();
        if state.waiting.len() == MAX_WAITING {
            state.waiting.pop_front();
            drop(state);
            self.inner.metrics.witnessed(WitnessOutcome::Overflow, 1);
            self.inner.coverage.gap(self.inner.coverage.now());
            state = self.lock();
        }
        state.waiting.push_back(Witnessed {
            identity,
            arrived: at,
            bucket: bucket(thread),
        });
    }

    /// An event a stream delivered (by its original display-event subject).
    pub fn delivered(&self, subject: &str) {
        let identity = self.inner.hasher.hash_one(subject);
        self.lock().delivered.insert(identity);
    }

    /// Judges what was seen on Core up to `horizon` (less the grace): each event no stream delivered is a gap of
    /// its thread. Returns how many were missing.
    pub fn judge(&self, horizon: SystemTime, now: SystemTime) -> usize {
        let until = horizon.checked_sub(GRACE).unwrap_or(SystemTime::UNIX_EPOCH);
        let mut missing = Vec::new();
        let mut matched = 0u64;
        {
            let mut state = self.lock();
            while let Some(front) = state.waiting.front() {
                if front.arrived > until {
                    break;
                }
                let witnessed = state.waiting.pop_front().expect("a front");
                if state.delivered.contains(&witnessed.identity)
                    || state.delivered_before.contains(&witnessed.identity)
                {
                    matched += 1;
                } else {
                    missing.push(witnessed.bucket);
                }
            }
            let rotate = state
                .rotated
                .is_none_or(|at| now.duration_since(at).unwrap_or_default() >= DELIVERED_ROTATION);
            if rotate {
                let delivered = std::mem::take(&mut state.delivered);
                state.delivered_before = delivered;
                state.rotated = Some(now);
            }
        }
        self.inner
            .metrics
            .witnessed(WitnessOutcome::Delivered, matched);
        if !missing.is_empty() {
            let at = self.inner.coverage.now();
            for bucket in &missing {
                self.inner.coverage.thread_gap(*bucket, at);
            }
            self.inner
                .metrics
                .witnessed(WitnessOutcome::Missing, missing.len() as u64);
            tracing::warn!(
                events = missing.len(),
                "events seen on Core NATS reached no consumed stream: their threads hydrate again (no stream for their class, a full stream with discard new, or a stream without a working leader)"
            );
        }
        missing.len()
    }

    /// Witnesses `subscriber` (the display-event subjects on Core NATS) and judges every [`JUDGE_EVERY`] against
    /// the source's covered-through instant, until `stop`.
    pub async fn run(self, mut subscriber: async_nats::Subscriber, stop: CancellationToken) {
        let mut judge = tokio::time::interval(JUDGE_EVERY);
        judge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let stopped = stop.cancelled();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                biased;
                () = &mut stopped => return,
                _ = judge.tick() => {
                    if let Some(horizon) = self.inner.freshness.covered_through() {
                        self.judge(horizon, SystemTime::now());
                    }
                }
                message = subscriber.next() => match message {
                    Some(message) => self.seen(&message.subject, SystemTime::now()),
                    None => {
                        tracing::error!("the Core witness subscription ended");
                        return;
                    }
                },
            }
        }
    }
}

/// The thread token of a display-event subject.
fn thread_of(subject: &str) -> Option<&str> {
    DeliveryKey::parse_subject(subject)
        .ok()
        .map(|_| subject.split('.').nth(3).unwrap_or_default())
}

/// What the witness found, the `result` of `history_view_jetstream_witnessed_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WitnessOutcome {
    /// A stream delivered it.
    Delivered,
    /// No stream delivered it: a gap of its thread.
    Missing,
    /// Given up unjudged (too many waiting): a gap of every view.
    Overflow,
}

impl WitnessOutcome {
    pub const ALL: [WitnessOutcome; 3] = [
        WitnessOutcome::Delivered,
        WitnessOutcome::Missing,
        WitnessOutcome::Overflow,
    ];

    pub fn label(self) -> &'static str {
        match self {
            WitnessOutcome::Delivered => "delivered",
            WitnessOutcome::Missing => "missing",
            WitnessOutcome::Overflow => "overflow",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAG: Duration = Duration::from_secs(2);

    fn subject(thread: &str, event: u32) -> String {
        format!("agent.A.a1.{thread}.d1.r1.display_event.agent_stream_chunk.e{event}")
    }

    fn witness() -> (Witness, Coverage) {
        let coverage = Coverage::new(LAG);
        let witness = Witness::new(
            coverage.clone(),
            Freshness::new(coverage.clone(), LAG),
            Arc::new(SourceMetrics::register(
                &mut crate::metrics::Registrar::new(),
            )),
            None,
        );
        (witness, coverage)
    }

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000) + Duration::from_millis(ms)
    }

    #[test]
    fn an_event_a_stream_delivered_is_no_gap_in_either_order() {
        let (witness, coverage) = witness();
        let epoch = coverage.epoch(bucket("t1"));
        witness.seen(&subject("t1", 1), at(0));
        witness.delivered(&subject("t1", 1));
        // A stream delivered it before Core did (a cluster), and Core saw a retry twice.
        witness.delivered(&subject("t1", 2));
        witness.seen(&subject("t1", 2), at(10));
        witness.seen(&subject("t1", 2), at(20));
        assert_eq!(witness.judge(at(5_000), at(5_000)), 0);
        assert_eq!(coverage.epoch(bucket("t1")), epoch);
    }

    #[test]
    fn an_event_no_stream_delivered_is_a_gap_of_its_thread_once_the_source_applied_past_it() {
        let (witness, coverage) = witness();
        let (t1, t2) = (bucket("t1"), bucket("t2"));
        assert_ne!(t1, t2);
        let (e1, e2) = (coverage.epoch(t1), coverage.epoch(t2));
        witness.seen(&subject("t1", 1), at(1_000));
        assert_eq!(
            witness.judge(at(1_000) + GRACE - Duration::from_millis(1), at(2_000)),
            0,
            "within the grace: the stream may not have stored it yet"
        );
        assert_eq!(witness.judge(at(1_000) + GRACE, at(2_000)), 1);
        assert_ne!(coverage.epoch(t1), e1, "its thread's views are partial");
        assert_eq!(coverage.epoch(t2), e2, "other threads keep theirs");
        assert_eq!(witness.judge(at(9_000), at(9_000)), 0, "judged once");
    }

    #[test]
    fn deliveries_are_remembered_for_two_rotations_only() {
        let (witness, _) = witness();
        witness.delivered(&subject("t1", 1));
        witness.judge(at(0), at(0));
        // A Core retry seconds later, after one rotation: still matched.
        witness.seen(&subject("t1", 1), at(5_000));
        assert_eq!(witness.judge(at(6_000), at(6_000)), 0);
        witness.judge(at(6_000), at(10_000));
        witness.judge(at(6_000), at(20_000));
        witness.seen(&subject("t1", 1), at(25_000));
        assert_eq!(witness.judge(at(26_000), at(26_000)), 1, "forgotten");
    }

    #[test]
    fn a_partitioned_worker_witnesses_its_own_threads_only() {
        let coverage = Coverage::new(LAG);
        let partitioning = Partitioning {
            partitions: 2,
            partition: 0,
            prefix: "chv".into(),
        };
        let witness = Witness::new(
            coverage.clone(),
            Freshness::new(coverage, LAG),
            Arc::new(SourceMetrics::register(
                &mut crate::metrics::Registrar::new(),
            )),
            Some(partitioning.clone()),
        );
        let (mine, other) = (0..)
            .map(|i| format!("t{i}"))
            .try_fold((None, None), |(mine, other), t| {
                let next = if partitioning.owns(&t) {
                    (mine.or(Some(t)), other)
                } else {
                    (mine, other.or(Some(t)))
                };
                match next {
                    (Some(m), Some(o)) => Err((m, o)),
                    next => Ok(next),
                }
            })
            .unwrap_err();
        witness.seen(&subject(&mine, 1), at(0));
        witness.seen(&subject(&other, 1), at(0));
        assert_eq!(witness.judge(at(5_000), at(5_000)), 1);
    }
}
