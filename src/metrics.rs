//! `Metrics`: the service's Prometheus metrics on its own registry (never the global one), with typed handles.
//! Label values come from closed sets, never from ids: the outcome enums below, and the `label()`s of the enums a
//! component owns (the cache's `Source` and `LimitPath`, the store's `QueryKind`). A leaf: it imports nothing of
//! the crate.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// What became of one message received from NATS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventOutcome {
    /// Decoded and added to its thread's view.
    Relevant,
    /// Outside the projectable families (or not a display event): dropped after reading its parents.
    Irrelevant,
    /// Its delivery key was already held.
    Duplicate,
    /// The payload could not be read at all.
    Malformed,
    /// The subject is not a 9-token display-event subject.
    BadSubject,
}

impl EventOutcome {
    /// Every outcome, in declaration order (the order of `Inner::events`).
    const ALL: [EventOutcome; 5] = [
        EventOutcome::Relevant,
        EventOutcome::Irrelevant,
        EventOutcome::Duplicate,
        EventOutcome::Malformed,
        EventOutcome::BadSubject,
    ];

    fn label(self) -> &'static str {
        match self {
            EventOutcome::Relevant => "relevant",
            EventOutcome::Irrelevant => "irrelevant",
            EventOutcome::Duplicate => "duplicate",
            EventOutcome::Malformed => "malformed",
            EventOutcome::BadSubject => "bad_subject",
        }
    }
}

/// What a fill achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillOutcome {
    /// The view is complete again.
    Complete,
    /// Read, but a gap or removal happened since the view was complete, or another display is waiting: still
    /// partial.
    Partial,
    /// The store failed; the view is partial and the next read hydrates.
    Error,
}

impl FillOutcome {
    fn label(self) -> &'static str {
        match self {
            FillOutcome::Complete => "complete",
            FillOutcome::Partial => "partial",
            FillOutcome::Error => "error",
        }
    }
}

/// Why the HTTP server turned a client away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpRefusal {
    /// A connection beyond `HISTORY_VIEW_HTTP_MAX_CONNECTIONS` (served the probes only, or closed).
    Connections,
    /// A read beyond `HISTORY_VIEW_HTTP_MAX_IN_FLIGHT` (answered 503).
    InFlight,
}

/// Which timeout closed an HTTP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpTimeout {
    /// A request's headers did not arrive within `HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS`.
    Header,
    /// No request for `HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS`.
    Idle,
}

/// What a background re-read of a view held partial by the persister-lag bound achieved.
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
    fn label(self) -> &'static str {
        match self {
            RereadResult::Complete => "complete",
            RereadResult::Partial => "partial",
            RereadResult::Error => "error",
        }
    }
}

/// What a JetStream consumer's resume found ([design 2.1](../docs/design.md#2.1)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeOutcome {
    /// The stream kept its identity and the messages after the last one applied: not a gap.
    Continued,
    /// The stream was recreated, lost messages not read yet, changed its leader, was deleted, or is new: a gap.
    Gap,
}

impl ResumeOutcome {
    fn label(self) -> &'static str {
        match self {
            ResumeOutcome::Continued => "continued",
            ResumeOutcome::Gap => "gap",
        }
    }
}

/// How a history read was routed among partitioned workers ([design 8](../docs/design.md#8)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadRoute {
    /// This worker owns the thread.
    Local,
    /// Answered by the owner.
    Forwarded,
    /// The owner did not answer in time: answered from the store, not cached.
    OwnerUnreachable,
    /// A forwarded read for a thread this worker does not own either (workers disagree on the partition count):
    /// answered from the store, not cached, never forwarded again.
    Loop,
}

impl ReadRoute {
    fn label(self) -> &'static str {
        match self {
            ReadRoute::Local => "local",
            ReadRoute::Forwarded => "forwarded",
            ReadRoute::OwnerUnreachable => "owner_unreachable",
            ReadRoute::Loop => "loop",
        }
    }
}

