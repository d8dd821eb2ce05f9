//! Trace continuation end to end ([design 5](../../docs/design.md#5)): the worker binary on real servers, exporting
//! OTLP/HTTP to a receiver that decodes the real protobuf (`test_support::otlp`), and aihub's publisher played by the
//! OpenTelemetry Python SDK with nats-py (`tests/tracing/publish.py`), its context in each message's headers.
//!
//! Each link of the trace is proved: a read's spans (server, `cache`, `hydrate`, the store queries, a wait for a run)
//! are in the caller's trace under its span, and the answer names the read's span (a read the store fails is an
//! error, down to its query); a read through a non-owner reaches the owner and its store in the same trace; an
//! ingested event's `process` span is a root linked, never parented, to the publisher's span, for a sampled few of
//! the events only by default; a hydration and a fill link to the publishers of the live events they saw (at most
//! 32); log lines inside a read carry its trace id; `explain` names the publisher's trace of each live event; a
//! `traceparent` that is not valid, on a read or a message, joins or names nothing; without an endpoint nothing is
//! exported and nothing names a trace.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant};

use chat_history_view::partition::owner;
use chat_history_view::telemetry::trace::MAX_LINKS;
use serde_json::{Value, json};
use test_support::class_streams::create_class_streams;
use test_support::otlp::{Link, OtlpReceiver, Span, SpanKind, StatusCode};
use test_support::rows;
use test_support::servers::python;

use crate::explain::explain;
use crate::helpers::{Api, BinaryApp, Reply, chunk_row, encode, metric, publish_rows, user_row};
use crate::scene::{Scene, read_until_cache};
use test_support::process::port_prefix;
use test_support::wait::{eventually, eventually_within, when};

/// The batch processor's export interval (the SDK honours `OTEL_BSP_SCHEDULE_DELAY`, in milliseconds): short, so
/// that spans arrive soon after they end; the waits stay generous.
const EXPORT_EVERY: (&str, &str) = ("OTEL_BSP_SCHEDULE_DELAY", "100");
/// The worker's service name when none is configured.
const SERVICE: &str = "chat-history-view";
const HISTORY_ROUTE: &str = "/v1/threads/{thread_id}/history";
/// The warning a malformed visible event causes when a read renders it ([contract 5.7](../../docs/contract.md#5.7)).
const MALFORMED_WARNING: &str = "Skipping malformed visible history event";

/// A caller's made-up trace context: a sampled span of a trace of its own.
struct Caller {
    trace_id: String,
    span_id: String,
}

impl Caller {
    fn new() -> Self {
        // Each RandomState has keys of its own, so each hash is a random number (made odd: an id is never zero).
        let random = || RandomState::new().hash_one(Instant::now()) | 1;
        Self {
            trace_id: format!("{:016x}{:016x}", random(), random()),
            span_id: format!("{:016x}", random()),
        }
    }

    /// `traceparent`, flags 01 (sampled).
    fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }
}

/// `traceparent`'s four fields: version, trace id, parent id, flags.
fn traceparent_fields(value: &str) -> [&str; 4] {
    let fields: Vec<&str> = value.split('-').collect();
    assert_eq!(fields.len(), 4, "not a traceparent: {value:?}");
    [fields[0], fields[1], fields[2], fields[3]]
}

/// Real servers, a receiver, and workers exporting to it.
struct Traced {
    scene: Scene,
    receiver: OtlpReceiver,
}

impl Traced {
    async fn new() -> Self {
        Self {
            scene: Scene::new().await,
            receiver: OtlpReceiver::start(),
        }
    }

