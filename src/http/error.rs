//! `ApiError`: every failure a caller can see, mapped in one place to a status and a JSON body
//! `{"error": {"code", "message"}}`. Internal detail goes to the log, never into the body.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::cache::ReadError;
use crate::store::StoreError;
use crate::thread_id::InvalidThreadId;

/// The header telling a client whether to retry an error answer; the official OpenAI SDKs read it before their
/// own rules (which retry 408, 409, 429 and every 5xx). Sent as `false` on the answers a retry cannot change.
pub const SHOULD_RETRY_HEADER: &str = "x-should-retry";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The path's thread id breaks a rule of [`crate::thread_id::ThreadId`]: which one.
    #[error("thread_id {0}")]
    InvalidThreadId(&'static str),
    #[error("agent_class and agent_id must be given together, both non-empty")]
    IncompleteIdentity,
    #[error("invalid query: {0}")]
    InvalidQuery(String),
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("the event store is unavailable; try again")]
    StoreUnavailable(#[source] ReadError),
    /// The store refused the thread's query for a reason retrying cannot fix (logged with the thread id and the
    /// store's reason, never answered).
    #[error("the event store rejected the query for this thread")]
    StoreQueryRejected { thread_id: Box<str>, cause: String },
    /// The thread's events exceed the per-thread limit; retrying does not help while the thread stays that large.
    #[error(
        "the thread's history exceeds this service's per-thread limit of {limit} bytes (HISTORY_VIEW_MAX_THREAD_BYTES)"
    )]
    ThreadTooLarge { limit: usize },
    /// Too many connections or reads at once; retry shortly.
    #[error("the service is busy; try again")]
    Overloaded,
    #[error("no such resource")]
    NotFound,
    /// A path the API serves, with a method it does not serve there (the `Allow` header lists those it does).
    #[error("this method is not allowed on this path")]
    MethodNotAllowed,
    /// `after` names no item of the conversation's current items.
    #[error("after names no item of this conversation")]
    InvalidCursor,
    /// A conversation of a thread without a client-visible display.
    #[error("no conversation with this id (the thread has no client-visible display)")]
    NoConversation,
    /// A response (a run) the thread's answer does not hold.
    #[error("no response with this id in the thread (no run of that id wrote a message)")]
    NoResponse,
    /// `verify` of a thread this worker does not hold in its cache.
    #[error("the thread is not in this worker's cache; nothing to verify")]
    NotCached,
    /// `verify` beyond its budget (`HISTORY_VIEW_SHADOW_MAX_PER_SEC` a second), or of a thread being verified.
    #[error(
        "too many verify requests (at most HISTORY_VIEW_SHADOW_MAX_PER_SEC a second, one a thread at a time); try again"
    )]
    VerifyLimited,
    /// `verify` of a thread another partitioned worker owns, which did not answer in time.
    #[error("the worker owning this thread did not answer; try again")]
    OwnerUnreachable,
    /// A request marked forwarded (`X-History-Forwarded`) for a thread this worker does not own.
    #[error(
        "this worker does not own the thread; send the request to any worker without X-History-Forwarded"
    )]
    Misdirected,
    /// The worker is shutting down: the reason a live feed ends at shutdown (its `end` event,
    /// [design 3.2](../../docs/design.md#3.2)). No request is answered with it: a stopping worker answers as usual
    /// during its shutdown delay, then accepts no connection.
    #[error("the worker is shutting down; reconnect to resume")]
    ShuttingDown,
}

impl From<InvalidThreadId> for ApiError {
    fn from(error: InvalidThreadId) -> Self {
        ApiError::InvalidThreadId(error.0)
    }
}

