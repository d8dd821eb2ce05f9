//! The store's metrics: its queries (how many, how long, which failed), the index-hint fallback, and the persister
//! lag read off every stored row. Recorded by the [`super::Store`] alone.

use std::time::Duration;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec};

use super::{QueryKind, StoreError};
use crate::metrics::{LATENCY_BUCKETS, Registrar, preset};

/// Persister lag is read from an ObjectId, which counts whole seconds; finer buckets would be noise.
const PERSISTER_LAG_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];

/// A persister lag below zero by more than the `_id`'s whole second, or above a day, is a clock (or a fixture), not
/// a lag: counted apart, kept out of the histogram.
const PERSISTER_LAG_FLOOR_NS: i128 = -1_000_000_000;
const PERSISTER_LAG_CEILING_NS: i128 = 86_400 * 1_000_000_000;

/// The `side` label of `history_view_persister_lag_out_of_range_total`: below the floor, above the ceiling.
const OUT_OF_RANGE_SIDES: [&str; 2] = ["negative", "too_large"];

pub struct StoreMetrics {
    query_seconds: HistogramVec,
    queries: IntCounterVec,
    errors: IntCounterVec,
    index_hint_fallbacks: IntCounter,
    persister_lag_seconds: Histogram,
    persister_lag_exceeded: IntCounter,
    persister_lag_out_of_range: IntCounterVec,
}

impl StoreMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let metrics = Self {
            query_seconds: registrar.histogram_vec(
                "history_view_store_query_duration_seconds",
                "Seconds a store query took to answer, by stage: markers (stage 1: the displays with a visible \
                 marker), events (stage 2: their events), fill, explain (explain's row metadata).",
                &["stage"],
                LATENCY_BUCKETS,
            ),
            queries: registrar.counter_vec(
                "history_view_store_queries_total",
                "Store queries answered, by kind: hydration_markers and hydration_events (a hydration's two \
                 stages on a read), reread_markers and reread_events (a background re-read's), warm_markers and \
                 warm_events (a starting worker's warm-up of the hot set, off the read path), shadow_markers and \
                 shadow_events (a shadow check's), fill, explain (explain's row metadata).",
                &["kind"],
            ),
            errors: registrar.counter_vec(
                "history_view_store_errors_total",
                "Store queries and pings that failed, by kind: timeout (no answer within the store timeout), \
                 unavailable (the store is unreachable: an outage), failed (another error a later query may not \
                 meet), rejected (a query the store refused, answered 500).",
                &["kind"],
            ),
            index_hint_fallbacks: registrar.counter(
                "history_view_index_hint_fallbacks_total",
                "Store queries run again without their index hint because the index is missing.",
            ),
            persister_lag_seconds: registrar.histogram(
                "history_view_persister_lag_seconds",
                "Seconds from a stored row's created_at to its _id time, per row a store read returns (the _id \
                 counts whole seconds: a row up to 1 s below zero counts as 0; lags out of range are kept out).",
                PERSISTER_LAG_BUCKETS,
            ),
            persister_lag_exceeded: registrar.counter(
                "history_view_persister_lag_exceeded_total",
                "Rows read from the store that were persisted later than HISTORY_VIEW_PERSIST_LAG_MS after their \
                 created_at.",
            ),
            persister_lag_out_of_range: registrar.counter_vec(
                "history_view_persister_lag_out_of_range_total",
                "Rows read from the store whose persister lag is not a lag, by side: negative (an _id time more \
                 than its whole second before created_at), too_large (more than a day after it); kept out of \
                 history_view_persister_lag_seconds.",
                &["side"],
            ),
        };
        preset(&metrics.queries, &QueryKind::ALL.map(QueryKind::label));
        preset(
            &metrics.query_seconds,
            &QueryKind::ALL.map(QueryKind::stage),
        );
        preset(&metrics.errors, &StoreError::KINDS);
        preset(&metrics.persister_lag_out_of_range, &OUT_OF_RANGE_SIDES);
        metrics
    }

    /// A store query of `kind` answered in `elapsed`.
    pub fn query(&self, kind: QueryKind, elapsed: Duration) {
        self.query_seconds
            .with_label_values(&[kind.stage()])
            .observe(elapsed.as_secs_f64());
        self.queries.with_label_values(&[kind.label()]).inc();
    }

    /// A store query or ping failed; `kind` is [`StoreError::kind`].
    pub fn error(&self, kind: &'static str) {
        self.errors.with_label_values(&[kind]).inc();
    }

    pub fn index_hint_fallback(&self) {
        self.index_hint_fallbacks.inc();
    }

    /// Records one stored row's persister lag (`_id` time minus `created_at`, in ns; the `_id` counts whole
    /// seconds, so a lag down to one second below zero is a row stored within its second, counted as 0); returns
    /// whether it exceeds `bound` (the caller warns). A lag further below zero or above a day says the clocks (or
    /// the row's `created_at`) are off: it is counted apart and kept out of the histogram and the bound's count.
    pub fn persister_lag(&self, lag_ns: i128, bound: Duration) -> bool {
        let side = if lag_ns < PERSISTER_LAG_FLOOR_NS {
            OUT_OF_RANGE_SIDES[0]
        } else if lag_ns > PERSISTER_LAG_CEILING_NS {
            OUT_OF_RANGE_SIDES[1]
        } else {
            let lag = Duration::from_nanos(u64::try_from(lag_ns.max(0)).unwrap_or(u64::MAX));
            self.persister_lag_seconds.observe(lag.as_secs_f64());
            let exceeded = lag > bound;
            if exceeded {
                self.persister_lag_exceeded.inc();
            }
            return exceeded;
        };
        self.persister_lag_out_of_range
            .with_label_values(&[side])
            .inc();
        false
    }
}

#[cfg(test)]
mod tests {
    use crate::metrics::{registered, sample};

    use super::*;

    #[test]
    fn a_lag_outside_zero_to_a_day_is_counted_apart_and_kept_out_of_the_histogram() {
        let (store, metrics) = registered(StoreMetrics::register);
        let store = &store;
        let bound = Duration::from_secs(2);
        let second: i128 = 1_000_000_000;
        // Stored within the second its `_id` counts: not negative, observed as 0.
        assert!(!store.persister_lag(-second / 2, bound));
        assert!(store.persister_lag(3 * second, bound));
        // A publisher clock ahead by 5 s, one row created at the epoch, one two days late.
        assert!(!store.persister_lag(-5 * second, bound));
        assert!(!store.persister_lag(1_800_000_000 * second, bound));
        assert!(!store.persister_lag(2 * 86_400 * second, bound));
        let rendered = metrics.render();
        assert_eq!(
            sample(&rendered, "history_view_persister_lag_seconds_count"),
            Some(2.0)
        );
        assert_eq!(
            sample(&rendered, "history_view_persister_lag_seconds_sum"),
            Some(3.0)
        );
        assert_eq!(
            sample(&rendered, "history_view_persister_lag_exceeded_total"),
            Some(1.0)
        );
        let side = |side: &str| {
            sample(
                &rendered,
                &format!("history_view_persister_lag_out_of_range_total{{side=\"{side}\"}}"),
            )
        };
        assert_eq!(side("negative"), Some(1.0));
        assert_eq!(side("too_large"), Some(2.0));
    }
}
