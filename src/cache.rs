//! `Views`: the moka cache of [`ThreadView`]s and the read path over it.
//!
//! - Live events go into their thread's view; a thread not in the cache gets a `Partial` view.
//! - A read of a `Complete` view is answered from memory. A read of a partial or absent view hydrates it from the
//!   store once (concurrent readers wait for the same hydration), merges the live events held (including those
//!   that arrived during the hydration) and marks it complete.
//! - A possible gap in the live stream downgrades every view to partial at once ([`Views::downgrade_all`] bumps a
//!   gap generation that views compare with the one they were completed at); a hydration
//!   that was in flight during a gap, or ran while NATS was disconnected, answers its read but leaves the view
//!   partial.
//! - Memory is bounded by a byte budget: each entry is charged its view's (and last rendered answer's) bytes plus
//!   headroom when inserted, and re-inserted (re-weighed) only when it outgrows that charge, so the charge does not
//!   fall below what is held by more than one event between checks.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use moka::future::Cache;
use serde::Serialize;

use crate::decode::ViewEvent;
use crate::metrics::{Metrics, Source};
use crate::project::{HistoryMessage, Identity, Projection};
use crate::store::{Store, StoreError};
use crate::view::{Inserted, ThreadView, ViewState};

/// A rendered history response.
#[derive(Debug, Clone)]
pub struct Answer {
    /// `{"thread_id": ..., "messages": [...]}`.
    pub body: Bytes,
    /// A strong validator of `body` (quoted), equal for equal bodies whatever their source.
    pub etag: String,
    pub source: Source,
}

/// The view cache and the store behind it. Cloning is cheap.
#[derive(Clone)]
pub struct Views {
    cache: Cache<String, Arc<Entry>>,
    store: Store,
    metrics: Metrics,
    /// Bumped on every possible gap in the live stream; a hydration that saw it change stays partial.
    gaps: Arc<AtomicU64>,
    /// Whether the live stream is connected now. A view hydrated while it is not cannot be complete: events
    /// published meanwhile are being missed.
    live: Arc<AtomicBool>,
}

/// One cached thread.
struct Entry {
    /// The cache key, kept so that live inserts need not copy it from each event.
    thread_id: Box<str>,
    view: Mutex<ThreadView>,
    /// Held while hydrating, so concurrent readers of a partial view share one store query.
    hydration: tokio::sync::Mutex<()>,
    /// Bumped when a hydration fails, so readers that waited for it fail too instead of queueing one store
    /// timeout after another.
    failed_hydrations: AtomicU64,
    /// The weight moka charged at the last insert.
    charged: AtomicUsize,
    /// The last rendered answer: (view version, primary identity, answer).
    rendered: Mutex<Option<(u64, Option<Identity>, Answer)>>,
    /// Warnings already logged for this view, so a malformed event is warned about once, not on every read.
    warned: Mutex<HashSet<u64>>,
}

