//! `ViewCache`: the moka cache of [`ThreadView`]s and the read path over it.
//!
//! - Live events go into their thread's view; a thread not in the cache gets a `Partial` view.
//! - A read of a `Complete` view is answered from memory. A read of a partial or absent view hydrates it from the
//!   store once (concurrent readers wait for the same hydration), merges the live events held (including those
//!   that arrived during the hydration) and marks it complete if [`Coverage::verdict`] allows it.
//! - **The persister-lag rule** ([design 2.1]): a view is complete only if its store read started at least
//!   `HISTORY_VIEW_PERSIST_LAG_MS` after the thread's coverage start (see [`crate::coverage`]). A view held partial
//!   only because the bound had not passed gets one background re-read once it has, so the next read is still
//!   served from memory. Case by case, why that suffices:
//!   - *start, reconnect*: coverage starts at the first confirmed round trip after (re)subscribing; an event
//!     published before it was either delivered live or is in the store by the time the read starts.
//!   - *slow consumer, dropped connection event, disconnect*: the gap moves coverage start to its handling and
//!     changes the epoch, so complete views are partial at their next read and hydrate after the bound.
//!   - *eviction, idle expiry*: an entry records its removal for the thread's bucket when it is dropped (the
//!     cache let go of it and nothing holds it any more), which also changes the bucket's epoch, so a successor
//!     completed before the record is partial again. Every event applied to the old entry was applied before its
//!     drop, so the successor's store read (at least the bound after the record) returns it. A successor created
//!     while an entry of its bucket is still alive (possibly its predecessor, not dropped yet) covers the thread
//!     from its own creation.
//!   - *replacement during re-weigh*: [`ViewCache::reweigh`] re-inserts an entry only while it is still the current
//!     one (an atomic compute on the key), so no other entry's events are overwritten.
//!   - *store outage*: the outage's end is a coverage start, since aihub's persister could not write either.
//!   - *hydration racing live events*: events that arrive during the store read are held by the view and merged;
//!     a gap or removal during the read moves coverage start past the read's start, so the read cannot count.
//! - A marker that lands live on a display the view has not read leaves that display uncovered: a complete view
//!   queues a fill of its stored events, off the read path, and is served from memory again once it is done (a
//!   read meanwhile waits for it). See [`ViewCache::fill`] for why the view stays complete.
//! - Memory is bounded by a byte budget: each entry is charged its view's (and last rendered answer's) bytes plus
//!   headroom when inserted, and re-inserted (re-weighed) only when it outgrows that charge, so the charge does not
//!   fall below what is held by more than one event between checks.
//!
//! [design 2.1]: ../docs/design.md#2.1

use std::collections::{HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use moka::future::Cache;
use moka::ops::compute::Op;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::coverage::{self, Coverage, Stamp, Verdict};
use crate::decode::ViewEvent;
use crate::metrics::{EventOutcome, FillOutcome, Metrics, RereadResult};
use crate::project::{HistoryMessage, Identity, Projection};
use crate::store::{Bounds, Hydration, Store, StoreError, StoreReads};
use crate::telemetry::RateLimit;
use crate::view::{Inserted, ThreadView, ViewState, display_bytes};

/// Most views one fill query serves.
const FILL_BATCH: usize = 64;
/// Fills waiting for a query; beyond it a fill is dropped and its view's next read hydrates.
const FILL_QUEUE: usize = 1024;

/// A view waiting for a fill, with its entry's hydration lock (readers of the entry wait for the fill).
struct FillRequest {
    entry: Arc<Entry>,
    _lock: tokio::sync::OwnedMutexGuard<()>,
}

/// Where a read's answer came from; also the `X-History-Source` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Cache,
    Store,
}

impl Source {
    /// The `source` label of the read metrics and the `X-History-Source` header's value.
    pub fn label(self) -> &'static str {
        match self {
            Source::Cache => "cache",
            Source::Store => "store",
        }
    }
}

/// Where `HISTORY_VIEW_MAX_THREAD_BYTES` stopped a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitPath {
    /// A store read (hydration) of the thread: the read answers 507.
    Read,
    /// A live view (live events, a fill) outgrew it: the view left the cache.
    Live,
}

impl LimitPath {
    /// The `path` label of `history_view_thread_limit_exceeded_total`.
    pub fn label(self) -> &'static str {
        match self {
            LimitPath::Read => "read",
            LimitPath::Live => "live",
        }
    }
}

