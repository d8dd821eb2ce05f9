//! `CatchUp`: which parts of the resumable live source (the JetStream consumers) are *behind* ([design
//! 2.1.4](../docs/design.md#2.1.4)), for readiness, for whether a read waits, and for the metrics. Whether an answer
//! comes from memory is not decided here but by [`crate::freshness::Freshness::serves`], the one rule; a lane that
//! lasts until someone acts holds that instant at none ([`crate::freshness::Part::Held`]). Core NATS tracks nothing
//! here: it is always caught up (a disconnect is a gap instead).
//!
//! The source is *behind* while any [`Lane`] is: a stream whose consumer is being (re)created until a consumer made
//! after that has delivered what the stream held and a reading after it showed nothing unread gone; a class stream
//! the partitioned stream does not source, or a source of it that stalled; a stream that refuses events; no stream
//! at all (fail closed).
//!
//! One mutex (the lanes), taken alone for a few steps by the source's tasks; readers load atomics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

/// One reason the source can be behind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Lane {
    /// A consumed stream.
    Stream(String),
    /// A class stream matching the pattern that the partitioned stream does not source.
    Unsourced(String),
    /// A source of the partitioned stream that nats-server has not heard from.
    Stalled(String),
    /// A class stream upstream of the partitioned stream not read with a quorum by the last discovery round.
    Unconfirmed(String),
    /// A stream that cannot take or keep display events ([`Refusal`]): fail closed for its class.
    Refusing(String, Refusal),
    /// No stream matches `HISTORY_VIEW_JETSTREAM_STREAMS`, or they cannot be listed: fail closed.
    NoStream,
}

impl Lane {
    /// Whether a read may wait for this lane: a resuming consumer catches up in moments, an upstream class stream
    /// is read again within a round; the others last until an operator or NATS acts.
    fn passing(&self) -> bool {
        matches!(self, Lane::Stream(_) | Lane::Unconfirmed(_))
    }
}

/// Why a stream cannot take or keep display events ([design 2.1.3](../docs/design.md#2.1.3)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    /// `discard: new` and at a limit (`max_msgs`, or `max_bytes` less the largest message it may store).
    Full,
    /// Sealed: it takes nothing more.
    Sealed,
    /// Its subjects no longer cover the display-event subjects it was consumed on.
    Subjects,
    /// A stream the name pattern does not match captures display-event subjects.
    Unmatched,
}

impl Refusal {
    pub const ALL: [Refusal; 4] = [
        Refusal::Full,
        Refusal::Sealed,
        Refusal::Subjects,
        Refusal::Unmatched,
    ];

    /// The `cause` label of `history_view_jetstream_refusing`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Full => "full",
            Refusal::Sealed => "sealed",
            Refusal::Subjects => "subjects",
            Refusal::Unmatched => "unmatched",
        }
    }

    /// What it means, for the log and `/readyz`.
    pub fn describe(self) -> &'static str {
        match self {
            Refusal::Full => "is full with discard: new (events published now are refused)",
            Refusal::Sealed => "is sealed (events published now are refused)",
            Refusal::Subjects => "no longer captures the display-event subjects it was consumed on",
            Refusal::Unmatched => {
                "captures display-event subjects but does not match HISTORY_VIEW_JETSTREAM_STREAMS"
            }
        }
    }
}

#[derive(Debug, Default)]
struct LaneState {
    behind: bool,
    /// Bumped whenever the lane falls behind: only a consumer of this generation or later catches it up.
    generation: u64,
}

pub struct CatchUp {
    state: Mutex<HashMap<Lane, LaneState>>,
    /// No lane is behind.
    caught_up: AtomicBool,
    /// Every lane behind is one a read may wait for.
    passing: AtomicBool,
    /// Bumped when the connection is lost, for consumer loops to resume.
    epochs: watch::Sender<u64>,
}

impl Default for CatchUp {
    fn default() -> Self {
        Self::new()
    }
}

