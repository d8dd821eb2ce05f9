//! The per-thread limit (`HISTORY_VIEW_MAX_THREAD_BYTES`): a store read of a larger thread answers 507, and a live
//! view that outgrows it leaves the cache, so one thread cannot take the budget of thousands.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use moka::ops::compute::Op;

use super::entry::Entry;
use super::{ReadError, ViewCache};
use crate::store::StoreReads;
use crate::view::ThreadView;

/// Where `HISTORY_VIEW_MAX_THREAD_BYTES` stopped a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitPath {
    /// A store read (hydration) of the thread: the read answers 507.
    Read,
    /// A live view (live events, a fill) outgrew it: the view left the cache.
    Live,
}

impl LimitPath {
    pub const ALL: [LimitPath; 2] = [LimitPath::Read, LimitPath::Live];

    /// The `path` label of `history_view_thread_limit_exceeded_total`.
    pub fn label(self) -> &'static str {
        match self {
            LimitPath::Read => "read",
            LimitPath::Live => "live",
        }
    }
}

impl<S: StoreReads> ViewCache<S> {
    /// The error of a read of a thread past `HISTORY_VIEW_MAX_THREAD_BYTES`.
    pub(super) fn too_large(&self) -> ReadError {
        ReadError::TooLarge {
            limit: self.settings.max_thread_bytes,
        }
    }

    /// Lets `entry` leave the cache if its view holds more than `HISTORY_VIEW_MAX_THREAD_BYTES`; returns whether
    /// it did.
    pub(super) async fn leave_if_too_large(&self, entry: &Arc<Entry>, path: LimitPath) -> bool {
        let over = entry.view_bytes.load(Ordering::Relaxed) > self.settings.max_thread_bytes;
        if over && !entry.too_large.load(Ordering::Acquire) {
            self.leave_too_large(entry, path).await;
        }
        over
    }

    /// Marks `entry` too large, empties its view and its rendering (their memory is freed now, whoever still
    /// holds the entry) and removes it from the cache. Its readers answer 507; the thread's next entry starts
    /// partial, so its reads go to the store, which answers the same while the thread stays that large. Leaving
    /// is a removal like an eviction: the next entry is not complete until its store read covers this one's events.
    pub(super) async fn leave_too_large(&self, entry: &Arc<Entry>, path: LimitPath) {
        if entry.too_large.swap(true, Ordering::AcqRel) {
            return;
        }
        *entry.lock_view(&self.metrics) = ThreadView::new();
        entry.forget_rendering();
        self.metrics.cache.thread_limit_exceeded(path);
        if path == LimitPath::Live {
            tracing::warn!(
                thread_id = &*entry.thread_id,
                limit_bytes = self.settings.max_thread_bytes,
                "A thread's live view outgrew HISTORY_VIEW_MAX_THREAD_BYTES and left the cache; its reads answer 507"
            );
        }
        self.if_current(entry, || Op::Remove).await;
    }
}