    /// The settings of a worker exporting to the receiver, JSON logs, with `extra`.
    fn tracing_env(&self, extra: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT", self.receiver.endpoint()),
            ("HISTORY_VIEW_LOG_FORMAT", "json".to_owned()),
            (EXPORT_EVERY.0, EXPORT_EVERY.1.to_owned()),
        ];
        env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        env
    }

    /// A Core worker exporting to the receiver, ready.
    async fn worker(&self, extra: &[(&'static str, &str)]) -> BinaryApp {
        let env = self.tracing_env(extra);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        self.scene.worker(self.scene.nats.url(), &env).await
    }

    /// The spans of `trace` received so far.
    fn trace(&self, trace_id: &str) -> Vec<Span> {
        in_trace(&self.receiver.spans(), trace_id)
    }

    /// Waits for the server span of `caller`'s read of `path` made on `service` (a child of the caller's span), and
    /// checks it: its name, kind and attributes (a status of 200), and, when `reply` is given, that the answer's
    /// `traceparent` names it.
    async fn server_span(
        &self,
        service: &str,
        caller: &Caller,
        path: &str,
        reply: Option<&Reply>,
    ) -> Span {
        self.server_span_with(service, caller, path, 200, reply)
            .await
    }

    /// [`Traced::server_span`] of a read answered `status` (an error span for a 5xx).
    async fn server_span_with(
        &self,
        service: &str,
        caller: &Caller,
        path: &str,
        status: i64,
        reply: Option<&Reply>,
    ) -> Span {
        let what = format!(
            "{service}'s server span of GET {path} in trace {}",
            caller.trace_id
        );
        let span = self
            .receiver
            .wait_for(&what, |spans| {
                spans
                    .iter()
                    .find(|s| {
                        s.trace_id == caller.trace_id
                            && s.service == service
                            && s.kind == SpanKind::Server
                            && s.str("url.path") == Some(path)
                    })
                    .cloned()
            })
            .await;
        assert_eq!(span.name, format!("GET {HISTORY_ROUTE}"), "{span}");
        assert_eq!(span.str("http.request.method"), Some("GET"), "{span}");
        assert_eq!(span.str("http.route"), Some(HISTORY_ROUTE), "{span}");
        assert_eq!(
            span.int("http.response.status_code"),
            Some(status),
            "{span}"
        );
        assert_eq!(span.status == StatusCode::Error, status >= 500, "{span}");
        if let Some(reply) = reply {
            let traceparent = reply.header("traceparent").unwrap_or_else(|| {
                panic!("the answer carries no traceparent: {:?}", reply.headers)
            });
            let [version, trace_id, span_id, flags] = traceparent_fields(traceparent);
            assert_eq!(version, "00", "{traceparent}");
            assert_eq!(
                trace_id, caller.trace_id,
                "the answer's trace: {traceparent}"
            );
            assert_eq!(
                span_id, span.span_id,
                "the answer's span is the server span: {traceparent}"
            );
            let flags = u8::from_str_radix(flags, 16).expect("hex flags");
            assert_eq!(flags & 1, 1, "the read's span is sampled: {traceparent}");
        }
        span
    }
}

/// The spans of `trace_id` among `spans`.
fn in_trace(spans: &[Span], trace_id: &str) -> Vec<Span> {
    spans
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .cloned()
        .collect()
}

/// The store query spans (`db.system.name` = mongodb) among `spans`.
fn store_spans(spans: &[Span]) -> Vec<&Span> {
    spans
        .iter()
        .filter(|s| s.str("db.system.name") == Some("mongodb"))
        .collect()
}

/// Checks a store query span against the database semantic conventions.
fn check_store_span(span: &Span, database: &str) {
    assert_eq!(span.kind, SpanKind::Client, "{span}");
    assert_eq!(span.str("db.namespace"), Some(database), "{span}");
    assert_eq!(
        span.str("db.collection.name"),
        Some("agent_events"),
        "{span}"
    );
    let operation = span.str("db.operation.name").unwrap_or_default();
    assert!(
        ["find", "aggregate"].contains(&operation),
        "a query's operation: {span}"
    );
    assert_eq!(span.name, format!("{operation} agent_events"), "{span}");
    assert!(span.str("chat_history_view.query").is_some(), "{span}");
}

fn history_path(thread: &str) -> String {
    format!("/v1/threads/{}/history", encode(thread))
}

/// `GET` the history of `thread` as `caller`.
async fn read(api: &Api, thread: &str, caller: &Caller) -> Reply {
    let traceparent = caller.traceparent();
    let reply = api
        .get(
            &history_path(thread),
            &[("traceparent", traceparent.as_str())],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply
}

/// A user turn and its answer, persisted long ago.
fn answered(thread: &str) -> Vec<Value> {
    vec![
        user_row(thread, "d1", "e1", 1, "Q"),
        chunk_row(thread, "d1", "A", "e2", 2, "A"),
    ]
}

/// A user turn and an answer chunk whose content is not a string: a malformed visible event, warned about when a
/// read renders it.
fn with_malformed_chunk(thread: &str) -> Vec<Value> {
    let mut bad = chunk_row(thread, "d1", "A", "e2", 2, "x");
    bad["event_data"]["content"] = Value::from(12345);
    vec![user_row(thread, "d1", "e1", 1, "Q"), bad]
}

/// `traceparent` values of the right length (55 characters) that are not valid: an all-zero trace id, an all-zero
/// span id, the forbidden version ff, flags that are not hex. A worker may keep such a value unread beside its
/// event; whenever it reads it, it finds no context.
const INVALID_TRACEPARENTS: [&str; 4] = [
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
];

/// Publishes `row` as aihub does, with `traceparent` as its only header.
async fn publish_with_traceparent(client: &async_nats::Client, row: &Value, traceparent: &str) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", traceparent);
    client
        .publish_with_headers(rows::subject(row), headers, rows::payload(row).into())
        .await
        .expect("publish");
    client.flush().await.expect("flush");
}

/// One event as the publisher script published it.
#[derive(Debug)]
struct Published {
    subject: String,
    trace_id: String,
    span_id: String,
    headers: BTreeMap<String, String>,
}

impl Published {
    /// The `traceparent` the message carried, whatever the case of its name.
    fn traceparent(&self) -> &str {
        self.headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("traceparent"))
            .map(|(_, value)| value.as_str())
            .unwrap_or_else(|| panic!("no traceparent was injected: {self:?}"))
    }

    fn link(&self) -> Link {
        Link {
            trace_id: self.trace_id.clone(),
            span_id: self.span_id.clone(),
        }
    }
}

/// Publishes `rows` on NATS at `nats_url` through aihub's publisher (`tests/tracing/publish.py`, the OpenTelemetry
/// Python SDK with `sampler`), each with its producer span's context in its headers; the header names title-cased
/// for the rows `title_case` picks.
async fn publish_traced(
    nats_url: &str,
    sampler: &str,
    rows: &[Value],
    title_case: impl Fn(usize) -> bool,
) -> Vec<Published> {
    let events: Vec<Value> = rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            json!({
                "subject": rows::subject(row),
                "payload": String::from_utf8(rows::payload(row)).expect("a JSON payload is UTF-8"),
                "title_case": title_case(i),
            })
        })
        .collect();
    let input = serde_json::to_vec(&events).expect("events serialize");
    let script = format!("{}/tests/tracing/publish.py", env!("CARGO_MANIFEST_DIR"));
    let args = [script, nats_url.to_owned(), sampler.to_owned()];
    let output = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut child = std::process::Command::new(python())
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the tools' python runs");
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(&input)
            .expect("the events reach the publisher");
        child.wait_with_output().expect("the publisher ends")
    })
    .await
    .expect("the publisher's task");
    assert!(
        output.status.success(),
        "the publisher failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let published: Vec<Published> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let line: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("the publisher's line {line:?}: {e}"));
            let field = |name: &str| line[name].as_str().expect("a string field").to_owned();
            Published {
                subject: field("subject"),
                trace_id: field("trace_id"),
                span_id: field("span_id"),
                headers: serde_json::from_value(line["headers"].clone()).expect("headers"),
            }
        })
        .collect();
    assert_eq!(published.len(), rows.len(), "one line per event");
    published
}