impl ApiError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::InvalidThreadId(_) => (StatusCode::BAD_REQUEST, "invalid_thread_id"),
            ApiError::IncompleteIdentity => (StatusCode::BAD_REQUEST, "incomplete_identity"),
            ApiError::InvalidQuery(_) => (StatusCode::BAD_REQUEST, "invalid_query"),
            ApiError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::StoreUnavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable"),
            ApiError::StoreQueryRejected { .. } => {
                (StatusCode::INTERNAL_SERVER_ERROR, "store_query_rejected")
            }
            ApiError::ThreadTooLarge { .. } => {
                (StatusCode::INSUFFICIENT_STORAGE, "thread_too_large")
            }
            ApiError::Overloaded => (StatusCode::SERVICE_UNAVAILABLE, "overloaded"),
            ApiError::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::InvalidCursor => (StatusCode::BAD_REQUEST, "invalid_cursor"),
            ApiError::NoConversation | ApiError::NoResponse => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::NotCached => (StatusCode::NOT_FOUND, "thread_not_cached"),
            ApiError::OwnerUnreachable => (StatusCode::SERVICE_UNAVAILABLE, "owner_unreachable"),
            ApiError::Misdirected => (StatusCode::MISDIRECTED_REQUEST, "misdirected"),
            ApiError::VerifyLimited => (StatusCode::TOO_MANY_REQUESTS, "verify_limited"),
            ApiError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        }
    }

    /// Whether the same request may succeed if sent again unchanged: `Some(false)` for the answers no retry can
    /// change (bad input, a missing resource or method, a missing or wrong token, a misdirected forward, a query
    /// the store refuses, a thread too large), sent as `x-should-retry: false` ([`SHOULD_RETRY_HEADER`], the
    /// header the official OpenAI SDKs honour before their own rules, which retry every 5xx); `None` for the
    /// passing conditions, which carry `Retry-After` instead ([design 3](../../docs/design.md#3)).
    fn should_retry(&self) -> Option<bool> {
        match self {
            ApiError::InvalidThreadId(_)
            | ApiError::IncompleteIdentity
            | ApiError::InvalidQuery(_)
            | ApiError::InvalidCursor
            | ApiError::Unauthorized
            | ApiError::NotFound
            | ApiError::NoConversation
            | ApiError::NoResponse
            | ApiError::NotCached
            | ApiError::MethodNotAllowed
            | ApiError::Misdirected
            | ApiError::StoreQueryRejected { .. }
            | ApiError::ThreadTooLarge { .. } => Some(false),
            ApiError::StoreUnavailable(_)
            | ApiError::Overloaded
            | ApiError::OwnerUnreachable
            | ApiError::VerifyLimited
            | ApiError::ShuttingDown => None,
        }
    }

    /// The JSON body of this error, `{"error": {"code", "message"}}`: the body of its response, and the data of a
    /// live feed's `end` event ([design 3.2](../../docs/design.md#3.2)), so a feed ends with exactly what the
    /// history would answer.
    pub fn body(&self) -> serde_json::Value {
        let (_, code) = self.status_and_code();
        json!({"error": {"code": code, "message": self.to_string()}})
    }

    /// What the body keeps out and the log tells: the cause of a store outage, or of a query the store refused.
    pub fn log_line(&self) -> Option<ErrorLog> {
        match self {
            ApiError::StoreUnavailable(error) => Some(ErrorLog::StoreUnavailable {
                error: chain(error),
            }),
            ApiError::StoreQueryRejected { thread_id, cause } => {
                Some(ErrorLog::StoreQueryRejected {
                    thread_id: thread_id.clone(),
                    error: cause.clone(),
                })
            }
            _ => None,
        }
    }
}

/// An error answer's log line, carried from the answer to where it is written: the middleware that counts error
/// answers (a response's extension), or a feed's `end`. Written once per answer.
#[derive(Debug, Clone)]
pub enum ErrorLog {
    StoreUnavailable { error: String },
    StoreQueryRejected { thread_id: Box<str>, error: String },
}

impl ErrorLog {
    pub fn write(&self) {
        match self {
            ErrorLog::StoreUnavailable { error } => {
                tracing::warn!(error = %error, "history read failed: store unavailable");
            }
            ErrorLog::StoreQueryRejected { thread_id, error } => {
                tracing::error!(thread_id = &**thread_id, error = %error, "history read failed: the store rejected the query");
            }
        }
    }
}

