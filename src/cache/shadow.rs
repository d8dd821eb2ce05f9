//! Shadow checks run on the cache ([`crate::shadow`] holds the rules): a sampled read answered from memory leaves
//! a [`Snapshot`]; once the persister-lag bound has passed, the thread's two-stage query runs on the checks' own
//! pool and slots, the rows are compared with the snapshot, the result is counted (a failure is logged with
//! metadata only), and a failure heals: the thread's view is made partial, so its next read hydrates. The same
//! comparison runs on demand ([`ViewCache::verify`]).
//!
//! A check never delays a read or a hydration: it takes no hydration slot, its queries use their own connection
//! pool, and a sample beyond the rate limit (or for a thread being checked) is dropped, never queued.

use std::time::SystemTime;

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::entry::Entry;
use super::{ReadError, ViewCache};
use crate::shadow::{
    Admission, Clocks, Comparison, Divergence, Finding, Sampler, ShadowSettings, Snapshot, Verdict,
    compare,
};
use crate::store::{Bounds, Hydration, StoreBounds, StoreError, StoreReads};
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
    slots: Semaphore,
    warnings: RateLimit,
}

impl Checks {
    pub fn new(settings: ShadowSettings, bounds: StoreBounds, window: std::time::Duration) -> Self {
        Self {
            sampler: Sampler::new(settings.sample, settings.max_per_sec, Instant::now()),
            settings,
            bounds,
            window,
            slots: Semaphore::new(CHECKS_AT_ONCE),
            warnings: RateLimit::default(),
        }
    }

    fn clocks(&self) -> Clocks {
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

/// The answer of `POST /v1/threads/{thread_id}/verify`: metadata only.
#[derive(Debug, Serialize)]
pub struct VerifyReport {
    pub thread_id: String,
    /// `complete` or `partial`: the view's state when it was compared.
    pub view: &'static str,
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
                    if verdict.is_failure() {
                        self.heal(&snapshot.thread_id).await;
                        if self.gap_followed(&snapshot, mark).await {
                            verdict = Verdict::Window;
                        }
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
    /// sampled check does. `None` when the thread is not cached.
    ///
    /// # Errors
    /// [`ReadError`] when the store failed or no check slot freed within the store timeout.
    pub async fn verify(&self, thread_id: &str) -> Result<Option<VerifyReport>, ReadError> {
        let Some(entry) = self.cache.get(thread_id).await else {
            return Ok(None);
        };
        let (snapshot, state) = {
            let view = entry.lock_view(&self.metrics);
            let state = view.state(self.coverage.epoch(entry.bucket));
            (
                Snapshot::of(thread_id, SystemTime::now(), view.events()),
                state,
            )
        };
        let comparison = self.compare_with_store(&snapshot).await?;
        let verdict = comparison.verdict();
        let healed = verdict.is_failure() && self.heal(thread_id).await;
        self.record(thread_id, verdict, &comparison);
        Ok(Some(VerifyReport {
            thread_id: thread_id.to_owned(),
            view: match state {
                ViewState::Complete => "complete",
                ViewState::Partial => "partial",
            },
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