/// The `process` spans among `spans`, by the subject they name.
fn process_spans(spans: &[Span]) -> BTreeMap<String, Vec<Span>> {
    let mut by_subject: BTreeMap<String, Vec<Span>> = BTreeMap::new();
    for span in spans.iter().filter(|s| s.name == "process") {
        let subject = span
            .str("messaging.destination.name")
            .unwrap_or_default()
            .to_owned();
        by_subject.entry(subject).or_default().push(span.clone());
    }
    by_subject
}

/// Checks an ingested event's span: a consumer root of a trace of its own, linked to the publisher's span.
fn check_process_span(span: &Span, published: &Published) {
    assert_eq!(span.service, SERVICE, "{span}");
    assert_eq!(span.kind, SpanKind::Consumer, "{span}");
    assert_eq!(
        span.parent_span_id, None,
        "a root, never the publisher's child: {span}"
    );
    assert_ne!(
        span.trace_id, published.trace_id,
        "a trace of its own: {span}"
    );
    assert_eq!(
        span.links,
        vec![published.link()],
        "linked to its publisher's span: {span}"
    );
    assert_eq!(span.str("messaging.system"), Some("nats"), "{span}");
    assert_eq!(
        span.str("messaging.operation.type"),
        Some("process"),
        "{span}"
    );
    assert_eq!(
        span.str("messaging.operation.name"),
        Some("process"),
        "{span}"
    );
}

/// Every JSON line of `worker`'s log that contains `needle`, parsed.
fn json_lines(worker: &BinaryApp, needle: &str) -> Vec<Value> {
    worker
        .log_lines(needle)
        .iter()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"))
        })
        .collect()
}

/// Waits until `worker` has logged a JSON line containing `needle`, and returns the first.
async fn logged(worker: &BinaryApp, needle: &str) -> Value {
    let line = worker.wait_log(needle).await;
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"))
}

