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
    /// A read waiting for a run beyond `HISTORY_VIEW_HTTP_MAX_WAITING` (answered 503).
    Waiting,
    /// A feed beyond `HISTORY_VIEW_HTTP_MAX_STREAMS` (answered 503).
    Streams,
}

impl HttpRefusal {
    fn label(self) -> &'static str {
        match self {
            HttpRefusal::Connections => "connections",
            HttpRefusal::InFlight => "in_flight",
            HttpRefusal::Waiting => "waiting",
            HttpRefusal::Streams => "streams",
        }
    }
}

/// The kinds of a live feed's events (and of a resume's first event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedEvent {
    /// The whole answer.
    Snapshot,
    /// The messages from the first that changed.
    Update,
}

impl FeedEvent {
    pub const ALL: [FeedEvent; 2] = [FeedEvent::Snapshot, FeedEvent::Update];

    pub fn label(self) -> &'static str {
        match self {
            FeedEvent::Snapshot => "snapshot",
            FeedEvent::Update => "update",
        }
    }
}

/// Which timeout closed an HTTP connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpTimeout {
    /// A request's headers did not arrive within `HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS`.
    Header,
    /// No request for `HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS`.
    Idle,
}

impl HttpTimeout {
    fn label(self) -> &'static str {
        match self {
            HttpTimeout::Header => "header",
            HttpTimeout::Idle => "idle",
        }
    }
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

/// The labelled metrics whose label values another module owns (its enum's `label()`s): that module presets them
/// at start ([`Metrics::preset`]), so every series is exported at zero before it first happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labelled {
    /// `history_view_read_duration_seconds{source}`.
    ReadSource,
    /// `history_view_store_queries_total{kind}`.
    StoreQueryKind,
    /// `history_view_store_query_duration_seconds{stage}`.
    StoreQueryStage,
    /// `history_view_store_errors_total{kind}`.
    StoreErrorKind,
    /// `history_view_thread_limit_exceeded_total{path}`.
    ThreadLimitPath,
    /// `history_view_shadow_checks_total{result}`.
    ShadowCheck,
    /// `history_view_shadow_events_total{result}`.
    ShadowEvent,
    /// `history_view_nats_connection_events_total{event}`.
    NatsConnectionEvent,
    /// `history_view_jetstream_gaps_total{cause}`.
    JetStreamGapCause,
    /// `history_view_jetstream_witnessed_total{result}`.
    WitnessResult,
}

/// The statuses the API answers besides 2xx and 304 (`history_view_read_errors_total{code}`, preset at zero):
/// bad input, a missing token, not found (or not cached), a wrong method, a rejected query, overload or an
/// unavailable store, a thread too large. Any other status is counted under its own code.
const READ_ERROR_CODES: [&str; 7] = ["400", "401", "404", "405", "500", "503", "507"];

/// Readiness components (`history_view_ready{component}`), as `/readyz` reports them.
const READY_COMPONENTS: [&str; 2] = ["nats", "store"];

/// A persister lag below zero by more than the `_id`'s whole second, or above a day, is a clock (or a fixture), not
/// a lag: counted apart, kept out of the histogram.
const PERSISTER_LAG_FLOOR_NS: i128 = -1_000_000_000;
const PERSISTER_LAG_CEILING_NS: i128 = 86_400 * 1_000_000_000;

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
    jetstream_gaps: IntCounterVec,
    jetstream_streams: IntGauge,
    jetstream_behind: IntGauge,
    jetstream_witnessed: IntCounterVec,
    read_routes: IntCounterVec,
    shadow_checks: IntCounterVec,
    /// `history_view_shadow_checks_total{result="dropped"}`, resolved once: with a high sample, most reads count it.
    shadow_dropped: IntCounter,
    shadow_events: IntCounterVec,
    shadow_check_delay_seconds: prometheus::Histogram,
    shadow_heals: IntCounter,
    covered_through_age_seconds: prometheus::Gauge,
    ready: IntGaugeVec,
    nats_connected: IntGauge,
    read_errors: IntCounterVec,
    store_errors: IntCounterVec,
    persister_lag_out_of_range: IntCounterVec,
    cache_budget_bytes: IntGauge,
    waiting_reads: IntGauge,
    feed_streams: IntGauge,
    feed_events: IntCounterVec,
    feed_resumes: IntCounterVec,
    feed_coalesced: IntCounter,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