/// Why a read could not be answered (the view stays partial).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The view needed the store and the store failed.
    #[error(transparent)]
    Store(StoreError),
    /// Every slot for store reads of whole threads stayed taken for the whole store timeout.
    #[error("too many store reads were in flight; none finished within the store timeout")]
    Busy,
    /// The read waited for another read of the same thread, and that one could not reach the store.
    #[error("a concurrent read of this thread could not reach the store")]
    ConcurrentReadFailed,
    /// The thread's events exceed `HISTORY_VIEW_MAX_THREAD_BYTES` (in the store, or in the view with its live
    /// events).
    #[error(
        "the thread's events exceed the per-thread limit of {limit} bytes (HISTORY_VIEW_MAX_THREAD_BYTES)"
    )]
    TooLarge { limit: usize },
}

impl From<StoreError> for ReadError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::TooLarge { limit } => ReadError::TooLarge { limit },
            other => ReadError::Store(other),
        }
    }
}

/// A rendered history response.
#[derive(Debug, Clone)]
pub struct Answer {
    /// `{"thread_id": ..., "messages": [...]}`.
    pub body: Bytes,
    /// A strong validator of `body` (quoted), equal for equal bodies whatever their source.
    pub etag: String,
    pub source: Source,
}

/// What the view cache is configured with.
#[derive(Debug, Clone)]
pub struct CacheSettings {
    /// `HISTORY_VIEW_CACHE_MAX_BYTES`: the byte budget of the views held.
    pub max_bytes: u64,
    /// `HISTORY_VIEW_CACHE_IDLE_SECS`: a view unused this long leaves.
    pub idle: Duration,
    /// `HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS`: store reads of whole threads at once.
    pub concurrent_hydrations: usize,
    /// `HISTORY_VIEW_STORE_TIMEOUT_MS`: how long a read may wait for the store, a hydration slot included.
    pub store_timeout: Duration,
    /// `HISTORY_VIEW_MAX_THREAD_BYTES`: most bytes of events one view or store read may hold.
    pub max_thread_bytes: usize,
}

/// The view cache and the store behind it (MongoDB's [`Store`]; an in-memory fake in the unit tests). Cloning is
/// cheap.
pub struct ViewCache<S = Store> {
    cache: Cache<String, Arc<Entry>>,
    store: Arc<S>,
    settings: Arc<CacheSettings>,
    /// Rate limits of the warnings about threads without a visible marker, and about reads stopped by the limit.
    no_marker_warnings: Arc<RateLimit>,
    too_large_warnings: Arc<RateLimit>,
    metrics: Metrics,
    /// Whether a store read may complete a view, and the epoch complete views are checked against.
    coverage: Coverage,
    /// Cancels the background re-reads and fills when the service stops.
    stop: CancellationToken,
    /// The queue of fills (see [`ViewCache::run_fills`]).
    fills: mpsc::Sender<FillRequest>,
    /// One permit per store read of a whole thread allowed at once (`HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS`): each
    /// may hold a thread's events in memory.
    hydration_slots: Arc<tokio::sync::Semaphore>,
}

/// An answer rendered from one version of a view for one primary identity.
struct Rendered {
    version: u64,
    primary: Option<Identity>,
    answer: Answer,
}

/// One cached thread.
struct Entry {
    /// The cache key, kept so that live inserts need not copy it from each event.
    thread_id: Box<str>,
    /// The thread's removal bucket in [`Coverage`].
    bucket: usize,
    /// The floor of this entry's coverage start ([`Coverage::entry_created`]).
    floor: Stamp,
    /// Where the entry records its removal when it is dropped.
    coverage: Coverage,
    /// The view. Lock it through [`Entry::view`], which applies the waiting events first.
    view: Mutex<ThreadView>,
    /// Live events that arrived while the view was locked (a read rendering it, a hydration merging): the live
    /// path never waits for a view. Whoever holds the view applies them before using it and again before letting
    /// go of it, and a holder that lets go re-checks them, so none is left behind ([`Entry::view`]).
    waiting: Mutex<Vec<ViewEvent>>,
    /// The view's bytes, updated by every holder as it lets go: weighing an entry never waits for its view.
    view_bytes: AtomicUsize,
    /// The bytes of the last rendered answer.
    rendered_bytes: AtomicUsize,
    /// Held while hydrating or filling, so concurrent readers of a partial view share one store query, and a read
    /// that arrives during a fill waits for it.
    hydration: Arc<tokio::sync::Mutex<()>>,
    /// Bumped when a hydration fails, so readers that waited for it fail too instead of queueing one store
    /// timeout after another.
    failed_hydrations: AtomicU64,
    /// Bumped when a hydration succeeds, so readers that waited for it share its answer even when the view stays
    /// partial (within the persister-lag bound), instead of each reading the store again.
    hydrations: AtomicU64,
    /// A background re-read is scheduled, so a deferred view gets one, not one per read.
    reread_scheduled: AtomicBool,
    /// A fill is scheduled and has not started reading which displays to fill.
    fill_scheduled: AtomicBool,
    /// The weight moka charged at the last insert.
    charged: AtomicUsize,
    /// The last rendered answer.
    rendered: Mutex<Option<Rendered>>,
    /// The thread outgrew `HISTORY_VIEW_MAX_THREAD_BYTES`: the entry left the cache with its view emptied, and its
    /// readers answer 507.
    too_large: AtomicBool,
    /// Whether stage 1's skipped markers were warned about for this entry.
    skipped_markers_warned: AtomicBool,
    /// Warnings already logged for this view, so a malformed event is warned about once, not on every read.
    warned: Mutex<HashSet<u64>>,
}

