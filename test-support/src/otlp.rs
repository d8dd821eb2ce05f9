//! An OTLP/HTTP trace receiver, as a collector would be: `POST /v1/traces` with an `application/x-protobuf`
//! `ExportTraceServiceRequest` (decoded by the `opentelemetry-proto` crate, the protocol's own definitions), answered
//! 200 with an empty `ExportTraceServiceResponse`. Every span it receives is kept, with its resource's service name,
//! for the tests to wait on and query; every request is noted, so a test can also prove that none came.
//!
//! It serves from a thread of its own with its own runtime: an exporter's request is answered whatever the test's
//! runtime is doing (blocked starting a server, say), so no export times out and loses spans because of the test.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode as HttpStatus, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;
use serde_json::Value;

pub use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
pub use opentelemetry_proto::tonic::trace::v1::status::StatusCode;

/// How long [`OtlpReceiver::wait_for`] waits: the worker's batch processor exports every
/// `OTEL_BSP_SCHEDULE_DELAY` (5 s by default), and a loaded machine may take far longer to build and send a batch.
pub const WAIT: Duration = Duration::from_secs(60);

/// The largest request accepted: far above any batch (at most 512 spans by default).
const MAX_REQUEST_BYTES: usize = 64 << 20;

/// One span as received.
#[derive(Debug, Clone)]
pub struct Span {
    /// The resource's `service.name`.
    pub service: String,
    /// Every attribute of the resource.
    pub resource: BTreeMap<String, Value>,
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub span_id: String,
    /// `None` for a root span.
    pub parent_span_id: Option<String>,
    pub name: String,
    pub kind: SpanKind,
    pub status: StatusCode,
    /// Attribute values as JSON: strings, integers, doubles, booleans, arrays; bytes as hex.
    pub attributes: BTreeMap<String, Value>,
    pub links: Vec<Link>,
}

/// A link of a span to another span's context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub trace_id: String,
    pub span_id: String,
}

impl Span {
    /// The attribute `key`'s value.
    pub fn attribute(&self, key: &str) -> Option<&Value> {
        self.attributes.get(key)
    }

    /// The attribute `key`'s value, if it is a string.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.attribute(key).and_then(Value::as_str)
    }

    /// The attribute `key`'s value, if it is an integer.
    pub fn int(&self, key: &str) -> Option<i64> {
        self.attribute(key).and_then(Value::as_i64)
    }

    /// Whether `ancestor` (a span id) is this span's parent, or its parent's, and so on up, within `spans`.
    pub fn descends_from(&self, ancestor: &str, spans: &[Span]) -> bool {
        let mut parent = self.parent_span_id.as_deref();
        // Bounded by the number of spans, so a cycle (which no exporter sends) cannot hang a test.
        for _ in 0..=spans.len() {
            let Some(id) = parent else {
                return false;
            };
            if id == ancestor {
                return true;
            }
            parent = spans
                .iter()
                .find(|s| s.span_id == id && s.trace_id == self.trace_id)
                .and_then(|s| s.parent_span_id.as_deref());
        }
        false
    }
}

impl std::fmt::Display for Span {
    /// One line: service, name, kind, ids, parent, attributes and links (what a failing test shows).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[{}] {:?} {} trace {} span {} parent {} status {} {}",
            self.service,
            self.name,
            self.kind.as_str_name(),
            self.trace_id,
            self.span_id,
            self.parent_span_id.as_deref().unwrap_or("-"),
            self.status.as_str_name(),
            serde_json::to_string(&self.attributes).unwrap_or_default(),
        )?;
        for link in &self.links {
            write!(f, " link {}/{}", link.trace_id, link.span_id)?;
        }
        Ok(())
    }
}

/// What the receiver got.
#[derive(Debug, Default)]
struct Received {
    spans: Vec<Span>,
    /// Every request, as `METHOD /path -> status`.
    requests: Vec<String>,
    /// The `Authorization` header of every export request that had one.
    authorizations: Vec<String>,
}

type Shared = Arc<Mutex<Received>>;