/// Renders an error chain on one line for the log.
pub(super) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl ApiError {
    /// The answer to a history read of `thread_id` that failed with `error`.
    pub fn from_read(error: ReadError, thread_id: &str) -> Self {
        match error {
            ReadError::Store(StoreError::Rejected(cause)) => ApiError::StoreQueryRejected {
                thread_id: thread_id.into(),
                cause: chain(&cause),
            },
            // Logged (rate-limited) where the limit was met.
            ReadError::TooLarge { limit } => ApiError::ThreadTooLarge { limit },
            other => ApiError::StoreUnavailable(other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, _) = self.status_and_code();
        let mut response = (status, Json(self.body())).into_response();
        if let Some(log) = self.log_line() {
            // Written by the middleware that counts error answers.
            response.extensions_mut().insert(log);
        }
        let headers = response.headers_mut();
        if self.should_retry() == Some(false) {
            headers.insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
        }
        match self {
            ApiError::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // A verify's budget refills at least one a second.
            ApiError::StoreUnavailable(_)
            | ApiError::Overloaded
            | ApiError::OwnerUnreachable
            | ApiError::VerifyLimited
            | ApiError::ShuttingDown => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejected_query_is_a_500_without_retry_after_and_an_outage_a_503_with_it() {
        let rejected = ApiError::from_read(
            StoreError::Rejected(mongodb::error::Error::custom("bad value")).into(),
            "t",
        )
        .into_response();
        assert_eq!(rejected.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(rejected.headers().get(header::RETRY_AFTER).is_none());

        let outage = ApiError::from_read(
            StoreError::Timeout(std::time::Duration::from_secs(1)).into(),
            "t",
        )
        .into_response();
        assert_eq!(outage.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(outage.headers()[header::RETRY_AFTER], "1");

        let too_large =
            ApiError::from_read(ReadError::TooLarge { limit: 1 << 20 }, "t").into_response();
        assert_eq!(too_large.status(), StatusCode::INSUFFICIENT_STORAGE);
        assert!(too_large.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn permanent_errors_say_not_to_retry_and_passing_ones_say_when_to() {
        let permanent = [
            ApiError::InvalidThreadId("is empty"),
            ApiError::IncompleteIdentity,
            ApiError::InvalidQuery("limit".into()),
            ApiError::InvalidCursor,
            ApiError::Unauthorized,
            ApiError::NotFound,
            ApiError::NoConversation,
            ApiError::NoResponse,
            ApiError::NotCached,
            ApiError::MethodNotAllowed,
            ApiError::Misdirected,
            ApiError::StoreQueryRejected {
                thread_id: "t".into(),
                cause: String::new(),
            },
            ApiError::ThreadTooLarge { limit: 1 << 20 },
        ];
        for error in permanent {
            let name = format!("{error:?}");
            let response = error.into_response();
            assert_eq!(response.headers()[SHOULD_RETRY_HEADER], "false", "{name}");
            assert!(
                response.headers().get(header::RETRY_AFTER).is_none(),
                "{name}"
            );
        }
        let passing = [
            ApiError::Overloaded,
            ApiError::OwnerUnreachable,
            ApiError::VerifyLimited,
            ApiError::ShuttingDown,
            ApiError::from_read(
                StoreError::Timeout(std::time::Duration::from_secs(1)).into(),
                "t",
            ),
        ];
        for error in passing {
            let name = format!("{error:?}");
            let response = error.into_response();
            assert!(
                response.headers().get(SHOULD_RETRY_HEADER).is_none(),
                "{name}"
            );
            assert_eq!(response.headers()[header::RETRY_AFTER], "1", "{name}");
        }
    }

    #[test]
    fn a_verify_beyond_its_budget_is_a_429_with_retry_after() {
        let refused = ApiError::VerifyLimited.into_response();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
    }

    #[tokio::test]
    async fn the_body_a_feed_ends_with_is_the_response_body() {
        for error in [
            ApiError::ThreadTooLarge { limit: 1 << 20 },
            ApiError::StoreQueryRejected {
                thread_id: "t".into(),
                cause: String::new(),
            },
            ApiError::ShuttingDown,
        ] {
            let body = error.body();
            let response = error.into_response();
            let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .expect("a body");
            let answered: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
            assert_eq!(answered, body);
        }
        let body = ApiError::ThreadTooLarge { limit: 1 << 20 }.body();
        assert_eq!(body["error"]["code"], "thread_too_large");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("1048576 bytes (HISTORY_VIEW_MAX_THREAD_BYTES)"))
        );
        assert_eq!(
            ApiError::ShuttingDown.body()["error"]["code"],
            "shutting_down"
        );
    }
}
