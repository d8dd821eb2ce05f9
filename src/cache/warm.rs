//! The hot set and the warm-up's hydrations ([design 2.5](../../docs/design.md#2.5)).
//!
//! - **The hot set**: the threads read most recently, newest first. A read stores its moment in its entry
//!   ([`Entry::last_read`], one relaxed store: nothing is locked or allocated on the read path); the hot set is
//!   taken by one walk over the cache, off the read path. Evicted threads leave it with their entries.
//! - **The warm-up**: a starting worker hydrates the threads of the hot set it was handed, newest first, through the
//!   same hydration as a read (one projector, one completeness rule), after the moment from which a store read can
//!   complete a view, at most `rate` a second, until done or the deadline. Reads come first: a warm hydration takes
//!   a slot only when two are free, so it never takes the last free one from a read, and it never queues on the
//!   slots' semaphore (tokio's semaphore is fair: a queued warm hydration would go before the reads queued after
//!   it); it waits in small steps instead, and holds at most half the slots at once (as explains do).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::ViewCache;
use super::entry::Entry;
use super::scan::share_of;
use super::work::Begin;
use crate::store::{Hydration, StoreReads};
use crate::view::ViewState;
use crate::warm_up::WarmState;

/// How long the warm-up waits before it looks again for two free slots, or for coverage.
const RETRY: Duration = Duration::from_millis(10);

/// How the warm-up runs.
#[derive(Debug, Clone, Copy)]
pub struct WarmPlan {
    /// Most hydrations started a second.
    pub rate: u32,
    /// When the warm-up stops, done or not.
    pub deadline: Instant,
}

/// What the warm-up did; hydrations still running at the deadline finish on their own and count as pending here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmReport {
    pub listed: usize,
    pub hydrated: usize,
    pub skipped: usize,
    pub failed: usize,
    pub pending: usize,
    /// The deadline came first.
    pub hit_deadline: bool,
}

impl WarmReport {
    fn count(&mut self, state: WarmState) {
        match state {
            WarmState::Hydrated => self.hydrated += 1,
            WarmState::Skipped => self.skipped += 1,
            WarmState::Failed => self.failed += 1,
            WarmState::Listed | WarmState::Pending => return,
        }
        self.pending -= 1;
    }
}

impl<S: StoreReads> ViewCache<S> {
    /// The ids of at most `max` threads to hand on, newest first: those this worker read, the most recently read
    /// first (a thread the warm-up hydrated ranks after every read one, in the order it was handed over), then those
    /// of `inherited` (the set this worker was handed, in its order) that have no entry here: the warm-up did not
    /// reach them (it was stopped, or hit its deadline) or they were evicted. A thread the store shows does not exist
    /// (its view complete and empty) is not handed on: it cost its one query in this generation.
    pub fn hot_set(&self, max: usize, inherited: &[String]) -> Vec<String> {
        if max == 0 {
            return Vec::new();
        }
        // The keys, not the entries: holding an entry would delay its removal record.
        let mut read: Vec<(u64, Arc<String>)> = self
            .cache
            .iter()
            .filter_map(|(thread, entry)| {
                let at = entry.last_read.load(Ordering::Relaxed);
                (at > 0 && !entry.too_large.load(Ordering::Relaxed) && !self.known_absent(&entry))
                    .then_some((at, thread))
            })
            .collect();
        if read.len() > max {
            read.select_nth_unstable_by_key(max, |(at, _)| std::cmp::Reverse(*at));
            read.truncate(max);
        }
        read.sort_unstable_by_key(|(at, _)| std::cmp::Reverse(*at));
        let mut threads: Vec<String> = read
            .into_iter()
            .map(|(_, thread)| (*thread).clone())
            .collect();
        let room = max - threads.len();
        threads.extend(
            inherited
                .iter()
                .filter(|thread| !self.cache.contains_key(thread.as_str()))
                .take(room)
                .cloned(),
        );
        threads
    }

    /// Whether `entry`'s thread does not exist as far as the store and the live source show: its view is complete
    /// and holds no event.
    fn known_absent(&self, entry: &Entry) -> bool {
        let view = entry.lock_view(&self.metrics);
        view.is_empty() && view.state(self.coverage.epoch(entry.bucket)) == ViewState::Complete
    }

