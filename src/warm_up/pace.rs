//! The warm-up's pace ([design 2.5](../../docs/design.md#2.5)): a starting worker hydrates the threads of the hot
//! set it was handed, newest first, through the cache's warm hydrations (the read's hydration, in a slot a read
//! does not need: [`ViewCache::warm_one`]), after the moment from which a store read can complete a view, at most
//! `HISTORY_VIEW_WARM_RATE` a second, until done or `HISTORY_VIEW_WARM_MAX_SECS`. It never queues on the slots: it
//! waits in small steps instead, and holds at most the cache's warm share of them at once.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use super::metrics::{WarmMetrics, WarmState};
use crate::cache::{ViewCache, Warmed};
use crate::store::StoreReads;

/// How long the warm-up waits before it looks again for two free slots.
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
    fn count(&mut self, warmed: Warmed) {
        match warmed {
            Warmed::Hydrated => self.hydrated += 1,
            Warmed::Skipped => self.skipped += 1,
            Warmed::Failed => self.failed += 1,
        }
        self.pending -= 1;
    }
}

/// Hydrates `threads` (the most recently read first) by `plan`, once a store read can complete a view.
pub async fn warm_up<S: StoreReads>(
    views: &ViewCache<S>,
    threads: Vec<String>,
    plan: WarmPlan,
    metrics: &Arc<WarmMetrics>,
) -> WarmReport {
    let mut report = WarmReport {
        listed: threads.len(),
        pending: threads.len(),
        ..WarmReport::default()
    };
    metrics.listed(threads.len());
    let share = views.warm_share();
    // With a single slot there is none to spare for the warm-up: the threads stay pending.
    if threads.is_empty() || share == 0 {
        return report;
    }
    if !views.wait_for_coverage(plan.deadline).await {
        report.hit_deadline = true;
        return report;
    }
    let interval = Duration::from_secs(1) / plan.rate.max(1);
    let mut running: JoinSet<Warmed> = JoinSet::new();
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
                if let Some(slot) = views.warm_slot() {
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
        let views = views.clone();
        let metrics = Arc::clone(metrics);
        running.spawn(async move {
            let warmed = views.warm_one(&thread, rank, slot).await;
            // Counted here, not as joined: a hydration still running at the deadline counts when it ends.
            metrics.done(WarmState::from(warmed));
            warmed
        });
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
