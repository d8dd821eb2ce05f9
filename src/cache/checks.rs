//! Shadow checks run on the cache ([`crate::shadow`] holds the rules): a sampled read answered from memory leaves
//! a [`Snapshot`]; once the persister-lag bound has passed, the thread's two-stage query runs on the checks' own
//! pool and slots, the rows are compared with the snapshot, the result is counted (a failure is logged with
//! metadata only), and a failure heals: the thread's view is made partial, so its next read hydrates. The same
//! comparison runs on demand ([`ViewCache::verify`]), within a budget of its own and only of a complete view.
//!
//! A check never delays a read or a hydration: it takes no hydration slot, its queries use their own connection
//! pool, and a sample beyond the rate limit (or for a thread being checked) is dropped, never queued. A verify
//! beyond its budget (or of a thread being verified) is refused, never queued.

use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

use super::entry::Entry;
use super::{ReadError, ViewCache};
use crate::bounds::StoreBounds;
use crate::shadow::{
    Admission, Clocks, Comparison, Divergence, Finding, Sampler, ShadowSettings, Snapshot, Verdict,
    compare,
};
use crate::store::{Bounds, Hydration, StoreError, StoreReads};
use crate::telemetry::RateLimit;
use crate::view::{ThreadView, ViewState};

/// Shadow checks' store reads at once (each may hold a thread's rows).
const CHECKS_AT_ONCE: usize = 2;
/// How often a failed check looks again whether a gap followed its read.
const WINDOW_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// The checks' configuration, sampler and slots.
pub struct Checks {
    settings: ShadowSettings,
    bounds: StoreBounds,
    /// How long after a read a lost connection may still be noticed.
    window: std::time::Duration,
    sampler: Sampler,
    /// `verify`'s budget: a sampler that draws every request, at the sampled checks' rate but a bucket of its own,
    /// so that neither starves the other ([design 2.1.6](../../docs/design.md#2.1.6)).
    verifies: Sampler,
    slots: Semaphore,
    warnings: RateLimit,
}

impl Checks {
    pub fn new(settings: ShadowSettings, bounds: StoreBounds, window: std::time::Duration) -> Self {
        Self {
            sampler: Sampler::new(settings.sample, settings.max_per_sec, Instant::now()),
            verifies: Sampler::new(1.0, settings.max_per_sec, Instant::now()),
            settings,
            bounds,
            window,
            slots: Semaphore::new(CHECKS_AT_ONCE),
            warnings: RateLimit::default(),
        }
    }

    pub(super) fn clocks(&self) -> Clocks {
        Clocks {
            persist_lag: self.bounds.persist_lag,
            margin: self.settings.clock_margin,
        }
    }
}

/// Where a sampled read stood: to judge later whether a gap followed it.
#[derive(Debug, Clone, Copy)]
struct ReadMark {
    at: Instant,
    gaps: u64,
}

/// What `verify` came to.
#[derive(Debug)]
pub enum Verified {
    /// The comparison of a complete view, or (`not_complete`) what a view that is not complete is.
    Report(VerifyReport),
    /// The thread is not in this worker's cache.
    NotCached,
    /// Beyond verify's budget, or its thread is being verified: counted `refused`, not compared. The bucket refills
    /// at least one verify a second (`HISTORY_VIEW_SHADOW_MAX_PER_SEC` is at least 1), so a second later it may pass.
    Refused,
}

/// A verify admitted by its budget: its thread may be verified again once this is dropped, also when the request
/// is cancelled mid-comparison (its client hung up).
struct Verifying<'a> {
    budget: &'a Sampler,
    thread_id: &'a str,
}

impl Drop for Verifying<'_> {
    fn drop(&mut self) {
        self.budget.done(self.thread_id);
    }
}

/// The answer of `POST /v1/threads/{thread_id}/verify`: metadata only.
#[derive(Debug, Serialize)]
pub struct VerifyReport {
    pub thread_id: String,
    /// `complete` or `partial`: the view's state when it was compared (or found not complete).
    pub view: &'static str,
    /// The worst finding; `not_complete` for a view that is not complete (not compared: nothing was promised).
    pub result: Verdict,
    /// Events by finding.
    pub counts: std::collections::BTreeMap<&'static str, u64>,
    /// The failing rows (missing, late, differs).
    pub divergent: Vec<Divergence>,
    /// Whether a complete view was made partial (its next read hydrates).
    pub healed: bool,
}

