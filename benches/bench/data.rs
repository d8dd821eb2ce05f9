//! The events the bench stores and streams, in aihub's persisted row shape (as `tests/api/helpers.rs` builds them):
//! `UserAgent` user messages (the markers that make a display visible) and chunks of about 100 bytes. A row becomes
//! a store document, or a NATS message: the row's 9-token subject with `event_data` as the JSON payload.

use async_nats::Subject;
use bytes::Bytes;
use mongodb::bson::Document;
use serde_json::{Value, json};

/// First `created_at` (ns); events of a thread are 1 µs apart in sequence order.
const BASE_CREATED_AT: i64 = 1_764_000_000_000_000_000;
const MARKER_PARENTS: [&str; 5] = [
    "UserMessageEvent",
    "StartEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];
const CHUNK_PARENTS: [&str; 2] = ["ChunkEvent", "DisplayEvent"];
/// The agent that streams the answers.
const AGENT: (&str, &str) = ("BenchAgent", "bench-1");
const USER: (&str, &str) = ("UserAgent", "user-1");
const FILLER: &str =
    "streamed tokens of an assistant answer, about as long as a short sentence is in practice";

fn event_id(thread: &str, seq: usize) -> String {
    format!("{thread}-{seq:08}")
}

fn created_at(seq: usize) -> i64 {
    BASE_CREATED_AT + seq as i64 * 1_000
}

/// The display of `turn` in a thread whose turns cycle over `displays` displays.
pub fn display(thread: &str, turn: usize, displays: usize) -> String {
    format!("{thread}-d{}", turn % displays.max(1))
}

/// A `UserAgent` user message on `display`: a visibility marker and a user turn (about 50 bytes of text).
pub fn marker(thread: &str, display: &str, seq: usize) -> Value {
    let event_id = event_id(thread, seq);
    let text = format!("question {seq}: what does the quarterly report say?");
    json!({
        "agent_class": USER.0, "agent_id": USER.1, "thread_id": thread, "display_id": display,
        "run_id": "run-1", "event_id": event_id, "event_type": "display_event", "event_name": "UserMessageEvent",
        "event_parents": MARKER_PARENTS,
        "event_data": {"event_id": event_id, "created_at": created_at(seq), "_event_name": "UserMessageEvent",
            "_parent_event_names": MARKER_PARENTS,
            "messages": [{"role": "user", "additional_kwargs": {}, "blocks": [{"block_type": "text", "text": text}]}]}
    })
}

/// A chunk of about 100 bytes of answer text on `display`.
pub fn chunk(thread: &str, display: &str, seq: usize) -> Value {
    chunk_with_text(thread, display, seq, &format!("{seq:08} {FILLER} "))
}

/// A chunk with the given text.
pub fn chunk_with_text(thread: &str, display: &str, seq: usize, text: &str) -> Value {
    let event_id = event_id(thread, seq);
    json!({
        "agent_class": AGENT.0, "agent_id": AGENT.1, "thread_id": thread, "display_id": display,
        "run_id": "run-1", "event_id": event_id, "event_type": "display_event", "event_name": "ChunkEvent",
        "event_parents": CHUNK_PARENTS,
        "event_data": {"event_id": event_id, "created_at": created_at(seq), "_event_name": "ChunkEvent",
            "_parent_event_names": CHUNK_PARENTS, "content": text, "model_name": "m"}
    })
}

/// A row as a store document.
pub fn document(row: &Value) -> Document {
    mongodb::bson::to_document(row).expect("a bench row converts to BSON")
}

/// A row as aihub publishes it, serialized once up front.
#[derive(Clone)]
pub struct Message {
    pub subject: Subject,
    pub payload: Bytes,
}

impl Message {
    pub fn from_row(row: &Value) -> Self {
        Self {
            subject: Subject::from(subject(row)),
            payload: Bytes::from(
                serde_json::to_vec(&row["event_data"]).expect("event_data serializes"),
            ),
        }
    }

    pub async fn publish(&self, client: &async_nats::Client) {
        client
            .publish(self.subject.clone(), self.payload.clone())
            .await
            .expect("publish to NATS");
    }
}

/// `agent.<agent_class>.<agent_id>.<thread_id>.<display_id>.<run_id>.display_event.<event_name>.<event_id>`
/// (the demo's mapping, `examples/demo/conversation.rs`).
pub fn subject(row: &Value) -> String {
    let field = |name: &str| row[name].as_str().unwrap_or_default();
    chat_history_view::subject::KEY_FIELDS
        .iter()
        .fold("agent".to_owned(), |subject, name| {
            format!("{subject}.{}", field(name))
        })
}

/// The shape of a stored thread: `turns` turns, each a marker followed by `events_per_turn - 1` chunks, the turns
/// cycling over `displays` displays.
#[derive(Debug, Clone, Copy)]
pub struct Conversation {
    pub turns: usize,
    pub events_per_turn: usize,
    pub displays: usize,
}

impl Conversation {
    pub fn events(&self) -> usize {
        self.turns * self.events_per_turn
    }

    /// History messages a read of the whole thread answers: one user and one assistant message per turn.
    pub fn messages(&self) -> usize {
        self.turns * 2
    }

    pub fn rows(&self, thread: &str) -> Vec<Value> {
        (0..self.events())
            .map(|seq| {
                let display = display(thread, seq / self.events_per_turn, self.displays);
                if seq % self.events_per_turn == 0 {
                    marker(thread, &display, seq)
                } else {
                    chunk(thread, &display, seq)
                }
            })
            .collect()
    }
}
