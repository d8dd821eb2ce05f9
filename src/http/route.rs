//! Routing among partitioned workers ([design 8](../../docs/design.md#8)): which worker answers a request for a
//! thread ([`route`], the one routing path of every thread endpoint), and the forward to it. A read, a `verify` or
//! a live feed of a thread another worker owns is forwarded to it (`HISTORY_VIEW_PEER_URL`), with the caller's
//! query, token and validators, and its answer passed back as it is; when the owner gives none in time, the caller
//! decides the fallback (a read answers from the store, [`super::read::read`]; a feed or `verify` is 503). A
//! forwarded request carries [`FORWARDED_HEADER`], so it is never forwarded again; one that reaches a worker that
//! does not own its thread either is answered 421 Misdirected Request there, at no store cost, and the forwarding
//! worker falls back as for a silent owner. So a client that sends the header itself gains nothing: to an owner it
//! is an ordinary read, to any other worker a 421.
//!
//! A forward is a client span, `forward {METHOD}` ([design 5](../../docs/design.md#5), "Traces"), a child of the
//! request's server span, and the forwarded request carries its `traceparent`, so the owner's server span is its
//! child in the same trace. The owner's own `traceparent` on its answer is dropped: the answer's names this
//! worker's span.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tracing::Instrument;

use super::error::chain;
use super::metrics::ReadRoute;
use super::{ApiError, AppState};
use crate::partition::Partitioning;
use crate::telemetry::{RateLimit, trace};

/// Marks a forwarded read (its value: the forwarding worker's partition).
pub const FORWARDED_HEADER: &str = "x-history-forwarded";

/// The request headers a forwarded read carries to the owner.
const PASSED_ON: [HeaderName; 3] = [
    header::AUTHORIZATION,
    header::IF_NONE_MATCH,
    HeaderName::from_static("last-event-id"),
];

/// Response headers that belong to one hop, not to the answer: the connection's, and the owner's trace context
/// (the answer's `traceparent` names this worker's server span, when tracing is on here).
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::CONTENT_LENGTH,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("traceparent"),
    HeaderName::from_static("tracestate"),
];

/// The other workers of a partitioned deployment. Cloning is cheap.
#[derive(Clone)]
pub struct Peers {
    pub partitioning: Partitioning,
    /// `HISTORY_VIEW_PEER_URL`, with `{partition}`.
    url: String,
    /// The read's store timeout (`HISTORY_VIEW_STORE_TIMEOUT_MS`).
    timeout: Duration,
    client: Client<HttpConnector, Empty<Bytes>>,
    /// At most one warning a second about owners that did not answer.
    warnings: Arc<RateLimit>,
}

/// Why a forwarded read got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("the owner's URL is not valid: {0}")]
    Url(String),
    #[error("the owner did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the owner could not be reached: {0}")]
    Unreachable(String),
}

/// How a request goes to its thread's owner.
#[derive(Debug, Clone, Copy)]
pub(super) enum Forward {
    /// A read (`GET`); the owner may take `waited` besides its own bound (a read waiting for a run).
    Read { waited: Duration },
    /// `POST .../verify`.
    Verify,
    /// A live feed, passed on as it streams.
    Feed,
}

/// Where a request for a thread is answered, as [`route`] decided.
pub(super) enum Routed {
    /// Here, through the cache: this worker owns the thread (every thread, with one partition).
    Local,
    /// Nowhere: a request marked forwarded for a thread this worker does not own either (workers that disagree on
    /// the partition count during a rollout, or a client that set the header itself). It answers 421 Misdirected
    /// Request: never forwarded again, and no store read here (a client's header cannot turn cache hits into store
    /// reads); the forwarding worker answers it as for a silent owner.
    Misdirected,
    /// The owner's answer, passed back as it is.
    Forwarded(Response<Body>),
    /// The owner gave no answer in time, or answered 421 (it does not own the thread either): counted, and warned
    /// about at most once a second.
    OwnerSilent,
}

impl Routed {
    /// The route of a request with no fallback when the owner is silent (a feed, `verify`): `None` to answer here,
    /// the owner's answer, or the error (503 `owner_unreachable`, 421 `misdirected`).
    pub(super) fn without_fallback(self) -> Result<Option<Response<Body>>, ApiError> {
        match self {
            Routed::Local => Ok(None),
            Routed::Forwarded(response) => Ok(Some(response)),
            Routed::OwnerSilent => Err(ApiError::OwnerUnreachable),
            Routed::Misdirected => Err(ApiError::Misdirected),
        }
    }
}