impl CatchUp {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(HashMap::new()),
            caught_up: AtomicBool::new(true),
            passing: AtomicBool::new(true),
            epochs: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Lane, LaneState>> {
        // Lanes change by single steps: a panic cannot leave the map torn.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no lane is behind (readiness).
    pub fn lanes_caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    /// Whether a lane that lasts until someone acts (no stream, a class stream not sourced, a stalled source) is
    /// behind: a read does not wait for it.
    pub fn blocked(&self) -> bool {
        !self.passing.load(Ordering::Acquire)
    }

    /// Whether `NoStream` is behind (readiness names it).
    pub fn no_stream(&self) -> bool {
        !self.lanes_caught_up() && self.is_behind(&Lane::NoStream)
    }

    /// Whether `lane` is behind.
    pub fn is_behind(&self, lane: &Lane) -> bool {
        self.lock().get(lane).is_some_and(|l| l.behind)
    }

    /// The streams that refuse events, and why (readiness names them).
    pub fn refusing(&self) -> Vec<(String, Refusal)> {
        let mut refusing: Vec<(String, Refusal)> = self
            .lock()
            .iter()
            .filter(|(_, l)| l.behind)
            .filter_map(|(lane, _)| match lane {
                Lane::Refusing(stream, why) => Some((stream.clone(), *why)),
                _ => None,
            })
            .collect();
        refusing.sort();
        refusing
    }

    /// `lane` is behind from now on; returns its new generation (a consumer created after this call catches it up
    /// with it).
    pub fn behind(&self, lane: &Lane) -> u64 {
        let mut state = self.lock();
        let entry = state.entry(lane.clone()).or_default();
        entry.behind = true;
        entry.generation += 1;
        let generation = entry.generation;
        self.update(&state);
        generation
    }

    /// `lane` is no longer tracked (its stream was deleted, the class stream is sourced, the source recovered).
    pub fn forget(&self, lane: &Lane) {
        let mut state = self.lock();
        if state.remove(lane).is_some() {
            self.update(&state);
        }
    }

    /// A check of a consumer of `generation` found its stream's state confirmed; with `drained`, it had delivered
    /// everything the stream held, which catches the lane up.
    pub fn confirmed(&self, lane: &Lane, generation: u64, drained: bool) {
        let mut state = self.lock();
        let Some(entry) = state.get_mut(lane) else {
            return;
        };
        if entry.generation != generation {
            // A consumer of an older generation: the lane fell behind since it was made.
            return;
        }
        if drained && entry.behind {
            entry.behind = false;
            self.update(&state);
        }
    }

    /// The connection was lost (or may have lost deliveries): every stream is behind until a consumer created
    /// from now on catches up, and the consumer loops are told to resume.
    pub fn connection_lost(&self) {
        let mut state = self.lock();
        for (lane, entry) in state.iter_mut() {
            if matches!(lane, Lane::Stream(_)) {
                entry.behind = true;
                entry.generation += 1;
            }
        }
        self.update(&state);
        drop(state);
        self.epochs.send_modify(|epoch| *epoch += 1);
    }

    /// Changes whenever the connection is lost.
    pub fn epochs(&self) -> watch::Receiver<u64> {
        self.epochs.subscribe()
    }

    fn update(&self, state: &HashMap<Lane, LaneState>) {
        let caught_up = state.values().all(|l| !l.behind);
        let passing = state.iter().all(|(lane, l)| !l.behind || lane.passing());
        self.passing.store(passing, Ordering::Release);
        self.caught_up.store(caught_up, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(name: &str) -> Lane {
        Lane::Stream(name.into())
    }

    #[test]
    fn a_lane_catches_up_only_by_a_drained_check_of_a_consumer_of_its_generation() {
        let catch_up = CatchUp::new();
        assert!(catch_up.lanes_caught_up(), "nothing tracked: Core NATS");
        let a = catch_up.behind(&stream("a"));
        let b = catch_up.behind(&stream("b"));
        catch_up.confirmed(&stream("a"), a, true);
        assert!(!catch_up.lanes_caught_up());
        catch_up.confirmed(&stream("b"), b, false);
        assert!(
            !catch_up.lanes_caught_up(),
            "a check that found messages pending catches nothing up"
        );
        catch_up.confirmed(&stream("b"), b, true);
        assert!(catch_up.lanes_caught_up());
        catch_up.connection_lost();
        assert!(!catch_up.lanes_caught_up());
        // A consumer of the old connection proves nothing.
        catch_up.confirmed(&stream("a"), a, true);
        catch_up.confirmed(&stream("b"), b, true);
        assert!(!catch_up.lanes_caught_up());
        catch_up.confirmed(&stream("a"), a + 1, true);
        catch_up.forget(&stream("b"));
        assert!(catch_up.lanes_caught_up());
    }

    #[test]
    fn a_read_waits_only_for_lanes_that_pass() {
        let catch_up = CatchUp::new();
        catch_up.behind(&stream("a"));
        assert!(!catch_up.blocked(), "a resuming consumer: a read may wait");
        let refusing = Lane::Refusing("s".into(), Refusal::Full);
        catch_up.behind(&refusing);
        assert!(catch_up.blocked());
        assert_eq!(catch_up.refusing(), vec![("s".to_owned(), Refusal::Full)]);
        catch_up.forget(&refusing);
        catch_up.behind(&Lane::NoStream);
        assert!(catch_up.blocked());
        assert!(catch_up.no_stream());
    }
}
