//! The HTTP side's metrics: connections and the clients turned away, reads (their duration, routes and errors),
//! the reads waiting for a run, the live feeds, and the readiness the operations endpoints report. Recorded by the
//! accept loop (`serve.rs`), the middleware (`mod.rs`), the handlers and `/metrics` itself (`operations.rs`).

use std::time::Duration;

use prometheus::{HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use crate::cache::AnswerSource;
use crate::metrics::{LATENCY_BUCKETS, Registrar, preset};

/// Why the HTTP server turned a client away (the `reason` of `history_view_http_refused_total`).
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
    const ALL: [HttpRefusal; 4] = [
        HttpRefusal::Connections,
        HttpRefusal::InFlight,
        HttpRefusal::Waiting,
        HttpRefusal::Streams,
    ];

    fn label(self) -> &'static str {
        match self {
            HttpRefusal::Connections => "connections",
            HttpRefusal::InFlight => "in_flight",
            HttpRefusal::Waiting => "waiting",
            HttpRefusal::Streams => "streams",
        }
    }
}

/// Which timeout closed an HTTP connection (the `kind` of `history_view_http_timeouts_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpTimeout {
    /// A request's headers did not arrive within `HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS`.
    Header,
    /// No request for `HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS`.
    Idle,
}

impl HttpTimeout {
    const ALL: [HttpTimeout; 2] = [HttpTimeout::Header, HttpTimeout::Idle];

    fn label(self) -> &'static str {
        match self {
            HttpTimeout::Header => "header",
            HttpTimeout::Idle => "idle",
        }
    }
}

/// How a read was routed among partitioned workers ([design 8](../../docs/design.md#8)), the `route` of
/// `history_view_read_routes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadRoute {
    /// This worker owns the thread.
    Local,
    /// Answered by the owner.
    Forwarded,
    /// The owner did not answer in time: answered from the store, not cached.
    OwnerUnreachable,
    /// A request marked forwarded for a thread this worker does not own either (workers disagree on the partition
    /// count, or a client set the header): answered 421, never forwarded again, no store read.
    Loop,
    /// The owner answered 421 (it does not own the thread either): answered here as for a silent owner.
    Misdirected,
}

impl ReadRoute {
    const ALL: [ReadRoute; 5] = [
        ReadRoute::Local,
        ReadRoute::Forwarded,
        ReadRoute::OwnerUnreachable,
        ReadRoute::Loop,
        ReadRoute::Misdirected,
    ];

    fn label(self) -> &'static str {
        match self {
            ReadRoute::Local => "local",
            ReadRoute::Forwarded => "forwarded",
            ReadRoute::OwnerUnreachable => "owner_unreachable",
            ReadRoute::Loop => "loop",
            ReadRoute::Misdirected => "misdirected",
        }
    }
}

/// The statuses the API answers besides 2xx and 304 (`history_view_read_errors_total{code}`, preset at zero):
/// bad input, a missing token, not found (or not cached), a wrong method, a rejected query, overload or an
/// unavailable store, a thread too large. Any other status is counted under its own code.
const READ_ERROR_CODES: [&str; 8] = ["400", "401", "404", "405", "421", "500", "503", "507"];

/// Readiness components (`history_view_ready{component}`), as `/readyz` reports them.
const READY_COMPONENTS: [&str; 2] = ["nats", "store"];

/// The kinds of a live feed's events (and of a resume's first event): the SSE event name, and the `kind` of
/// `history_view_feed_events_total` and `outcome` of `history_view_feed_resumes_total`.
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

/// The dialect a resume request speaks (`dialect` of `history_view_resume_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeDialect {
    /// The Vercel AI SDK's UI message stream (`ui-message-stream`).
    UiMessageStream,
    /// OpenAI Responses streaming (`responses/{run_id}?stream=true`).
    Responses,
}

impl ResumeDialect {
    pub const ALL: [ResumeDialect; 2] = [ResumeDialect::UiMessageStream, ResumeDialect::Responses];

    pub fn label(self) -> &'static str {
        match self {
            ResumeDialect::UiMessageStream => "ui_message_stream",
            ResumeDialect::Responses => "responses",
        }
    }
}

/// What a resume request answered (`outcome` of `history_view_resume_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeOutcome {
    /// A resumable message, streamed.
    Streamed,
    /// Nothing resumable: 204, or a lone `finish`.
    Idle,
}

