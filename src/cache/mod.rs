//! `ViewCache`: the moka cache of thread views ([`crate::view::ThreadView`]) and the read path over it.
//!
//! - Live events go into their thread's view ([`ViewCache::apply`]); a thread not in the cache gets a partial view.
//! - A read of a complete view is answered from memory. A read of a partial or absent view hydrates it from the
//!   store once (concurrent readers wait for the same hydration and share its outcome), merges the live events
//!   held, and marks it complete only if the persister-lag rule allows it ([design 2.1.1], [`crate::coverage`]); a
//!   view held partial only by the bound gets one background re-read once it has passed.
//! - A live marker on a display a complete view has not read queues a fill of that display, off the read path.
//! - Explains share one row scan per thread and hold at most half the store-read slots ([`scan`]).
//! - Memory is bounded by a byte budget, and one thread by `HISTORY_VIEW_MAX_THREAD_BYTES`.
//!
//! Why each case (start, reconnect, gap, eviction, re-weigh, store outage, hydration racing live events, fills)
//! keeps the promise is argued once, in [design 2.1.1] and [design 2].
//!
//! One job a file: `answer.rs` (a read's answer: the serving rule, or the store), `entry.rs` (an entry and its lock
//! order), `work.rs` (the store side's state machine),
//! `hydrate.rs` (hydrations and re-reads), `fill.rs` (fills), `scan.rs` (explain's row scans and share), `form.rs`
//! (what a read asks for and gets), `render.rs` (rendering once per version), `runs.rs` (the run form), `limit.rs` (the per-thread limit),
//! `metrics.rs` (the cache's and the shadow checks' metrics), `hot_set.rs` (the hot set by read recency, and the
//! warm hydrations), `checks.rs` (the shadow checks it runs), `settings.rs`; this file holds the moka cache, the
//! live path into it and the waits on a view. The store is read
//! through [`StoreReads`], so `tests.rs` runs every race here on an in-memory store and tokio's paused clock.
//!
//! [design 2.1.1]: ../../docs/design.md#2.1.1
//! [design 2]: ../../docs/design.md#2

mod answer;
mod checks;
mod entry;
mod etag;
mod fill;
mod form;
mod hot_set;
mod hydrate;
mod items;
mod limit;
mod metrics;
mod render;
mod runs;
mod scan;
mod settings;
#[cfg(test)]
mod tests;
mod transcript;
mod work;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use moka::future::Cache;
use moka::ops::compute::Op;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use checks::{Verified, VerifyReport};
pub use etag::etag_of;
pub use form::{Answer, AnswerSource, Facts, Form, HistoryBody};
pub use hot_set::Warmed;
pub use items::{ItemId, Items};
pub use limit::LimitPath;
pub use metrics::{AppliedEvents, CacheMetrics, ShadowMetrics, ViewMetrics};
pub use runs::{RunMessage, RunView};
pub use scan::RowScan;
pub use settings::{CacheSettings, DEFAULT_CACHE_MAX_BYTES};
pub use transcript::Transcript;

use crate::bounds::StoreBounds;
use crate::coverage::Coverage;
use crate::decode::ViewEvent;
use crate::freshness::Freshness;
use crate::project::Identity;
use crate::shadow::ShadowSettings;
use crate::store::{Hydration, Store, StoreError, StoreReads};
use crate::telemetry::RateLimit;
use crate::view::{Inserted, PublisherContext, ViewState};
use entry::Entry;
use fill::FillRequest;
use work::{Begin, Outcome};

/// The context of the span current now, if one is recorded: what a store job queued now for later (a fill) is
/// parented to, so that it joins the read, hydration or ingested event that asked for it. With tracing off no span
/// is ever current, so this is one thread-local look-up (and fills are queued rarely, never per event).
fn current_context() -> Option<opentelemetry::Context> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    cx.span().span_context().is_valid().then_some(cx)
}

/// Fills waiting for a query; beyond it a fill is dropped and its view's next read hydrates.
const FILL_QUEUE: usize = 1024;

/// Links the current span (a hydration's or a fill's) to the publishers' contexts of the live events it merged
/// (at most [`crate::telemetry::trace::MAX_LINKS`], chosen by the caller; none while tracing is off). Each is read
/// by the propagator here, after the view was let go of; an invalid one is left out.
fn link_current_span(publishers: Vec<PublisherContext>) {
    if publishers.is_empty() {
        return;
    }
    let span = tracing::Span::current();
    for context in publishers.iter().filter_map(PublisherContext::span_context) {
        tracing_opentelemetry::OpenTelemetrySpanExt::add_link(&span, context);
    }
}

