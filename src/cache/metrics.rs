//! The cache wing's metrics: [`CacheMetrics`] (reads, hydrations, re-reads, fills, limits, size, freshness) and
//! [`ShadowMetrics`] (the shadow checks, run by `checks.rs`), with the outcome enums only they use; and the wing's
//! handle, [`ViewMetrics`], which also carries where a view's holder counts the live events it applies
//! ([`AppliedEvents`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Gauge, Histogram, IntCounter, IntCounterVec, IntGauge};

use super::LimitPath;
use crate::metrics::{Registrar, gauge_value, preset};
use crate::shadow::{Finding, Verdict};
use crate::view::Inserted;

/// The view cache's metrics handle. Cloning is cheap.
#[derive(Clone)]
pub struct ViewMetrics {
    pub cache: Arc<CacheMetrics>,
    pub shadow: Arc<ShadowMetrics>,
    pub applied: AppliedEvents,
}

/// Where a view's holder counts the live events that waited beside the view and that it applied: the ingest
/// path's own outcome counters (`history_view_events_total`'s `relevant` and `duplicate`), handed over by the wiring,
/// so that an event counts the same whichever path applied it.
#[derive(Clone)]
pub struct AppliedEvents {
    added: IntCounter,
    duplicate: IntCounter,
}

impl AppliedEvents {
    pub fn new(added: IntCounter, duplicate: IntCounter) -> Self {
        Self { added, duplicate }
    }

    /// Counts one live event by what its insert did (an orphan is added as far as the ingest path goes: the
    /// cache counts it as orphaned too).
    pub fn count(&self, inserted: Inserted) {
        match inserted {
            Inserted::Added | Inserted::Orphaned => self.added.inc(),
            Inserted::Duplicate => self.duplicate.inc(),
        }
    }
}

#[cfg(test)]
impl ViewMetrics {
    /// The wing's sets on a registry of their own, the applied events counted as `history_view_events_total` is.
    pub(crate) fn registered() -> (Self, crate::metrics::Exposition) {
        crate::metrics::registered(|registrar| {
            let events = registrar.counter_vec(
                "history_view_events_total",
                "Display-event messages received from NATS, by outcome: relevant, duplicate.",
                &["outcome"],
            );
            Self {
                cache: Arc::new(CacheMetrics::register(registrar)),
                shadow: Arc::new(ShadowMetrics::register(registrar)),
                applied: AppliedEvents::new(
                    events.with_label_values(&["relevant"]),
                    events.with_label_values(&["duplicate"]),
                ),
            }
        })
    }
}

/// What a fill achieved (the `outcome` of `history_view_fills_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillOutcome {
    /// The view is complete again.
    Complete,
    /// Read, but a gap or removal happened since the view was complete, or another display is waiting: still
    /// partial.
    Partial,
    /// The store failed (or the fill queue was full); the view is partial and the next read hydrates.
    Error,
}

impl FillOutcome {
    const ALL: [FillOutcome; 3] = [
        FillOutcome::Complete,
        FillOutcome::Partial,
        FillOutcome::Error,
    ];

    fn label(self) -> &'static str {
        match self {
            FillOutcome::Complete => "complete",
            FillOutcome::Partial => "partial",
            FillOutcome::Error => "error",
        }
    }
}

/// What a background re-read of a view held partial by the persister-lag bound achieved (the `result` of
/// `history_view_background_rereads_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RereadResult {
    /// The view is complete.
    Complete,
    /// Still partial (the coverage start moved again, or a live marker stands on a display not read).
    Partial,
    /// The store failed; the next read hydrates.
    Error,
}

impl RereadResult {
    const ALL: [RereadResult; 3] = [
        RereadResult::Complete,
        RereadResult::Partial,
        RereadResult::Error,
    ];

    fn label(self) -> &'static str {
        match self {
            RereadResult::Complete => "complete",
            RereadResult::Partial => "partial",
            RereadResult::Error => "error",
        }
    }
}

/// The `result` label of `history_view_hydrations_total`.
const HYDRATION_RESULTS: [&str; 2] = ["ok", "error"];

pub struct CacheMetrics {
    hits: IntCounter,
    misses: IntCounter,
    hydrations: IntCounterVec,
    views_downgraded: IntCounter,
    unproven_reads: IntCounter,
    entries: IntGauge,
    weighted_bytes: IntGauge,
    budget_bytes: IntGauge,
    fills: IntCounterVec,
    hydration_slot_timeouts: IntCounter,
    thread_limit_exceeded: IntCounterVec,
    markers_skipped: IntCounter,
    orphaned_events: IntCounter,
    rereads: IntCounterVec,
    malformed_warnings: IntCounter,
    covered_through_age_seconds: Gauge,
}