/// Handles to every metric; cloning is cheap (one `Arc`).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Registry,
    /// Every metric's name and label names, in registration order (even before a labelled metric has a child).
    described: Vec<(String, Vec<String>)>,
    /// `history_view_events_total` resolved per outcome once, so counting an event is one atomic add.
    events: [IntCounter; EventOutcome::ALL.len()],
    cache_hits: IntCounter,
    cache_misses: IntCounter,
    hydrations: IntCounterVec,
    views_downgraded: IntCounter,
    cache_entries: IntGauge,
    cache_weighted_bytes: IntGauge,
    store_query_seconds: HistogramVec,
    store_queries: IntCounterVec,
    fills: IntCounterVec,
    read_seconds: HistogramVec,
    ingest_lag_seconds: prometheus::Histogram,
    nats_connection_events: IntCounterVec,
    index_hint_fallbacks: IntCounter,
    markers_skipped: IntCounter,
    hydration_slot_timeouts: IntCounter,
    thread_limit_exceeded: IntCounterVec,
    http_connections: IntGauge,
    http_refused: IntCounterVec,
    http_timeouts: IntCounterVec,
    malformed_warnings: IntCounter,
    rereads: IntCounterVec,
    persister_lag_seconds: prometheus::Histogram,
    persister_lag_exceeded: IntCounter,
    jetstream_last_sequence: IntGaugeVec,
    jetstream_pending: IntGaugeVec,
    jetstream_resumes: IntCounterVec,
    read_routes: IntCounterVec,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
const LAG_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];
/// Persister lag is read from an ObjectId, which counts whole seconds; finer buckets would be noise.
const PERSISTER_LAG_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];

