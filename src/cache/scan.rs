//! Explain's store work ([design 3.3](../../docs/design.md#3.3)): the row scan that gives explain the stored rows'
//! metadata, shared by the concurrent explains of a thread, and the explain share, which keeps explains off the
//! hydration slots that history reads need.
//!
//! - **One scan for concurrent explains.** The scans in flight live in a moka cache of their own, keyed by thread:
//!   `or_try_insert_with` runs one scan per thread and hands its rows (or its failure) to every explain that asked
//!   meanwhile. The explain that ran it removes it as soon as it is in, so the rows are never reused by a later
//!   explain; one that arrives after a scan finished and finds it still held (its runner went away before removing
//!   it) removes it and scans again: every explain's rows come from a scan that finished after it asked.
//! - **The explain share.** An explain's store work (the hydration of a view that is not complete, an uncached
//!   read, and the row scan) first takes a permit of the share, `HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS / 2` (at
//!   least 1), then a hydration slot. So explains hold at most that many slots at once, and the others, at least
//!   half, stay for history reads however many explains come; an explain beyond its share waits for a permit
//!   within the store timeout, then answers 503 like a read that found no slot.
//!
//! Order: a permit of the share is always taken before a hydration slot, and no one waits for a permit while
//! holding a slot, so the two semaphores cannot deadlock. An explain lets its read's permit go before it scans.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use moka::ops::compute::Op;
use tokio::sync::SemaphorePermit;
use tokio::time::Instant;

use super::{ReadError, ViewCache};
use crate::explain::RowMeta;
use crate::store::{Bounds, StoreReads};

/// The explain share of `slots` hydration slots: half of them, at least one (with a single slot there is no half to
/// keep; see [design 3.3](../../docs/design.md#3.3)).
pub(super) fn share_of(slots: usize) -> usize {
    (slots / 2).max(1)
}

/// One row scan of a thread, as the explains that asked for it during it share it.
#[derive(Debug)]
pub struct RowScan {
    /// The thread's stored rows without payloads, in stage 2's order.
    pub rows: Vec<RowMeta>,
    /// The count of scans finished when this one finished (its place among them).
    finished: u64,
}

impl<S: StoreReads> ViewCache<S> {
    /// Every stored row of `thread_id` without its payload, for `explain`: from the scan in flight for the thread,
    /// or from one this call runs (within the explain share, a hydration slot, the store timeout and
    /// `HISTORY_VIEW_MAX_THREAD_BYTES`).
    ///
    /// # Errors
    /// [`ReadError`] as for a hydration: the scan's failure, shared by every explain that waited for it.
    pub async fn row_metadata(&self, thread_id: &str) -> Result<Arc<RowScan>, ReadError> {
        // SeqCst with the increment at a scan's end: a scan that finishes after this load counts higher.
        let asked = self.scans_finished.load(Ordering::SeqCst);
        loop {
            let scan = self
                .scans
                .entry_by_ref(thread_id)
                .or_try_insert_with(self.scan(thread_id))
                .await
                .map_err(|error| (*error).clone())?;
            let ran_it = scan.is_fresh();
            let scan = scan.into_value();
            if ran_it {
                // Its waiters have their rows already: a later explain must scan again.
                self.forget_scan(thread_id, &scan).await;
            }
            if scan.finished > asked {
                return Ok(scan);
            }
            // Finished before this explain asked, and left behind by a runner that went away: stale for it.
            self.forget_scan(thread_id, &scan).await;
        }
    }

    /// The scan itself: a permit of the explain share, a hydration slot, one query.
    async fn scan(&self, thread_id: &str) -> Result<Arc<RowScan>, ReadError> {
        let deadline = self.bounds.store_deadline();
        let _share = self.explain_permit(deadline).await?;
        let _slot = self.hydration_slot(deadline).await?;
        let bounds = Bounds {
            deadline,
            budget: self.settings.max_thread_bytes,
        };
        let rows = self
            .store
            .row_metadata(thread_id, bounds)
            .await
            .map_err(|error| ReadError::from(self.limit_met(error, thread_id)))?;
        let finished = self.scans_finished.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(Arc::new(RowScan { rows, finished }))
    }

    /// Removes `scan` from the scans in flight if it is still the thread's (a newer one stays).
    async fn forget_scan(&self, thread_id: &str, scan: &Arc<RowScan>) {
        self.scans
            .entry_by_ref(thread_id)
            .and_compute_with(|current| {
                std::future::ready(match current {
                    Some(current) if Arc::ptr_eq(current.value(), scan) => Op::Remove,
                    _ => Op::Nop,
                })
            })
            .await;
    }

    /// A permit of the explain share, waited for until `deadline`; beyond it the explain answers 503 (counted as a
    /// slot timeout: the share is part of the slots).
    ///
    /// # Errors
    /// [`ReadError::Busy`] when no permit freed in time.
    pub(super) async fn explain_permit(
        &self,
        deadline: Instant,
    ) -> Result<SemaphorePermit<'_>, ReadError> {
        match tokio::time::timeout_at(deadline, self.explain_share.acquire()).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => {
                self.metrics.cache.hydration_slot_timeout();
                Err(ReadError::Busy)
            }
        }
    }
}
