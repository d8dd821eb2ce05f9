//! `GET /v1/threads/{thread_id}/history`: parse the thread id and the query once, read through the view cache,
//! answer with the body, its ETag and its source (or 304 when the caller already has it). The read itself (routed
//! among partitioned workers, and waiting for a run when asked) is shared with the Conversations endpoints.

use std::time::Duration;

use tokio::time::Instant;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use md5::{Digest, Md5};
use serde::Deserialize;

use super::metrics::ReadRoute;
use super::{ApiError, AppState, FORWARDED_HEADER};
use crate::cache::{Answer, Form, HistoryBody, Source};
use crate::freshness;
use crate::project::Identity;

/// The response header saying where a history came from: `cache` or `store`.
pub const SOURCE_HEADER: &str = "x-history-source";

/// The response header naming the instant up to which the answer holds every event that reached NATS (RFC 3339,
/// milliseconds, UTC).
pub const COVERED_THROUGH_HEADER: &str = "x-history-covered-through";

/// The response header naming the run a read waited for when the answer does not hold it finished.
pub const RUN_PENDING_HEADER: &str = "x-history-run-pending";

/// The shortest interval between two reads of a read waiting for a run when the last one was answered from the
/// store (the view was partial, so the next read hydrates again).
pub const STORE_REREAD_INTERVAL: Duration = Duration::from_millis(100);

/// The longest `wait_ms`.
pub const MAX_WAIT: Duration = Duration::from_millis(5_000);

/// Longest accepted thread id, in bytes.
pub const MAX_THREAD_ID_BYTES: usize = 256;

/// A thread id that can be a NATS subject token: non-empty, at most 256 bytes, no `.`, `*`, `>`, whitespace or
/// control characters (`%00` included).
/// It is otherwise opaque and goes into store queries only as a string value, never as query syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadId(String);

impl ThreadId {
    /// # Errors
    /// [`ApiError::InvalidThreadId`] saying which rule the id breaks.
    pub fn parse(id: String) -> Result<Self, ApiError> {
        if id.is_empty() {
            return Err(ApiError::InvalidThreadId("must not be empty"));
        }
        if id.len() > MAX_THREAD_ID_BYTES {
            return Err(ApiError::InvalidThreadId("must be at most 256 bytes"));
        }
        if id.contains(['.', '*', '>']) || id.contains(char::is_whitespace) {
            return Err(ApiError::InvalidThreadId(
                "must not contain '.', '*', '>' or whitespace",
            ));
        }
        if id.contains(char::is_control) {
            return Err(ApiError::InvalidThreadId(
                "must not contain control characters",
            ));
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// aihub's `str_to_object_id` ([contract 8.3](../../docs/contract.md#8.3)) for a non-empty id: a 24-hex id in any case
/// becomes lowercase, anything else the hex of the first 12 bytes of its UTF-8 MD5 digest.
pub fn canonical_object_id(id: &str) -> String {
    if id.len() == 24 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return id.to_ascii_lowercase();
    }
    let digest = Md5::digest(id.as_bytes());
    digest[..12].iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Debug, Deserialize)]
pub struct HistoryQuery {
    agent_class: Option<String>,
    agent_id: Option<String>,
    #[serde(default)]
    canonicalize: bool,
    wait_for_run: Option<String>,
    wait_ms: Option<String>,
}

/// Read-your-writes: answer once `run_id` finished in the thread's answer, or after `wait`.
#[derive(Debug)]
pub struct RunWait {
    run_id: String,
    wait: Duration,
}

impl HistoryQuery {
    /// The primary identity: both parts or neither.
    pub fn identity(&self) -> Result<Option<Identity>, ApiError> {
        match (&self.agent_class, &self.agent_id) {
            (None, None) => Ok(None),
            (Some(agent_class), Some(agent_id))
                if !agent_class.is_empty() && !agent_id.is_empty() =>
            {
                Ok(Some(Identity {
                    agent_class: agent_class.clone(),
                    agent_id: agent_id.clone(),
                }))
            }
            _ => Err(ApiError::IncompleteIdentity),
        }
    }