impl<S: StoreReads> ViewCache<S> {
    /// Offers a read answered from memory of `entry` (whose `view` the caller holds) to the shadow checks.
    pub(super) fn sample(
        &self,
        entry: &Entry,
        view: &ThreadView,
        covered_through: Option<SystemTime>,
    ) {
        let checks = &self.checks;
        match checks.sampler.admit(&entry.thread_id, Instant::now()) {
            Admission::Skipped => {}
            Admission::Dropped => self.metrics.shadow.dropped(),
            Admission::Admitted => {
                let mut snapshot = Snapshot::of(&entry.thread_id, SystemTime::now(), view.events());
                snapshot.covered_through = covered_through;
                let mark = ReadMark {
                    at: Instant::now(),
                    gaps: self.coverage.gaps(),
                };
                tokio::spawn(self.clone().scheduled_check(snapshot, mark));
            }
        }
    }

    /// Waits out the bound, then checks and counts; the thread may be sampled again afterwards.
    async fn scheduled_check(self, snapshot: Snapshot, mark: ReadMark) {
        let due = mark.at + self.checks.bounds.persist_lag;
        let stopped = tokio::select! {
            biased;
            () = self.stop.cancelled() => true,
            () = tokio::time::sleep_until(due) => false,
        };
        if !stopped {
            match self.compare_with_store(&snapshot).await {
                Ok(comparison) => {
                    let mut verdict = comparison.verdict();
                    if verdict.heals() {
                        self.heal(&snapshot.thread_id).await;
                    }
                    if verdict.is_failure() && self.gap_followed(&snapshot, mark).await {
                        verdict = Verdict::Window;
                    }
                    self.record(&snapshot.thread_id, verdict, &comparison);
                    self.metrics.shadow.check_delay(mark.at.elapsed());
                }
                Err(error) => {
                    tracing::debug!(thread_id = &*snapshot.thread_id, %error, "a shadow check could not read the store");
                    self.metrics.shadow.check(Verdict::Error);
                }
            }
        }
        self.checks.sampler.done(&snapshot.thread_id);
    }

    /// Whether a gap was noticed after the read within the window in which a dead link is noticed: waits until a
    /// gap is recorded (yes), a freshness probe sent after the read came back with no gap since (no: the link was
    /// alive after the read), or the window has passed (no).
    async fn gap_followed(&self, snapshot: &Snapshot, mark: ReadMark) -> bool {
        let until = mark.at + self.checks.window;
        loop {
            if self.coverage.gaps() != mark.gaps {
                return true;
            }
            let alive_after = self
                .freshness
                .covered_through()
                .is_some_and(|covered| covered >= snapshot.read_at);
            if alive_after || Instant::now() >= until {
                return false;
            }
            tokio::select! {
                biased;
                () = self.stop.cancelled() => return false,
                () = tokio::time::sleep(WINDOW_POLL) => {}
            }
        }
    }

    /// The thread's two-stage query (on the checks' pool, within the store timeout) over the snapshot's visible
    /// displays and the store's, compared with the snapshot.
    async fn compare_with_store(&self, snapshot: &Snapshot) -> Result<Comparison, ReadError> {
        // A `shadow_check` span holds the check's two store queries: a root the configured sampler decides for a
        // sampled check, a child of the request's span for a verify.
        let span = tracing::info_span!(
            "shadow_check",
            otel.kind = "internal",
            otel.status_code = tracing::field::Empty,
        );
        let comparison = self
            .query_and_compare(snapshot)
            .instrument(span.clone())
            .await;
        if comparison.is_err() {
            span.record("otel.status_code", "error");
        }
        comparison
    }

    /// [`ViewCache::compare_with_store`], inside its span.
    async fn query_and_compare(&self, snapshot: &Snapshot) -> Result<Comparison, ReadError> {
        let deadline = self.checks.bounds.store_deadline();
        let Ok(Ok(_slot)) = tokio::time::timeout_at(deadline, self.checks.slots.acquire()).await
        else {
            return Err(ReadError::Busy);
        };
        let budget = self.settings.max_thread_bytes;
        let bounds = Bounds { deadline, budget };
        let thread = &*snapshot.thread_id;
        let stored = self
            .store
            .visible_displays(thread, Hydration::Shadow, bounds)
            .await
            .map_err(ReadError::from)?;
        let mut displays: Vec<String> = snapshot.visible.iter().map(|d| d.to_string()).collect();
        for display in stored.displays {
            if !snapshot.visible.contains(display.as_str()) {
                displays.push(display);
            }
        }
        if displays.is_empty() {
            return Ok(compare(snapshot, &[], None, self.checks.clocks()));
        }
        let rows = self
            .store
            .stored_rows(thread, &displays, bounds)
            .await
            .map_err(|error| match error {
                StoreError::TooLarge { .. } => self.too_large(),
                other => ReadError::Store(other),
            })?;
        // What the view holds now: a row stored about the read and delivered live since is no divergence.
        let now = match self.cache.get(thread).await {
            Some(entry) => {
                let view = entry.lock_view(&self.metrics);
                Some(Snapshot::of(thread, SystemTime::now(), view.events()))
            }
            None => None,
        };
        Ok(compare(snapshot, &rows, now.as_ref(), self.checks.clocks()))
    }