/// The response body's shape.
#[derive(Serialize)]
struct HistoryBody<'a> {
    thread_id: &'a str,
    messages: &'a [HistoryMessage],
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a view lock leaves a view that is still structurally valid (every mutation is a
    // single insert); serving it beats failing every later read of the thread.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Entry {
    fn new(thread_id: &str) -> Self {
        Self {
            thread_id: thread_id.into(),
            view: Mutex::new(ThreadView::new()),
            hydration: tokio::sync::Mutex::new(()),
            failed_hydrations: AtomicU64::new(0),
            charged: AtomicUsize::new(0),
            rendered: Mutex::new(None),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Bytes held: the view and its last rendered answer.
    fn held_bytes(&self) -> usize {
        let view = lock(&self.view).bytes();
        let rendered = lock(&self.rendered).as_ref().map_or(0, |(_, _, answer)| {
            answer.body.len() + answer.etag.len() + 64
        });
        view + rendered
    }

    /// The weight to charge now: the bytes held plus a quarter of headroom, so that a growing view is re-weighed
    /// only every so often.
    fn charge(&self) -> u32 {
        let bytes = self.held_bytes();
        let charge = bytes + bytes / 4 + 512;
        self.charged.store(charge, Ordering::Relaxed);
        u32::try_from(charge).unwrap_or(u32::MAX)
    }

    fn outgrew_charge(&self) -> bool {
        self.held_bytes() > self.charged.load(Ordering::Relaxed)
    }

    /// Renders the view for `primary`, reusing the last rendering while the view has not changed. Warnings not
    /// logged for this view before are logged (and counted in `metrics`).
    fn render(
        &self,
        view: &ThreadView,
        thread_id: &str,
        primary: Option<&Identity>,
        source: Source,
        metrics: &Metrics,
    ) -> Answer {
        let mut rendered = lock(&self.rendered);
        if let Some((version, identity, answer)) = rendered.as_ref()
            && *version == view.version()
            && identity.as_ref() == primary
        {
            return Answer {
                source,
                ..answer.clone()
            };
        }
        let projection = view.project(primary);
        metrics.malformed_warnings(self.log_new_warnings(&projection));
        let answer = answer(thread_id, &projection, source);
        *rendered = Some((view.version(), primary.cloned(), answer.clone()));
        answer
    }

    /// Logs the warnings this view has not logged yet; returns how many.
    fn log_new_warnings(&self, projection: &Projection) -> usize {
        if projection.warnings.is_empty() {
            return 0;
        }
        let mut warned = lock(&self.warned);
        let mut logged = 0;
        for warning in &projection.warnings {
            let mut hasher = DefaultHasher::new();
            let identity = (
                &warning.event_id,
                &warning.display_id,
                &warning.run_id,
                &warning.event_name,
            );
            identity.hash(&mut hasher);
            warning.error_type().hash(&mut hasher);
            if warned.insert(hasher.finish()) {
                warning.log();
                logged += 1;
            }
        }
        logged
    }
}

/// Serialises a projection into the response body and its ETag.
pub fn answer(thread_id: &str, projection: &Projection, source: Source) -> Answer {
    let body = serde_json::to_vec(&HistoryBody {
        thread_id,
        messages: &projection.history.messages,
    })
    // Serialising strings and vectors of plain structs cannot fail.
    .unwrap_or_default();
    let mut hasher = DefaultHasher::new();
    body.hash(&mut hasher);
    Answer {
        etag: format!("\"{:016x}\"", hasher.finish()),
        body: Bytes::from(body),
        source,
    }
}

impl Views {
    pub fn new(store: Store, metrics: Metrics, max_bytes: u64, idle: Duration) -> Self {
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_thread: &String, entry: &Arc<Entry>| entry.charge())
            .time_to_idle(idle)
            .build();
        Self {
            cache,
            store,
            metrics,
            gaps: Arc::new(AtomicU64::new(0)),
            live: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Applies one live event to its thread's view, creating a partial view for a thread not held.
    pub async fn apply(&self, event: ViewEvent) -> Inserted {
        let entry = self.entry(event.key.thread_id()).await;
        let inserted = lock(&entry.view).insert(event);
        if entry.outgrew_charge() {
            self.reweigh(&entry, &entry.thread_id).await;
        }
        inserted
    }

    /// Answers a history read, from memory when the view is complete, otherwise by hydrating it from the store.
    ///
    /// # Errors
    /// [`StoreError`] when the view needed the store and the store failed; the view stays partial.
    pub async fn read(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer, StoreError> {
        let entry = self.entry(thread_id).await;
        if let Some(answer) = self.complete_answer(&entry, thread_id, primary, Source::Cache) {
            self.metrics.cache_hit();
            return Ok(answer);
        }
        self.metrics.cache_miss();
        let failures_before = entry.failed_hydrations.load(Ordering::Acquire);
        let _hydrating = entry.hydration.lock().await;
        // Another reader may have hydrated the view while this one waited, or failed to.
        if let Some(answer) = self.complete_answer(&entry, thread_id, primary, Source::Store) {
            return Ok(answer);
        }
        if entry.failed_hydrations.load(Ordering::Acquire) != failures_before {
            return Err(StoreError::ConcurrentReadFailed);
        }
        let gaps_before = self.gaps.load(Ordering::Acquire);
        let live_before = self.live.load(Ordering::Acquire);
        let rows = match self.store.thread_rows(thread_id).await {
            Ok(rows) => rows,
            Err(error) => {
                entry.failed_hydrations.fetch_add(1, Ordering::AcqRel);
                self.metrics.hydration(false);
                return Err(error);
            }
        };
        let answer = {
            let mut view = lock(&entry.view);
            let live = std::mem::take(&mut *view);
            *view = ThreadView::hydrated(rows.events, rows.displays, live);
            let gap_free = live_before
                && self.live.load(Ordering::Acquire)
                && self.gaps.load(Ordering::Acquire) == gaps_before;
            // Otherwise (or when a live marker stands on a display the store did not return yet) answer from what
            // was read, but hydrate again on the next read.
            if gap_free {
                view.mark_complete(gaps_before);
            }
            entry.render(&view, thread_id, primary, Source::Store, &self.metrics)
        };
        self.metrics.hydration(true);
        self.reweigh(&entry, thread_id).await;
        Ok(answer)
    }

    /// Records whether the live stream is connected (and subscribed).
    pub fn set_live(&self, live: bool) {
        self.live.store(live, Ordering::Release);
    }

    /// Marks every view partial after a possible gap in the live stream.
    ///
    /// O(1): it bumps the gap generation, which every view compares with the one it was completed at. The views
    /// are counted as downgraded when a read finds them so.
    pub fn downgrade_all(&self) {
        self.gaps.fetch_add(1, Ordering::AcqRel);
    }

    /// Updates the cache size gauges (called before a metrics scrape).
    pub async fn report_size(&self) {
        self.cache.run_pending_tasks().await;
        self.metrics
            .cache_size(self.cache.entry_count(), self.cache.weighted_size());
    }

    fn complete_answer(
        &self,
        entry: &Entry,
        thread_id: &str,
        primary: Option<&Identity>,
        source: Source,
    ) -> Option<Answer> {
        let mut view = lock(&entry.view);
        if view.state(self.gaps.load(Ordering::Acquire)) == ViewState::Complete {
            return Some(entry.render(&view, thread_id, primary, source, &self.metrics));
        }
        // Complete as of an older generation: a gap happened since.
        if view.downgrade() {
            self.metrics.views_downgraded(1);
        }
        None
    }

    async fn entry(&self, thread_id: &str) -> Arc<Entry> {
        if let Some(entry) = self.cache.get(thread_id).await {
            return entry;
        }
        self.cache
            .get_with_by_ref(thread_id, async { Arc::new(Entry::new(thread_id)) })
            .await
    }

    /// Re-inserts `entry` so moka weighs it again. If the cache meanwhile holds another entry for the thread (this
    /// one was evicted and live events created a new one), that entry's events are merged in and the view is left
    /// partial: events may have reached the other entry after the merge.
    async fn reweigh(&self, entry: &Arc<Entry>, thread_id: &str) {
        if let Some(current) = self.cache.get(thread_id).await
            && !Arc::ptr_eq(&current, entry)
        {
            let other = lock(&current.view).clone();
            let mut view = lock(&entry.view);
            view.merge(other);
            view.downgrade();
        }
        self.cache
            .insert(thread_id.to_owned(), Arc::clone(entry))
            .await;
    }
}
