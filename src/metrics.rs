//! `Metrics`: the worker's Prometheus metrics on a registry of its own (never the process-global one, so each test
//! app starts clean), the handle that bundles every component's metric set, and the text served at `/metrics`.
//!
//! Each component registers the metrics it records, and owns their outcome enums, beside its code:
//! [`IngestMetrics`] in `ingest.rs`, [`SourceMetrics`] in `source/metrics.rs`, [`CacheMetrics`] and
//! [`ShadowMetrics`] in `cache/metrics.rs`, [`StoreMetrics`] in `store/metrics.rs`, [`HttpMetrics`] in
//! `http/metrics.rs`, [`WarmMetrics`] in `warm/metrics.rs`. A set exports its labelled series at zero when it
//! registers them, so a panel or an alert sees 0 rather than nothing; label values come from closed sets (the
//! owner's enums' `label()`s), never from ids.
//!
//! This file keeps what they share: the [`Registrar`] they register through, the latency buckets, and the tests
//! that pin every name and label (dashboards and alerts depend on them) and hold every help text to what its
//! metric counts.

use std::sync::Arc;

use prometheus::core::{Collector, MetricVec, MetricVecBuilder};
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::cache::{CacheMetrics, ShadowMetrics};
use crate::http::HttpMetrics;
use crate::ingest::IngestMetrics;
use crate::source::SourceMetrics;
use crate::store::StoreMetrics;
use crate::warm_up::WarmMetrics;

/// Buckets of the read and store-query durations, in seconds: from a read answered from memory to the store timeout.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Every component's metric set; cloning is cheap (one `Arc` a set).
#[derive(Clone)]
pub struct Metrics {
    /// What became of each message, and its lag: the ingest path, a view's holder, the Core loop.
    pub ingest: Arc<IngestMetrics>,
    /// NATS connection events and the JetStream source: the watcher, the tracker, the witness.
    pub source: Arc<SourceMetrics>,
    /// Reads, hydrations, re-reads, fills, limits, size and freshness: the view cache.
    pub cache: Arc<CacheMetrics>,
    /// The shadow checks (run by the view cache).
    pub shadow: Arc<ShadowMetrics>,
    /// Queries, their errors, the index-hint fallback and the persister lag: the store.
    pub store: Arc<StoreMetrics>,
    /// Connections, refusals, timeouts, reads, routes, errors, feeds and readiness: the HTTP side.
    pub http: Arc<HttpMetrics>,
    /// The warm-up of the hot set handed over at a restart.
    pub warm: Arc<WarmMetrics>,
    /// Spans the trace exporter could not send ([`crate::telemetry::trace::spans_dropped`]), brought up to date at
    /// each scrape.
    spans_dropped: IntCounter,
    /// Where every set is registered; gathered for `/metrics`.
    registry: Registry,
    catalogue: Arc<Catalogue>,
}

/// What was registered, for the tests.
struct Catalogue {
    /// Every metric as its component described it, in registration order.
    registered: Vec<Described>,
    /// Every metric's name and label names, in the same order.
    names: Vec<(String, Vec<String>)>,
}

