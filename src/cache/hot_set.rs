//! What the cache gives the hand-over of the hot set ([design 2.5](../../docs/design.md#2.5)); the warm-up's pace
//! and plan are the warm-up's own (`warm_up/pace.rs`).
//!
//! - **The hot set**: the threads read most recently, newest first. A read stores its moment in its entry
//!   ([`Entry::last_read`], one relaxed store: nothing is locked or allocated on the read path); the hot set is
//!   taken by one walk over the cache, off the read path. Evicted threads leave it with their entries.
//! - **A warm hydration**: one thread hydrated through the same hydration as a read (one projector, one
//!   completeness rule), in a slot taken only when two are free, so it never takes the last free one from a read,
//!   and never queued for (tokio's semaphore is fair: a queued warm hydration would go before the reads queued
//!   after it); the warm-up holds at most [`ViewCache::warm_share`] of them at once (as explains do).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::ViewCache;
use super::entry::Entry;
use super::scan::share_of;
use super::work::Begin;
use crate::store::{Hydration, StoreReads};
use crate::view::ViewState;

/// What a warm hydration did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Warmed {
    Hydrated,
    /// Left alone: its view was complete already, or a read's hydration of it was in flight.
    Skipped,
    /// The store failed, or the thread exceeds the limit; its next read hydrates.
    Failed,
}

/// How long the warm-up waits before it looks again for coverage.
const RETRY: Duration = Duration::from_millis(10);

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

    /// How many warm hydrations may run at once: the explain share of the slots, none with a single slot (there
    /// is none to spare).
    pub fn warm_share(&self) -> usize {
        if self.settings.concurrent_hydrations < 2 {
            0
        } else {
            share_of(self.settings.concurrent_hydrations)
        }
    }

    /// Waits until a store read that starts now may complete a view ([`crate::coverage::Coverage::complete_from`])
    /// and the live source has caught up; `false` if `deadline` came first. A warm hydration before that would be
    /// held partial by the completeness rule and read again in the background: two hydrations instead of one.
    pub async fn wait_for_coverage(&self, deadline: Instant) -> bool {
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
    pub fn warm_slot(&self) -> Option<OwnedSemaphorePermit> {
        let mut two = Arc::clone(&self.hydration_slots)
            .try_acquire_many_owned(2)
            .ok()?;
        // The other one goes back at once.
        two.split(1)
    }

    /// Hydrates `thread` in `slot`, unless its view is complete or a read is hydrating it; the entry ranks as
    /// read at `rank` unless a read came first.
    pub async fn warm_one(&self, thread: &str, rank: u64, slot: OwnedSemaphorePermit) -> Warmed {
        let entry: Arc<Entry> = self.entry(thread).await;
        // Err: a read stamped it already.
        let _ = entry
            .last_read
            .compare_exchange(0, rank, Ordering::Relaxed, Ordering::Relaxed);
        if self.state(&entry) == ViewState::Complete {
            return Warmed::Skipped;
        }
        match entry.store.begin_hydration() {
            Begin::Run(ticket) => {
                match self
                    .hydrate(&entry, Hydration::Warm, ticket, Some(slot))
                    .await
                {
                    Ok(()) => {
                        self.reweigh(&entry).await;
                        Warmed::Hydrated
                    }
                    Err(_) => Warmed::Failed,
                }
            }
            // A read's hydration (or a fill) is in flight: it serves the thread.
            Begin::Wait(_) => Warmed::Skipped,
        }
    }
}