/// A running receiver on 127.0.0.1; stopped on drop.
pub struct OtlpReceiver {
    port: u16,
    received: Shared,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OtlpReceiver {
    /// A receiver on a port the system picks.
    ///
    /// # Panics
    /// When 127.0.0.1 cannot be bound at all.
    pub fn start() -> Self {
        Self::bind(0).expect("bind an OTLP receiver on 127.0.0.1")
    }

    /// A receiver on `port` of 127.0.0.1 (0: a port the system picks).
    ///
    /// # Errors
    /// When the port cannot be bound (something else listens there).
    pub fn bind(port: u16) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let received = Shared::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .fallback(other)
            .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
            .with_state(received.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name(format!("otlp-receiver-{port}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)
                        .expect("a listener for the runtime");
                    // An error here ends the server; the test then sees no spans and says what it waited for.
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(async {
                            let _ = stopped.await;
                        })
                        .await;
                });
            })?;
        Ok(Self {
            port,
            received,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The base URL an exporter is given (`OTEL_EXPORTER_OTLP_ENDPOINT`): `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn received(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every span received so far, in the order received.
    pub fn spans(&self) -> Vec<Span> {
        self.received().spans.clone()
    }

    /// The `Authorization` headers of the export requests received so far.
    pub fn authorizations(&self) -> Vec<String> {
        self.received().authorizations.clone()
    }

    /// Every request received so far (`METHOD /path -> status`), whatever its path or body.
    pub fn requests(&self) -> Vec<String> {
        self.received().requests.clone()
    }

    /// Waits up to [`WAIT`] until `found` finds what it looks for among the spans received so far, and returns it.
    ///
    /// # Panics
    /// When it is not found in time: the message names `what` and lists every span received.
    pub async fn wait_for<T>(&self, what: &str, mut found: impl FnMut(&[Span]) -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(value) = found(&self.received().spans) {
                return value;
            }
            if Instant::now() > deadline {
                let received = self.received();
                panic!(
                    "{what}: not received within {WAIT:?}; {} requests, {} spans:\n{}",
                    received.requests.len(),
                    received.spans.len(),
                    received
                        .spans
                        .iter()
                        .map(Span::to_string)
                        .collect::<Vec<_>>()
                        .join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `POST /v1/traces`: an `ExportTraceServiceRequest` in protobuf, its spans kept.
async fn traces(State(received): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(authorization) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .authorizations
            .push(authorization.to_owned());
    }
    let note = |status: HttpStatus| {
        received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .requests
            .push(format!("POST /v1/traces -> {}", status.as_u16()));
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity");
    if !content_type.starts_with("application/x-protobuf") || encoded {
        note(HttpStatus::UNSUPPORTED_MEDIA_TYPE);
        return (
            HttpStatus::UNSUPPORTED_MEDIA_TYPE,
            format!("expected application/x-protobuf without encoding, got {content_type:?}"),
        )
            .into_response();
    }
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(request) => request,
        Err(error) => {
            note(HttpStatus::BAD_REQUEST);
            return (
                HttpStatus::BAD_REQUEST,
                format!("not an ExportTraceServiceRequest: {error}"),
            )
                .into_response();
        }
    };
    let spans = spans_of(request);
    {
        let mut received = received.lock().unwrap_or_else(PoisonError::into_inner);
        received.spans.extend(spans);
        received.requests.push("POST /v1/traces -> 200".into());
    }
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}

/// Any other request: noted and answered 404.
async fn other(State(received): State<Shared>, method: Method, uri: Uri) -> HttpStatus {
    received
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .requests
        .push(format!("{method} {} -> 404", uri.path()));
    HttpStatus::NOT_FOUND
}

/// The spans of a request, each with its resource.
fn spans_of(request: ExportTraceServiceRequest) -> Vec<Span> {
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let resource = attributes(
            resource_spans
                .resource
                .map(|r| r.attributes)
                .unwrap_or_default(),
        );
        let service = resource
            .get("service.name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        for scope_spans in resource_spans.scope_spans {
            for span in scope_spans.spans {
                spans.push(Span {
                    service: service.clone(),
                    resource: resource.clone(),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: (!span.parent_span_id.is_empty())
                        .then(|| hex(&span.parent_span_id)),
                    kind: SpanKind::try_from(span.kind).unwrap_or(SpanKind::Unspecified),
                    status: span
                        .status
                        .and_then(|s| StatusCode::try_from(s.code).ok())
                        .unwrap_or(StatusCode::Unset),
                    name: span.name,
                    attributes: attributes(span.attributes),
                    links: span
                        .links
                        .iter()
                        .map(|link| Link {
                            trace_id: hex(&link.trace_id),
                            span_id: hex(&link.span_id),
                        })
                        .collect(),
                });
            }
        }
    }
    spans
}

fn attributes(list: Vec<KeyValue>) -> BTreeMap<String, Value> {
    list.into_iter()
        .map(|kv| (kv.key, kv.value.map_or(Value::Null, json)))
        .collect()
}

fn json(value: AnyValue) -> Value {
    match value.value {
        Some(any_value::Value::StringValue(s)) => Value::String(s),
        Some(any_value::Value::BoolValue(b)) => Value::Bool(b),
        Some(any_value::Value::IntValue(i)) => Value::from(i),
        Some(any_value::Value::DoubleValue(d)) => Value::from(d),
        Some(any_value::Value::ArrayValue(array)) => {
            Value::Array(array.values.into_iter().map(json).collect())
        }
        Some(any_value::Value::KvlistValue(list)) => {
            Value::Object(attributes(list.values).into_iter().collect())
        }
        Some(any_value::Value::BytesValue(bytes)) => Value::String(hex(&bytes)),
        Some(any_value::Value::StringValueStrindex(_)) | None => Value::Null,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