impl CacheMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let metrics = Self {
            hits: registrar.counter(
                "history_view_cache_hits_total",
                "Reads through the view cache answered at once from a complete view.",
            ),
            misses: registrar.counter(
                "history_view_cache_misses_total",
                "Reads through the view cache that found no complete view: each runs or waits for a hydration, or \
                 waits for a fill.",
            ),
            hydrations: registrar.counter_vec(
                "history_view_hydrations_total",
                "Store reads of a whole thread into its view (hydrations on a read and background re-reads), by \
                 result: ok, error (the store failed or timed out, or the thread exceeds \
                 HISTORY_VIEW_MAX_THREAD_BYTES).",
                &["result"],
            ),
            views_downgraded: registrar.counter(
                "history_view_views_downgraded_total",
                "Complete views made partial: found stale at their next use (a possible gap or a removal since), \
                 after a failed fill, or healed by a failed shadow check or verify.",
            ),
            unproven_reads: registrar.counter(
                "history_view_unproven_reads_total",
                "Reads of a complete view answered from the store because the live source had not proved, within \
                 the window, that it applied everything published before it (the serving rule).",
            ),
            entries: registrar.gauge(
                "history_view_cache_entries",
                "Thread views the cache holds (updated at each scrape).",
            ),
            weighted_bytes: registrar.gauge(
                "history_view_cache_weighted_bytes",
                "Weighted size of the views the cache holds, in bytes (updated at each scrape).",
            ),
            budget_bytes: registrar.gauge(
                "history_view_cache_budget_bytes",
                "The view cache's budget in bytes (HISTORY_VIEW_CACHE_MAX_BYTES), to compare \
                 history_view_cache_weighted_bytes with.",
            ),
            fills: registrar.counter_vec(
                "history_view_fills_total",
                "Fills of displays a live marker made visible in a complete view, by outcome: complete (the view \
                 is complete again), partial (a gap or a removal since, or another display waiting), error (the \
                 store failed or the fill queue was full: the next read hydrates).",
                &["outcome"],
            ),
            hydration_slot_timeouts: registrar.counter(
                "history_view_hydration_slot_timeouts_total",
                "Store reads of whole threads (hydrations, background re-reads, uncached reads, explain's row \
                 metadata) that found no free slot of HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS (for an explain: of \
                 the explains' half of them) within the store timeout; a read among them answers 503.",
            ),
            thread_limit_exceeded: registrar.counter_vec(
                "history_view_thread_limit_exceeded_total",
                "Cached threads stopped by HISTORY_VIEW_MAX_THREAD_BYTES (their view left the cache and their \
                 reads answer 507), by path: read (a hydration read more), live (live events or a fill made the \
                 view outgrow it).",
                &["path"],
            ),
            markers_skipped: registrar.counter(
                "history_view_markers_skipped_total",
                "Visibility-marker displays a hydration skipped because their display_id is not a string.",
            ),
            orphaned_events: registrar.counter(
                "history_view_orphaned_events_total",
                "Live events a hydration dropped because the store no longer holds them although the \
                 persister-lag bound says it did (created more than the bound and the clock margin before the \
                 hydration's first query): a deleted thread or event, or a persister slower than the bound.",
            ),
            rereads: registrar.counter_vec(
                "history_view_background_rereads_total",
                "Background re-reads of views held partial by the persister-lag bound, by result: complete, \
                 partial (the coverage start moved again, or a live marker stands on a display not read), error \
                 (the store failed: the next read hydrates).",
                &["result"],
            ),
            malformed_warnings: registrar.counter(
                "history_view_malformed_event_warnings_total",
                "Warnings logged about malformed visible events found while rendering a view (each once per \
                 view, as aihub logs them).",
            ),
            covered_through_age_seconds: registrar.float_gauge(
                "history_view_covered_through_age_seconds",
                "Seconds since the instant up to which answers from memory hold every event that reached NATS \
                 (X-History-Covered-Through), or since the start while none is known (updated at each scrape).",
            ),
        };
        preset(&metrics.hydrations, &HYDRATION_RESULTS);
        preset(&metrics.fills, &FillOutcome::ALL.map(FillOutcome::label));
        preset(
            &metrics.rereads,
            &RereadResult::ALL.map(RereadResult::label),
        );
        preset(
            &metrics.thread_limit_exceeded,
            &LimitPath::ALL.map(LimitPath::label),
        );
        metrics
    }

    pub fn hit(&self) {
        self.hits.inc();
    }

    pub fn miss(&self) {
        self.misses.inc();
    }

    pub fn hydration(&self, ok: bool) {
        let result = if ok {
            HYDRATION_RESULTS[0]
        } else {
            HYDRATION_RESULTS[1]
        };
        self.hydrations.with_label_values(&[result]).inc();
    }

    pub fn orphaned_events(&self, count: usize) {
        self.orphaned_events.inc_by(count as u64);
    }

    pub fn views_downgraded(&self, count: u64) {
        self.views_downgraded.inc_by(count);
    }

    pub fn unproven_read(&self) {
        self.unproven_reads.inc();
    }

    pub fn size(&self, entries: u64, weighted_bytes: u64) {
        self.entries.set(gauge_value(entries));
        self.weighted_bytes.set(gauge_value(weighted_bytes));
    }

    pub fn budget(&self, bytes: u64) {
        self.budget_bytes.set(gauge_value(bytes));
    }

    pub fn fill(&self, outcome: FillOutcome) {
        self.fills.with_label_values(&[outcome.label()]).inc();
    }

    pub fn hydration_slot_timeout(&self) {
        self.hydration_slot_timeouts.inc();
    }

    /// A thread stopped by `HISTORY_VIEW_MAX_THREAD_BYTES`.
    pub fn thread_limit_exceeded(&self, path: LimitPath) {
        self.thread_limit_exceeded
            .with_label_values(&[path.label()])
            .inc();
    }

    pub fn markers_skipped(&self, n: u64) {
        self.markers_skipped.inc_by(n);
    }

    pub fn reread(&self, result: RereadResult) {
        self.rereads.with_label_values(&[result.label()]).inc();
    }

    pub fn malformed_warnings(&self, count: usize) {
        self.malformed_warnings.inc_by(count as u64);
    }

    pub fn covered_through_age(&self, age: Duration) {
        self.covered_through_age_seconds.set(age.as_secs_f64());
    }
}

