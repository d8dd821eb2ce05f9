//! The HTTP API ([design section 3](../../docs/design.md#3)): `router(state)` and the shared `AppState`. Handlers are
//! thin: extract a [`read::ThreadRequest`], call one function, map the result. The read they share (the request's
//! checks, the read itself, the wait for a run or a change, the answer's headers) is [`read`]; routing among
//! partitioned workers is [`route`]. The HTTP side's metrics are in `metrics.rs` ([`HttpMetrics`]); each API
//! request's server span is [`trace`].

mod conversations;
mod error;
mod feed;
mod history;
mod inspect;
mod listeners;
mod metrics;
mod operations;
mod read;
mod responses;
mod resume;
mod route;
mod serve;
mod settings;
mod tokens;
mod traceparent;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{MethodRouter, get};
use tokio::sync::Semaphore;

pub use error::{ApiError, SHOULD_RETRY_HEADER};
pub use listeners::Listeners;
pub use metrics::HttpMetrics;
pub use read::{COVERED_THROUGH_HEADER, SOURCE_HEADER, canonical_object_id};
pub use route::{FORWARDED_HEADER, Peers};
pub use serve::{ConnectionLimits, RESERVED_CONNECTIONS, accept_loop};
pub use settings::{HttpSettings, Inspector};
pub use tokens::ApiTokens;

use crate::cache::ViewCache;
use crate::metrics::Exposition;
use crate::readiness::Readiness;
use metrics::HttpRefusal;

/// What every handler may use. Cloning is cheap.
#[derive(Clone)]
pub struct AppState {
    pub views: ViewCache,
    /// The HTTP side's metrics.
    pub metrics: Arc<HttpMetrics>,
    /// Every wing's metrics, rendered at `/metrics`.
    pub exposition: Exposition,
    pub readiness: Readiness,
    /// When set, `/v1/*` requires `Authorization: Bearer <token>` with one of these tokens
    /// (`HISTORY_VIEW_API_TOKEN`, or the lines of `HISTORY_VIEW_API_TOKEN_FILE`, which its watcher follows).
    pub api_token: Option<ApiTokens>,
    /// Whether `/inspect/threads/{thread_id}` serves the inspector page (`HISTORY_VIEW_INSPECTOR`).
    pub inspector: bool,
    /// The OpenAPI document as JSON, served at `/openapi.json`.
    pub openapi: Bytes,
    /// One permit per history read answered at once (`HISTORY_VIEW_HTTP_MAX_IN_FLIGHT`).
    pub reads: Arc<Semaphore>,
    /// One permit per read waiting for a run (`HISTORY_VIEW_HTTP_MAX_WAITING`); such a read takes no `reads` permit.
    pub waiting: Arc<Semaphore>,
    /// One permit per open live feed (`HISTORY_VIEW_HTTP_MAX_STREAMS`); a feed takes no `reads` permit.
    pub streams: Arc<Semaphore>,
    /// Partitioned workers: the owner of each thread and how to reach it; `None` with one partition.
    pub peers: Option<Peers>,
}

impl AppState {
    /// History reads being answered now.
    pub fn reads_in_flight(&self, max: usize) -> usize {
        max.saturating_sub(self.reads.available_permits())
    }
}

/// The whole API: the history reads (token and in-flight limit checked) and the operations endpoints.
pub fn router(state: AppState) -> Router {
    router_with(state, get(history::get_history))
}

/// [`router`] with `history` answering the history reads, behind the same middleware (the benchmark measures its
/// ceiling with a handler that returns a fixed body).
pub fn router_with(state: AppState, history: MethodRouter<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/threads/{thread_id}/history", history)
        .route(
            "/v1/threads/{thread_id}/verify",
            axum::routing::post(history::verify),
        )
        .route(
            "/v1/threads/{thread_id}/history/explain",
            get(inspect::explain),
        )
        .route(
            "/v1/conversations/{thread_id}",
            get(conversations::get_conversation),
        )
        .route(
            "/v1/conversations/{thread_id}/items",
            get(conversations::list_items),
        )
        .route(
            "/v1/threads/{thread_id}/ui-messages",
            get(resume::ui_messages),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            limit_in_flight,
        ))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    // The live feed holds a stream permit of its own, not a read permit, for as long as it is open.
    let feeds = Router::new()
        .route(
            "/v1/threads/{thread_id}/history/stream",
            get(feed::stream_history),
        )
        .route(
            "/v1/threads/{thread_id}/ui-message-stream",
            get(resume::ui_message_stream),
        )
        .route(
            "/v1/threads/{thread_id}/responses/{run_id}",
            get(responses::get_response),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    // Every API answer passes `count_errors`, and runs inside its server span (outermost, so that refusals by the
    // token and the in-flight limit are traced too); the operations endpoints, added after them, do neither.
    let api = Router::new()
        .merge(api)
        .merge(feeds)
        .route("/inspect/threads/{thread_id}", get(inspect::inspector))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), count_errors))
        .layer(middleware::from_fn(traceparent::trace_request));
    closing(operations(api), state)
}