/// Routes a request for `thread` among partitioned workers: answered here when this worker owns the thread or the
/// request was forwarded already, forwarded to the owner otherwise. Each route is counted in
/// `history_view_read_routes_total` (none with one partition).
pub(super) async fn route(
    state: &AppState,
    thread: &str,
    forward: Forward,
    uri: &Uri,
    headers: &HeaderMap,
) -> Routed {
    let Some(peers) = &state.peers else {
        return Routed::Local;
    };
    let partition = match peers.owner_elsewhere(thread) {
        None => {
            state.metrics.read_route(ReadRoute::Local);
            return Routed::Local;
        }
        Some(_) if headers.contains_key(FORWARDED_HEADER) => {
            state.metrics.read_route(ReadRoute::Loop);
            return Routed::Misdirected;
        }
        Some(owner) => owner,
    };
    let forwarded = match forward {
        Forward::Read { waited } => {
            peers
                .forward(partition, Method::GET, uri, headers, waited)
                .await
        }
        Forward::Verify => {
            peers
                .forward(partition, Method::POST, uri, headers, Duration::ZERO)
                .await
        }
        Forward::Feed => peers.forward_stream(partition, uri, headers).await,
    };
    match forwarded {
        Ok(response) if response.status() == StatusCode::MISDIRECTED_REQUEST => {
            state.metrics.read_route(ReadRoute::Misdirected);
            if peers.warnings.allow() {
                tracing::warn!(
                    partition,
                    "the worker a request was forwarded to does not own its thread either (do the workers agree on HISTORY_VIEW_PARTITIONS?); answered here as for a silent owner"
                );
            }
            Routed::OwnerSilent
        }
        Ok(response) => {
            state.metrics.read_route(ReadRoute::Forwarded);
            Routed::Forwarded(response)
        }
        Err(error) => {
            state.metrics.read_route(ReadRoute::OwnerUnreachable);
            if peers.warnings.allow() {
                tracing::warn!(partition, %error, "the owner of a thread did not answer a forwarded request (a read is answered from the store, a feed or verify 503)");
            }
            Routed::OwnerSilent
        }
    }
}

/// Beyond the owner's own bound: the hop there and back, and scheduling on a loaded machine.
const HOP_MARGIN: Duration = Duration::from_millis(500);

impl Peers {
    /// How long the owner may take to answer a read: a wait for its JetStream source to catch up (at most half the
    /// store timeout, `ViewCache::read`), then a store read within the store timeout, plus the hop. Waiting less
    /// gave up on owners that were answering (and read the store a second time for the same thread).
    fn owner_bound(&self) -> Duration {
        self.timeout + self.timeout / 2 + HOP_MARGIN
    }

    pub fn new(partitioning: Partitioning, url: String, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Self {
            partitioning,
            url,
            timeout,
            client,
            warnings: Arc::default(),
        }
    }

    /// The partition owning `thread_id` unless it is this worker's.
    pub fn owner_elsewhere(&self, thread_id: &str) -> Option<u32> {
        let owner = crate::partition::owner(thread_id, self.partitioning.partitions);
        (owner != self.partitioning.partition).then_some(owner)
    }