    /// `wait_for_run` (a non-empty run id) with `wait_ms` (0 to 5000, default 5000).
    pub fn run_wait(&self) -> Result<Option<RunWait>, ApiError> {
        let invalid = |message: &str| Err(ApiError::InvalidQuery(message.into()));
        let wait = match &self.wait_ms {
            None => MAX_WAIT,
            Some(ms) => match ms.parse::<u64>() {
                Ok(ms) if ms <= MAX_WAIT.as_millis() as u64 => Duration::from_millis(ms),
                _ => return invalid("wait_ms must be an integer from 0 to 5000"),
            },
        };
        match &self.wait_for_run {
            None if self.wait_ms.is_some() => invalid("wait_ms needs wait_for_run"),
            None => Ok(None),
            Some(run) if run.is_empty() => invalid("wait_for_run must not be empty"),
            Some(run) => Ok(Some(RunWait {
                run_id: run.clone(),
                wait,
            })),
        }
    }
}

/// Whether a request waits for a run (it names `wait_for_run`, percent-encoded or not): such a request takes a
/// `HISTORY_VIEW_HTTP_MAX_WAITING` permit instead of an in-flight one.
pub fn waits_for_run(uri: &Uri) -> bool {
    uri.query().unwrap_or_default().split('&').any(|pair| {
        let name = pair.split('=').next().unwrap_or_default();
        percent_encoding::percent_decode_str(name).decode_utf8_lossy() == "wait_for_run"
    })
}

/// A read as the routing decided: the owner's answer passed back as it is, or this worker's answer.
pub enum Read<F> {
    Forwarded(Response),
    Answered {
        answer: Answer<F>,
        /// The run the read waited for, when the answer does not hold it finished.
        pending: Option<String>,
    },
}

/// A read of `thread` for `primary` in form `F`, routed among partitioned workers: forwarded to the owner, or
/// answered here, through the cache when this worker owns the thread and from the store otherwise (a forwarded
/// read it does not own either, or an owner that did not answer). With `wait`, a read through the cache is
/// repeated as the thread's view changes until the run finished or the wait ends (after an answer from the store,
/// at most every [`STORE_REREAD_INTERVAL`], so a partial view's waiters do not hydrate on every live event).
pub async fn read<F: Form>(
    state: &AppState,
    thread: &str,
    primary: Option<&Identity>,
    wait: Option<&RunWait>,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Read<F>, ApiError> {
    let cached = match route(state, thread, headers) {
        Route::Local => true,
        Route::Owner(partition) => {
            let waited = wait.map_or(Duration::ZERO, |w| w.wait);
            match forward(state, partition, Method::GET, uri, headers, waited).await {
                Some(response) => return Ok(Read::Forwarded(response)),
                None => false,
            }
        }
        Route::Store => false,
    };
    let once = async || {
        let started = std::time::Instant::now();
        let answer = if cached {
            state.views.read::<F>(thread, primary).await
        } else {
            state.views.read_uncached::<F>(thread, primary).await
        }
        .map_err(|error| ApiError::from_read(error, thread))?;
        state.metrics.http.read(answer.source, started.elapsed());
        Ok::<_, ApiError>(answer)
    };
    let Some(wait) = wait else {
        return Ok(Read::Answered {
            answer: once().await?,
            pending: None,
        });
    };
    let deadline = Instant::now() + wait.wait;
    loop {
        let answer = once().await?;
        if answer.facts.run_finished(&wait.run_id) {
            return Ok(Read::Answered {
                answer,
                pending: None,
            });
        }
        if !cached || Instant::now() >= deadline {
            return Ok(Read::Answered {
                answer,
                pending: Some(wait.run_id.clone()),
            });
        }
        let read_at = Instant::now();
        let until = deadline.min(read_at + crate::cache::CHANGE_RECHECK);
        state
            .views
            .changed(thread, answer.generation, answer.version, until)
            .await;
        if answer.source == Source::Store {
            tokio::time::sleep_until(deadline.min(read_at + STORE_REREAD_INTERVAL)).await;
        }
    }
}

pub async fn get_history(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw_query): RawQuery,
    query: Result<Query<HistoryQuery>, QueryRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (thread_id, query) = thread_and_query(path, raw_query, query)?;
    let primary = query.identity()?;
    let wait = query.run_wait()?;
    let thread = thread_id.as_str();
    match read::<HistoryBody>(
        &state,
        thread,
        primary.as_ref(),
        wait.as_ref(),
        &uri,
        &headers,
    )
    .await?
    {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, pending } => {
            let body = answer.body.body.clone();
            Ok(respond(&answer, &answer.body.etag, body, pending, &headers))
        }
    }
}