/// A locked view ([`Entry::view`]). Letting go of it applies the events that waited meanwhile, records the view's
/// bytes, and re-checks for events that arrived in between (taking the view again if it is free).
struct ViewGuard<'a> {
    entry: &'a Entry,
    metrics: &'a Metrics,
    /// `None` only while dropping.
    view: Option<MutexGuard<'a, ThreadView>>,
}

impl<'a> ViewGuard<'a> {
    /// Takes over `view` (locked) and applies the waiting events to it.
    fn new(entry: &'a Entry, metrics: &'a Metrics, view: MutexGuard<'a, ThreadView>) -> Self {
        let mut guard = ViewGuard {
            entry,
            metrics,
            view: Some(view),
        };
        guard.apply_waiting();
        guard
    }

    /// Inserts the waiting events, in arrival order, counting each as the live path would have.
    fn apply_waiting(&mut self) {
        let waiting = std::mem::take(&mut *lock(&self.entry.waiting));
        for event in waiting {
            let outcome = match self.insert(event) {
                Inserted::Added => EventOutcome::Relevant,
                Inserted::Duplicate => EventOutcome::Duplicate,
            };
            self.metrics.event(outcome);
        }
    }
}

impl std::ops::Deref for ViewGuard<'_> {
    type Target = ThreadView;
    fn deref(&self) -> &ThreadView {
        self.view.as_deref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for ViewGuard<'_> {
    fn deref_mut(&mut self) -> &mut ThreadView {
        self.view.as_deref_mut().expect("held until dropped")
    }
}

impl Drop for ViewGuard<'_> {
    fn drop(&mut self) {
        loop {
            self.apply_waiting();
            self.entry.view_bytes.store(self.bytes(), Ordering::Relaxed);
            drop(self.view.take());
            // An event pushed after the last check, while this guard still held the view, waits for a holder:
            // be that holder if the view is free (if it is not, its holder checks as it lets go).
            if lock(&self.entry.waiting).is_empty() {
                return;
            }
            match self.entry.try_lock_view() {
                Some(view) => self.view = Some(view),
                None => return,
            }
        }
    }
}

/// A thread's rows as a hydration read them.
struct ThreadRows {
    displays: Vec<String>,
    events: Vec<ViewEvent>,
    skipped_markers: u64,
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

impl Drop for Entry {
    fn drop(&mut self) {
        self.coverage
            .entry_dropped(self.bucket, self.coverage.now());
    }
}

impl Entry {
    fn new(thread_id: &str, coverage: &Coverage) -> Self {
        let bucket = coverage::bucket(thread_id);
        let view = ThreadView::new();
        Self {
            thread_id: thread_id.into(),
            bucket,
            floor: coverage.entry_created(bucket, coverage.now()),
            coverage: coverage.clone(),
            view_bytes: AtomicUsize::new(view.bytes()),
            view: Mutex::new(view),
            waiting: Mutex::new(Vec::new()),
            rendered_bytes: AtomicUsize::new(0),
            hydration: Arc::new(tokio::sync::Mutex::new(())),
            failed_hydrations: AtomicU64::new(0),
            hydrations: AtomicU64::new(0),
            reread_scheduled: AtomicBool::new(false),
            fill_scheduled: AtomicBool::new(false),
            charged: AtomicUsize::new(0),
            rendered: Mutex::new(None),
            too_large: AtomicBool::new(false),
            skipped_markers_warned: AtomicBool::new(false),
            warned: Mutex::new(HashSet::new()),
        }
    }

    /// Bytes held: the view and its last rendered answer (as of their last change).
    fn held_bytes(&self) -> usize {
        self.view_bytes.load(Ordering::Relaxed) + self.rendered_bytes.load(Ordering::Relaxed)
    }

    /// Locks the view, waiting for another holder, with the waiting live events applied.
    fn view<'a>(&'a self, metrics: &'a Metrics) -> ViewGuard<'a> {
        ViewGuard::new(self, metrics, lock(&self.view))
    }