    /// Hydrates `threads` (the most recently read first) by `plan`, once a store read can complete a view.
    pub async fn warm_up(&self, threads: Vec<String>, plan: WarmPlan) -> WarmReport {
        let mut report = WarmReport {
            listed: threads.len(),
            pending: threads.len(),
            ..WarmReport::default()
        };
        self.metrics.warm.listed(threads.len());
        // With a single slot there is none to spare for the warm-up: the threads stay pending.
        if threads.is_empty() || self.settings.concurrent_hydrations < 2 {
            return report;
        }
        if !self.wait_for_coverage(plan.deadline).await {
            report.hit_deadline = true;
            return report;
        }
        let share = share_of(self.settings.concurrent_hydrations);
        let interval = Duration::from_secs(1) / plan.rate.max(1);
        let mut running: JoinSet<WarmState> = JoinSet::new();
        let mut next = Instant::now();
        let listed = threads.len() as u64;
        'threads: for (i, thread) in threads.into_iter().enumerate() {
            let slot = loop {
                let now = Instant::now();
                if now >= plan.deadline {
                    report.hit_deadline = true;
                    break 'threads;
                }
                if now >= next && running.len() < share {
                    if let Some(slot) = self.warm_slot() {
                        break slot;
                    }
                }
                let until = next.max(now + RETRY).min(plan.deadline);
                tokio::select! {
                    () = tokio::time::sleep_until(until) => {}
                    Some(done) = running.join_next(), if !running.is_empty() => {
                        if let Ok(state) = done {
                            report.count(state);
                        }
                    }
                }
            };
            next = next.max(Instant::now()) + interval;
            // Ranks below every read (a read's stamp is at least a day in nanoseconds), newest highest.
            let rank = listed - i as u64;
            let views = self.clone();
            running.spawn(async move { views.warm_one(&thread, rank, slot).await });
        }
        while !running.is_empty() {
            match tokio::time::timeout_at(plan.deadline, running.join_next()).await {
                Ok(Some(Ok(state))) => report.count(state),
                Ok(Some(Err(_))) => {}
                Ok(None) => break,
                Err(_) => {
                    report.hit_deadline = true;
                    // They finish on their own (each within the store timeout) and count in the metric.
                    running.detach_all();
                }
            }
        }
        report
    }

    /// Waits until a store read that starts now may complete a view ([`crate::coverage::Coverage::complete_from`])
    /// and the live source has caught up; `false` if `deadline` came first. A warm hydration before that would be
    /// held partial by the completeness rule and read again in the background: two hydrations instead of one.
    async fn wait_for_coverage(&self, deadline: Instant) -> bool {
        loop {
            let now = Instant::now();
            let from = self.coverage.complete_from();
            if self.coverage.catch_up().lanes_caught_up()
                && from.is_some_and(|from| self.coverage.instant(from) <= now)
            {
                return true;
            }
            if now >= deadline {
                return false;
            }
            let until = from
                .map(|from| self.coverage.instant(from))
                .filter(|at| *at > now)
                .unwrap_or(now + RETRY)
                .min(deadline);
            tokio::time::sleep_until(until).await;
        }
    }

    /// A hydration slot for the warm-up, taken only when another stays free for a read; never waited for.
    fn warm_slot(&self) -> Option<OwnedSemaphorePermit> {
        let mut two = Arc::clone(&self.hydration_slots)
            .try_acquire_many_owned(2)
            .ok()?;
        // The other one goes back at once.
        two.split(1)
    }

    /// Hydrates `thread` in `slot`, unless its view is complete or a read is hydrating it; the entry ranks as
    /// read at `rank` unless a read came first.
    async fn warm_one(&self, thread: &str, rank: u64, slot: OwnedSemaphorePermit) -> WarmState {
        let entry: Arc<Entry> = self.entry(thread).await;
        // Err: a read stamped it already.
        let _ = entry
            .last_read
            .compare_exchange(0, rank, Ordering::Relaxed, Ordering::Relaxed);
        let state = if self.state(&entry) == ViewState::Complete {
            WarmState::Skipped
        } else {
            match entry.store.begin_hydration() {
                Begin::Run(ticket) => {
                    match self
                        .hydrate(&entry, Hydration::Warm, ticket, Some(slot))
                        .await
                    {
                        Ok(()) => {
                            self.reweigh(&entry).await;
                            WarmState::Hydrated
                        }
                        Err(_) => WarmState::Failed,
                    }
                }
                // A read's hydration (or a fill) is in flight: it serves the thread.
                Begin::Wait(_) => WarmState::Skipped,
            }
        };
        self.metrics.warm.done(state);
        state
    }
}