/// `POST /v1/threads/{thread_id}/verify`: the shadow comparison now, against the view of the thread's worker (this
/// one, or the owner among partitioned workers, which the request is forwarded to).
pub async fn verify(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw_query): RawQuery,
    query: Result<Query<HistoryQuery>, QueryRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (thread_id, _) = thread_and_query(path, raw_query, query)?;
    let thread = thread_id.as_str();
    match route(&state, thread, &headers) {
        Route::Local => {}
        Route::Owner(partition) => {
            return forward(
                &state,
                partition,
                Method::POST,
                &uri,
                &headers,
                Duration::ZERO,
            )
            .await
            .ok_or(ApiError::OwnerUnreachable);
        }
        // A forwarded request for a thread this worker does not own either: it holds no view of it.
        Route::Store => return Err(ApiError::NotCached),
    }
    match state.views.verify(thread).await {
        Ok(Some(report)) => Ok(axum::Json(report).into_response()),
        Ok(None) => Err(ApiError::NotCached),
        Err(error) => Err(ApiError::from_read(error, thread)),
    }
}

/// The thread id by the path rules (canonical with `canonicalize=true`) and the query, checked as every thread
/// endpoint checks them.
pub fn thread_and_query(
    path: Result<Path<String>, PathRejection>,
    raw_query: Option<String>,
    query: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<(ThreadId, HistoryQuery), ApiError> {
    let Path(raw_id) = path.map_err(|_| ApiError::InvalidThreadId("is not valid UTF-8"))?;
    check_query(raw_query.as_deref())?;
    let Query(query) = query.map_err(|e| ApiError::InvalidQuery(e.body_text()))?;
    let mut thread_id = ThreadId::parse(raw_id)?;
    if query.canonicalize {
        thread_id = ThreadId::parse(canonical_object_id(thread_id.as_str()))?;
    }
    Ok((thread_id, query))
}

/// Where a read is answered.
pub(super) enum Route {
    /// By this worker, through its cache.
    Local,
    /// By the worker of this partition, forwarded.
    Owner(u32),
    /// From the store, without caching: a forwarded read of a thread this worker does not own either.
    Store,
}

/// Routes a read among partitioned workers (every read is local with one partition), counting the route.
pub(super) fn route(state: &AppState, thread_id: &str, headers: &HeaderMap) -> Route {
    let Some(peers) = &state.peers else {
        return Route::Local;
    };
    let route = match peers.owner_elsewhere(thread_id) {
        None => Route::Local,
        Some(_) if headers.contains_key(FORWARDED_HEADER) => Route::Store,
        Some(owner) => return Route::Owner(owner),
    };
    state.metrics.http.read_route(match route {
        Route::Local => ReadRoute::Local,
        _ => ReadRoute::Loop,
    });
    route
}

/// The owner's answer to a forwarded request, passed back as it is; `None` when it gave none in time (a read is
/// then answered from the store).
async fn forward(
    state: &AppState,
    partition: u32,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    waited: Duration,
) -> Option<Response> {
    let peers = state.peers.as_ref()?;
    let forwarded = peers.forward(partition, method, uri, headers, waited).await;
    passed_back(state, partition, forwarded)
}

/// The outcome of a request forwarded to the owner of `partition`, counted (`history_view_read_routes_total`),
/// and warned about, at most once a second, when the owner gave no answer.
pub(super) fn passed_back(
    state: &AppState,
    partition: u32,
    forwarded: Result<Response, super::route::ForwardError>,
) -> Option<Response> {
    match forwarded {
        Ok(response) => {
            state.metrics.http.read_route(ReadRoute::Forwarded);
            Some(response)
        }
        Err(error) => {
            state.metrics.http.read_route(ReadRoute::OwnerUnreachable);
            if state
                .peers
                .as_ref()
                .is_some_and(|peers| peers.warnings.allow())
            {
                tracing::warn!(partition, %error, "the owner of a thread did not answer a forwarded request (a read is answered from the store, a feed or verify 503)");
            }
            None
        }
    }
}

/// Refuses a query string whose names or values do not percent-decode to UTF-8 (the form decoder behind `Query`
/// would replace such bytes silently) or decode to control characters.
fn check_query(raw: Option<&str>) -> Result<(), ApiError> {
    for piece in raw.unwrap_or_default().split(['&', '=']) {
        let decoded = percent_encoding::percent_decode_str(piece)
            .decode_utf8()
            .map_err(|_| ApiError::InvalidQuery("a parameter is not valid UTF-8".into()))?;
        if decoded.contains(char::is_control) {
            return Err(ApiError::InvalidQuery(
                "a parameter contains control characters".into(),
            ));
        }
    }
    Ok(())
}

/// Whether an `If-None-Match` header matches the ETag (weak comparison, `*` matches anything).
fn matches_etag(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|tag| tag.trim().trim_start_matches("W/"))
        .any(|tag| tag == "*" || tag == etag)
}