impl ResumeOutcome {
    pub const ALL: [ResumeOutcome; 2] = [ResumeOutcome::Streamed, ResumeOutcome::Idle];

    pub fn label(self) -> &'static str {
        match self {
            ResumeOutcome::Streamed => "streamed",
            ResumeOutcome::Idle => "idle",
        }
    }
}

pub struct HttpMetrics {
    connections: IntGauge,
    refused: IntCounterVec,
    timeouts: IntCounterVec,
    read_seconds: HistogramVec,
    read_routes: IntCounterVec,
    read_errors: IntCounterVec,
    waiting_reads: IntGauge,
    feed_streams: IntGauge,
    feed_events: IntCounterVec,
    feed_resumes: IntCounterVec,
    feed_coalesced: IntCounter,
    resumes: IntCounterVec,
    ready: IntGaugeVec,
    nats_connected: IntGauge,
}

impl HttpMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let metrics = Self {
            connections: registrar.gauge(
                "history_view_http_connections",
                "Open HTTP connections, on the API's listener and the probes' own.",
            ),
            refused: registrar.counter_vec(
                "history_view_http_refused_total",
                "Clients turned away, by reason: connections (a connection beyond \
                 HISTORY_VIEW_HTTP_MAX_CONNECTIONS: served the operations endpoints only, or closed), in_flight (a \
                 read beyond HISTORY_VIEW_HTTP_MAX_IN_FLIGHT: answered 503), waiting (a read waiting for a run \
                 beyond HISTORY_VIEW_HTTP_MAX_WAITING: answered 503), streams (a feed beyond \
                 HISTORY_VIEW_HTTP_MAX_STREAMS: answered 503).",
                &["reason"],
            ),
            timeouts: registrar.counter_vec(
                "history_view_http_timeouts_total",
                "HTTP connections closed by a timeout, by kind: header (a request's headers slower than \
                 HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS), idle (no request for HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS).",
                &["kind"],
            ),
            read_seconds: registrar.histogram_vec(
                "history_view_read_duration_seconds",
                "Seconds a read of a thread answered here took (a history, items, conversation or explain read; \
                 each round of a read waiting for a run), by source: cache (from memory), store (after a store \
                 read); its count is the reads by source.",
                &["source"],
                LATENCY_BUCKETS,
            ),
            read_routes: registrar.counter_vec(
                "history_view_read_routes_total",
                "Requests for a thread (reads, feeds, verify) of partitioned workers, by route: local (this worker \
                 owns the thread), forwarded (answered by the owner), owner_unreachable (the owner gave no answer \
                 in time: a read is answered from the store), loop (marked forwarded, by a worker or a client, though \
                 this worker does not own the thread either: answered 421 Misdirected Request, no store read), \
                 misdirected (the worker forwarded to answered 421: answered here as for an unreachable owner).",
                &["route"],
            ),
            read_errors: registrar.counter_vec(
                "history_view_read_errors_total",
                "API answers that are neither 2xx nor 304, by HTTP status code: 400, 401, 404, 405, 421, 500, 503 \
                 and 507 from the start, any other as it happens (the operations endpoints are not counted).",
                &["code"],
            ),
            waiting_reads: registrar.gauge(
                "history_view_http_waiting_reads",
                "Reads waiting for a run (wait_for_run) now, of at most HISTORY_VIEW_HTTP_MAX_WAITING.",
            ),
            feed_streams: registrar.gauge(
                "history_view_feed_streams",
                "Long responses open now, of at most HISTORY_VIEW_HTTP_MAX_STREAMS: live feeds (history/stream) and \
                 resume streams (ui-message-stream).",
            ),
            feed_events: registrar.counter_vec(
                "history_view_feed_events_total",
                "Events the live feeds sent, by kind: snapshot (the whole answer), update (the messages from the \
                 first that changed).",
                &["kind"],
            ),
            feed_resumes: registrar.counter_vec(
                "history_view_feed_resumes_total",
                "Feeds opened with Last-Event-ID, by outcome: update (the answer it named was still known), \
                 snapshot (it was not).",
                &["outcome"],
            ),
            feed_coalesced: registrar.counter(
                "history_view_feed_coalesced_changes_total",
                "Changes of a thread's view a feed sent within a later event instead of one of their own.",
            ),
            resumes: registrar.counter_vec(
                "history_view_resume_requests_total",
                "Requests to resume a running answer answered here, by dialect (ui_message_stream, responses) and \
                 outcome: streamed (replayed, then followed while the run runs), idle (nothing to resume: a \
                 ui-message-stream's 204 or lone finish). Refusals and errors are counted as API errors.",
                &["dialect", "outcome"],
            ),
            ready: registrar.gauge_vec(
                "history_view_ready",
                "Readiness as /readyz reports it, by component: nats, store; 1 ready, 0 not (updated at each \
                 scrape).",
                &["component"],
            ),
            nats_connected: registrar.gauge(
                "history_view_nats_connected",
                "Whether the NATS connection is up: 1 up, 0 down (updated at each scrape).",
            ),
        };
        preset(&metrics.refused, &HttpRefusal::ALL.map(HttpRefusal::label));
        preset(&metrics.timeouts, &HttpTimeout::ALL.map(HttpTimeout::label));
        preset(
            &metrics.read_seconds,
            &AnswerSource::ALL.map(AnswerSource::label),
        );
        preset(&metrics.read_routes, &ReadRoute::ALL.map(ReadRoute::label));
        preset(&metrics.read_errors, &READ_ERROR_CODES);
        preset(&metrics.feed_events, &FeedEvent::ALL.map(FeedEvent::label));
        preset(&metrics.feed_resumes, &FeedEvent::ALL.map(FeedEvent::label));
        for dialect in ResumeDialect::ALL {
            for outcome in ResumeOutcome::ALL {
                metrics
                    .resumes
                    .with_label_values(&[dialect.label(), outcome.label()]);
            }
        }
        preset(&metrics.ready, &READY_COMPONENTS);
        metrics
    }

    pub fn connection_opened(&self) {
        self.connections.inc();
    }

    pub fn connection_closed(&self) {
        self.connections.dec();
    }

    pub fn refused(&self, reason: HttpRefusal) {
        self.refused.with_label_values(&[reason.label()]).inc();
    }

    pub fn timeout(&self, kind: HttpTimeout) {
        self.timeouts.with_label_values(&[kind.label()]).inc();
    }

    /// A read of a thread answered in `elapsed`, from `source`.
    pub fn read(&self, source: AnswerSource, elapsed: Duration) {
        self.read_seconds
            .with_label_values(&[source.label()])
            .observe(elapsed.as_secs_f64());
    }

    /// A request for a thread routed by partition.
    pub fn read_route(&self, route: ReadRoute) {
        self.read_routes.with_label_values(&[route.label()]).inc();
    }

    /// An API answer that is neither 2xx nor 304 (its status is the `code` label; the common ones are preset).
    pub fn read_error(&self, status: u16) {
        self.read_errors
            .with_label_values(&[&status.to_string()])
            .inc();
    }

    /// A read waiting for a run began (`1`) or ended (`-1`).
    pub fn waiting_reads(&self, change: i64) {
        self.waiting_reads.add(change);
    }

    /// A feed opened (`1`) or ended (`-1`).
    pub fn feed_streams(&self, change: i64) {
        self.feed_streams.add(change);
    }

    /// A feed sent an event of `kind`, covering `coalesced` more changes than one.
    pub fn feed_event(&self, kind: FeedEvent, coalesced: u64) {
        self.feed_events.with_label_values(&[kind.label()]).inc();
        self.feed_coalesced.inc_by(coalesced);
    }

    /// A feed opened with `Last-Event-ID` began with `outcome`.
    pub fn feed_resume(&self, outcome: FeedEvent) {
        self.feed_resumes
            .with_label_values(&[outcome.label()])
            .inc();
    }

    /// A resume request in `dialect` answered with `outcome`.
    pub fn resume(&self, dialect: ResumeDialect, outcome: ResumeOutcome) {
        self.resumes
            .with_label_values(&[dialect.label(), outcome.label()])
            .inc();
    }

    /// Readiness as `/readyz` sees it now (set when `/metrics` is scraped).
    pub fn readiness(&self, nats: bool, store: bool, nats_connected: bool) {
        self.ready
            .with_label_values(&[READY_COMPONENTS[0]])
            .set(i64::from(nats));
        self.ready
            .with_label_values(&[READY_COMPONENTS[1]])
            .set(i64::from(store));
        self.nats_connected.set(i64::from(nats_connected));
    }
}
