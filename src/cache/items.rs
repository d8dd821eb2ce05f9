//! The Conversations items form of a history ([design 3.1](../../docs/design.md#3.1)): every message rendered once
//! as an OpenAI Conversations `message` item, with its id and status from the projector's provenance, kept with
//! each item's id and an index from id to position, so that a page (cut by the Conversations layer,
//! `http/conversations.rs`, which also reads the `after` cursor) copies the page's items only.

use std::collections::HashMap;

use bytes::Bytes;
use serde::Serialize;

use super::etag::etag_of;
use crate::decode::Part;
use crate::project::{HistoryMessage, Projection, Role, format_item_id};

/// An item id's digest ([`crate::project::Provenance::id`]).
pub type ItemId = [u8; 16];

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
                id: &format_item_id(&id),
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

    /// The position of the item whose id has digest `id`, if one has.
    pub fn position(&self, id: &ItemId) -> Option<usize> {
        self.index.get(id).map(|&at| at as usize)
    }

    /// The JSON of the item at `at`.
    pub fn json(&self, at: usize) -> &[u8] {
        let start = if at == 0 {
            0
        } else {
            self.ends[at - 1] as usize
        };
        &self.json[start..self.ends[at] as usize]
    }

    /// The id digest of the item at `at` (its id is [`format_item_id`] of it).
    pub fn id(&self, at: usize) -> &ItemId {
        &self.ids[at]
    }
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
    use crate::decode::ViewEvent;
    use crate::decode::testing::{chunk, stop, user};
    use crate::project::project;
    use serde_json::Value;

    /// Every item's JSON, in history order.
    fn items(events: &[ViewEvent]) -> Vec<Value> {
        let items = Items::new(&project(events, None));
        (0..items.len())
            .map(|at| serde_json::from_slice(items.json(at)).unwrap())
            .collect()
    }

    #[test]
    fn ids_follow_the_first_event_and_status_the_last_run() {
        let events = vec![
            user("d", "u1", 1, "q"),
            chunk("r1", "c1", 2, "a"),
            chunk("r1", "c2", 3, "b"),
        ];
        let first = items(&events);
        assert_eq!(first[1]["status"], "in_progress");
        assert_eq!(first[0]["status"], "completed");
        assert_eq!(first[1]["content"][0]["text"], "ab");
        assert_eq!(first[1]["content"][0]["type"], "output_text");
        assert_eq!(first[0]["content"][0]["type"], "input_text");
        // A stop of the run finishes the message; the ids stay.
        let mut finished = events.clone();
        finished.push(stop("r1", "s1", 4));
        let after = items(&finished);
        assert_eq!(after[1]["status"], "completed");
        assert_eq!(after[0]["id"], first[0]["id"]);
        assert_eq!(after[1]["id"], first[1]["id"]);
        // An earlier event joining the message changes its id only.
        let mut earlier = events.clone();
        earlier.push(chunk("r1", "c0", 2, "_"));
        let joined = items(&earlier);
        assert_eq!(joined[0]["id"], first[0]["id"]);
        assert_ne!(joined[1]["id"], first[1]["id"]);
    }

    #[test]
    fn each_item_is_found_by_its_id_digest_and_shows_that_id() {
        let events = vec![user("d", "u1", 1, "q"), chunk("r1", "c1", 2, "a")];
        let items = Items::new(&project(&events, None));
        assert_eq!(items.len(), 2);
        for at in 0..items.len() {
            let json: Value = serde_json::from_slice(items.json(at)).unwrap();
            assert_eq!(json["id"], format_item_id(items.id(at)));
            assert_eq!(items.position(items.id(at)), Some(at));
        }
        assert_eq!(items.position(&[0; 16]), None);
        assert!(Items::new(&project(&[], None)).is_empty());
    }
}
