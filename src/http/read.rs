//! The read core every thread endpoint shares ([design 3](../../docs/design.md#3)):
//!
//! - [`ThreadRequest`], the one extractor of a thread request: the thread id by the path rules (canonical with
//!   `canonicalize=true`) and the query, checked once (the bearer token was checked before, by the router's
//!   middleware); the identity and the wait for a run on demand, as each endpoint uses them.
//! - [`read`]: a read routed among partitioned workers ([`super::route`]: forwarded to the owner, or answered here
//!   through the cache, or from the store when the owner did not answer), repeated for a read that waits for a run
//!   (inside one `wait_for_run` span).
//! - [`next_change`]: the wait for a thread's answer to change, paced by its caller ([`Pace`]): the wait for a run
//!   and the live feed ([`super::feed`]) both wait through it.
//! - [`respond`]: an answer's body and headers (`ETag`, 304, `X-History-Source`, `X-History-Covered-Through`,
//!   `X-History-Run-Pending`).
//!
//! A handler extracts a `ThreadRequest`, calls one function and maps its result.

use std::time::Duration;

use axum::extract::{FromRequestParts, Path, Query};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use md5::{Digest, Md5};
use serde::Deserialize;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

use super::route::{Forward, Routed, route};
use super::{ApiError, AppState};
use crate::cache::{Answer, AnswerSource, Form, ViewCache};
use crate::freshness;
use crate::project::Identity;
use crate::thread_id::ThreadId;

/// The response header saying where a history came from: `cache` or `store`.
pub const SOURCE_HEADER: &str = "x-history-source";

/// The response header naming the instant up to which the answer holds every event that reached NATS (RFC 3339,
/// milliseconds, UTC).
pub const COVERED_THROUGH_HEADER: &str = "x-history-covered-through";

/// The response header naming the run a read waited for when the answer does not hold it finished.
pub const RUN_PENDING_HEADER: &str = "x-history-run-pending";

/// The longest `wait_ms`.
pub const MAX_WAIT: Duration = Duration::from_millis(5_000);

/// aihub's `str_to_object_id` ([contract 8.3](../../docs/contract.md#8.3)) for a non-empty id: a 24-hex id in any case
/// becomes lowercase, anything else the hex of the first 12 bytes of its UTF-8 MD5 digest.
pub fn canonical_object_id(id: &str) -> String {
    if id.len() == 24 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return id.to_ascii_lowercase();
    }
    let digest = Md5::digest(id.as_bytes());
    digest[..12].iter().map(|b| format!("{b:02x}")).collect()
}

/// The query parameters every thread endpoint reads (the items' paging parameters are the Conversations layer's).
#[derive(Debug, Deserialize)]
struct HistoryQuery {
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

/// A request for one thread, checked as every thread endpoint checks it ([`FromRequestParts`]): the path's thread
/// id is UTF-8 and keeps the path rules ([`ThreadId`], the canonical id with `canonicalize=true`), and the query
/// decodes to UTF-8 without control characters into well-typed parameters. In that order: the first rule broken is
/// the error. The identity and the wait for a run are checked by the endpoints that use them (`verify` ignores
/// both, the conversation ignores the wait).
pub struct ThreadRequest {
    pub thread: ThreadId,
    query: HistoryQuery,
    /// The path and query as the caller sent them: what a forward sends the owner.
    pub uri: Uri,
    /// The caller's headers: `If-None-Match` for a 304, `Last-Event-ID` for a feed, what a forward passes on.
    pub headers: HeaderMap,
}

impl<S: Send + Sync> FromRequestParts<S> for ThreadRequest {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // By name: a path may hold more than the thread (a response's run id).
        let Path(mut path) =
            Path::<std::collections::HashMap<String, String>>::from_request_parts(parts, state)
                .await
                .map_err(|_| ApiError::InvalidThreadId("is not valid UTF-8"))?;
        let raw_id = path.remove("thread_id").unwrap_or_default();
        check_query(parts.uri.query())?;
        let Query(query) = Query::<HistoryQuery>::try_from_uri(&parts.uri)
            .map_err(|e| ApiError::InvalidQuery(e.body_text()))?;
        let mut thread = ThreadId::parse(raw_id)?;
        if query.canonicalize {
            thread = ThreadId::parse(canonical_object_id(thread.as_str()))?;
        }
        Ok(Self {
            thread,
            query,
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
        })
    }
}

