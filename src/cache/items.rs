//! The Conversations items form of a history ([design 3.1](../../docs/design.md#3.1)): every message rendered once
//! as an OpenAI Conversations `message` item, with its id and status from the projector's provenance, and pages
//! cut from them by copying the page's items only.

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;

use super::etag::etag_of;
use crate::decode::Part;
use crate::project::{HistoryMessage, Projection, Role, format_item_id as format_id};

/// An item id's digest ([`crate::project::Provenance::id`]).
type ItemId = [u8; 16];

/// A history's messages as rendered items.
#[derive(Debug)]
pub struct Items {
    /// Every item's JSON, one after the other, in history order.
    json: Bytes,
    /// Where each item's JSON ends in `json`.
    ends: Vec<u32>,
    /// Each item's id, in history order.
    ids: Vec<ItemId>,
    /// Each id's position.
    index: HashMap<ItemId, u32>,
    /// A strong validator of every item (so of every page cut from them).
    pub etag: String,
}

/// Which way a page runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    Asc,
    #[default]
    Desc,
}

/// An `after` cursor naming no item of the history.
#[derive(Debug, PartialEq, Eq)]
pub struct InvalidCursor;

impl Items {
    pub fn new(projection: &Projection) -> Self {
        let messages = &projection.history.messages;
        let mut json = Vec::with_capacity(messages.len() * 128);
        let mut ends = Vec::with_capacity(messages.len());
        let mut ids = Vec::with_capacity(messages.len());
        let mut index = HashMap::with_capacity(messages.len());
        for (message, provenance) in messages.iter().zip(&projection.provenance) {
            let id = provenance.id_digest();
            let item = ItemJson {
                kind: "message",
                id: &format_id(&id),
                status: if message.role == Role::Assistant && provenance.in_progress() {
                    "in_progress"
                } else {
                    "completed"
                },
                role: message.role,
                content: content(message),
            };
            // Serialising strings and vectors of plain structs into a vector cannot fail.
            let _ = serde_json::to_writer(&mut json, &item);
            ends.push(u32::try_from(json.len()).unwrap_or(u32::MAX));
            // Two messages never share a first event, so ids are unique; the first one wins if they were not.
            let at = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            index.entry(id).or_insert(at);
            ids.push(id);
        }
        Self {
            etag: etag_of(&json),
            json: Bytes::from(json),
            ends,
            ids,
            index,
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Bytes held, for the cache's weigher.
    pub fn bytes(&self) -> usize {
        self.json.len() + self.ends.len() * 4 + self.ids.len() * (16 + 24) + self.etag.len() + 128
    }

    /// The list body of the page of at most `limit` items in `order` after the item `after` (from the first item
    /// in that order without one): `{"object": "list", "data", "first_id", "last_id", "has_more"}`.
    ///
    /// # Errors
    /// [`InvalidCursor`] when `after` names no item of this history.
    pub fn page(
        &self,
        order: Order,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Bytes, InvalidCursor> {
        let len = self.len();
        // Positions in `order`: 0 is the first item of the page sequence.
        let start = match after {
            None => 0,
            Some(after) => {
                let at = parse_id(after)
                    .and_then(|id| self.index.get(&id))
                    .ok_or(InvalidCursor)?;
                let at = *at as usize;
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
        let mut body = BytesMut::with_capacity(128 + self.span(positions.clone()));
        body.put_slice(br#"{"object":"list","data":["#);
        let mut first_id = None;
        let mut last_id = None;
        for (n, at) in positions.enumerate() {
            if n > 0 {
                body.put_u8(b',');
            }
            body.put_slice(&self.json[self.item(at)]);
            first_id.get_or_insert(at);
            last_id = Some(at);
        }
        body.put_slice(br#"],"first_id":"#);
        self.put_id(&mut body, first_id);
        body.put_slice(br#","last_id":"#);
        self.put_id(&mut body, last_id);
        body.put_slice(if end < len {
            br#","has_more":true}"#
        } else {
            br#","has_more":false}"#
        });
        Ok(body.freeze())
    }

    /// The byte range of item `at` in `json`.
    fn item(&self, at: usize) -> std::ops::Range<usize> {
        let start = if at == 0 {
            0
        } else {
            self.ends[at - 1] as usize
        };
        start..self.ends[at] as usize
    }

    fn span(&self, positions: impl Iterator<Item = usize>) -> usize {
        positions.map(|at| self.item(at).len() + 1).sum()
    }

    fn put_id(&self, body: &mut BytesMut, at: Option<usize>) {
        match at {
            Some(at) => {
                body.put_u8(b'"');
                body.put_slice(format_id(&self.ids[at]).as_bytes());
                body.put_u8(b'"');
            }
            None => body.put_slice(b"null"),
        }
    }
}

/// The digest bytes of an item id, if `text` is one (`msg_` and 32 lowercase hex digits).
fn parse_id(text: &str) -> Option<ItemId> {
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

/// One Conversations `message` item.
#[derive(Serialize)]
struct ItemJson<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    id: &'a str,
    status: &'static str,
    role: Role,
    content: Vec<ContentJson<'a>>,
}

/// A part as the Conversations content union has it: the union has no audio type, so audio is an `input_file` with
/// a `data:` URL (the official SDK's strict validation refuses an unknown type).
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentJson<'a> {
    InputText {
        text: &'a str,
    },
    OutputText {
        text: &'a str,
        annotations: [(); 0],
    },
    InputImage {
        image_url: &'a str,
        detail: &'static str,
    },
    InputFile {
        file_data: String,
        filename: String,
    },
}

fn content(message: &HistoryMessage) -> Vec<ContentJson<'_>> {
    message
        .content
        .iter()
        .map(|part| match part {
            Part::Text { text } if message.role == Role::Assistant => ContentJson::OutputText {
                text,
                annotations: [],
            },
            Part::Text { text } => ContentJson::InputText { text },
            Part::ImageUrl { image_url } => ContentJson::InputImage {
                image_url: &image_url.url,
                detail: "auto",
            },
            Part::InputAudio { input_audio } => ContentJson::InputFile {
                file_data: format!(
                    "data:audio/{};base64,{}",
                    input_audio.format, input_audio.data
                ),
                filename: format!("audio.{}", input_audio.format),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Decoded, ViewEvent, decode_payload};
    use crate::project::project;
    use crate::subject::DeliveryKey;
    use serde_json::{Value, json};

    fn event(subject: &str, payload: Value) -> ViewEvent {
        let key = DeliveryKey::parse_subject(subject).unwrap();
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(event) => event,
            Decoded::Irrelevant => unreachable!("{subject}"),
        }
    }

    fn user(display: &str, id: &str, at: i64, text: &str) -> ViewEvent {
        event(
            &format!("agent.UserAgent.u.t.{display}.ru{id}.display_event.UserMessageEvent.{id}"),
            json!({"_parent_event_names": ["UserMessageEvent"], "created_at": at,
                   "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": text}]}]}),
        )
    }

    fn chunk(run: &str, id: &str, at: i64, text: &str) -> ViewEvent {
        event(
            &format!("agent.A.a.t.d.{run}.display_event.ChunkEvent.{id}"),
            json!({"_parent_event_names": ["ChunkEvent"], "created_at": at, "content": text}),
        )
    }

    fn stop(run: &str, id: &str, at: i64) -> ViewEvent {
        event(
            &format!("agent.A.a.t.d.{run}.display_event.StopEvent.{id}"),
            json!({"_parent_event_names": ["StopEvent"], "created_at": at}),
        )
    }

    fn page(items: &Items, order: Order, after: Option<&str>, limit: usize) -> Value {
        serde_json::from_slice(&items.page(order, after, limit).unwrap()).unwrap()
    }

    /// Every page walk in either order with any limit yields the items once each, in order.
    #[test]
    fn pages_walk_the_items_in_either_order_with_any_limit() {
        let mut events = Vec::new();
        for i in 0..7 {
            events.push(user("d", &format!("u{i}"), i * 10, &format!("q{i}")));
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
    fn ids_follow_the_first_event_and_status_the_last_run() {
        let events = vec![
            user("d", "u1", 1, "q"),
            chunk("r1", "c1", 2, "a"),
            chunk("r1", "c2", 3, "b"),
        ];
        let before = Items::new(&project(&events, None));
        let first = page(&before, Order::Asc, None, 10);
        assert_eq!(first["data"][1]["status"], "in_progress");
        assert_eq!(first["data"][0]["status"], "completed");
        assert_eq!(first["data"][1]["content"][0]["text"], "ab");
        assert_eq!(first["data"][1]["content"][0]["type"], "output_text");
        assert_eq!(first["data"][0]["content"][0]["type"], "input_text");
        // A stop of the run finishes the message; the ids stay.
        let mut finished = events.clone();
        finished.push(stop("r1", "s1", 4));
        let after = page(&Items::new(&project(&finished, None)), Order::Asc, None, 10);
        assert_eq!(after["data"][1]["status"], "completed");
        assert_eq!(after["data"][0]["id"], first["data"][0]["id"]);
        assert_eq!(after["data"][1]["id"], first["data"][1]["id"]);
        // An earlier event joining the message changes its id only.
        let mut earlier = events.clone();
        earlier.push(chunk("r1", "c0", 2, "_"));
        let joined = page(&Items::new(&project(&earlier, None)), Order::Asc, None, 10);
        assert_eq!(joined["data"][0]["id"], first["data"][0]["id"]);
        assert_ne!(joined["data"][1]["id"], first["data"][1]["id"]);
        assert_eq!(first["first_id"], first["data"][0]["id"]);
        assert_eq!(first["last_id"], first["data"][1]["id"]);
    }

    #[test]
    fn an_after_naming_no_item_is_an_invalid_cursor_and_an_empty_history_pages_empty() {
        let items = Items::new(&project(&[user("d", "u1", 1, "q")], None));
        for bad in [
            "",
            "msg_",
            "msg_zz",
            "msg_00000000000000000000000000000000",
            "x",
        ] {
            assert_eq!(
                items.page(Order::Desc, Some(bad), 20),
                Err(InvalidCursor),
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
}