impl Metrics {
    /// Creates the metrics on a fresh registry.
    ///
    /// # Panics
    /// Only if a metric definition below is invalid (a programming error caught by every test run).
    pub fn new() -> Self {
        let registry = Registry::new();
        let mut described = Vec::new();
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let histogram_vec = |name: &str, help: &str, labels: &[&str], buckets: &[f64]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                labels,
            )
            .expect("valid metric")
        };
        let events = register(
            &registry,
            &mut described,
            counter_vec(
                "history_view_events_total",
                "NATS messages received, by outcome",
                &["outcome"],
            ),
        );
        let inner = Inner {
            events: EventOutcome::ALL.map(|outcome| events.with_label_values(&[outcome.label()])),
            cache_hits: register(&registry, &mut described,
                counter(
                    "history_view_cache_hits_total",
                    "Reads answered from a complete view",
                ),
            ),
            cache_misses: register(&registry, &mut described,
                counter(
                    "history_view_cache_misses_total",
                    "Reads that found no complete view",
                ),
            ),
            hydrations: register(&registry, &mut described,
                counter_vec(
                    "history_view_hydrations_total",
                    "Views loaded from the store, by result",
                    &["result"],
                ),
            ),
            views_downgraded: register(&registry, &mut described,
                counter(
                    "history_view_views_downgraded_total",
                    "Complete views marked partial: found stale at their next use after a possible gap or a \
                     removal, or after a failed fill",
                ),
            ),
            cache_entries: register(&registry, &mut described,
                IntGauge::new("history_view_cache_entries", "Thread views held")
                    .expect("valid metric"),
            ),
            cache_weighted_bytes: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_cache_weighted_bytes",
                    "Weighted size of the views held, in bytes",
                )
                .expect("valid metric"),
            ),
            store_query_seconds: register(&registry, &mut described,
                histogram_vec(
                    "history_view_store_query_duration_seconds",
                    "Store query duration, by stage (markers, events, fill)",
                    &["stage"],
                    LATENCY_BUCKETS,
                ),
            ),
            store_queries: register(&registry, &mut described,
                counter_vec(
                    "history_view_store_queries_total",
                    "Store queries, by kind (hydration or background re-read stage, fill)",
                    &["kind"],
                ),
            ),
            fills: register(&registry, &mut described,
                counter_vec(
                    "history_view_fills_total",
                    "Fills of displays a live marker made visible, by outcome",
                    &["outcome"],
                ),
            ),
            read_seconds: register(&registry, &mut described,
                histogram_vec(
                    "history_view_read_duration_seconds",
                    "History read duration, by source",
                    &["source"],
                    LATENCY_BUCKETS,
                ),
            ),
            ingest_lag_seconds: register(&registry, &mut described,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "history_view_ingest_lag_seconds",
                        "Receive time minus the event's created_at",
                    )
                    .buckets(LAG_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            nats_connection_events: register(&registry, &mut described,
                counter_vec(
                    "history_view_nats_connection_events_total",
                    "NATS connection state changes, by event",
                    &["event"],
                ),
            ),
            hydration_slot_timeouts: register(&registry, &mut described,
                counter(
                    "history_view_hydration_slot_timeouts_total",
                    "Store reads of whole threads that found no free slot (HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS) \
                     within the store timeout and answered 503",
                ),
            ),
            http_connections: register(&registry, &mut described,
                IntGauge::new("history_view_http_connections", "Open HTTP connections")
                    .expect("valid metric"),
            ),
            http_refused: register(&registry, &mut described,
                counter_vec(
                    "history_view_http_refused_total",
                    "Clients turned away: connections beyond HISTORY_VIEW_HTTP_MAX_CONNECTIONS (reason=connections; \
                     served the probes and /metrics only, or closed) and reads beyond HISTORY_VIEW_HTTP_MAX_IN_FLIGHT \
                     (reason=in_flight; answered 503)",
                    &["reason"],
                ),
            ),
            http_timeouts: register(&registry, &mut described,
                counter_vec(
                    "history_view_http_timeouts_total",
                    "HTTP connections closed because a request's headers were too slow (kind=header) or no request \
                     came (kind=idle)",
                    &["kind"],
                ),
            ),
            thread_limit_exceeded: register(&registry, &mut described,
                counter_vec(
                    "history_view_thread_limit_exceeded_total",
                    "Threads stopped by HISTORY_VIEW_MAX_THREAD_BYTES: store reads that answered 507 (path=read), \
                     live views that left the cache (path=live)",
                    &["path"],
                ),
            ),
            markers_skipped: register(&registry, &mut described,
                counter(
                    "history_view_markers_skipped_total",
                    "Visibility marker displays skipped by a store read because their display_id is not a string",
                ),
            ),
            index_hint_fallbacks: register(&registry, &mut described,
                counter(
                    "history_view_index_hint_fallbacks_total",
                    "Store queries retried without the index hint because the index is missing",
                ),
            ),
            malformed_warnings: register(&registry, &mut described,
                counter(
                    "history_view_malformed_event_warnings_total",
                    "Warnings logged about malformed visible events",
                ),
            ),
            rereads: register(&registry, &mut described,
                counter_vec(
                    "history_view_background_rereads_total",
                    "Background re-reads of views held partial by the persister-lag bound, by result",
                    &["result"],
                ),
            ),
            persister_lag_seconds: register(&registry, &mut described,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "history_view_persister_lag_seconds",
                        "Per row read from the store: its _id time minus its created_at (whole seconds of _id)",
                    )
                    .buckets(PERSISTER_LAG_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            persister_lag_exceeded: register(&registry, &mut described,
                counter(
                    "history_view_persister_lag_exceeded_total",
                    "Rows read from the store that were persisted later than HISTORY_VIEW_PERSIST_LAG_MS after created_at",
                ),
            ),
            jetstream_last_sequence: register(&registry, &mut described,
                IntGaugeVec::new(
                    Opts::new(
                        "history_view_jetstream_last_sequence",
                        "JetStream source: the stream sequence of the last message applied, by class stream",
                    ),
                    &["stream"],
                )
                .expect("valid metric"),
            ),
            jetstream_pending: register(&registry, &mut described,
                IntGaugeVec::new(
                    Opts::new(
                        "history_view_jetstream_pending",
                        "JetStream source: messages the consumer has not delivered yet, by class stream",
                    ),
                    &["stream"],
                )
                .expect("valid metric"),
            ),
            jetstream_resumes: register(&registry, &mut described,
                counter_vec(
                    "history_view_jetstream_resumes_total",
                    "JetStream source: consumer resumes and new or deleted streams, by outcome (continued, gap)",
                    &["outcome"],
                ),
            ),
            read_routes: register(&registry, &mut described,
                counter_vec(
                    "history_view_read_routes_total",
                    "Partitioned workers: history reads by route (local, forwarded, owner_unreachable, loop)",
                    &["route"],
                ),
            ),
            registry,
            described,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Every metric's name and label names, in registration order.
    pub fn described(&self) -> &[(String, Vec<String>)] {
        &self.inner.described
    }

    pub fn hydration_slot_timeout(&self) {
        self.inner.hydration_slot_timeouts.inc();
    }
    pub fn http_connection_opened(&self) {
        self.inner.http_connections.inc();
    }
    pub fn http_connection_closed(&self) {
        self.inner.http_connections.dec();
    }
    pub fn http_refused(&self, reason: HttpRefusal) {
        let label = match reason {
            HttpRefusal::Connections => "connections",
            HttpRefusal::InFlight => "in_flight",
        };
        self.inner.http_refused.with_label_values(&[label]).inc();
    }
    pub fn http_timeout(&self, kind: HttpTimeout) {
        let label = match kind {
            HttpTimeout::Header => "header",
            HttpTimeout::Idle => "idle",
        };
        self.inner.http_timeouts.with_label_values(&[label]).inc();
    }
    /// A thread stopped by `HISTORY_VIEW_MAX_THREAD_BYTES`; `path` is the cache's `LimitPath::label`.
    pub fn thread_limit_exceeded(&self, path: &'static str) {
        self.inner
            .thread_limit_exceeded
            .with_label_values(&[path])
            .inc();
    }
    pub fn markers_skipped(&self, n: u64) {
        self.inner.markers_skipped.inc_by(n);
    }
    pub fn event(&self, outcome: EventOutcome) {
        self.inner.events[outcome as usize].inc();
    }
    pub fn events(&self, outcome: EventOutcome, n: u64) {
        self.inner.events[outcome as usize].inc_by(n);
    }
    pub fn cache_hit(&self) {
        self.inner.cache_hits.inc();
    }
    pub fn cache_miss(&self) {
        self.inner.cache_misses.inc();
    }
    pub fn hydration(&self, ok: bool) {
        self.inner
            .hydrations
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
    }
    pub fn views_downgraded(&self, count: u64) {
        self.inner.views_downgraded.inc_by(count);
    }
    pub fn cache_size(&self, entries: u64, weighted_bytes: u64) {
        self.inner
            .cache_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.inner
            .cache_weighted_bytes
            .set(i64::try_from(weighted_bytes).unwrap_or(i64::MAX));
    }
    /// A store query answered in `elapsed`; `kind` and `stage` are the store's `QueryKind::label` and `stage`.
    pub fn store_query(&self, kind: &'static str, stage: &'static str, elapsed: Duration) {
        self.inner
            .store_query_seconds
            .with_label_values(&[stage])
            .observe(elapsed.as_secs_f64());
        self.inner.store_queries.with_label_values(&[kind]).inc();
    }
    pub fn fill(&self, outcome: FillOutcome) {
        self.inner.fills.with_label_values(&[outcome.label()]).inc();
    }
    /// A history read answered in `elapsed`; `source` is the cache's `Source::label`.
    pub fn read(&self, source: &'static str, elapsed: Duration) {
        self.inner
            .read_seconds
            .with_label_values(&[source])
            .observe(elapsed.as_secs_f64());
    }
    /// Records how long after its `created_at` (ns since the epoch) an event was received.
    pub fn ingest_lag(&self, created_at_ns: i64) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        // Test fixtures and clock skew give lags below zero or absurdly large; both are clamped rather than dropped.
        let lag = (now.saturating_sub(created_at_ns)).max(0) as f64 / 1e9;
        self.inner.ingest_lag_seconds.observe(lag);
    }
    pub fn nats_connection_event(&self, event: &'static str) {
        self.inner
            .nats_connection_events
            .with_label_values(&[event])
            .inc();
    }
    pub fn index_hint_fallback(&self) {
        self.inner.index_hint_fallbacks.inc();
    }
    pub fn reread(&self, result: RereadResult) {
        self.inner
            .rereads
            .with_label_values(&[result.label()])
            .inc();
    }
    /// A history read routed by partition.
    pub fn read_route(&self, route: ReadRoute) {
        self.inner
            .read_routes
            .with_label_values(&[route.label()])
            .inc();
    }

    pub fn jetstream_resume(&self, outcome: ResumeOutcome) {
        self.inner
            .jetstream_resumes
            .with_label_values(&[outcome.label()])
            .inc();
    }
    /// A message of `stream` applied: its stream sequence and what the consumer still has to deliver.
    pub fn jetstream_applied(&self, stream: &str, sequence: u64, pending: u64) {
        self.inner
            .jetstream_last_sequence
            .with_label_values(&[stream])
            .set(i64::try_from(sequence).unwrap_or(i64::MAX));
        self.jetstream_pending(stream, pending);
    }
    /// What the consumer of `stream` has still to deliver.
    pub fn jetstream_pending(&self, stream: &str, pending: u64) {
        self.inner
            .jetstream_pending
            .with_label_values(&[stream])
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
    }
    /// Records one stored row's persister lag; returns whether it exceeds `bound` (the caller warns).
    pub fn persister_lag(&self, lag: Duration, bound: Duration) -> bool {
        self.inner.persister_lag_seconds.observe(lag.as_secs_f64());
        let exceeded = lag > bound;
        if exceeded {
            self.inner.persister_lag_exceeded.inc();
        }
        exceeded
    }
    pub fn malformed_warnings(&self, count: usize) {
        self.inner.malformed_warnings.inc_by(count as u64);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.inner.registry.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }
}

