//! The OpenAI Conversations shape of a thread ([design 3.1](../../docs/design.md#3.1)): `GET
//! /v1/conversations/{thread_id}/items` pages the history's messages as Conversations items, tail-first by
//! default, cut from exactly the answer the history endpoint gives (the same read core, [`super::read`]: routing,
//! source and completeness, waiting for a run); `GET /v1/conversations/{thread_id}` describes the conversation.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::Response;
use serde::Deserialize;

use super::read::{Read, ThreadRequest, read, respond};
use super::{ApiError, AppState};
use crate::cache::{InvalidCursor, Items, Order};

/// The largest and the default `limit`.
pub const MAX_LIMIT: usize = 100;
pub const DEFAULT_LIMIT: usize = 20;

/// The paging parameters; `include` / `include[]` are accepted and ignored (the items carry no optional fields).
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    limit: Option<String>,
    order: Option<String>,
    after: Option<String>,
}

impl PageQuery {
    fn limit(&self) -> Result<usize, ApiError> {
        match &self.limit {
            None => Ok(DEFAULT_LIMIT),
            Some(text) => match text.parse::<usize>() {
                Ok(limit) if (1..=MAX_LIMIT).contains(&limit) => Ok(limit),
                _ => Err(ApiError::InvalidQuery(
                    "limit must be an integer from 1 to 100".into(),
                )),
            },
        }
    }

    fn order(&self) -> Result<Order, ApiError> {
        match self.order.as_deref() {
            None => Ok(Order::default()),
            Some("asc") => Ok(Order::Asc),
            Some("desc") => Ok(Order::Desc),
            Some(_) => Err(ApiError::InvalidQuery("order must be asc or desc".into())),
        }
    }
}

/// `GET /v1/conversations/{thread_id}/items`.
pub async fn list_items(
    State(state): State<AppState>,
    request: ThreadRequest,
    page: Result<Query<PageQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(page) = page.map_err(|e| ApiError::InvalidQuery(e.body_text()))?;
    let (limit, order) = (page.limit()?, page.order()?);
    let primary = request.identity()?;
    let wait = request.run_wait()?;
    match read::<Items>(&state, &request, primary.as_ref(), wait.as_ref()).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, pending } => {
            let body = answer
                .body
                .page(order, page.after.as_deref(), limit)
                .map_err(|InvalidCursor| ApiError::InvalidCursor)?;
            let etag = &answer.body.etag;
            Ok(respond(&answer, etag, body, pending, &request.headers))
        }
    }
}

/// `GET /v1/conversations/{thread_id}`: `{"id", "object": "conversation", "created_at", "metadata": {}}`, the
/// creation time being the first visible event's (whole seconds); 404 when no display of the thread is visible.
pub async fn get_conversation(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    match read::<Items>(&state, &request, primary.as_ref(), None).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, .. } => {
            if !answer.facts.visible {
                return Err(ApiError::NoConversation);
            }
            let created_at = answer
                .facts
                .first_visible_at
                .map_or(0, |ns| ns.div_euclid(1_000_000_000));
            let body = serde_json::json!({
                "id": request.thread.as_str(),
                "object": "conversation",
                "created_at": created_at,
                "metadata": {},
            });
            let body = Bytes::from(body.to_string());
            let etag = crate::cache::etag_of(&body);
            Ok(respond(&answer, &etag, body, None, &request.headers))
        }
    }
}