const LAG_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];
/// Persister lag is read from an ObjectId, which counts whole seconds; finer buckets would be noise.
const PERSISTER_LAG_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
/// A shadow check runs the persister-lag bound after its read, later when the store is slow or a failure waits out
/// the gap window.
const SHADOW_DELAY_BUCKETS: &[f64] = &[0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0];

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
        let shadow_checks = register(
            &registry,
            &mut described,
            counter_vec(
                "history_view_shadow_checks_total",
                "Shadow checks of reads answered from memory, by result (match, ahead, uncertain, window, late, differs, missing, dropped, error)",
                &["result"],
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
                     (reason=in_flight; answered 503) and reads waiting for a run beyond HISTORY_VIEW_HTTP_MAX_WAITING \
                     (reason=waiting; answered 503) and feeds beyond HISTORY_VIEW_HTTP_MAX_STREAMS (reason=streams; answered 503)",
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
            jetstream_gaps: register(&registry, &mut described,
                counter_vec(
                    "history_view_jetstream_gaps_total",
                    "JetStream source: possible losses of events not read, by cause (removed, deleted, recreated, new_leader, stream_deleted, new_stream, upstream)",
                    &["cause"],
                ),
            ),
            jetstream_streams: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_jetstream_streams",
                    "JetStream source: streams consumed now (0: none matches HISTORY_VIEW_JETSTREAM_STREAMS, or Core NATS)",
                )
                .expect("valid metric"),
            ),
            jetstream_witnessed: register(&registry, &mut described,
                counter_vec(
                    "history_view_jetstream_witnessed_total",
                    "JetStream source's Core witness: display events seen on Core NATS, by result (delivered by a stream; missing: no stream delivered it, a gap of its thread; overflow: given up unjudged, a gap of every view)",
                    &["result"],
                ),
            ),
            jetstream_behind: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_jetstream_behind",
                    "JetStream source: 1 while a lane is behind: a stream resuming, a class stream not sourced or not confirmed, a stalled source, no stream (reads wait or go to the store)",
                )
                .expect("valid metric"),
            ),
            read_routes: register(&registry, &mut described,
                counter_vec(
                    "history_view_read_routes_total",
                    "Partitioned workers: history reads by route (local, forwarded, owner_unreachable, loop)",
                    &["route"],
                ),
            ),
            shadow_dropped: shadow_checks.with_label_values(&["dropped"]),
            shadow_checks,
            shadow_events: register(&registry, &mut described,
                counter_vec(
                    "history_view_shadow_events_total",
                    "Events compared by shadow checks, by finding (match, ahead, uncertain, window, late, differs, missing)",
                    &["result"],
                ),
            ),
            shadow_check_delay_seconds: register(&registry, &mut described,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "history_view_shadow_check_delay_seconds",
                        "Time from a sampled read to its shadow check's judgement",
                    )
                    .buckets(SHADOW_DELAY_BUCKETS.to_vec()),
                )
                .expect("valid metric"),
            ),
            shadow_heals: register(&registry, &mut described,
                counter(
                    "history_view_shadow_heals_total",
                    "Complete views made partial by a failed shadow check (their next read hydrates)",
                ),
            ),
            covered_through_age_seconds: register(&registry, &mut described,
                prometheus::Gauge::new(
                    "history_view_covered_through_age_seconds",
                    "Age of the instant up to which answers from memory hold every event that reached NATS (since the start while none is known)",
                )
                .expect("valid metric"),
            ),
            ready: register(&registry, &mut described,
                IntGaugeVec::new(
                    Opts::new(
                        "history_view_ready",
                        "Readiness by component (nats, store), as /readyz reports it: 1 ready, 0 not",
                    ),
                    &["component"],
                )
                .expect("valid metric"),
            ),
            nats_connected: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_nats_connected",
                    "Whether the NATS connection is up (1) or not (0)",
                )
                .expect("valid metric"),
            ),
            read_errors: register(&registry, &mut described,
                counter_vec(
                    "history_view_read_errors_total",
                    "API answers that are neither 2xx nor 304, by HTTP status code",
                    &["code"],
                ),
            ),
            store_errors: register(&registry, &mut described,
                counter_vec(
                    "history_view_store_errors_total",
                    "Store queries and pings that failed, by kind (timeout, unavailable, failed, rejected)",
                    &["kind"],
                ),
            ),
            persister_lag_out_of_range: register(&registry, &mut described,
                counter_vec(
                    "history_view_persister_lag_out_of_range_total",
                    "Rows read from the store whose persister lag is not a lag: _id time more than its whole second \
                     before created_at (side=negative) or more than a day after it (side=too_large); kept out of \
                     history_view_persister_lag_seconds",
                    &["side"],
                ),
            ),
            cache_budget_bytes: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_cache_budget_bytes",
                    "The view cache's byte budget (HISTORY_VIEW_CACHE_MAX_BYTES)",
                )
                .expect("valid metric"),
            ),
            waiting_reads: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_http_waiting_reads",
                    "Reads waiting for a run (wait_for_run) now, of at most HISTORY_VIEW_HTTP_MAX_WAITING",
                )
                .expect("valid metric"),
            ),
            feed_streams: register(&registry, &mut described,
                IntGauge::new(
                    "history_view_feed_streams",
                    "Open live feeds (history/stream), of at most HISTORY_VIEW_HTTP_MAX_STREAMS",
                )
                .expect("valid metric"),
            ),
            feed_events: register(&registry, &mut described,
                counter_vec(
                    "history_view_feed_events_total",
                    "Events the live feeds sent, by kind (snapshot: the whole answer; update: the messages from the \
                     first that changed)",
                    &["kind"],
                ),
            ),
            feed_resumes: register(&registry, &mut described,
                counter_vec(
                    "history_view_feed_resumes_total",
                    "Feeds opened with Last-Event-ID, by outcome (update: the answer it named was still known; \
                     snapshot: it was not)",
                    &["outcome"],
                ),
            ),
            feed_coalesced: register(&registry, &mut described,
                IntCounter::new(
                    "history_view_feed_coalesced_changes_total",
                    "Changes of a thread's view a feed sent within a later event instead of one of their own",
                )
                .expect("valid metric"),
            ),
            registry,
            described,
        };
        // The label values this module owns, at zero from the start.
        let preset = |vec: &IntCounterVec, values: &[&str]| {
            for value in values {
                vec.with_label_values(&[value]);
            }
        };
        preset(&inner.hydrations, &["ok", "error"]);
        preset(
            &inner.fills,
            &[
                FillOutcome::Complete,
                FillOutcome::Partial,
                FillOutcome::Error,
            ]
            .map(FillOutcome::label),
        );
        preset(
            &inner.rereads,
            &[
                RereadResult::Complete,
                RereadResult::Partial,
                RereadResult::Error,
            ]
            .map(RereadResult::label),
        );
        preset(
            &inner.jetstream_resumes,
            &[ResumeOutcome::Continued, ResumeOutcome::Gap].map(ResumeOutcome::label),
        );
        preset(
            &inner.read_routes,
            &[
                ReadRoute::Local,
                ReadRoute::Forwarded,
                ReadRoute::OwnerUnreachable,
                ReadRoute::Loop,
            ]
            .map(ReadRoute::label),
        );
        preset(
            &inner.http_refused,
            &[
                HttpRefusal::Connections,
                HttpRefusal::InFlight,
                HttpRefusal::Waiting,
                HttpRefusal::Streams,
            ]
            .map(HttpRefusal::label),
        );
        preset(
            &inner.http_timeouts,
            &[HttpTimeout::Header, HttpTimeout::Idle].map(HttpTimeout::label),
        );
        preset(&inner.read_errors, &READ_ERROR_CODES);
        preset(&inner.feed_events, &FeedEvent::ALL.map(FeedEvent::label));
        preset(&inner.feed_resumes, &FeedEvent::ALL.map(FeedEvent::label));
        preset(
            &inner.persister_lag_out_of_range,
            &["negative", "too_large"],
        );
        for component in READY_COMPONENTS {
            inner.ready.with_label_values(&[component]);
        }
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Exports `metric`'s series for each of `values` at zero (values another module owns).
    pub fn preset(&self, metric: Labelled, values: &[&str]) {
        let inner = &self.inner;
        for value in values {
            let labels = [*value];
            match metric {
                Labelled::ReadSource => drop(inner.read_seconds.with_label_values(&labels)),
                Labelled::StoreQueryKind => drop(inner.store_queries.with_label_values(&labels)),
                Labelled::StoreQueryStage => {
                    drop(inner.store_query_seconds.with_label_values(&labels));
                }
                Labelled::StoreErrorKind => drop(inner.store_errors.with_label_values(&labels)),
                Labelled::ThreadLimitPath => {
                    drop(inner.thread_limit_exceeded.with_label_values(&labels));
                }
                Labelled::ShadowCheck => drop(inner.shadow_checks.with_label_values(&labels)),
                Labelled::ShadowEvent => drop(inner.shadow_events.with_label_values(&labels)),
                Labelled::NatsConnectionEvent => {
                    drop(inner.nats_connection_events.with_label_values(&labels));
                }
                Labelled::JetStreamGapCause => {
                    drop(inner.jetstream_gaps.with_label_values(&labels))
                }
                Labelled::WitnessResult => {
                    drop(inner.jetstream_witnessed.with_label_values(&labels))
                }
            }
        }
    }

    /// Readiness as `/readyz` sees it now (set when `/metrics` is scraped).
    pub fn readiness(&self, nats: bool, store: bool, nats_connected: bool) {
        let inner = &self.inner;
        inner
            .ready
            .with_label_values(&["nats"])
            .set(i64::from(nats));
        inner
            .ready
            .with_label_values(&["store"])
            .set(i64::from(store));
        inner.nats_connected.set(i64::from(nats_connected));
    }

    /// An API answer that is neither 2xx nor 304 (its status is the `code` label; the common ones are preset).
    pub fn read_error(&self, status: u16) {
        self.inner
            .read_errors
            .with_label_values(&[&status.to_string()])
            .inc();
    }

    /// A store query or ping failed; `kind` is the store's `StoreError::kind`.
    pub fn store_error(&self, kind: &'static str) {
        self.inner.store_errors.with_label_values(&[kind]).inc();
    }

    /// A feed opened (`1`) or ended (`-1`).
    pub fn feed_streams(&self, change: i64) {
        self.inner.feed_streams.add(change);
    }

    /// A feed sent an event of `kind`, covering `coalesced` more changes than one.
    pub fn feed_event(&self, kind: FeedEvent, coalesced: u64) {
        self.inner
            .feed_events
            .with_label_values(&[kind.label()])
            .inc();
        self.inner.feed_coalesced.inc_by(coalesced);
    }

    /// A feed opened with `Last-Event-ID` began with `outcome`.
    pub fn feed_resume(&self, outcome: FeedEvent) {
        self.inner
            .feed_resumes
            .with_label_values(&[outcome.label()])
            .inc();
    }

    /// A read waiting for a run began (`1`) or ended (`-1`).
    pub fn waiting_reads(&self, change: i64) {
        self.inner.waiting_reads.add(change);
    }

    pub fn cache_budget(&self, bytes: u64) {
        self.inner
            .cache_budget_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
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
        self.inner
            .http_refused
            .with_label_values(&[reason.label()])
            .inc();
    }
    pub fn http_timeout(&self, kind: HttpTimeout) {
        self.inner
            .http_timeouts
            .with_label_values(&[kind.label()])
            .inc();
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
    /// A possible loss of a JetStream source, by cause.
    pub fn jetstream_gap(&self, cause: &str) {
        self.inner.jetstream_gaps.with_label_values(&[cause]).inc();
    }

    /// `count` events judged by the Core witness alike, by `result`.
    pub fn witnessed(&self, result: &str, count: u64) {
        if count > 0 {
            self.inner
                .jetstream_witnessed
                .with_label_values(&[result])
                .inc_by(count);
        }
    }

    /// A stream is consumed (1) or no longer (-1).
    pub fn jetstream_streams(&self, change: i64) {
        self.inner.jetstream_streams.add(change);
    }

    /// Whether the JetStream source is behind.
    pub fn jetstream_behind(&self, behind: bool) {
        self.inner.jetstream_behind.set(i64::from(behind));
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
    /// Records one stored row's persister lag (`_id` time minus `created_at`, in ns; the `_id` counts whole
    /// seconds, so a lag down to one second below zero is a row stored within its second, counted as 0); returns
    /// whether it exceeds `bound` (the caller warns). A lag further below zero or above a day says the clocks (or
    /// the row's `created_at`) are off: it is counted apart and kept out of the histogram and the bound's count.
    pub fn persister_lag(&self, lag_ns: i128, bound: Duration) -> bool {
        let side = if lag_ns < PERSISTER_LAG_FLOOR_NS {
            "negative"
        } else if lag_ns > PERSISTER_LAG_CEILING_NS {
            "too_large"
        } else {
            let lag = Duration::from_nanos(u64::try_from(lag_ns.max(0)).unwrap_or(u64::MAX));
            self.inner.persister_lag_seconds.observe(lag.as_secs_f64());
            let exceeded = lag > bound;
            if exceeded {
                self.inner.persister_lag_exceeded.inc();
            }
            return exceeded;
        };
        self.inner
            .persister_lag_out_of_range
            .with_label_values(&[side])
            .inc();
        false
    }
    /// One shadow check's result (a `label()` of `shadow::Verdict`).
    pub fn shadow_check(&self, result: &'static str) {
        self.inner.shadow_checks.with_label_values(&[result]).inc();
    }
    /// A sampled read not checked (over the rate limit, or its thread is being checked).
    pub fn shadow_dropped(&self) {
        self.inner.shadow_dropped.inc();
    }
    /// Events a shadow check compared with one finding (or `window`).
    pub fn shadow_events(&self, result: &'static str, n: u64) {
        if n > 0 {
            self.inner
                .shadow_events
                .with_label_values(&[result])
                .inc_by(n);
        }
    }
    pub fn shadow_check_delay(&self, delay: Duration) {
        self.inner
            .shadow_check_delay_seconds
            .observe(delay.as_secs_f64());
    }
    pub fn shadow_heal(&self) {
        self.inner.shadow_heals.inc();
    }
    pub fn covered_through_age(&self, age: Duration) {
        self.inner
            .covered_through_age_seconds
            .set(age.as_secs_f64());
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

    fn sample(rendered: &str, series: &str) -> Option<f64> {
        rendered
            .lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn a_lag_outside_zero_to_a_day_is_counted_apart_and_kept_out_of_the_histogram() {
        let metrics = Metrics::new();
        let bound = Duration::from_secs(2);
        let second: i128 = 1_000_000_000;
        // Stored within the second its `_id` counts: not negative, observed as 0.
        assert!(!metrics.persister_lag(-second / 2, bound));
        assert!(metrics.persister_lag(3 * second, bound));
        // A publisher clock ahead by 5 s, one row created at the epoch, one two days late.
        assert!(!metrics.persister_lag(-5 * second, bound));
        assert!(!metrics.persister_lag(1_800_000_000 * second, bound));
        assert!(!metrics.persister_lag(2 * 86_400 * second, bound));
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

    #[test]
    fn labelled_counters_are_exported_at_zero_from_the_start() {
        let metrics = Metrics::new();
        metrics.preset(Labelled::ShadowCheck, &["missing"]);
        let rendered = metrics.render();
        for series in [
            "history_view_http_refused_total{reason=\"connections\"}",
            "history_view_http_refused_total{reason=\"in_flight\"}",
            "history_view_http_timeouts_total{kind=\"header\"}",
            "history_view_read_errors_total{code=\"503\"}",
            "history_view_hydrations_total{result=\"error\"}",
            "history_view_shadow_checks_total{result=\"missing\"}",
            "history_view_ready{component=\"store\"}",
        ] {
            assert_eq!(sample(&rendered, series), Some(0.0), "{series}");
        }
        metrics.read_error(503);
        metrics.read_error(418);
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

    /// Dashboards and alerts name these metrics and labels: a rename here is a breaking change for operators.
    #[test]
    fn metric_names_and_labels_are_pinned() {
        let pinned: [(&str, &[&str]); 48] = [
            ("history_view_events_total", &["outcome"]),
            ("history_view_shadow_checks_total", &["result"]),
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
