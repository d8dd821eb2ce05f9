//! The warm-up's metric: `history_view_warm_threads{state}`, the threads of the hot set a starting worker read and
//! what became of them, with the closed set of states.

use prometheus::IntGaugeVec;

use crate::cache::Warmed;
use crate::metrics::{Registrar, gauge_value, preset};

/// What became of a thread of the hot set (the `state` of `history_view_warm_threads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmState {
    /// Read from the hot set (this worker's threads only).
    Listed,
    /// Hydrated by the warm-up.
    Hydrated,
    /// Left alone: its view was complete already, or a read's hydration of it was in flight.
    Skipped,
    /// Its hydration failed (the store, or the per-thread limit); its next read hydrates.
    Failed,
    /// Not reached yet; what is left when the warm-up ends is what it did not reach within its time.
    Pending,
}

impl From<Warmed> for WarmState {
    fn from(warmed: Warmed) -> Self {
        match warmed {
            Warmed::Hydrated => WarmState::Hydrated,
            Warmed::Skipped => WarmState::Skipped,
            Warmed::Failed => WarmState::Failed,
        }
    }
}

impl WarmState {
    const ALL: [WarmState; 5] = [
        WarmState::Listed,
        WarmState::Hydrated,
        WarmState::Skipped,
        WarmState::Failed,
        WarmState::Pending,
    ];

    fn label(self) -> &'static str {
        match self {
            WarmState::Listed => "listed",
            WarmState::Hydrated => "hydrated",
            WarmState::Skipped => "skipped",
            WarmState::Failed => "failed",
            WarmState::Pending => "pending",
        }
    }
}

pub struct WarmMetrics {
    threads: IntGaugeVec,
}

impl WarmMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let metrics = Self {
            threads: registrar.gauge_vec(
                "history_view_warm_threads",
                "Threads of the hot set this worker read at its start and what the warm-up did with them, by \
                 state: listed (read from the hot set), hydrated (by the warm-up), skipped (already complete, or \
                 a read was hydrating it), failed (its hydration failed), pending (not reached yet; left over \
                 once HISTORY_VIEW_WARM_MAX_SECS passed). 0 throughout without a hot set.",
                &["state"],
            ),
        };
        preset(&metrics.threads, &WarmState::ALL.map(WarmState::label));
        metrics
    }

    /// The hot set read: `listed` threads, all pending.
    pub fn listed(&self, listed: usize) {
        let listed = gauge_value(listed as u64);
        self.threads
            .with_label_values(&[WarmState::Listed.label()])
            .set(listed);
        self.threads
            .with_label_values(&[WarmState::Pending.label()])
            .set(listed);
    }

    /// One listed thread is done, in `state`.
    pub fn done(&self, state: WarmState) {
        self.threads.with_label_values(&[state.label()]).inc();
        self.threads
            .with_label_values(&[WarmState::Pending.label()])
            .dec();
    }
}