    /// Makes the thread's view partial if it is complete; returns whether it was.
    async fn heal(&self, thread_id: &str) -> bool {
        let Some(entry) = self.cache.get(thread_id).await else {
            return false;
        };
        let healed = entry.lock_view(&self.metrics).downgrade();
        if healed {
            self.metrics.shadow.heal();
            self.metrics.cache.views_downgraded(1);
        }
        healed
    }

    /// Counts a check and its events, and warns (metadata only, rate-limited) about a failure.
    fn record(&self, thread_id: &str, verdict: Verdict, comparison: &Comparison) {
        self.metrics.shadow.check(verdict);
        for finding in Finding::ALL {
            let label = if verdict == Verdict::Window && finding.is_failure() {
                Verdict::Window.label()
            } else {
                finding.label()
            };
            self.metrics.shadow.events(label, comparison.count(finding));
        }
        if verdict.is_failure() && self.checks.warnings.allow() {
            let events: Vec<String> = comparison
                .divergent
                .iter()
                .take(20)
                .map(|d| format!("{}:{}/{}", d.finding.label(), d.event_name, d.event_id))
                .collect();
            tracing::warn!(
                thread_id,
                result = verdict.label(),
                missing = comparison.count(Finding::Missing),
                late = comparison.count(Finding::Late),
                differs = comparison.count(Finding::Differs),
                matched = comparison.count(Finding::Match),
                events = ?events,
                "A shadow check found the view lacking what the store holds; the view is healed (its next read hydrates)"
            );
        }
    }

    /// `POST /v1/threads/{thread_id}/verify`: the comparison now, against the thread's current view, healing as a
    /// sampled check does. Only a complete view is compared: a view that is not complete was never served as
    /// complete (its reads hydrate), so it answers `not_complete`, no store query and no failure. Each verify of a
    /// cached thread takes a token of verify's own budget first; beyond it, or while its thread is being verified,
    /// it is refused (nothing else is done).
    ///
    /// # Errors
    /// [`ReadError`] when the store failed or no check slot freed within the store timeout.
    pub async fn verify(&self, thread_id: &str) -> Result<Verified, ReadError> {
        let Some(entry) = self.cache.get(thread_id).await else {
            return Ok(Verified::NotCached);
        };
        let budget = &self.checks.verifies;
        if budget.admit(thread_id, Instant::now()) != Admission::Admitted {
            self.metrics.shadow.check(Verdict::Refused);
            return Ok(Verified::Refused);
        }
        let _verifying = Verifying { budget, thread_id };
        let snapshot = {
            let view = entry.lock_view(&self.metrics);
            match view.state(self.coverage.epoch(entry.bucket)) {
                ViewState::Complete => {
                    Some(Snapshot::of(thread_id, SystemTime::now(), view.events()))
                }
                ViewState::Partial => None,
            }
        };
        let Some(snapshot) = snapshot else {
            self.metrics.shadow.check(Verdict::NotComplete);
            return Ok(Verified::Report(VerifyReport {
                thread_id: thread_id.to_owned(),
                view: "partial",
                result: Verdict::NotComplete,
                counts: Finding::ALL.iter().map(|f| (f.label(), 0)).collect(),
                divergent: Vec::new(),
                healed: false,
            }));
        };
        let comparison = self.compare_with_store(&snapshot).await?;
        let verdict = comparison.verdict();
        let healed = verdict.heals() && self.heal(thread_id).await;
        self.record(thread_id, verdict, &comparison);
        Ok(Verified::Report(VerifyReport {
            thread_id: thread_id.to_owned(),
            view: "complete",
            result: verdict,
            counts: Finding::ALL
                .iter()
                .map(|f| (f.label(), comparison.count(*f)))
                .collect(),
            divergent: comparison.divergent,
            healed,
        }))
    }
}
