//! `GET /v1/threads/{thread_id}/history/explain` ([design 3.3](../../docs/design.md#3.3)): every event of the thread
//! with its fate, from the same read as the history (the read core, [`super::read`]: same routing, source and
//! completeness) joined with the stored rows' metadata (one scan shared by the explains asking meanwhile, within the
//! explain share of the store-read slots: [`crate::cache::RowScan`]); and `GET /inspect/threads/{thread_id}`, the inspector page
//! that shows it beside the live feed.

use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::read::{Read, ThreadId, ThreadRequest, read, respond};
use super::{ApiError, AppState};
use crate::cache::etag_of;
use crate::explain::{ViewFates, explain as join};

/// The inspector page: one HTML file, no build step.
const INSPECTOR_PAGE: &str = include_str!("inspector.html");

/// `GET /v1/threads/{thread_id}/history/explain`.
pub async fn explain(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("explain")?;
    match read::<ViewFates>(&state, &request, primary.as_ref(), None).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, .. } => {
            let thread = request.thread.as_str();
            let rows = state
                .views
                .row_metadata(thread)
                .await
                .map_err(|error| ApiError::from_read(error, thread))?;
            let explanation = join(thread, &answer.body, &rows.rows);
            // Serialising strings, numbers and maps of them cannot fail.
            let body = Bytes::from(serde_json::to_vec(&explanation).unwrap_or_default());
            let etag = etag_of(&body);
            let mut response = respond(&answer, &etag, body, None, &request.headers);
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            Ok(response)
        }
    }
}

/// `GET /inspect/threads/{thread_id}`: the inspector page when `HISTORY_VIEW_INSPECTOR` allows it; 404 otherwise.
/// The page holds no data: its script reads the feed and `explain` through the API (with the token typed into
/// it, when one is set).
pub async fn inspector(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    if !state.inspector {
        return Err(ApiError::NotFound);
    }
    let Path(raw_id) = path.map_err(|_| ApiError::InvalidThreadId("is not valid UTF-8"))?;
    ThreadId::parse(raw_id)?;
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
                 img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
    ];
    Ok((headers, INSPECTOR_PAGE).into_response())
}
