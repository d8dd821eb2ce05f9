//! The OpenAI Conversations shape of a thread ([design 3.1](../../docs/design.md#3.1)): `GET
//! /v1/conversations/{thread_id}/items` pages the history's messages as Conversations items, tail-first by
//! default, cut from exactly the answer the history endpoint gives (the same read core, [`super::read`]: routing,
//! source and completeness, waiting for a run); `GET /v1/conversations/{thread_id}` describes the conversation.
//!
//! The paging is here: the parameters, the `after` cursor (an item id, decoded by [`parse_item_id`]; a page names
//! its ends by the same ids, [`format_item_id`]) and the list body, cut from the items the cache rendered once
//! ([`Items`]: every item's JSON, its id and an index from id to position) by copying the page's items only.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::Response;
use bytes::{BufMut, BytesMut};
use serde::Deserialize;

use super::read::{Read, ThreadRequest, read, respond};
use super::{ApiError, AppState};
use crate::cache::{ItemId, Items};
use crate::project::format_item_id;

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

/// Which way a page runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    Asc,
    /// Newest first: the default.
    #[default]
    Desc,
}

impl PageQuery {
    fn limit(&self) -> Result<usize, ApiError> {
        match &self.limit {
            None => Ok(DEFAULT_LIMIT),
            Some(text) => match super::read::query_number(text) {
                Ok(limit) if (1..=MAX_LIMIT as u64).contains(&limit) => Ok(limit as usize),
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
            // The cursor is checked against the answer read: an `after` naming no current item is refused.
            let body = cut_page(&answer.body, order, page.after.as_deref(), limit)?;
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

/// The `after` cursor: an item id as the items show it ([`format_item_id`]: `msg_` and the 32 lowercase hex digits
/// of its digest), back to its digest; `None` for any other text.
fn parse_item_id(text: &str) -> Option<ItemId> {
    let hex = text.strip_prefix("msg_")?.as_bytes();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (byte, pair) in id.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        *byte = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(id)
}

/// The list body of the page of at most `limit` items in `order` after the item `after` (from the first item in
/// that order without one): `{"object": "list", "data", "first_id", "last_id", "has_more"}`.
///
/// # Errors
/// [`ApiError::InvalidCursor`] when `after` names no item of `items`.
fn cut_page(
    items: &Items,
    order: Order,
    after: Option<&str>,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let len = items.len();
    // Positions in `order`: 0 is the first item of the page sequence.
    let start = match after {
        None => 0,
        Some(after) => {
            let at = parse_item_id(after)
                .and_then(|id| items.position(&id))
                .ok_or(ApiError::InvalidCursor)?;
            match order {
                Order::Asc => at + 1,
                Order::Desc => len - at,
            }
        }
    };
    let end = (start + limit).min(len);
    let positions = (start..end).map(|i| match order {
        Order::Asc => i,
        Order::Desc => len - 1 - i,
    });
    let span: usize = positions.clone().map(|at| items.json(at).len() + 1).sum();
    let mut body = BytesMut::with_capacity(128 + span);
    body.put_slice(br#"{"object":"list","data":["#);
    let mut first_id = None;
    let mut last_id = None;
    for (n, at) in positions.enumerate() {
        if n > 0 {
            body.put_u8(b',');
        }
        body.put_slice(items.json(at));
        first_id.get_or_insert(at);
        last_id = Some(at);
    }
    body.put_slice(br#"],"first_id":"#);
    put_id(&mut body, items, first_id);
    body.put_slice(br#","last_id":"#);
    put_id(&mut body, items, last_id);
    body.put_slice(if end < len {
        br#","has_more":true}"#
    } else {
        br#","has_more":false}"#
    });
    Ok(body.freeze())
}

/// The id of the item at `at` as a JSON string (what a next page's `after` names), or `null` on an empty page.
fn put_id(body: &mut BytesMut, items: &Items, at: Option<usize>) {
    match at {
        Some(at) => {
            body.put_u8(b'"');
            body.put_slice(format_item_id(items.id(at)).as_bytes());
            body.put_u8(b'"');
        }
        None => body.put_slice(b"null"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::ViewEvent;
    use crate::decode::testing::chunk;
    use crate::project::project;
    use serde_json::{Value, json};

    fn user(id: &str, at: i64, text: &str) -> ViewEvent {
        crate::decode::testing::user("d", id, at, text)
    }

    fn page(items: &Items, order: Order, after: Option<&str>, limit: usize) -> Value {
        serde_json::from_slice(&cut_page(items, order, after, limit).unwrap()).unwrap()
    }

    /// Every page walk in either order with any limit yields the items once each, in order.
    #[test]
    fn pages_walk_the_items_in_either_order_with_any_limit() {
        let mut events = Vec::new();
        for i in 0..7 {
            events.push(user(&format!("u{i}"), i * 10, &format!("q{i}")));
            events.push(chunk(
                &format!("r{i}"),
                &format!("c{i}"),
                i * 10 + 1,
                &format!("a{i}"),
            ));
        }
        let items = Items::new(&project(&events, None));
        assert_eq!(items.len(), 14);
        let all = page(&items, Order::Asc, None, 100);
        let all: Vec<Value> = all["data"].as_array().unwrap().clone();
        for order in [Order::Asc, Order::Desc] {
            for limit in 1..=15 {
                let mut walked = Vec::new();
                let mut after: Option<String> = None;
                loop {
                    let page = page(&items, order, after.as_deref(), limit);
                    let data = page["data"].as_array().unwrap();
                    assert!(data.len() <= limit);
                    assert_eq!(page["first_id"], data[0]["id"]);
                    walked.extend(data.iter().cloned());
                    if !page["has_more"].as_bool().unwrap() {
                        break;
                    }
                    assert_eq!(page["last_id"], data.last().unwrap()["id"]);
                    after = Some(page["last_id"].as_str().unwrap().to_owned());
                }
                if order == Order::Desc {
                    walked.reverse();
                }
                assert_eq!(walked, all, "{order:?} {limit}");
            }
        }
    }

    #[test]
    fn an_after_naming_no_item_is_an_invalid_cursor_and_an_empty_history_pages_empty() {
        let items = Items::new(&project(&[user("u1", 1, "q")], None));
        for bad in [
            "",
            "msg_",
            "msg_zz",
            "msg_00000000000000000000000000000000",
            "x",
        ] {
            assert!(
                matches!(
                    cut_page(&items, Order::Desc, Some(bad), 20),
                    Err(ApiError::InvalidCursor)
                ),
                "{bad}"
            );
        }
        let empty = Items::new(&project(&[], None));
        assert!(empty.is_empty());
        assert_eq!(
            page(&empty, Order::Desc, None, 20),
            json!({"object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false})
        );
        let id = page(&items, Order::Asc, None, 1)["first_id"].clone();
        let rest = page(&items, Order::Asc, id.as_str(), 1);
        assert_eq!(rest["data"], json!([]));
        assert_eq!(rest["has_more"], false);
    }

    #[test]
    fn a_cursor_is_an_item_id_and_nothing_else() {
        let digest: ItemId = std::array::from_fn(|i| (i as u8) * 17);
        let id = format_item_id(&digest);
        assert_eq!(id, "msg_00112233445566778899aabbccddeeff");
        assert_eq!(parse_item_id(&id), Some(digest));
        for bad in [
            "msg_00112233445566778899AABBCCDDEEFF",
            "msg_00112233445566778899aabbccddeef",
            "msg_00112233445566778899aabbccddeeff0",
            "MSG_00112233445566778899aabbccddeeff",
            " msg_00112233445566778899aabbccddeeff",
            "msg_0011223344556677889 aabbccddeeff",
        ] {
            assert_eq!(parse_item_id(bad), None, "{bad}");
        }
    }
}
