//! `GET /v1/threads/{thread_id}/history` ([design 3](../../docs/design.md#3)): the thread's history body, its ETag
//! and its source (or 304 when the caller already has it), read by the read core ([`super::read`]); and `POST
//! /v1/threads/{thread_id}/verify`, the shadow comparison of the thread's view now.

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::read::{Read, ThreadRequest, read, respond};
use super::route::{Forward, route};
use super::{ApiError, AppState};
use crate::cache::{HistoryBody, Verified};

/// `GET /v1/threads/{thread_id}/history`.
pub async fn get_history(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    let wait = request.run_wait()?;
    match read::<HistoryBody>(&state, &request, primary.as_ref(), wait.as_ref()).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, pending } => {
            let body = answer.body.body.clone();
            let etag = &answer.body.etag;
            Ok(respond(&answer, etag, body, pending, &request.headers))
        }
    }
}

/// `POST /v1/threads/{thread_id}/verify`: the shadow comparison now, against the view of the thread's worker (this
/// one, or the owner among partitioned workers, which the request is forwarded to): 429 beyond verify's budget, and
/// `not_complete` for a view that is not complete. The identity and the other query parameters are ignored.
pub async fn verify(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let thread = request.thread.as_str();
    let routed = route(
        &state,
        thread,
        Forward::Verify,
        &request.uri,
        &request.headers,
    )
    .await;
    if let Some(response) = routed.without_fallback()? {
        return Ok(response);
    }
    match state.views.verify(thread).await {
        Ok(Verified::Report(report)) => Ok(axum::Json(report).into_response()),
        Ok(Verified::NotCached) => Err(ApiError::NotCached),
        Ok(Verified::Refused) => Err(ApiError::VerifyLimited),
        Err(error) => Err(ApiError::from_read(error, thread)),
    }
}
