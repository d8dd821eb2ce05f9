//! `CatchUp`: whether the resumable live source (the JetStream consumers) has everything its streams hold, so that
//! a complete view may be served from memory ([design 2.1.4](../docs/design.md#2.1.4)). Core NATS tracks nothing
//! here: it is always caught up (a disconnect is a gap instead).
//!
//! The source is *behind* while any [`Lane`] is: a stream whose consumer is being (re)created until a consumer made
//! after that has delivered what the stream held and a reading after it showed nothing unread gone; a stream whose
//! last confirmed check is older than the silence bound (a lease each check renews, so a stream that stops
//! answering, or a worker that was frozen, is behind without any task noticing); a class stream the partitioned
//! stream does not source, or a source of it that stalled; no stream at all (fail closed).
//!
//! One mutex (the lanes), taken alone for a few steps by the source's tasks; reads load two atomics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// One reason the source can be behind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Lane {
    /// A consumed stream.
    Stream(String),
    /// A class stream matching the pattern that the partitioned stream does not source.
    Unsourced(String),
    /// A source of the partitioned stream that nats-server has not heard from.
    Stalled(String),
    /// A class stream upstream of the partitioned stream, confirmed (a lease, as a stream's) by each discovery round
    /// that reads its state with a quorum.
    Unconfirmed(String),
    /// No stream matches `HISTORY_VIEW_JETSTREAM_STREAMS`, or they cannot be listed: fail closed.
    NoStream,
}

impl Lane {
    /// Whether a read may wait for this lane: a resuming consumer catches up in moments; the others last until
    /// an operator or NATS acts.
    fn passing(&self) -> bool {
        matches!(self, Lane::Stream(_))
    }
}

#[derive(Debug, Default)]
struct LaneState {
    behind: bool,
    /// Bumped whenever the lane falls behind: only a consumer of this generation or later catches it up.
    generation: u64,
    /// Until when its last confirmed check holds (streams only).
    lease_until: Option<Instant>,
}

pub struct CatchUp {
    state: Mutex<HashMap<Lane, LaneState>>,
    /// No lane is behind.
    caught_up: AtomicBool,
    /// Every lane behind is a stream resuming (a read may wait for it).
    passing: AtomicBool,
    /// The earliest lease's end, in nanoseconds since `origin` (`u64::MAX`: no lease).
    lease_until: AtomicU64,
    origin: Instant,
    /// Woken whenever the source is caught up again (every lane, and a lease renewed).
    changed: Notify,
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
            lease_until: AtomicU64::new(u64::MAX),
            origin: Instant::now(),
            changed: Notify::new(),
            epochs: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Lane, LaneState>> {
        // Lanes change by single steps: a panic cannot leave the map torn.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no lane is behind and every stream's last check still holds.
    pub fn is_caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire) && self.leases_hold()
    }

    /// Whether no lane is behind, leases aside (readiness: a lease that lapsed for a moment does not take a
    /// worker out of its Service).
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

    fn leases_hold(&self) -> bool {
        let until = self.lease_until.load(Ordering::Acquire);
        until == u64::MAX || self.nanos(Instant::now()) < until
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX - 1)
    }

    /// Waits until the source is caught up, or `deadline`; returns whether it is. Returns at once while a lane
    /// that lasts is behind.
    pub async fn wait(&self, deadline: Instant) -> bool {
        loop {
            let changed = self.changed.notified();
            if self.is_caught_up() {
                return true;
            }
            if self.blocked() {
                return false;
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(deadline) => return self.is_caught_up(),
            }
        }
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

    /// A check of a consumer of `generation` found its stream's state confirmed until `lease_until`; with
    /// `drained`, it had delivered everything the stream held, which catches the lane up.
    pub fn confirmed(&self, lane: &Lane, generation: u64, drained: bool, lease_until: Instant) {
        let mut state = self.lock();
        let Some(entry) = state.get_mut(lane) else {
            return;
        };
        if entry.generation != generation {
            // A consumer of an older generation: the lane fell behind since it was made.
            return;
        }
        entry.lease_until = Some(lease_until);
        if drained {
            entry.behind = false;
        }
        self.update(&state);
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
        let lease = state
            .values()
            .filter_map(|l| l.lease_until)
            .map(|at| self.nanos(at))
            .min()
            .unwrap_or(u64::MAX);
        self.lease_until.store(lease, Ordering::Release);
        self.passing.store(passing, Ordering::Release);
        self.caught_up.store(caught_up, Ordering::Release);
        if caught_up {
            self.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn stream(name: &str) -> Lane {
        Lane::Stream(name.into())
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_catches_up_only_by_a_consumer_of_its_generation() {
        let catch_up = CatchUp::new();
        assert!(catch_up.is_caught_up(), "nothing tracked: Core NATS");
        let a = catch_up.behind(&stream("a"));
        let b = catch_up.behind(&stream("b"));
        let lease = Instant::now() + Duration::from_secs(2);
        catch_up.confirmed(&stream("a"), a, true, lease);
        assert!(!catch_up.is_caught_up());
        catch_up.confirmed(&stream("b"), b, false, lease);
        assert!(!catch_up.is_caught_up(), "confirmed but not drained");
        catch_up.confirmed(&stream("b"), b, true, lease);
        assert!(catch_up.is_caught_up());
        catch_up.connection_lost();
        assert!(!catch_up.is_caught_up());
        // A consumer of the old connection proves nothing.
        catch_up.confirmed(&stream("a"), a, true, lease);
        catch_up.confirmed(&stream("b"), b, true, lease);
        assert!(!catch_up.is_caught_up());
        catch_up.confirmed(&stream("a"), a + 1, true, lease);
        catch_up.forget(&stream("b"));
        assert!(catch_up.is_caught_up());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_lapses_is_behind_until_a_check_renews_it() {
        let catch_up = CatchUp::new();
        let generation = catch_up.behind(&stream("a"));
        catch_up.confirmed(
            &stream("a"),
            generation,
            true,
            Instant::now() + Duration::from_secs(2),
        );
        assert!(catch_up.is_caught_up());
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!catch_up.is_caught_up(), "silence is behind");
        assert!(
            catch_up.lanes_caught_up(),
            "readiness ignores a lapsed lease"
        );
        catch_up.confirmed(
            &stream("a"),
            generation,
            false,
            Instant::now() + Duration::from_secs(2),
        );
        assert!(catch_up.is_caught_up());
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_waits_for_a_resuming_stream_but_not_for_a_lasting_lane() {
        let catch_up = Arc::new(CatchUp::new());
        let generation = catch_up.behind(&stream("a"));
        let waiter = {
            let catch_up = Arc::clone(&catch_up);
            tokio::spawn(async move {
                catch_up
                    .wait(Instant::now() + Duration::from_secs(60))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        catch_up.confirmed(
            &stream("a"),
            generation,
            true,
            Instant::now() + Duration::from_secs(2),
        );
        assert!(waiter.await.unwrap());

        catch_up.behind(&Lane::NoStream);
        let start = Instant::now();
        assert!(!catch_up.wait(start + Duration::from_secs(60)).await);
        assert_eq!(Instant::now(), start, "no wait for a lane that lasts");
        assert!(catch_up.no_stream());
    }
}