/// Registers `metric` and notes its name and label names.
fn register<T: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    described: &mut Vec<(String, Vec<String>)>,
    metric: T,
) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique and valid");
    described.extend(
        metric
            .desc()
            .into_iter()
            .map(|d| (d.fq_name.clone(), d.variable_labels.clone())),
    );
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dashboards and alerts name these metrics and labels: a rename here is a breaking change for operators.
    #[test]
    fn metric_names_and_labels_are_pinned() {
        let pinned: [(&str, &[&str]); 28] = [
            ("history_view_events_total", &["outcome"]),
            ("history_view_cache_hits_total", &[]),
            ("history_view_cache_misses_total", &[]),
            ("history_view_hydrations_total", &["result"]),
            ("history_view_views_downgraded_total", &[]),
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
            ("history_view_index_hint_fallbacks_total", &[]),
            ("history_view_malformed_event_warnings_total", &[]),
            ("history_view_background_rereads_total", &["result"]),
            ("history_view_persister_lag_seconds", &[]),
            ("history_view_persister_lag_exceeded_total", &[]),
            ("history_view_jetstream_last_sequence", &["stream"]),
            ("history_view_jetstream_pending", &["stream"]),
            ("history_view_jetstream_resumes_total", &["outcome"]),
            ("history_view_read_routes_total", &["route"]),
        ];
        let metrics = Metrics::new();
        let described: Vec<(&str, Vec<&str>)> = metrics
            .described()
            .iter()
            .map(|(name, labels)| (name.as_str(), labels.iter().map(String::as_str).collect()))
            .collect();
        let pinned: Vec<(&str, Vec<&str>)> = pinned
            .iter()
            .map(|(name, labels)| (*name, labels.to_vec()))
            .collect();
        assert_eq!(described, pinned);
    }
}