    /// The view if no one holds it (a poisoned lock is taken over, as [`lock`] does).
    fn try_lock_view(&self) -> Option<MutexGuard<'_, ThreadView>> {
        match self.view.try_lock() {
            Ok(view) => Some(view),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Applies a live event if the view is free; otherwise leaves it waiting for the view's holder, which applies
    /// it (and counts it) before letting go. Returns what the insert did, or `None` if the event waits.
    fn apply_live(&self, event: ViewEvent, metrics: &Metrics) -> Option<(Inserted, bool)> {
        let Some(view) = self.try_lock_view() else {
            lock(&self.waiting).push(event);
            // The holder may have checked the waiting events just before this push and be letting go now: take
            // the view if it is free, so the event does not wait for the next holder.
            if let Some(view) = self.try_lock_view() {
                drop(ViewGuard::new(self, metrics, view));
            }
            return None;
        };
        let mut guard = ViewGuard::new(self, metrics, view);
        let inserted = guard.insert(event);
        Some((inserted, guard.take_fill_due()))
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
        view: &mut ThreadView,
        primary: Option<&Identity>,
        source: Source,
        metrics: &Metrics,
    ) -> Answer {
        let mut rendered = lock(&self.rendered);
        if let Some(last) = rendered.as_ref()
            && last.version == view.version()
            && last.primary.as_ref() == primary
        {
            return Answer {
                source,
                ..last.answer.clone()
            };
        }
        let projection = view.project(primary);
        metrics.malformed_warnings(self.log_new_warnings(&projection));
        let answer = answer(&self.thread_id, &projection, source);
        self.rendered_bytes.store(
            answer.body.len() + answer.etag.len() + 64,
            Ordering::Relaxed,
        );
        *rendered = Some(Rendered {
            version: view.version(),
            primary: primary.cloned(),
            answer: answer.clone(),
        });
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

impl<S> Clone for ViewCache<S> {
    fn clone(&self) -> Self {
        Self {
            cache: self.cache.clone(),
            store: Arc::clone(&self.store),
            settings: Arc::clone(&self.settings),
            no_marker_warnings: Arc::clone(&self.no_marker_warnings),
            too_large_warnings: Arc::clone(&self.too_large_warnings),
            metrics: self.metrics.clone(),
            coverage: self.coverage.clone(),
            stop: self.stop.clone(),
            fills: self.fills.clone(),
            hydration_slots: Arc::clone(&self.hydration_slots),
        }
    }
}

impl<S: StoreReads> ViewCache<S> {
    pub fn new(store: S, metrics: Metrics, coverage: Coverage, settings: CacheSettings) -> Self {
        let cache = Cache::builder()
            .max_capacity(settings.max_bytes)
            .weigher(|_thread: &String, entry: &Arc<Entry>| entry.charge())
            .time_to_idle(settings.idle)
            .build();
        let (fills, requests) = mpsc::channel(FILL_QUEUE);
        let views = Self {
            cache,
            store: Arc::new(store),
            hydration_slots: Arc::new(tokio::sync::Semaphore::new(settings.concurrent_hydrations)),
            settings: Arc::new(settings),
            no_marker_warnings: Arc::default(),
            too_large_warnings: Arc::default(),
            metrics,
            coverage,
            stop: CancellationToken::new(),
            fills,
        };
        tokio::spawn(views.clone().run_fills(requests));
        views
    }

    /// Applies one live event to its thread's view, creating a partial view for a thread not held. An event
    /// applied to an entry the cache let go of meanwhile is not lost for reads: that entry records its removal when
    /// it is dropped, after the event, so the thread's next entry is complete only once the store has it.
    ///
    /// Returns what the insert did, or `None` when the view was locked (a read rendering it, a hydration merging)
    /// and the event waits beside it: its holder applies and counts it (see [`Entry::view`]).
    pub async fn apply(&self, event: ViewEvent) -> Option<Inserted> {
        let entry = self.entry(event.key.thread_id()).await;
        let applied = entry.apply_live(event, &self.metrics);
        if self.leave_if_too_large(&entry, LimitPath::Live).await {
            return applied.map(|(inserted, _)| inserted);
        }
        let (inserted, fill_due) = applied?;
        if fill_due {
            self.schedule_fill(&entry);
        }
        if entry.outgrew_charge() {
            self.reweigh(&entry).await;
        }
        Some(inserted)
    }

    /// Answers a history read, from memory when the view is complete, otherwise by hydrating it from the store.
    ///
    /// # Errors
    /// [`ReadError`] when the view needed the store and the store failed (or was busy), or the thread is too large.
    pub async fn read(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer, ReadError> {
        let entry = self.entry(thread_id).await;
        if let Some(answer) = self.complete_answer(&entry, primary, Source::Cache) {
            self.metrics.cache_hit();
            return Ok(answer);
        }
        self.metrics.cache_miss();
        let failures_before = entry.failed_hydrations.load(Ordering::Acquire);
        let hydrations_before = entry.hydrations.load(Ordering::Acquire);
        let _hydrating = entry.hydration.lock().await;
        // Another reader may have hydrated the view while this one waited, or failed to.
        if let Some(answer) = self.complete_answer(&entry, primary, Source::Store) {
            return Ok(answer);
        }
        if entry.too_large.load(Ordering::Acquire) {
            return Err(self.too_large());
        }
        if entry.failed_hydrations.load(Ordering::Acquire) != failures_before {
            return Err(ReadError::ConcurrentReadFailed);
        }
        let shared = entry.hydrations.load(Ordering::Acquire) != hydrations_before;
        if !shared {
            self.hydrate(&entry, Hydration::OnRead).await?;
        }
        // Answer from what was read even when the view stays partial (the next read hydrates again).
        let answer = {
            let mut view = entry.view(&self.metrics);
            entry.render(&mut view, primary, Source::Store, &self.metrics)
        };
        if !shared {
            self.reweigh(&entry).await;
        }
        Ok(answer)
    }

    /// Stops the background re-reads and fills (at shutdown).
    pub fn stop_background(&self) {
        self.stop.cancel();
    }

    /// Updates the cache size gauges (called before a metrics scrape).
    pub async fn report_size(&self) {
        self.cache.run_pending_tasks().await;
        self.metrics
            .cache_size(self.cache.entry_count(), self.cache.weighted_size());
    }

    /// Reads the thread from the store and merges the live events held; marks the view complete when the coverage
    /// verdict allows it, or schedules a re-read for when it will. The caller holds the entry's hydration lock.
    async fn hydrate(&self, entry: &Arc<Entry>, hydration: Hydration) -> Result<(), ReadError> {
        let deadline = Instant::now() + self.settings.store_timeout;
        // Waiting for a slot counts against the read's store timeout.
        let Ok(Ok(_slot)) = tokio::time::timeout_at(deadline, self.hydration_slots.acquire()).await
        else {
            entry.failed_hydrations.fetch_add(1, Ordering::AcqRel);
            self.metrics.hydration_slot_timeout();
            return Err(ReadError::Busy);
        };
        let start = self.coverage.read_start_now(entry.bucket, entry.floor);
        let (visible, events) = match self
            .read_thread(&entry.thread_id, hydration, deadline)
            .await
        {
            Ok(rows) => rows,
            Err(error) => {
                if let StoreError::TooLarge { .. } = error {
                    self.leave_too_large(entry, LimitPath::Read).await;
                }
                entry.failed_hydrations.fetch_add(1, Ordering::AcqRel);
                self.metrics.hydration(false);
                return Err(error.into());
            }
        };
        let rows = ThreadRows {
            displays: visible.displays,
            events,
            skipped_markers: visible.skipped_markers,
        };
        if rows.skipped_markers > 0 {
            self.metrics.markers_skipped(rows.skipped_markers);
            if !entry.skipped_markers_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    thread_id = &*entry.thread_id,
                    skipped = rows.skipped_markers,
                    "Skipping visibility markers whose display_id is not a string"
                );
            }
        }
        let verdict = self.coverage.verdict(&start);
        let (deferred, fill) = {
            let mut view = entry.view(&self.metrics);
            let live = std::mem::take(&mut *view);
            *view = ThreadView::hydrated(rows.events, rows.displays, live);
            match verdict {
                Verdict::Complete(epoch) => {
                    view.mark_complete(epoch);
                    // A live marker on a display the store did not return yet (not persisted when stage 1 ran):
                    // fill it, off the read path.
                    (None, view.needs_fill(epoch))
                }
                // Partial only because the bound has not passed: read again once it has.
                Verdict::Deferred(until) => (Some(until), false),
                Verdict::Uncovered => (None, false),
            }
        };
        // The stored events fit, but with the live ones held the view may not.
        if self.leave_if_too_large(entry, LimitPath::Read).await {
            entry.failed_hydrations.fetch_add(1, Ordering::AcqRel);
            return Err(self.too_large());
        }
        entry.hydrations.fetch_add(1, Ordering::AcqRel);
        self.metrics.hydration(true);
        if let Some(until) = deferred {
            self.schedule_reread(entry, until);
        }
        if fill {
            self.schedule_fill(entry);
        }
        Ok(())
    }

    /// The two-stage query of `thread_id` ([contract 4](../docs/contract.md#4)) within `deadline` and
    /// `HISTORY_VIEW_MAX_THREAD_BYTES` (the displays count against it as the view holds them).
    ///
    /// # Errors
    /// [`StoreError`] from either stage; `TooLarge` naming the per-thread limit.
    async fn read_thread(
        &self,
        thread_id: &str,
        hydration: Hydration,
        deadline: Instant,
    ) -> Result<(crate::store::VisibleDisplays, Vec<ViewEvent>), StoreError> {
        let limit = self.settings.max_thread_bytes;
        let bounds = Bounds {
            deadline,
            budget: limit,
        };
        let visible = self
            .store
            .visible_displays(thread_id, hydration, bounds)
            .await
            .map_err(|error| self.limit_met(error, thread_id))?;
        if visible.displays.is_empty() {
            // Fail closed: legacy threads without markers reconstruct as empty history ([contract
            // 4](../docs/contract.md#4)). Any client can ask for a thread that does not exist, so the warning is
            // rate-limited.
            if self.no_marker_warnings.allow() {
                tracing::warn!(
                    thread_id,
                    "No client-visible display marker found for thread history"
                );
            }
            return Ok((visible, Vec::new()));
        }
        let displays: usize = visible.displays.iter().map(|d| display_bytes(d)).sum();
        let bounds = Bounds {
            deadline,
            budget: limit.saturating_sub(displays),
        };
        let events = self
            .store
            .display_events(thread_id, &visible.displays, hydration, bounds)
            .await
            .map_err(|error| self.limit_met(error, thread_id))?;
        Ok((visible, events))
    }

    /// A store read stopped by its budget is a read past the per-thread limit: warned about (rate-limited, metadata
    /// only) and named by the limit; other errors pass through.
    fn limit_met(&self, error: StoreError, thread_id: &str) -> StoreError {
        let StoreError::TooLarge { .. } = error else {
            return error;
        };
        let limit = self.settings.max_thread_bytes;
        if self.too_large_warnings.allow() {
            tracing::warn!(
                thread_id,
                limit_bytes = limit,
                "A thread's stored events exceed HISTORY_VIEW_MAX_THREAD_BYTES; its reads answer 507"
            );
        }
        StoreError::TooLarge { limit }
    }

    /// Re-reads `entry` from the store at `until` in the background (once per entry at a time), so a view held
    /// partial by the persister-lag bound becomes complete without a reader waiting for the store.
    fn schedule_reread(&self, entry: &Arc<Entry>, until: Stamp) {
        if entry.reread_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        let views = self.clone();
        let entry = Arc::clone(entry);
        let at = self.coverage.instant(until);
        tokio::spawn(async move {
            tokio::select! {
                biased;
                () = views.stop.cancelled() => return,
                () = tokio::time::sleep_until(at) => {}
            }
            entry.reread_scheduled.store(false, Ordering::Release);
            let _hydrating = entry.hydration.lock().await;
            if views.state(&entry) == ViewState::Complete {
                return;
            }
            let result = match views.hydrate(&entry, Hydration::Reread).await {
                Err(_) => RereadResult::Error,
                Ok(()) => match views.state(&entry) {
                    ViewState::Complete => RereadResult::Complete,
                    ViewState::Partial => RereadResult::Partial,
                },
            };
            views.metrics.reread(result);
            views.reweigh(&entry).await;
        });
    }

    /// The entry's view state as of its thread's current coverage epoch.
    fn state(&self, entry: &Entry) -> ViewState {
        entry
            .view(&self.metrics)
            .state(self.coverage.epoch(entry.bucket))
    }

    fn complete_answer(
        &self,
        entry: &Entry,
        primary: Option<&Identity>,
        source: Source,
    ) -> Option<Answer> {
        let mut view = entry.view(&self.metrics);
        if view.state(self.coverage.epoch(entry.bucket)) == ViewState::Complete {
            return Some(entry.render(&mut view, primary, source, &self.metrics));
        }
        // Complete as of an older epoch: a gap or a removal happened since.
        if view.downgrade_if_stale(self.coverage.epoch(entry.bucket)) {
            self.metrics.views_downgraded(1);
        }
        None
    }

    /// Fills the displays a live marker made visible in a complete view, off the read path, one fill per entry at
    /// a time. The hydration lock is taken now if it is free (otherwise as soon as it is), so a read that comes
    /// next waits for the fill (and answers from memory once it is done) instead of hydrating.
    fn schedule_fill(&self, entry: &Arc<Entry>) {
        if entry.fill_scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        match Arc::clone(&entry.hydration).try_lock_owned() {
            Ok(lock) => self.queue_fill(FillRequest {
                entry: Arc::clone(entry),
                _lock: lock,
            }),
            Err(_) => {
                // A hydration or another fill holds the lock; this fill follows it.
                let views = self.clone();
                let entry = Arc::clone(entry);
                tokio::spawn(async move {
                    let lock = Arc::clone(&entry.hydration).lock_owned().await;
                    views.queue_fill(FillRequest { entry, _lock: lock });
                });
            }
        }
    }

    fn queue_fill(&self, request: FillRequest) {
        if let Err(error) = self.fills.try_send(request) {
            // The queue is full (or the service is stopping): no fill. The view stays partial (a display is left
            // uncovered), so the next read hydrates.
            error
                .into_inner()
                .entry
                .fill_scheduled
                .store(false, Ordering::Release);
            self.metrics.fill(FillOutcome::Error);
        }
    }

    /// Runs the queued fills until the service stops: every request queued while a fill query is in flight goes
    /// into the next one, so many threads' turns share one store query.
    async fn run_fills(self, mut requests: mpsc::Receiver<FillRequest>) {
        loop {
            let first = tokio::select! {
                biased;
                () = self.stop.cancelled() => return,
                request = requests.recv() => match request {
                    Some(request) => request,
                    None => return,
                },
            };
            let mut batch = vec![first];
            while batch.len() < FILL_BATCH {
                match requests.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            self.fill(batch).await;
        }
    }

    /// Reads the stored events of the uncovered displays of a batch of views in one query and merges them (each
    /// request holds its entry's hydration lock). A view stays complete if it was complete when the fill started
    /// and no gap or removal happened since: then its hydration read started at least the persister-lag bound
    /// after its coverage start, so every event of these displays published before that start is in the store
    /// now, and every later one was applied live ([design 2.1]). A failed fill leaves the views partial, so their
    /// next reads hydrate.
    ///
    /// [design 2.1]: ../docs/design.md#2.1
    async fn fill(&self, batch: Vec<FillRequest>) {
        let mut work: Vec<(FillRequest, Vec<Box<str>>)> = Vec::with_capacity(batch.len());
        let mut threads = HashSet::new();
        for request in batch {
            let entry = &request.entry;
            // From here on a new uncovered display needs a fill of its own.
            entry.fill_scheduled.store(false, Ordering::Release);
            let epoch = self.coverage.epoch(entry.bucket);
            let displays = {
                let view = entry.view(&self.metrics);
                if !view.needs_fill(epoch) {
                    continue;
                }
                view.uncovered_displays()
            };
            // Two entries of one thread (one of them on its way out) cannot share a query's rows: the second
            // waits for its next read's hydration.
            if threads.insert(entry.thread_id.clone()) {
                work.push((request, displays));
            }
        }
        if work.is_empty() {
            return;
        }
        let wanted: Vec<(&str, &[Box<str>])> = work
            .iter()
            .map(|(request, displays)| (&*request.entry.thread_id, displays.as_slice()))
            .collect();
        let bounds = Bounds {
            deadline: Instant::now() + self.settings.store_timeout,
            budget: self.settings.max_thread_bytes.saturating_mul(wanted.len()),
        };
        match self.store.fill_events(&wanted, bounds).await {
            Ok(events) => {
                let index: HashMap<&str, usize> = wanted
                    .iter()
                    .enumerate()
                    .map(|(i, (thread, _))| (*thread, i))
                    .collect();
                let mut per_view: Vec<Vec<ViewEvent>> = work.iter().map(|_| Vec::new()).collect();
                for event in events {
                    if let Some(&i) = index.get(event.key.thread_id())
                        && wanted[i].1.iter().any(|d| **d == *event.key.display_id())
                    {
                        per_view[i].push(event);
                    }
                }
                for ((request, displays), events) in work.into_iter().zip(per_view) {
                    let entry = &request.entry;
                    entry.view(&self.metrics).fill(&displays, events);
                    if self.leave_if_too_large(entry, LimitPath::Live).await {
                        continue;
                    }
                    let outcome = match self.state(entry) {
                        ViewState::Complete => FillOutcome::Complete,
                        ViewState::Partial => FillOutcome::Partial,
                    };
                    self.metrics.fill(outcome);
                    self.reweigh(entry).await;
                }
            }
            Err(error) => {
                tracing::warn!(views = work.len(), %error, "filling newly visible displays failed; their next reads hydrate");
                for (request, _) in work {
                    if request.entry.view(&self.metrics).downgrade() {
                        self.metrics.views_downgraded(1);
                    }
                    // Readers that waited for the fill fail with it rather than queue another store timeout.
                    request
                        .entry
                        .failed_hydrations
                        .fetch_add(1, Ordering::AcqRel);
                    self.metrics.fill(FillOutcome::Error);
                }
            }
        }
    }

    /// The thread's current entry, created if the cache holds none.
    async fn entry(&self, thread_id: &str) -> Arc<Entry> {
        if let Some(entry) = self.cache.get(thread_id).await {
            return entry;
        }
        self.cache
            .get_with_by_ref(thread_id, async {
                Arc::new(Entry::new(thread_id, &self.coverage))
            })
            .await
    }

    /// Re-inserts `entry` so moka weighs it again, if it is still the thread's current entry. An entry the cache
    /// let go of meanwhile stays out: its successor covers the thread from the removal on.
    async fn reweigh(&self, entry: &Arc<Entry>) {
        self.if_current(entry, || Op::Put(Arc::clone(entry))).await;
    }

    /// Runs `op` on the thread's cache slot if `entry` is still its current entry.
    async fn if_current(&self, entry: &Arc<Entry>, op: impl FnOnce() -> Op<Arc<Entry>>) {
        self.cache
            .entry_by_ref(&*entry.thread_id)
            .and_compute_with(|current| {
                let op = match current {
                    Some(current) if Arc::ptr_eq(current.value(), entry) => op(),
                    _ => Op::Nop,
                };
                std::future::ready(op)
            })
            .await;
    }

    /// The error of a read of a thread past `HISTORY_VIEW_MAX_THREAD_BYTES`.
    fn too_large(&self) -> ReadError {
        ReadError::TooLarge {
            limit: self.settings.max_thread_bytes,
        }
    }

    /// Lets `entry` leave the cache if its view holds more than `HISTORY_VIEW_MAX_THREAD_BYTES`; returns whether
    /// it did.
    async fn leave_if_too_large(&self, entry: &Arc<Entry>, path: LimitPath) -> bool {
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
    async fn leave_too_large(&self, entry: &Arc<Entry>, path: LimitPath) {
        if entry.too_large.swap(true, Ordering::AcqRel) {
            return;
        }
        *entry.view(&self.metrics) = ThreadView::new();
        *lock(&entry.rendered) = None;
        entry.rendered_bytes.store(0, Ordering::Relaxed);
        self.metrics.thread_limit_exceeded(path);
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

#[cfg(test)]
mod tests;

#[cfg(test)]
mod entry_tests {
    use super::*;
    use crate::decode::decode_payload;
    use crate::subject::DeliveryKey;

    fn chunk(event_id: &str, created_at: i64) -> ViewEvent {
        let key = DeliveryKey::parse_subject(&format!(
            "agent.A.a.t.d.r.display_event.ChunkEvent.{event_id}"
        ))
        .unwrap();
        let payload = format!(
            r#"{{"_parent_event_names": ["ChunkEvent"], "created_at": {created_at}, "content": "c"}}"#
        );
        match decode_payload(key, payload.as_bytes()).unwrap() {
            crate::decode::Decoded::Event(event) => event,
            crate::decode::Decoded::Irrelevant => unreachable!(),
        }
    }

    /// Events the holders counted as relevant.
    fn relevant(metrics: &Metrics) -> f64 {
        let sample = "history_view_events_total{outcome=\"relevant\"} ";
        metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(sample)?.parse().ok())
            .unwrap_or(0.0)
    }

    #[test]
    fn a_live_event_waits_beside_a_locked_view_and_its_holder_applies_it_in_order() {
        let metrics = Metrics::new();
        let entry = Entry::new("t", &Coverage::new(Duration::ZERO));
        // Weighed as the view it holds from the start (a lower first charge lets more entries in than they weigh).
        assert_eq!(entry.held_bytes(), ThreadView::new().bytes());
        let held = entry.view(&metrics);
        // The live path does not wait for the holder.
        assert!(entry.apply_live(chunk("a", 2), &metrics).is_none());
        assert!(entry.apply_live(chunk("a", 1), &metrics).is_none());
        assert!(entry.apply_live(chunk("b", 3), &metrics).is_none());
        assert_eq!(held.len(), 0);
        drop(held);
        // Applied as the holder let go, in arrival order (the first delivery of `a` wins), and counted.
        assert!(lock(&entry.waiting).is_empty());
        let view = entry.view(&metrics);
        assert_eq!(view.len(), 2);
        assert_eq!(relevant(&metrics), 2.0);
        assert_eq!(entry.view_bytes.load(Ordering::Relaxed), view.bytes());
        drop(view);
        assert_eq!(
            entry.apply_live(chunk("c", 4), &metrics).map(|(i, _)| i),
            Some(Inserted::Added)
        );
    }

    #[test]
    fn an_event_pushed_while_the_holder_lets_go_is_not_left_behind() {
        // Many rounds of a holder letting go while another thread pushes: every event ends up in the view.
        let metrics = Metrics::new();
        let entry = Arc::new(Entry::new("t", &Coverage::new(Duration::ZERO)));
        let rounds = 2_000;
        let mut applied_live = 0u32;
        std::thread::scope(|scope| {
            let reader = Arc::clone(&entry);
            let metrics_reader = metrics.clone();
            scope.spawn(move || {
                for _ in 0..rounds {
                    let view = reader.view(&metrics_reader);
                    std::hint::black_box(view.len());
                }
            });
            for i in 0..rounds {
                if entry
                    .apply_live(chunk(&format!("e{i}"), i), &metrics)
                    .is_some()
                {
                    applied_live += 1;
                }
            }
        });
        assert!(lock(&entry.waiting).is_empty());
        assert_eq!(entry.view(&metrics).len(), rounds as usize);
        // Each event counted once: by the live path, or by the holder that applied it.
        assert_eq!(relevant(&metrics) + f64::from(applied_live), rounds as f64);
    }
}