impl ThreadRequest {
    /// The primary identity: both parts or neither.
    ///
    /// # Errors
    /// [`ApiError::IncompleteIdentity`] for one part alone or an empty one.
    pub fn identity(&self) -> Result<Option<Identity>, ApiError> {
        match (&self.query.agent_class, &self.query.agent_id) {
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
    ///
    /// # Errors
    /// [`ApiError::InvalidQuery`] for a `wait_ms` out of range or without `wait_for_run`, or an empty run id.
    pub fn run_wait(&self) -> Result<Option<RunWait>, ApiError> {
        let invalid = |message: &str| Err(ApiError::InvalidQuery(message.into()));
        let wait = match &self.query.wait_ms {
            None => MAX_WAIT,
            Some(ms) => match query_number(ms) {
                Ok(ms) if ms <= MAX_WAIT.as_millis() as u64 => Duration::from_millis(ms),
                _ => return invalid("wait_ms must be an integer from 0 to 5000"),
            },
        };
        match &self.query.wait_for_run {
            None if self.query.wait_ms.is_some() => invalid("wait_ms needs wait_for_run"),
            None => Ok(None),
            Some(run) if run.is_empty() => invalid("wait_for_run must not be empty"),
            Some(run) => Ok(Some(RunWait {
                run_id: run.clone(),
                wait,
            })),
        }
    }

    /// Refuses a wait for a run on `endpoint`, which does not wait (the feed, explain).
    ///
    /// # Errors
    /// [`ApiError::InvalidQuery`]: the wait's own error when it is malformed, else one naming `endpoint`.
    pub fn refuse_run_wait(&self, endpoint: &str) -> Result<(), ApiError> {
        if self.run_wait()?.is_some() {
            return Err(ApiError::InvalidQuery(format!(
                "wait_for_run applies to the history and the items, not to {endpoint}"
            )));
        }
        Ok(())
    }
}

/// A number in a query as the API documents it: decimal digits only, without a sign, spaces or leading zeros
/// (`0` itself aside), so `+5`, `05` and ` 5` are refused rather than read as 5 (Rust's integer parsing takes a `+`
/// and leading zeros).
pub(super) fn query_number(text: &str) -> Result<u64, ()> {
    let canonical = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if canonical {
        text.parse().map_err(|_| ())
    } else {
        Err(())
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

/// A read of the request's thread for `primary` in form `F`, routed among partitioned workers: forwarded to the
/// owner, or answered here, through the cache when this worker owns the thread and from the store otherwise (a
/// forwarded read it does not own either, or an owner that did not answer: the fallback). With `wait`, a read
/// through the cache is repeated as the thread's view changes ([`next_change`], paced by [`RUN_WAIT`]) until the
/// run finished or the wait ends; a read from the store is answered at once.
pub async fn read<F: Form>(
    state: &AppState,
    request: &ThreadRequest,
    primary: Option<&Identity>,
    wait: Option<&RunWait>,
) -> Result<Read<F>, ApiError> {
    let thread = request.thread.as_str();
    let waited = wait.map_or(Duration::ZERO, |w| w.wait);
    let forward = Forward::Read { waited };
    let cached = match route(state, thread, forward, &request.uri, &request.headers).await {
        Routed::Local => true,
        Routed::Forwarded(response) => return Ok(Read::Forwarded(response)),
        Routed::Misdirected => return Err(ApiError::Misdirected),
        // Only the owner receives the thread's events: a view here could never be complete, so none is made.
        Routed::OwnerSilent => false,
    };
    let once = async || {
        let started = std::time::Instant::now();
        let answer = if cached {
            state.views.read::<F>(thread, primary).await
        } else {
            state.views.read_uncached::<F>(thread, primary).await
        }
        .map_err(|error| ApiError::from_read(error, thread))?;
        state.metrics.read(answer.source, started.elapsed());
        Ok::<_, ApiError>(answer)
    };
    let Some(wait) = wait else {
        return Ok(Read::Answered {
            answer: once().await?,
            pending: None,
        });
    };
    // The wait is a span of its own ([design 5](../../docs/design.md#5), "Traces"): each read it repeats is a child.
    let span = tracing::info_span!(
        "wait_for_run",
        otel.kind = "internal",
        chat_history_view.run_finished = Empty,
        otel.status_code = Empty,
    );
    let waited = async {
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
            next_change(
                &state.views,
                thread,
                Seen::of(&answer),
                RUN_WAIT,
                Instant::now(),
                Some(deadline),
            )
            .await;
        }
    };
    let read = waited.instrument(span.clone()).await;
    match &read {
        Ok(Read::Answered { pending, .. }) => {
            span.record("chat_history_view.run_finished", pending.is_none());
        }
        Ok(Read::Forwarded(_)) => {}
        Err(_) => {
            span.record("otel.status_code", "error");
        }
    }
    read
}

/// How a reader that follows a thread's answer paces its reads: the wait for a run ([`RUN_WAIT`]) and the live
/// feed (`feed::FEED`) differ because they wait for different things.
///
/// - `recheck`: the longest one wait listens to the thread's entry. A notification reaches only listeners of the
///   entry they found; an entry made meanwhile (the thread's was evicted and a read made a new one) is not
///   listened to, so a reader looks again this often. A read waiting for a run answers its caller as soon as the
///   run is there, within `wait_ms`: 250 ms. An open feed lives for minutes, and hundreds may be open: a second.
/// - `after_cache`: the shortest time from the caller's `since` to the next read after an answer from memory. The
///   wait for a run reads at once (zero: it answers once, when its run finished); the feed sends changes within
///   5 ms of its last event together, in one event.
/// - `after_store`: the same after an answer from the store: the view was partial, so the next read hydrates again;
///   both wait [`STORE_REREAD_INTERVAL`], so a partial view's waiters do not hydrate on every live event.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    pub recheck: Duration,
    pub after_cache: Duration,
    pub after_store: Duration,
}

/// The shortest interval between two reads of a waiting reader when the last one was answered from the store.
pub const STORE_REREAD_INTERVAL: Duration = Duration::from_millis(100);

/// The pace of a read waiting for a run.
pub const RUN_WAIT: Pace = Pace {
    recheck: Duration::from_millis(250),
    after_cache: Duration::ZERO,
    after_store: STORE_REREAD_INTERVAL,
};

/// The answer a reader that follows a thread saw last: its name (the entry's generation and the view's version)
/// and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub generation: u64,
    pub version: u64,
    pub source: AnswerSource,
}

impl Seen {
    pub fn of<F>(answer: &Answer<F>) -> Self {
        Self {
            generation: answer.generation,
            version: answer.version,
            source: answer.source,
        }
    }
}

/// Waits until the thread's answer may no longer be `seen`: the entry that rendered it notified a change or was
/// replaced, or `pace.recheck` passed; then until `since` plus the pause `pace` asks after an answer from `seen`'s
/// source. Never past `deadline`.
pub async fn next_change(
    views: &ViewCache,
    thread: &str,
    seen: Seen,
    pace: Pace,
    since: Instant,
    deadline: Option<Instant>,
) {
    let within = |at: Instant| deadline.map_or(at, |deadline| deadline.min(at));
    let recheck_at = within(Instant::now() + pace.recheck);
    views
        .changed(thread, seen.generation, seen.version, recheck_at)
        .await;
    let pause = match seen.source {
        AnswerSource::Store => pace.after_store,
        AnswerSource::Cache => pace.after_cache,
    };
    if !pause.is_zero() {
        tokio::time::sleep_until(within(since + pause)).await;
    }
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

    #[test]
    fn query_numbers_are_plain_decimal_digits() {
        assert_eq!(super::query_number("0"), Ok(0));
        assert_eq!(super::query_number("5"), Ok(5));
        assert_eq!(super::query_number("5000"), Ok(5000));
        for refused in [
            "",
            "+5",
            "05",
            "00",
            " 5",
            "5 ",
            "-0",
            "5e2",
            "0x5",
            "99999999999999999999",
        ] {
            assert_eq!(super::query_number(refused), Err(()), "{refused:?}");
        }
    }
}