/// What the view cache is built with: its settings, the shadow checks', the shared bounds, and how long after a read
/// a lost connection may still be noticed (a shadow check judges a failure only after it).
#[derive(Debug, Clone)]
pub struct CacheSetup {
    pub settings: CacheSettings,
    pub shadow: ShadowSettings,
    pub bounds: StoreBounds,
    pub gap_window: Duration,
}

/// Why a read could not be answered (the view stays partial). Clone: explains sharing one row scan each get its
/// failure.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The view needed the store and the store failed.
    #[error(transparent)]
    Store(StoreError),
    /// Every slot for store reads of whole threads stayed taken for the whole store timeout.
    #[error("too many store reads were in flight; none finished within the store timeout")]
    Busy,
    /// The read waited for another store read of the same thread (a hydration or a fill), and that one failed.
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

/// The view cache and the store behind it (MongoDB's [`Store`]; an in-memory fake in the unit tests). Cloning is
/// cheap.
pub struct ViewCache<S = Store> {
    cache: Cache<String, Arc<Entry>, foldhash::quality::RandomState>,
    store: Arc<S>,
    settings: Arc<CacheSettings>,
    /// The store timeout and the persister-lag bound.
    bounds: StoreBounds,
    metrics: ViewMetrics,
    /// Whether a store read may complete a view, and the epoch complete views are checked against.
    coverage: Coverage,
    /// Cancels the background re-reads and fills when the service stops.
    stop: CancellationToken,
    /// The queue of fills ([`fill`]).
    fills: mpsc::Sender<FillRequest>,
    /// One permit per store read of a whole thread allowed at once (`HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS`): each
    /// may hold a thread's events in memory.
    hydration_slots: Arc<tokio::sync::Semaphore>,
    /// The explain share ([`scan`]): explains take a permit of it before a hydration slot, so they hold at most
    /// half the slots.
    explain_share: Arc<tokio::sync::Semaphore>,
    /// Explain's row scans in flight, by thread: concurrent explains of a thread share one ([`scan`]).
    scans: Cache<String, Arc<RowScan>>,
    /// Row scans finished so far: tells a scan left behind from one an explain may share.
    scans_finished: Arc<AtomicU64>,
    /// Rate limits of the warnings about threads without a visible marker, and about reads stopped by the limit.
    no_marker_warnings: Arc<RateLimit>,
    too_large_warnings: Arc<RateLimit>,
    /// The shadow checks ([`shadow`]).
    checks: Arc<checks::Checks>,
    /// Up to when the live stream has been applied (the covered-through instant of answers from memory).
    freshness: Freshness,
}

impl<S> Clone for ViewCache<S> {
    fn clone(&self) -> Self {
        Self {
            cache: self.cache.clone(),
            store: Arc::clone(&self.store),
            settings: Arc::clone(&self.settings),
            bounds: self.bounds,
            metrics: self.metrics.clone(),
            coverage: self.coverage.clone(),
            stop: self.stop.clone(),
            fills: self.fills.clone(),
            hydration_slots: Arc::clone(&self.hydration_slots),
            explain_share: Arc::clone(&self.explain_share),
            scans: self.scans.clone(),
            scans_finished: Arc::clone(&self.scans_finished),
            no_marker_warnings: Arc::clone(&self.no_marker_warnings),
            too_large_warnings: Arc::clone(&self.too_large_warnings),
            checks: Arc::clone(&self.checks),
            freshness: self.freshness.clone(),
        }
    }
}