    /// Forwards the request `method` `uri` (path and query as the caller sent them, no body) to the worker of
    /// `partition`, and returns its answer, whatever its status. The owner may take the store timeout and `waited`
    /// (a read waiting for a run).
    ///
    /// # Errors
    /// [`ForwardError`] when no answer came in time.
    pub async fn forward(
        &self,
        partition: u32,
        method: Method,
        uri: &Uri,
        headers: &HeaderMap,
        waited: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        let timeout = self.owner_bound() + waited;
        let target = self.target(partition, uri);
        let span = forward_span(&method, &target);
        let exchange = async {
            let (parts, body) = self
                .send(&span, method, &target, headers)
                .await?
                .into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| ForwardError::Unreachable(e.to_string()))?
                .to_bytes();
            Ok(Response::from_parts(parts, Body::from(body)))
        };
        let answer = tokio::time::timeout(timeout, exchange)
            .instrument(span.clone())
            .await
            .unwrap_or(Err(ForwardError::Timeout(timeout)));
        record_forward(&span, &answer);
        answer
    }

    /// Forwards a live feed's request to the owner of `partition` and passes its response on as it streams: only
    /// the response's head must come within the store timeout (the forward's span ends with it).
    ///
    /// # Errors
    /// [`ForwardError`] when no response head came in time.
    pub async fn forward_stream(
        &self,
        partition: u32,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Result<Response<Body>, ForwardError> {
        let target = self.target(partition, uri);
        let span = forward_span(&Method::GET, &target);
        let head = tokio::time::timeout(
            self.timeout,
            self.send(&span, Method::GET, &target, headers),
        )
        .instrument(span.clone())
        .await
        .unwrap_or(Err(ForwardError::Timeout(self.timeout)))
        .map(|response| response.map(Body::new));
        record_forward(&span, &head);
        head
    }

    /// The URL of `uri` (path and query as the caller sent them) at the worker of `partition`.
    fn target(&self, partition: u32, uri: &Uri) -> String {
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        format!(
            "{}{path}",
            self.url.replace("{partition}", &partition.to_string())
        )
    }

    /// Sends the request to `target`, with the `traceparent` of the forward's `span`; the response's hop-by-hop
    /// headers are removed.
    async fn send(
        &self,
        span: &tracing::Span,
        method: Method,
        target: &str,
        headers: &HeaderMap,
    ) -> Result<Response<hyper::body::Incoming>, ForwardError> {
        let mut request = Request::builder()
            .method(method)
            .uri(target)
            .header(FORWARDED_HEADER, self.partitioning.partition)
            .body(Empty::new())
            .map_err(|e| ForwardError::Url(e.to_string()))?;
        for name in PASSED_ON {
            for value in headers.get_all(&name) {
                request.headers_mut().append(name.clone(), value.clone());
            }
        }
        trace::inject(span, request.headers_mut());
        let mut response = self
            .client
            .request(request)
            .await
            .map_err(|e| ForwardError::Unreachable(chain(&e)))?;
        for name in HOP_BY_HOP {
            response.headers_mut().remove(name);
        }
        Ok(response)
    }
}

/// The client span of a forward to `target` (`forward GET`, `forward POST`); a disabled span when tracing is off,
/// before any parsing.
fn forward_span(method: &Method, target: &str) -> tracing::Span {
    if !trace::enabled() {
        return tracing::Span::none();
    }
    let url = url::Url::parse(target).ok();
    let address = url
        .as_ref()
        .and_then(url::Url::host_str)
        .unwrap_or_default();
    // Integers as i64: `tracing` hands unsigned values to the OpenTelemetry layer as text.
    let port = url
        .as_ref()
        .and_then(url::Url::port_or_known_default)
        .map(i64::from);
    let full = url.as_ref().map_or_else(|| target.to_owned(), full_url);
    tracing::info_span!(
        "forward",
        otel.name = %format!("forward {method}"),
        otel.kind = "client",
        http.request.method = method.as_str(),
        server.address = address,
        server.port = port,
        url.full = full,
        http.response.status_code = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// `url` as `url.full` says: credentials in it (a peer URL may have them) replaced by `REDACTED`.
fn full_url(url: &url::Url) -> String {
    let mut url = url.clone();
    if !url.username().is_empty() {
        // Err: a URL that cannot have credentials has none to hide.
        let _ = url.set_username("REDACTED");
    }
    if url.password().is_some() {
        let _ = url.set_password(Some("REDACTED"));
    }
    url.into()
}

/// Records a forward's outcome on its span: the owner's status (an error from 400 on, as for any HTTP client), or
/// why no answer came.
fn record_forward<B>(span: &tracing::Span, outcome: &Result<Response<B>, ForwardError>) {
    let error = match outcome {
        Ok(response) => {
            let status = response.status();
            span.record("http.response.status_code", i64::from(status.as_u16()));
            if status.as_u16() < 400 {
                return;
            }
            status.as_str().to_owned()
        }
        Err(error) => error.kind().to_owned(),
    };
    span.record("otel.status_code", "error");
    span.record("error.type", error);
}

impl ForwardError {
    /// A short, closed name of the cause (a span's `error.type`).
    fn kind(&self) -> &'static str {
        match self {
            ForwardError::Url(_) => "invalid_url",
            ForwardError::Timeout(_) => "timeout",
            ForwardError::Unreachable(_) => "unreachable",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forwards_full_url_hides_credentials_and_keeps_the_rest() {
        let url = url::Url::parse("http://user:pw@chv-1.chv:8080/v1/threads/t/history?agent_id=a")
            .unwrap();
        assert_eq!(
            full_url(&url),
            "http://REDACTED:REDACTED@chv-1.chv:8080/v1/threads/t/history?agent_id=a"
        );
        let url = url::Url::parse("http://chv-1.chv:8080/v1/threads/t/history").unwrap();
        assert_eq!(full_url(&url), "http://chv-1.chv:8080/v1/threads/t/history");
    }
}