/// What a connection beyond the cap may reach: the probes, `/metrics` and the OpenAPI document; anything else
/// answers 503 overloaded.
pub fn reserve_router(state: AppState) -> Router {
    let refused = Router::new()
        .fallback(overloaded)
        .layer(middleware::from_fn_with_state(state.clone(), count_errors));
    closing(operations(refused), state)
}

/// What the probes' own listener (`HISTORY_VIEW_PROBE_LISTEN`) serves: the probes, `/metrics` and the OpenAPI
/// document; anything else is not found there.
pub fn probe_router(state: AppState) -> Router {
    closing(operations(Router::new()).fallback(not_found), state)
}

/// Every answer given while the worker is stopping says `Connection: close` (hyper then closes the connection after
/// it): a pooled client opens its next connection anew, to another worker once the orchestrator has removed this
/// one, instead of finding its idle connection closed under it at the drain ([design 3.4](../../docs/design.md#3.4)).
fn closing(router: Router<AppState>, state: AppState) -> Router {
    router
        .layer(middleware::from_fn_with_state(
            state.clone(),
            close_when_stopping,
        ))
        .with_state(state)
}

async fn close_when_stopping(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    if state.readiness.stopping() {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

fn operations(router: Router<AppState>) -> Router<AppState> {
    router
        .route("/healthz", get(operations::healthz))
        .route("/readyz", get(operations::readyz))
        .route("/metrics", get(operations::metrics))
        .route("/openapi.json", get(operations::openapi))
        .method_not_allowed_fallback(method_not_allowed)
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

/// A known path with a method it does not serve: the JSON error body every other error has (axum's own 405 is
/// empty), and axum still adds the `Allow` header.
async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

async fn overloaded() -> ApiError {
    ApiError::Overloaded
}

/// Counts an API answer that is neither 2xx nor 304 (`history_view_read_errors_total{code}`), and writes the log
/// line its error left for the log ([`error::ErrorLog`]: what the body keeps out).
async fn count_errors(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let status = response.status();
    if !(status.is_success() || status == axum::http::StatusCode::NOT_MODIFIED) {
        state.metrics.read_error(status.as_u16());
    }
    if let Some(log) = response.extensions_mut().remove::<error::ErrorLog>() {
        log.write();
    }
    response
}

/// Answers 503 at once when `HISTORY_VIEW_HTTP_MAX_IN_FLIGHT` reads are being answered (a queue would only make
/// every reader late). A read waiting for a run takes one of `HISTORY_VIEW_HTTP_MAX_WAITING` instead, for its
/// reads and its wait ([`read::waits_for_run`]), so waiters never turn other reads into 503s.
async fn limit_in_flight(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if read::waits_for_run(request.uri()) {
        let Ok(_waiting) = state.waiting.try_acquire() else {
            state.metrics.refused(HttpRefusal::Waiting);
            return Err(ApiError::Overloaded);
        };
        let _counted = WaitingRead::new(&state.metrics);
        return Ok(next.run(request).await);
    }
    let Ok(_permit) = state.reads.try_acquire() else {
        state.metrics.refused(HttpRefusal::InFlight);
        return Err(ApiError::Overloaded);
    };
    Ok(next.run(request).await)
}

/// A read waiting for a run, counted in `history_view_http_waiting_reads` until it is dropped (however the request
/// ends: a client that goes away drops it too).
struct WaitingRead<'a>(&'a HttpMetrics);

impl<'a> WaitingRead<'a> {
    fn new(metrics: &'a HttpMetrics) -> Self {
        metrics.waiting_reads(1);
        Self(metrics)
    }
}

impl Drop for WaitingRead<'_> {
    fn drop(&mut self) {
        self.0.waiting_reads(-1);
    }
}

/// The token of an `Authorization` header value: the `Bearer` scheme in any case (RFC 9110: schemes are
/// case-insensitive), then one or more spaces.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let start = rest.iter().position(|&b| b != b' ')?;
    Some(&rest[start..])
}

/// Checks the bearer token when one is configured.
async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(expected) = &state.api_token {
        let presented = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| bearer_token(v.as_bytes()));
        if !presented.is_some_and(|token| expected.matches(token)) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setting::Secret;

    #[test]
    fn the_bearer_scheme_is_case_insensitive_and_the_token_exact() {
        let digest = ApiTokens::new(&[Secret::new("s3cret")]);
        for accepted in ["Bearer s3cret", "bearer s3cret", "BEARER  s3cret"] {
            let token = bearer_token(accepted.as_bytes());
            assert!(token.is_some_and(|t| digest.matches(t)), "{accepted}");
        }
        for refused in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Bearer ",
            "Bearers3cret",
            "Basic s3cret",
            "s3cret",
        ] {
            let token = bearer_token(refused.as_bytes());
            assert!(!token.is_some_and(|t| digest.matches(t)), "{refused}");
        }
    }
}