/// The answer to a read: `body` (a form of `answer`) with `etag`, or 304 when the caller already has it; where it
/// came from, up to when it is covered, and the run it waited for in vain.
pub fn respond<F>(
    answer: &Answer<F>,
    etag: &str,
    body: axum::body::Bytes,
    pending: Option<String>,
    request_headers: &HeaderMap,
) -> Response {
    let not_modified = matches_etag(request_headers, etag);
    let mut response = if not_modified {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()
    };
    let headers = response.headers_mut();
    if let Ok(etag) = HeaderValue::from_str(etag) {
        headers.insert(header::ETAG, etag);
    }
    headers.insert(
        SOURCE_HEADER,
        HeaderValue::from_static(answer.source.label()),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Some(at) = answer.covered_through
        && let Ok(value) = HeaderValue::from_str(&freshness::rfc3339_millis(at))
    {
        headers.insert(COVERED_THROUGH_HEADER, value);
    }
    if let Some(run) = pending
        && let Ok(value) = HeaderValue::from_str(&run)
    {
        headers.insert(RUN_PENDING_HEADER, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_ids_that_cannot_be_subject_tokens_are_rejected() {
        for bad in [
            "",
            "a.b",
            "a*",
            "a>b",
            "a b",
            "a\tb",
            "a\0b",
            "a\u{7f}b",
            "a\u{85}b",
            &"x".repeat(257),
        ] {
            assert!(ThreadId::parse(bad.to_owned()).is_err(), "{bad:?}");
        }
        for good in [
            "66f10000000000000000aaaa",
            "$gt",
            "{\"$ne\":1}",
            &"x".repeat(256),
        ] {
            assert!(ThreadId::parse(good.to_owned()).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn query_strings_must_decode_to_utf8_without_control_characters() {
        for good in [
            None,
            Some(""),
            Some("agent_class=Agent%20A&agent_id=%C3%A9"),
            Some("canonicalize=true"),
        ] {
            assert!(check_query(good).is_ok(), "{good:?}");
        }
        for bad in [
            "agent_class=%FF&agent_id=a",
            "agent_class=a%00&agent_id=a",
            "%FF=1",
            "agent_id=%0A",
        ] {
            assert!(check_query(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn canonical_ids_agree_with_the_shared_table() {
        let table: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("../../tests/conformance/canonical-ids.json"))
                .unwrap();
        assert!(!table.is_empty());
        for row in table {
            let input = row["input"].as_str().unwrap();
            assert_eq!(
                canonical_object_id(input),
                row["canonical"].as_str().unwrap(),
                "{input}"
            );
        }
    }

    #[test]
    fn if_none_match_accepts_lists_weak_tags_and_star() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::IF_NONE_MATCH,
            HeaderValue::from_static("\"a\", W/\"b\""),
        );
        assert!(matches_etag(&headers, "\"b\""));
        assert!(!matches_etag(&headers, "\"c\""));
        headers.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        assert!(matches_etag(&headers, "\"c\""));
    }
}