impl Metrics {
    /// Creates every component's metrics on a fresh registry.
    ///
    /// # Panics
    /// Only if a metric definition is invalid or a name is registered twice (a programming error caught by every
    /// test run).
    pub fn new() -> Self {
        let mut registrar = Registrar {
            registry: Registry::new(),
            described: Vec::new(),
        };
        let ingest = Arc::new(IngestMetrics::register(&mut registrar));
        let source = Arc::new(SourceMetrics::register(&mut registrar));
        let cache = Arc::new(CacheMetrics::register(&mut registrar));
        let shadow = Arc::new(ShadowMetrics::register(&mut registrar));
        let store = Arc::new(StoreMetrics::register(&mut registrar));
        let http = Arc::new(HttpMetrics::register(&mut registrar));
        let warm = Arc::new(WarmMetrics::register(&mut registrar));
        let spans_dropped = registrar.counter(
            "history_view_trace_spans_dropped_total",
            "Spans the trace exporter could not send to the collector (each failed export's batch), dropped.",
        );
        registrar
            .gauge_vec(
                "history_view_build_info",
                "Always 1; its label version is the worker's version (the release's Cargo version).",
                &["version"],
            )
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let Registrar {
            registry,
            described,
        } = registrar;
        // The process collector's `process_*` (CPU seconds, resident and virtual memory, open and maximum file
        // descriptors, start time), read from /proc at each scrape; not a described metric of the worker's own.
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("the process collector registers once");
        let names = described
            .iter()
            .map(|d| {
                let labels = d.labels.iter().map(|label| (*label).to_owned()).collect();
                (d.name.to_owned(), labels)
            })
            .collect();
        Self {
            ingest,
            source,
            cache,
            shadow,
            store,
            http,
            warm,
            spans_dropped,
            registry,
            catalogue: Arc::new(Catalogue {
                registered: described,
                names,
            }),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let dropped = crate::telemetry::trace::spans_dropped();
        self.spans_dropped
            .inc_by(dropped.saturating_sub(self.spans_dropped.get()));
        let mut buffer = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }

    /// Every metric's name and label names, in registration order.
    pub fn described(&self) -> &[(String, Vec<String>)] {
        &self.catalogue.names
    }

    /// Every metric as its component described it (help and kind too), in registration order.
    pub fn registered(&self) -> &[Described] {
        &self.catalogue.registered
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The kind of a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric as its component registered it.
#[derive(Debug, Clone, Copy)]
pub struct Described {
    pub name: &'static str,
    pub labels: &'static [&'static str],
    /// What it counts or measures (the `# HELP` line).
    pub help: &'static str,
    pub kind: Kind,
}

/// Registers a component's metrics on the worker's registry and notes how each one is described.
///
/// Every method panics on an invalid definition or a name registered twice: a programming error that every test
/// run catches ([`Metrics::new`]).
pub struct Registrar {
    registry: Registry,
    described: Vec<Described>,
}

impl Registrar {
    pub fn counter(&mut self, name: &'static str, help: &'static str) -> IntCounter {
        let metric = IntCounter::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Counter)
    }

    pub fn counter_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> IntCounterVec {
        let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Counter)
    }

    pub fn gauge(&mut self, name: &'static str, help: &'static str) -> IntGauge {
        let metric = IntGauge::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Gauge)
    }

    pub fn gauge_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> IntGaugeVec {
        let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Gauge)
    }

    /// A gauge of a fractional quantity (seconds).
    pub fn float_gauge(&mut self, name: &'static str, help: &'static str) -> Gauge {
        let metric = Gauge::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Gauge)
    }

    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        buckets: &[f64],
    ) -> Histogram {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        let metric = Histogram::with_opts(opts).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Histogram)
    }

    pub fn histogram_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
        buckets: &[f64],
    ) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        let metric = HistogramVec::new(opts, labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Histogram)
    }

    fn add<T: Collector + Clone + 'static>(
        &mut self,
        metric: T,
        name: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
        kind: Kind,
    ) -> T {
        self.registry
            .register(Box::new(metric.clone()))
            .expect("metric names are unique and valid");
        self.described.push(Described {
            name,
            labels,
            help,
            kind,
        });
        metric
    }
}

/// Exports the series of a one-label metric for each of `values` at zero.
pub fn preset<T: MetricVecBuilder>(metric: &MetricVec<T>, values: &[&str]) {
    for value in values {
        metric.with_label_values(&[value]);
    }
}