/// A shadow check runs the persister-lag bound after its read, later when the store is slow or a failure waits out
/// the gap window.
const SHADOW_DELAY_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];

pub struct ShadowMetrics {
    checks: IntCounterVec,
    /// `history_view_shadow_checks_total{result="dropped"}`, resolved once: with a high sample, most reads count it.
    dropped: IntCounter,
    events: IntCounterVec,
    check_delay_seconds: Histogram,
    heals: IntCounter,
}

impl ShadowMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let checks = registrar.counter_vec(
            "history_view_shadow_checks_total",
            "Shadow checks of reads answered from memory (and verify requests), by result: their worst finding, \
             match, ahead, uncertain, orphaned (the view held events the store no longer has although the bound \
             says it did: deleted, or a persister slower than the bound; healed, not a failure), window (a \
             failure a gap followed within the window), late, differs or missing (late, differs and missing are \
             failures); dropped (a sampled read not checked: over \
             HISTORY_VIEW_SHADOW_MAX_PER_SEC, or its thread being checked); error (the store did not answer); \
             not_complete (a verify of a view not complete, not compared); refused (a verify beyond its own \
             budget of HISTORY_VIEW_SHADOW_MAX_PER_SEC, or of a thread being verified: answered 429).",
            &["result"],
        );
        let metrics = Self {
            dropped: checks.with_label_values(&[Verdict::Dropped.label()]),
            checks,
            events: registrar.counter_vec(
                "history_view_shadow_events_total",
                "Rows and held events compared by shadow checks, by result: their finding, match, ahead, \
                 uncertain, orphaned, late, differs or missing, or window for a failure of a check a gap followed.",
                &["result"],
            ),
            check_delay_seconds: registrar.histogram(
                "history_view_shadow_check_delay_seconds",
                "Seconds from a sampled read to its shadow check's judgement (the persister-lag bound, the store \
                 query, and for a failure the wait for the gap window).",
                SHADOW_DELAY_BUCKETS,
            ),
            heals: registrar.counter(
                "history_view_shadow_heals_total",
                "Complete views made partial by a failed shadow check or verify (their next read hydrates).",
            ),
        };
        preset(&metrics.checks, &Verdict::ALL.map(Verdict::label));
        let mut findings = Finding::ALL.map(Finding::label).to_vec();
        findings.push(Verdict::Window.label());
        preset(&metrics.events, &findings);
        metrics
    }

    /// One shadow check's verdict.
    pub fn check(&self, verdict: Verdict) {
        self.checks.with_label_values(&[verdict.label()]).inc();
    }

    /// A sampled read not checked (over the rate limit, or its thread is being checked).
    pub fn dropped(&self) {
        self.dropped.inc();
    }

    /// `n` events a shadow check compared with one finding (or `window`).
    pub fn events(&self, result: &'static str, n: u64) {
        if n > 0 {
            self.events.with_label_values(&[result]).inc_by(n);
        }
    }

    pub fn check_delay(&self, delay: Duration) {
        self.check_delay_seconds.observe(delay.as_secs_f64());
    }

    pub fn heal(&self) {
        self.heals.inc();
    }
}