impl<S: StoreReads> ViewCache<S> {
    pub fn new(
        store: S,
        metrics: ViewMetrics,
        coverage: Coverage,
        freshness: Freshness,
        setup: CacheSetup,
    ) -> Self {
        let CacheSetup {
            settings,
            shadow,
            bounds,
            gap_window,
        } = setup;
        let cache = Cache::builder()
            .max_capacity(settings.max_bytes)
            .weigher(|_thread: &String, entry: &Arc<Entry>| entry.charge())
            .time_to_idle(settings.idle)
            .build_with_hasher(foldhash::quality::RandomState::default());
        let share = scan::share_of(settings.concurrent_hydrations);
        // A scan leaves this cache as soon as its runner has it; the bounds only matter for one left behind.
        let scans = Cache::builder()
            .max_capacity(share as u64)
            .time_to_live(bounds.store_timeout)
            .build();
        let (fills, requests) = mpsc::channel(FILL_QUEUE);
        metrics.cache.budget(settings.max_bytes);
        let views = Self {
            cache,
            store: Arc::new(store),
            hydration_slots: Arc::new(tokio::sync::Semaphore::new(settings.concurrent_hydrations)),
            explain_share: Arc::new(tokio::sync::Semaphore::new(share)),
            scans,
            scans_finished: Arc::default(),
            checks: Arc::new(checks::Checks::new(shadow, bounds, gap_window)),
            freshness,
            settings: Arc::new(settings),
            bounds,
            metrics,
            coverage,
            stop: CancellationToken::new(),
            fills,
            no_marker_warnings: Arc::default(),
            too_large_warnings: Arc::default(),
        };
        tokio::spawn(views.clone().run_fills(requests));
        views
    }

    /// Applies one live event to its thread's view, creating a partial view for a thread not held. An event
    /// applied to an entry the cache let go of meanwhile is not lost for reads: that entry records its removal when
    /// it is dropped, after the event, so the thread's next entry is complete only once the store has it.
    ///
    /// `publisher` is the context the event's message carried, kept beside it while tracing is on (the view keeps
    /// it if the event is added, [`crate::view::PublisherContext`]).
    ///
    /// Returns what the insert did, or `None` when the view was locked and the event waits beside it: its holder
    /// applies and counts it ([`entry`]).
    pub async fn apply(
        &self,
        event: ViewEvent,
        publisher: Option<PublisherContext>,
    ) -> Option<Inserted> {
        let entry = self.entry(event.key.thread_id()).await;
        let applied = entry.apply_live(event, publisher, &self.metrics);
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

    /// Waits until the view of `thread_id` is no longer the one an answer was rendered from (`generation` and
    /// `version`: [`Answer::generation`], [`Answer::version`]), or until `until`. Returns at once when the thread's
    /// entry is another one (the answer's was evicted); without an entry, it waits until `until` (an entry made
    /// meanwhile is not listened to, so callers look again every so often: `http::read::Pace`).
    pub async fn changed(&self, thread_id: &str, generation: u64, version: u64, until: Instant) {
        let Some(entry) = self.cache.get(thread_id).await else {
            tokio::time::sleep_until(until).await;
            return;
        };
        if entry.generation != generation {
            return;
        }
        // Counted before the version is compared: a holder that changes the view after this comparison sees the
        // listener and notifies ([`entry::Listening`]).
        let _listening = entry.listen();
        let notified = entry.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if entry.version.load(Ordering::SeqCst) != version {
            return;
        }
        let _ = tokio::time::timeout_at(until, notified).await;
    }

    /// The per-message digests of the thread's answer named by `generation` and `version` (for `primary`), if
    /// that entry still holds the thread and kept them: what a resumed feed compares the current answer with.
    pub async fn recent_digests(
        &self,
        thread_id: &str,
        generation: u64,
        version: u64,
        primary: Option<&Identity>,
    ) -> Option<Arc<[u64]>> {
        let entry = self.cache.get(thread_id).await?;
        (entry.generation == generation)
            .then(|| entry.recent_digests(version, primary))
            .flatten()
    }

    /// Cancelled when the worker stops (the feeds end on it).
    pub fn stopping(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Stops the background re-reads and fills (at shutdown).
    pub fn stop_background(&self) {
        self.stop.cancel();
    }

    /// Updates the cache size gauges (called before a metrics scrape).
    pub async fn report_size(&self) {
        self.cache.run_pending_tasks().await;
        self.metrics
            .cache
            .size(self.cache.entry_count(), self.cache.weighted_size());
        self.report_freshness();
    }

    /// The age of the covered-through instant of answers from memory (set before a metrics scrape).
    fn report_freshness(&self) {
        let age = self
            .freshness
            .covered_through()
            .map_or(self.coverage.uptime(), |at| {
                std::time::SystemTime::now()
                    .duration_since(at)
                    .unwrap_or_default()
            });
        self.metrics.cache.covered_through_age(age);
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
}
