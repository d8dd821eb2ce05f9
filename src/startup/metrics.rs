//! `Metrics`: every wing's metric set, registered in one place on one registry where the application is wired, and
//! the tests that pin every name and label (dashboards and alerts depend on them) and hold every help text to what
//! its metric counts. Each wing is handed its own set (or sets) from here; none reads another's.

use std::sync::Arc;

use crate::cache::{AppliedEvents, CacheMetrics, ShadowMetrics, ViewMetrics};
use crate::http::HttpMetrics;
use crate::metrics::{Described, Exposition, Registrar};
use crate::source::{IngestMetrics, SourceMetrics};
use crate::store::StoreMetrics;
use crate::warm_up::WarmMetrics;

/// Every wing's metric set; cloning is cheap (one `Arc` a set).
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
    /// Where every set is registered; rendered for `/metrics`.
    pub exposition: Exposition,
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
    /// Creates every wing's metrics on a fresh registry.
    ///
    /// # Panics
    /// Only if a metric definition is invalid or a name is registered twice (a programming error caught by every
    /// test run).
    pub fn new() -> Self {
        let mut registrar = Registrar::new();
        let ingest = Arc::new(IngestMetrics::register(&mut registrar));
        let source = Arc::new(SourceMetrics::register(&mut registrar));
        let cache = Arc::new(CacheMetrics::register(&mut registrar));
        let shadow = Arc::new(ShadowMetrics::register(&mut registrar));
        let store = Arc::new(StoreMetrics::register(&mut registrar));
        let http = Arc::new(HttpMetrics::register(&mut registrar));
        let warm = Arc::new(WarmMetrics::register(&mut registrar));
        registrar.counter_read_at_scrape(
            "history_view_trace_spans_dropped_total",
            "Spans the trace exporter could not send to the collector (each failed export's batch), dropped.",
            crate::telemetry::trace::spans_dropped,
        );
        registrar
            .gauge_vec(
                "history_view_build_info",
                "Always 1; its label version is the worker's version (the release's Cargo version).",
                &["version"],
            )
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        // The process collector's `process_*` (CPU seconds, resident and virtual memory, open and maximum file
        // descriptors, start time), read from /proc at each scrape; not a described metric of the worker's own.
        #[cfg(target_os = "linux")]
        registrar.collector(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        let (exposition, described) = registrar.finish();
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
            exposition,
            catalogue: Arc::new(Catalogue {
                registered: described,
                names,
            }),
        }
    }

    /// The view cache's handle: its sets, and the ingest path's counters for the live events a view's holder
    /// applies for it.
    pub fn views(&self) -> ViewMetrics {
        ViewMetrics {
            cache: Arc::clone(&self.cache),
            shadow: Arc::clone(&self.shadow),
            applied: AppliedEvents::new(
                self.ingest.counter(crate::source::EventOutcome::Relevant),
                self.ingest.counter(crate::source::EventOutcome::Duplicate),
            ),
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.exposition.render()
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