/// A count as an integer gauge's value (a count beyond `i64::MAX` shows as that).
pub fn gauge_value(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// The value of `series` (its name and labels as rendered) in a `/metrics` text, for the components' tests.
#[cfg(test)]
pub(crate) fn sample(rendered: &str, series: &str) -> Option<f64> {
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use clap::CommandFactory;

    use super::*;
    use crate::config::Config;

    #[test]
    fn labelled_counters_are_exported_at_zero_from_the_start() {
        let metrics = Metrics::new();
        let rendered = metrics.render();
        for series in [
            "history_view_http_refused_total{reason=\"connections\"}",
            "history_view_http_refused_total{reason=\"in_flight\"}",
            "history_view_http_timeouts_total{kind=\"header\"}",
            "history_view_read_errors_total{code=\"503\"}",
            "history_view_hydrations_total{result=\"error\"}",
            "history_view_shadow_checks_total{result=\"missing\"}",
            "history_view_store_queries_total{kind=\"explain\"}",
            "history_view_nats_connection_events_total{event=\"slow_consumer\"}",
            "history_view_ready{component=\"store\"}",
        ] {
            assert_eq!(sample(&rendered, series), Some(0.0), "{series}");
        }
        // The JetStream source's series only on a JetStream worker.
        assert!(!rendered.contains("history_view_jetstream_gaps_total{"));
        metrics.source.preset_jetstream();
        let rendered = metrics.render();
        assert_eq!(
            sample(
                &rendered,
                "history_view_jetstream_gaps_total{cause=\"new_leader\"}"
            ),
            Some(0.0)
        );
        metrics.http.read_error(503);
        metrics.http.read_error(418);
        let rendered = metrics.render();
        assert_eq!(
            sample(&rendered, "history_view_read_errors_total{code=\"503\"}"),
            Some(1.0)
        );
        assert_eq!(
            sample(&rendered, "history_view_read_errors_total{code=\"418\"}"),
            Some(1.0)
        );
    }

    /// Dashboards and alerts name these metrics and labels: a rename here is a breaking change for operators. The
    /// order is not pinned (the exposition sorts by name).
    #[test]
    fn metric_names_and_labels_are_pinned() {
        let pinned: [(&str, &[&str]); 54] = [
            ("history_view_build_info", &["version"]),
            ("history_view_events_total", &["outcome"]),
            ("history_view_shadow_checks_total", &["result"]),
            ("history_view_cache_hits_total", &[]),
            ("history_view_cache_misses_total", &[]),
            ("history_view_hydrations_total", &["result"]),
            ("history_view_views_downgraded_total", &[]),
            ("history_view_unproven_reads_total", &[]),
            ("history_view_cache_entries", &[]),
            ("history_view_cache_weighted_bytes", &[]),
            ("history_view_store_query_duration_seconds", &["stage"]),
            ("history_view_store_queries_total", &["kind"]),
            ("history_view_fills_total", &["outcome"]),
            ("history_view_read_duration_seconds", &["source"]),
            ("history_view_ingest_lag_seconds", &[]),
            ("history_view_nats_connection_events_total", &["event"]),
            ("history_view_hydration_slot_timeouts_total", &[]),
            ("history_view_http_connections", &[]),
            ("history_view_http_refused_total", &["reason"]),
            ("history_view_http_timeouts_total", &["kind"]),
            ("history_view_thread_limit_exceeded_total", &["path"]),
            ("history_view_markers_skipped_total", &[]),
            ("history_view_orphaned_events_total", &[]),
            ("history_view_index_hint_fallbacks_total", &[]),
            ("history_view_malformed_event_warnings_total", &[]),
            ("history_view_background_rereads_total", &["result"]),
            ("history_view_persister_lag_seconds", &[]),
            ("history_view_persister_lag_exceeded_total", &[]),
            ("history_view_jetstream_last_sequence", &["stream"]),
            ("history_view_jetstream_pending", &["stream"]),
            ("history_view_jetstream_refusing", &["stream", "cause"]),
            ("history_view_jetstream_resumes_total", &["outcome"]),
            ("history_view_jetstream_gaps_total", &["cause"]),
            ("history_view_jetstream_streams", &[]),
            ("history_view_jetstream_witnessed_total", &["result"]),
            ("history_view_jetstream_behind", &[]),
            ("history_view_read_routes_total", &["route"]),
            ("history_view_shadow_events_total", &["result"]),
            ("history_view_shadow_check_delay_seconds", &[]),
            ("history_view_shadow_heals_total", &[]),
            ("history_view_covered_through_age_seconds", &[]),
            ("history_view_ready", &["component"]),
            ("history_view_nats_connected", &[]),
            ("history_view_read_errors_total", &["code"]),
            ("history_view_store_errors_total", &["kind"]),
            ("history_view_persister_lag_out_of_range_total", &["side"]),
            ("history_view_cache_budget_bytes", &[]),
            ("history_view_http_waiting_reads", &[]),
            ("history_view_feed_streams", &[]),
            ("history_view_feed_events_total", &["kind"]),
            ("history_view_feed_resumes_total", &["outcome"]),
            ("history_view_feed_coalesced_changes_total", &[]),
            ("history_view_warm_threads", &["state"]),
            ("history_view_trace_spans_dropped_total", &[]),
        ];
        let metrics = Metrics::new();
        let mut described: Vec<(&str, Vec<&str>)> = metrics
            .described()
            .iter()
            .map(|(name, labels)| (name.as_str(), labels.iter().map(String::as_str).collect()))
            .collect();
        let mut pinned: Vec<(&str, Vec<&str>)> = pinned
            .iter()
            .map(|(name, labels)| (*name, labels.to_vec()))
            .collect();
        described.sort();
        pinned.sort();
        assert_eq!(described, pinned);
    }

    /// Words that open a help saying what the code does rather than what the metric counts.
    const VERBS: [&str; 14] = [
        "Count",
        "Counts",
        "Counted",
        "Record",
        "Records",
        "Recorded",
        "Track",
        "Tracks",
        "Increment",
        "Increments",
        "Incremented",
        "Measure",
        "Measures",
        "Observe",
    ];

    /// The `# HELP` line is all an operator reading `/metrics` has: it must name what the metric counts or
    /// measures, with its unit, every label, and every label value exported from the start (so a value added to
    /// an enum and not explained fails here), and name only settings and metrics that exist.
    #[test]
    fn every_help_text_names_what_its_metric_counts() {
        let metrics = Metrics::new();
        metrics.source.preset_jetstream();
        let mut exported: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for family in metrics.registry.gather() {
            for metric in family.get_metric() {
                for pair in metric.get_label() {
                    exported
                        .entry(family.name().to_owned())
                        .or_default()
                        .insert(pair.value().to_owned());
                }
            }
        }
        let settings: BTreeSet<String> = Config::command()
            .get_arguments()
            .filter_map(|argument| argument.get_env())
            .map(|env| env.to_string_lossy().into_owned())
            .collect();
        let names: BTreeSet<&str> = metrics.registered().iter().map(|d| d.name).collect();
        let mut failures = Vec::new();
        for metric in metrics.registered() {
            let help = metric.help;
            let words: BTreeSet<&str> = help
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|word| !word.is_empty())
                .collect();
            let mut fail = |why: String| failures.push(format!("{}: {why}", metric.name));
            if !help.starts_with(|c: char| c.is_ascii_uppercase()) {
                fail("starts with no capital".into());
            }
            if !help.ends_with('.') {
                fail("does not end with a period".into());
            }
            let first = help.split_whitespace().next().unwrap_or_default();
            if metric.kind == Kind::Counter && VERBS.contains(&first) {
                fail(format!(
                    "opens with the verb {first:?}: name what it counts"
                ));
            }
            if (metric.kind == Kind::Counter) != metric.name.ends_with("_total") {
                fail("a counter's name ends in _total, and only a counter's".into());
            }
            let unit = ["seconds", "bytes"]
                .into_iter()
                .find(|unit| metric.name.ends_with(&format!("_{unit}")));
            match unit {
                Some(unit) if !words.iter().any(|word| word.eq_ignore_ascii_case(unit)) => {
                    fail(format!("does not say {unit}"));
                }
                None if metric.kind == Kind::Histogram => {
                    fail("a histogram's name ends in its unit".into());
                }
                _ => {}
            }
            for label in metric.labels {
                if !words.contains(label) {
                    fail(format!("does not name its label {label}"));
                }
            }
            // The version is the one label value from no closed set: one per process, said by its help.
            let values = exported
                .get(metric.name)
                .filter(|_| metric.name != "history_view_build_info");
            for value in values.into_iter().flatten() {
                if !words.contains(value.as_str()) {
                    fail(format!("does not explain the label value {value}"));
                }
            }
            for word in &words {
                if word.starts_with("HISTORY_VIEW_") && !settings.contains(*word) {
                    fail(format!("names {word}, which is no setting"));
                }
                if word.starts_with("history_view_") && !names.contains(word) {
                    fail(format!("names {word}, which is no metric"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