/// The receiver itself, against the exporter the worker uses (`opentelemetry-otlp` over HTTP with protobuf, its
/// hyper client): a span's service, ids, parent, kind, status, attributes and links arrive as they were sent, so a
/// failure of the tests below is the worker's, not the receiver's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_decodes_what_the_workers_exporter_sends() {
    use opentelemetry::trace::{
        Link as OtelLink, Span as _, SpanContext, SpanId, SpanKind as Kind, Status,
        TraceContextExt, TraceFlags, TraceId, TraceState, Tracer as _, TracerProvider as _,
    };
    use opentelemetry::{Context, KeyValue};
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;

    let receiver = OtlpReceiver::start();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_endpoint(format!("{}/v1/traces", receiver.endpoint()))
        .with_http_client(
            opentelemetry_http::hyper::HyperClient::with_default_connector(
                Duration::from_secs(10),
                None,
            ),
        )
        .build()
        .expect("an exporter");
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_span_processor(
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build(),
        )
        .with_resource(
            opentelemetry_sdk::Resource::builder_empty()
                .with_service_name("receiver-check")
                .build(),
        )
        .build();
    let tracer = provider.tracer("receiver-check");
    let context = |caller: &Caller| {
        SpanContext::new(
            TraceId::from_hex(&caller.trace_id).expect("a trace id"),
            SpanId::from_hex(&caller.span_id).expect("a span id"),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        )
    };
    let (caller, publisher) = (Caller::new(), Caller::new());
    let mut span = tracer
        .span_builder("GET /check")
        .with_kind(Kind::Server)
        .with_attributes([
            KeyValue::new("http.response.status_code", 503_i64),
            KeyValue::new("url.path", "/check"),
        ])
        .with_links(vec![OtelLink::with_context(context(&publisher))])
        .start_with_context(
            &tracer,
            &Context::new().with_remote_span_context(context(&caller)),
        );
    span.set_status(Status::error("unavailable"));
    let span_id = span.span_context().span_id().to_string();
    span.end();
    // Shutting down exports what the processor holds; it blocks, so off the runtime's threads.
    tokio::task::spawn_blocking(move || provider.shutdown())
        .await
        .expect("the shutdown's task")
        .expect("the provider shuts down");
    let received = receiver
        .wait_for("the span sent", |spans| {
            spans.iter().find(|s| s.span_id == span_id).cloned()
        })
        .await;
    assert_eq!(received.service, "receiver-check");
    assert_eq!(received.trace_id, caller.trace_id);
    assert_eq!(received.parent_span_id, Some(caller.span_id.clone()));
    assert_eq!(received.name, "GET /check");
    assert_eq!(received.kind, SpanKind::Server);
    assert_eq!(received.status, StatusCode::Error);
    assert_eq!(received.int("http.response.status_code"), Some(503));
    assert_eq!(received.str("url.path"), Some("/check"));
    assert_eq!(
        received.links,
        vec![Link {
            trace_id: publisher.trace_id,
            span_id: publisher.span_id
        }]
    );
    assert_eq!(
        receiver.requests(),
        vec!["POST /v1/traces -> 200".to_owned()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_with_a_traceparent_joins_the_callers_trace_down_to_the_store_then_from_memory() {
    let traced = Traced::new().await;
    let thread = "t-traced-read";
    traced.scene.store.insert_rows(&answered(thread)).await;
    // The default sampler (parent-based): a sampled caller's read is traced.
    let worker = traced.worker(&[]).await;
    let path = history_path(thread);

    // The first read hydrates from the store.
    let caller = Caller::new();
    let reply = read(&worker.api, thread, &caller).await;
    assert_eq!(reply.source(), Some("store"));
    let server = traced
        .server_span(SERVICE, &caller, &path, Some(&reply))
        .await;
    assert_eq!(
        server.parent_span_id.as_deref(),
        Some(caller.span_id.as_str()),
        "{server}"
    );
    let trace = traced
        .receiver
        .wait_for(
            "the first read's cache, hydrate and two store query spans",
            |spans| {
                let trace = in_trace(spans, &caller.trace_id);
                let under = |name: &str| {
                    trace
                        .iter()
                        .any(|s| s.name == name && s.descends_from(&server.span_id, &trace))
                };
                let queries = store_spans(&trace)
                    .into_iter()
                    .filter(|s| s.descends_from(&server.span_id, &trace))
                    .count();
                (under("cache") && under("hydrate") && queries >= 2).then_some(trace)
            },
        )
        .await;
    let cache = trace
        .iter()
        .find(|s| s.name == "cache")
        .expect("cache span");
    assert_eq!(
        cache.str("chat_history_view.source"),
        Some("store"),
        "{cache}"
    );
    assert_eq!(cache.kind, SpanKind::Internal, "{cache}");
    let hydrate = trace
        .iter()
        .find(|s| s.name == "hydrate")
        .expect("hydrate span");
    assert_eq!(hydrate.kind, SpanKind::Internal, "{hydrate}");
    let queries = store_spans(&trace);
    for query in &queries {
        check_store_span(query, &traced.scene.database);
    }
    for kind in ["hydration_markers", "hydration_events"] {
        let query = queries
            .iter()
            .find(|s| s.str("chat_history_view.query") == Some(kind))
            .unwrap_or_else(|| panic!("no {kind} query among {queries:#?}"));
        assert!(
            query.descends_from(&hydrate.span_id, &trace),
            "a hydration's query: {query}"
        );
    }
    for span in &trace {
        assert_eq!(span.service, SERVICE, "{span}");
        assert!(
            span.span_id == server.span_id || span.descends_from(&server.span_id, &trace),
            "every span of the read is under its server span: {span}"
        );
    }

    // Later reads come from memory (once the persister-lag bound has passed since the worker started): the
    // `cache` span says so, and no hydration or query is in their traces.
    let api = &worker.api;
    let (caller, reply) = eventually("a read served from memory", || async move {
        let caller = Caller::new();
        let reply = read(api, thread, &caller).await;
        if reply.source() == Some("cache") {
            Ok((caller, reply))
        } else {
            Err(format!("from {:?}: {}", reply.source(), reply.body))
        }
    })
    .await;
    let server = traced
        .server_span(SERVICE, &caller, &path, Some(&reply))
        .await;
    assert_eq!(
        server.parent_span_id.as_deref(),
        Some(caller.span_id.as_str()),
        "{server}"
    );
    // Children end before their parent, and the processor exports spans in the order they ended: with the server
    // span received, the read's other spans are too.
    let trace = traced.trace(&caller.trace_id);
    let cache = trace
        .iter()
        .find(|s| s.name == "cache")
        .unwrap_or_else(|| panic!("no cache span in {trace:#?}"));
    assert_eq!(
        cache.str("chat_history_view.source"),
        Some("cache"),
        "{cache}"
    );
    assert!(cache.descends_from(&server.span_id, &trace), "{cache}");
    assert!(
        trace.iter().all(|s| s.name != "hydrate") && store_spans(&trace).is_empty(),
        "a read from memory hydrates nothing: {trace:#?}"
    );

    // A read waiting for a run that does not finish: its wait is a span of the read.
    let caller = Caller::new();
    let traceparent = caller.traceparent();
    let reply = worker
        .api
        .get(
            &format!("{path}?wait_for_run=r-unfinished&wait_ms=200"),
            &[("traceparent", traceparent.as_str())],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-history-run-pending"), Some("r-unfinished"));
    let server = traced
        .server_span(SERVICE, &caller, &path, Some(&reply))
        .await;
    let trace = traced.trace(&caller.trace_id);
    let wait = trace
        .iter()
        .find(|s| s.name == "wait_for_run")
        .unwrap_or_else(|| panic!("no wait_for_run span in {trace:#?}"));
    assert_eq!(wait.kind, SpanKind::Internal, "{wait}");
    assert!(wait.descends_from(&server.span_id, &trace), "{wait}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hydration_links_to_the_publishers_of_the_live_events_it_merged_at_most_32() {
    let traced = Traced::new().await;
    let thread = "t-traced-hydrate-links";
    traced
        .scene
        .store
        .insert_rows(&[user_row(thread, "d1", "e0", 1, "Q")])
        .await;
    let worker = traced.worker(&[]).await;
    // Live events of a thread not read yet: held in a partial view until a read hydrates it.
    let events: Vec<Value> = (1..=40)
        .map(|c| chunk_row(thread, "d1", "A", &format!("e{c}"), 1 + c, "x"))
        .collect();
    let published = publish_traced(&traced.scene.nats.url(), "always_on", &events, |_| false).await;
    worker.api.wait_for_events(events.len() as u64).await;
    let caller = Caller::new();
    let reply = read(&worker.api, thread, &caller).await;
    assert_eq!(reply.source(), Some("store"));
    let hydrate = traced
        .receiver
        .wait_for("the read's hydrate span", |spans| {
            spans
                .iter()
                .find(|s| s.trace_id == caller.trace_id && s.name == "hydrate")
                .cloned()
        })
        .await;
    let publishers: Vec<Link> = published.iter().map(Published::link).collect();
    assert_eq!(hydrate.links.len(), MAX_LINKS, "{hydrate}");
    for link in &hydrate.links {
        assert!(
            publishers.contains(link),
            "a link to no publisher: {hydrate}"
        );
    }
    let distinct: std::collections::BTreeSet<_> =
        hydrate.links.iter().map(|l| &l.span_id).collect();
    assert_eq!(distinct.len(), MAX_LINKS, "{hydrate}");

    // Live events whose traceparent is not valid link to nothing: another thread's hydration links to its two
    // valid publishers only, whatever span is current when the contexts are read.
    let thread = "t-traced-hydrate-invalid";
    traced
        .scene
        .store
        .insert_rows(&[user_row(thread, "d1", "e0", 1, "Q")])
        .await;
    let valid: Vec<Value> = (1..=2)
        .map(|c| chunk_row(thread, "d1", "A", &format!("e{c}"), 1 + c, "x"))
        .collect();
    let published = publish_traced(&traced.scene.nats.url(), "always_on", &valid, |_| false).await;
    for (i, traceparent) in INVALID_TRACEPARENTS.iter().enumerate() {
        let row = chunk_row(thread, "d1", "A", &format!("e{}", 10 + i), 10, "y");
        publish_with_traceparent(&traced.scene.publisher, &row, traceparent).await;
    }
    worker
        .api
        .wait_for_events((events.len() + valid.len() + INVALID_TRACEPARENTS.len()) as u64)
        .await;
    let caller = Caller::new();
    read(&worker.api, thread, &caller).await;
    let hydrate = traced
        .receiver
        .wait_for("the second read's hydrate span", |spans| {
            spans
                .iter()
                .find(|s| s.trace_id == caller.trace_id && s.name == "hydrate")
                .cloned()
        })
        .await;
    let mut links = hydrate.links.clone();
    links.sort_by(|a, b| a.span_id.cmp(&b.span_id));
    let mut expected: Vec<Link> = published.iter().map(Published::link).collect();
    expected.sort_by(|a, b| a.span_id.cmp(&b.span_id));
    assert_eq!(links, expected, "{hydrate}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_links_to_the_publisher_of_the_marker_that_made_its_display_visible() {
    let traced = Traced::new().await;
    let thread = "t-traced-fill-links";
    let mut rows = answered(thread);
    // An answer on a display no marker has made visible yet.
    rows.push(chunk_row(thread, "d2", "A", "e4", 4, "A2"));
    traced.scene.store.insert_rows(&rows).await;
    // Every root sampled: the fill's span is recorded whether the event's span queued it or it is a root.
    let worker = traced
        .worker(&[("OTEL_TRACES_SAMPLER", "parentbased_always_on")])
        .await;
    read_until_cache(&worker.api, thread, "").await;
    let marker = publish_traced(
        &traced.scene.nats.url(),
        "always_on",
        &[user_row(thread, "d2", "e3", 3, "Q2")],
        |_| false,
    )
    .await;
    let expected = crate::helpers::turns(&[
        ("user", "Q"),
        ("assistant", "A"),
        ("user", "Q2"),
        ("assistant", "A2"),
    ]);
    let (api, expected) = (&worker.api, &expected);
    eventually("the display filled, served from memory", || async move {
        let reply = api.history(thread, "").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        when(
            reply.source() == Some("cache") && reply.json()["messages"] == *expected,
            || format!("from {:?}: {}", reply.source(), reply.body),
        )
    })
    .await;
    let fill = traced
        .receiver
        .wait_for("a fill span linked to the marker's publisher", |spans| {
            spans
                .iter()
                .find(|s| s.name == "fill" && s.links.contains(&marker[0].link()))
                .cloned()
        })
        .await;
    assert_eq!(fill.kind, SpanKind::Internal, "{fill}");
    assert_eq!(fill.service, SERVICE, "{fill}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_with_an_invalid_traceparent_is_answered_and_traced_as_a_root_of_its_own() {
    let traced = Traced::new().await;
    let thread = "t-traced-invalid";
    traced.scene.store.insert_rows(&answered(thread)).await;
    // Every root sampled: the read's span is exported whatever its parent.
    let worker = traced
        .worker(&[("OTEL_TRACES_SAMPLER", "parentbased_always_on")])
        .await;
    let path = history_path(thread);
    for traceparent in [
        "garbage",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
    ] {
        let reply = worker.api.get(&path, &[("traceparent", traceparent)]).await;
        assert_eq!(reply.status, 200, "{traceparent}: {}", reply.body);
        let answered = reply
            .header("traceparent")
            .unwrap_or_else(|| panic!("{traceparent}: the answer carries no traceparent"));
        let [_, trace_id, span_id, _] = traceparent_fields(answered);
        assert!(
            !"4bf92f3577b34da6a3ce929d0e0e4736".eq_ignore_ascii_case(trace_id),
            "{traceparent}: the read joined an invalid context: {answered}"
        );
        let span = traced
            .receiver
            .wait_for(&format!("the read's span after {traceparent:?}"), |spans| {
                spans.iter().find(|s| s.span_id == span_id).cloned()
            })
            .await;
        assert_eq!(span.trace_id, trace_id, "{span}");
        assert_eq!(span.kind, SpanKind::Server, "{span}");
        assert_eq!(span.parent_span_id, None, "{traceparent}: a root: {span}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_the_store_fails_is_an_error_span_down_to_its_query() {
    let mut traced = Traced::new().await;
    let worker = traced
        .worker(&[("HISTORY_VIEW_STORE_TIMEOUT_MS", "1000")])
        .await;
    traced.scene.mongo.stop();
    let thread = "t-traced-outage";
    let path = history_path(thread);
    let caller = Caller::new();
    let traceparent = caller.traceparent();
    let reply = worker
        .api
        .get(&path, &[("traceparent", traceparent.as_str())])
        .await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    let server = traced
        .server_span_with(SERVICE, &caller, &path, 503, Some(&reply))
        .await;
    let trace = traced.trace(&caller.trace_id);
    let queries = store_spans(&trace);
    assert!(!queries.is_empty(), "no store query span: {trace:#?}");
    for query in queries {
        assert!(query.descends_from(&server.span_id, &trace), "{query}");
        assert_eq!(query.status, StatusCode::Error, "{query}");
        assert!(
            ["timeout", "unavailable", "failed", "rejected"]
                .contains(&query.str("error.type").unwrap_or_default()),
            "error.type is a store error's kind: {query}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_through_a_non_owner_reaches_the_owner_and_its_store_in_the_callers_trace() {
    let traced = Traced::new().await;
    let nats_url = traced.scene.nats.url();
    create_class_streams(&nats_url, ["UserAgent".to_owned(), "A".to_owned()]).await;
    let prefix = port_prefix(2);
    let mut workers = Vec::new();
    for k in 0..2u16 {
        let name = format!("chv-{k}");
        let mut env = vec![
            ("HISTORY_VIEW_NATS_URL", nats_url.clone()),
            ("HISTORY_VIEW_MONGODB_URI", traced.scene.mongo.uri()),
            (
                "HISTORY_VIEW_MONGODB_DATABASE",
                traced.scene.database.clone(),
            ),
            ("HISTORY_VIEW_SOURCE", "jetstream".to_owned()),
            ("HISTORY_VIEW_PARTITIONS", "2".to_owned()),
            ("HISTORY_VIEW_PARTITION", k.to_string()),
            ("HISTORY_VIEW_JETSTREAM_REPLICAS", "1".to_owned()),
            (
                "HISTORY_VIEW_PEER_URL",
                format!("http://127.0.0.1:{prefix}{{partition}}"),
            ),
        ];
        env.extend(traced.tracing_env(&[("OTEL_SERVICE_NAME", name.as_str())]));
        let app = BinaryApp::start_on(prefix * 10 + k, &env).await;
        app.wait_ready().await;
        workers.push(app);
    }
    // A thread worker 0 owns, read through worker 1.
    let thread = (0..)
        .map(|i| format!("t-traced-forward-{i}"))
        .find(|t| owner(t, 2) == 0)
        .expect("a thread");
    traced.scene.store.insert_rows(&answered(&thread)).await;
    let path = history_path(&thread);
    let caller = Caller::new();
    let reply = read(&workers[1].api, &thread, &caller).await;
    assert_eq!(
        reply.json()["messages"],
        crate::helpers::turns(&[("user", "Q"), ("assistant", "A")])
    );

    // The non-owner's server span, a child of the caller's, is the one the answer names.
    let entry = traced
        .server_span("chv-1", &caller, &path, Some(&reply))
        .await;
    assert_eq!(
        entry.parent_span_id.as_deref(),
        Some(caller.span_id.as_str()),
        "{entry}"
    );
    let owner_server = traced.server_span("chv-0", &caller, &path, None).await;
    let trace = traced
        .receiver
        .wait_for(
            "the forward span and the owner's store query spans",
            |spans| {
                let trace = in_trace(spans, &caller.trace_id);
                let forward = trace.iter().any(|s| {
                    s.service == "chv-1" && s.kind == SpanKind::Client && s.name == "forward GET"
                });
                let queries = store_spans(&trace)
                    .into_iter()
                    .filter(|s| {
                        s.service == "chv-0" && s.descends_from(&owner_server.span_id, &trace)
                    })
                    .count();
                (forward && queries >= 2).then_some(trace)
            },
        )
        .await;
    let forward = trace
        .iter()
        .find(|s| s.name == "forward GET")
        .expect("the forward span");
    assert!(
        forward.descends_from(&entry.span_id, &trace),
        "under the non-owner's read: {forward}"
    );
    assert_eq!(forward.str("http.request.method"), Some("GET"), "{forward}");
    assert_eq!(
        forward.str("server.address"),
        Some("127.0.0.1"),
        "{forward}"
    );
    assert_eq!(
        forward.int("server.port"),
        Some(i64::from(prefix * 10)),
        "{forward}"
    );
    assert!(
        forward
            .str("url.full")
            .is_some_and(|url| url.contains(&path)),
        "{forward}"
    );
    assert_eq!(
        forward.int("http.response.status_code"),
        Some(200),
        "{forward}"
    );
    assert_eq!(
        owner_server.parent_span_id.as_deref(),
        Some(forward.span_id.as_str()),
        "the owner's read is the forward's child: {owner_server}"
    );
    // The store was read by the owner alone, under its read.
    for query in store_spans(&trace) {
        assert_eq!(query.service, "chv-0", "{query}");
        assert!(
            query.descends_from(&owner_server.span_id, &trace),
            "{query}"
        );
        check_store_span(query, &traced.scene.database);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sampled_ingested_event_is_a_root_span_linked_to_its_publishers_span() {
    let traced = Traced::new().await;
    // Roots always sampled: every event gets its span.
    let worker = traced
        .worker(&[("OTEL_TRACES_SAMPLER", "parentbased_always_on")])
        .await;
    let mut events = Vec::new();
    for t in 0..2 {
        let thread = format!("t-traced-ingest-{t}");
        events.push(user_row(&thread, "d1", "e0", 1, "Q"));
        for c in 1..10 {
            events.push(chunk_row(&thread, "d1", "A", &format!("e{c}"), 1 + c, "x"));
        }
    }
    // Half of them with title-cased header names, as a publisher other than the Python SDK may send.
    let published = publish_traced(&traced.scene.nats.url(), "always_on", &events, |i| {
        i % 2 == 1
    })
    .await;
    for event in &published {
        let [_, trace_id, span_id, flags] = traceparent_fields(event.traceparent());
        assert_eq!(
            (trace_id, span_id),
            (event.trace_id.as_str(), event.span_id.as_str())
        );
        // The current SDK's sampled spans carry W3C level 2's random bit too; the worker takes them.
        assert_eq!(flags, "03", "{event:?}");
    }
    worker.api.wait_for_events(events.len() as u64).await;
    let spans = traced
        .receiver
        .wait_for("a process span for every event", |spans| {
            let by_subject = process_spans(spans);
            published
                .iter()
                .all(|p| by_subject.contains_key(&p.subject))
                .then_some(by_subject)
        })
        .await;
    let mut traces = std::collections::BTreeSet::new();
    for event in &published {
        let spans = &spans[&event.subject];
        assert_eq!(spans.len(), 1, "one span per event: {spans:#?}");
        check_process_span(&spans[0], event);
        traces.insert(spans[0].trace_id.clone());
    }
    assert_eq!(
        traces.len(),
        published.len(),
        "each event's span is a trace of its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_default_sampler_only_a_few_percent_of_ingested_events_get_a_span() {
    const EVENTS: usize = 3_000;
    let traced = Traced::new().await;
    // The default sampler: parent-based, 1% of roots. The publisher samples every event (flags 03): a link is not
    // a parent, so that does not make the worker trace them.
    let worker = traced.worker(&[]).await;
    let mut events = Vec::new();
    for t in 0..30 {
        let thread = format!("t-traced-sampled-{t}");
        events.push(user_row(&thread, "d1", "e0", 1, "Q"));
        for c in 1..(EVENTS / 30) {
            events.push(chunk_row(
                &thread,
                "d1",
                "A",
                &format!("e{c}"),
                1 + c as i64,
                "x",
            ));
        }
    }
    assert_eq!(events.len(), EVENTS);
    let published = publish_traced(&traced.scene.nats.url(), "always_on", &events, |_| false).await;
    worker
        .api
        .wait_for_events_within(EVENTS as u64, Duration::from_secs(60))
        .await;
    // A traced read after the last event: spans are exported in the order they ended, so once its server span is
    // received, every event's span is too.
    let caller = Caller::new();
    let thread = "t-traced-sampled-0";
    read(&worker.api, thread, &caller).await;
    traced
        .server_span(SERVICE, &caller, &history_path(thread), None)
        .await;
    let spans = process_spans(&traced.receiver.spans());
    let sampled: usize = spans.values().map(Vec::len).sum();
    // 1% of 3,000 is 30 (a standard deviation of 5.4): 0 or 150 and more cannot happen by chance.
    assert!(
        sampled > 0 && sampled < 150,
        "{sampled} of {EVENTS} events got a span"
    );
    let by_subject: BTreeMap<&str, &Published> =
        published.iter().map(|p| (p.subject.as_str(), p)).collect();
    for (subject, spans) in &spans {
        let event = by_subject
            .get(subject.as_str())
            .unwrap_or_else(|| panic!("a span for no event published: {spans:#?}"));
        assert_eq!(spans.len(), 1, "{spans:#?}");
        check_process_span(&spans[0], event);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_line_inside_a_read_carries_the_callers_trace_id() {
    let traced = Traced::new().await;
    let thread = "t-traced-log";
    traced
        .scene
        .store
        .insert_rows(&with_malformed_chunk(thread))
        .await;
    let worker = traced.worker(&[]).await;
    let caller = Caller::new();
    read(&worker.api, thread, &caller).await;
    let line = logged(&worker, MALFORMED_WARNING).await;
    assert_eq!(line["trace_id"], caller.trace_id.as_str(), "{line}");
    let span_id = line["span_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no span_id: {line}"))
        .to_owned();
    // The span it names is one of the read's.
    let span = traced
        .receiver
        .wait_for("the span the warning names", |spans| {
            spans.iter().find(|s| s.span_id == span_id).cloned()
        })
        .await;
    assert_eq!(span.trace_id, caller.trace_id, "{span}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_lists_the_publishers_trace_id_of_each_live_event_and_none_of_stored_rows() {
    let traced = Traced::new().await;
    let thread = "t-traced-explain";
    traced.scene.store.insert_rows(&answered(thread)).await;
    let worker = traced.worker(&[]).await;
    // The view is complete: what arrives now is held live.
    read_until_cache(&worker.api, thread, "").await;
    let nats_url = traced.scene.nats.url();
    let sampled = publish_traced(
        &nats_url,
        "always_on",
        &[chunk_row(thread, "d1", "A", "e3", 3, "B")],
        |_| false,
    )
    .await;
    // Not sampled by the publisher (flags 02): still a valid context, still listed.
    let unsampled = publish_traced(
        &nats_url,
        "always_off",
        &[chunk_row(thread, "d1", "A", "e4", 4, "C")],
        |_| true,
    )
    .await;
    assert_eq!(traceparent_fields(unsampled[0].traceparent())[3], "02");
    // No trace context at all.
    publish_rows(
        &traced.scene.publisher,
        &[chunk_row(thread, "d1", "A", "e5", 5, "D")],
    )
    .await;
    // Trace contexts that are not valid (one of another length, and those of the right length): the events count,
    // and explain, reading a kept header inside its own read's span, finds no publisher in it.
    let mut invalid = Vec::new();
    for (i, traceparent) in std::iter::once("00-not-a-trace-01")
        .chain(INVALID_TRACEPARENTS)
        .enumerate()
    {
        let event_id = format!("e{}", 6 + i);
        let row = chunk_row(thread, "d1", "A", &event_id, 6, "E");
        publish_with_traceparent(&traced.scene.publisher, &row, traceparent).await;
        invalid.push(event_id);
    }
    // Explained once the view holds them all.
    let (api, expected_invalid) = (&worker.api, &invalid);
    let body = eventually("the live events in the view", || async move {
        let reply = explain(api, thread, "").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body = reply.json();
        let held = |id: &str| {
            body["events"].as_array().is_some_and(|events| {
                events
                    .iter()
                    .any(|e| e["event_id"] == id && e["in_view"] == true)
            })
        };
        if ["e3", "e4", "e5"]
            .into_iter()
            .chain(expected_invalid.iter().map(String::as_str))
            .all(held)
        {
            Ok(body)
        } else {
            Err(body.to_string())
        }
    })
    .await;
    let events = body["events"].as_array().expect("events");
    let publisher_trace = |event_id: &str| {
        let event = events
            .iter()
            .find(|e| e["event_id"] == event_id)
            .unwrap_or_else(|| panic!("{event_id} is not explained: {body}"));
        event.get("publisher_trace_id").cloned()
    };
    assert_eq!(publisher_trace("e1"), None, "stored only: {body}");
    assert_eq!(publisher_trace("e2"), None, "stored only: {body}");
    assert_eq!(
        publisher_trace("e3"),
        Some(json!(sampled[0].trace_id)),
        "{body}"
    );
    assert_eq!(
        publisher_trace("e4"),
        Some(json!(unsampled[0].trace_id)),
        "{body}"
    );
    assert_eq!(
        publisher_trace("e5"),
        None,
        "published without a traceparent: {body}"
    );
    for event_id in &invalid {
        assert_eq!(
            publisher_trace(event_id),
            None,
            "published with an invalid traceparent: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_nothing_is_exported_and_nothing_names_a_trace() {
    // Where an OTLP/HTTP exporter given no endpoint sends its spans.
    let fallback = OtlpReceiver::bind(4318).unwrap_or_else(|error| {
        panic!(
            "this test listens on 127.0.0.1:4318, where an OTLP exporter without an endpoint falls back to, to \
             prove nothing arrives there; it cannot bind it ({error}): stop what listens there (a collector, or \
             another run of this test) and run it again"
        )
    });
    let scene = Scene::new().await;
    let thread = "t-untraced";
    scene.store.insert_rows(&with_malformed_chunk(thread)).await;
    // Everything sampled, were tracing on.
    let mut worker = scene
        .worker(
            scene.nats.url(),
            &[
                ("OTEL_TRACES_SAMPLER", "always_on"),
                ("HISTORY_VIEW_LOG_FORMAT", "json"),
                EXPORT_EVERY,
            ],
        )
        .await;
    let first = read(&worker.api, thread, &Caller::new()).await;
    assert_eq!(first.source(), Some("store"));
    // Every read until one is served from memory names no trace.
    assert_eq!(first.header("traceparent"), None, "{:?}", first.headers);
    let api = &worker.api;
    eventually("a read served from memory", || async move {
        let reply = read(api, thread, &Caller::new()).await;
        assert_eq!(reply.header("traceparent"), None, "{:?}", reply.headers);
        when(reply.source() == Some("cache"), || {
            format!("from {:?}: {}", reply.source(), reply.body)
        })
    })
    .await;
    let events: Vec<Value> = (3..13)
        .map(|c| chunk_row(thread, "d1", "A", &format!("e{c}"), c, "x"))
        .collect();
    publish_traced(&scene.nats.url(), "always_on", &events, |_| false).await;
    worker.api.wait_for_events(events.len() as u64).await;
    // The warning logged inside the first read names no trace; no line does.
    let warning = logged(&worker, MALFORMED_WARNING).await;
    assert!(
        warning.get("trace_id").is_none() && warning.get("span_id").is_none(),
        "{warning}"
    );
    for line in json_lines(&worker, "") {
        assert!(line.get("trace_id").is_none(), "{line}");
    }
    // A provider, had there been one, would export what it holds when the worker stops.
    worker.terminate();
    assert!(
        worker.wait_exit(Duration::from_secs(20)).await.is_some(),
        "the worker did not stop"
    );
    assert_eq!(
        fallback.requests(),
        Vec::<String>::new(),
        "nothing may reach 127.0.0.1:4318"
    );
}

/// Tracing says what it does: one INFO line at start (on, where to without the endpoint's credentials, the
/// sampler; or off), and, with the collector down, a WARN (at most one a second, never the password) and the
/// spans it dropped counted in `history_view_trace_spans_dropped_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_announces_itself_and_reports_spans_it_cannot_send() {
    const PASSWORD: &str = "otlp-secret-5c1f";
    let scene = Scene::new().await;
    // Nothing listens there: every export fails.
    let collector = format!(
        "http://chv:{PASSWORD}@127.0.0.1:{}",
        test_support::process::free_port()
    );
    let app = scene
        .worker(
            scene.nats.url(),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.as_str()),
                ("OTEL_TRACES_SAMPLER", "always_on"),
                ("HISTORY_VIEW_LOG_FORMAT", "json"),
                EXPORT_EVERY,
                ("RUST_LOG", "trace"),
            ],
        )
        .await;
    let announced = app.log_lines("tracing on");
    assert_eq!(announced.len(), 1, "{announced:?}");
    assert!(
        announced[0].contains("127.0.0.1") && announced[0].contains("AlwaysOn"),
        "{}",
        announced[0]
    );
    let reporting = &app;
    eventually_within(
        "a failed export reported",
        Duration::from_secs(30),
        || async move {
            let api = &reporting.api;
            assert_eq!(api.history("t-down", "").await.status, 200);
            let dropped = metric(
                &api.metrics().await,
                "history_view_trace_spans_dropped_total",
            );
            let warned = reporting.log_lines("could not send spans").len();
            when(dropped > 0.0 && warned > 0, || {
                format!("{dropped} spans dropped, {warned} warnings")
            })
        },
    )
    .await;
    let warnings = app.log_lines("could not send spans");
    assert!(warnings[0].contains("\"WARN\""), "{}", warnings[0]);
    let leaked = app.log_lines(PASSWORD);
    assert!(
        leaked.is_empty(),
        "the endpoint's password was logged: {leaked:?}"
    );

    let off = scene.worker(scene.nats.url(), &[]).await;
    assert_eq!(off.log_lines("tracing off").len(), 1);

    // With a collector: the credentials reach it as Basic authorization, not in the URL.
    let receiver = OtlpReceiver::start();
    let endpoint = receiver
        .endpoint()
        .replace("http://", &format!("http://chv:{PASSWORD}@"));
    let on = scene
        .worker(
            scene.nats.url(),
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_TRACES_SAMPLER", "always_on"),
                EXPORT_EVERY,
            ],
        )
        .await;
    assert_eq!(on.api.history("t-up", "").await.status, 200);
    let collecting = &receiver;
    eventually_within(
        "an export at the collector",
        Duration::from_secs(30),
        || {
            let seen = when(!collecting.authorizations().is_empty(), || {
                format!("{:?}", collecting.requests())
            });
            async move { seen }
        },
    )
    .await;
    use base64::Engine as _;
    let expected = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("chv:{PASSWORD}"))
    );
    assert!(
        receiver.authorizations().iter().all(|a| *a == expected),
        "{:?}",
        receiver.authorizations()
    );
}
