//! aihub's display events as its persister stores them: the row (the subject's fields, `event_parents`, and the
//! payload as `event_data`), and the same event as aihub publishes it (the row's subject, `event_data` as JSON).

use chat_history_view::subject::{DeliveryKey, KEY_FIELDS};
use mongodb::bson::Document;
use serde_json::{Value, json};

/// The parents (`_parent_event_names`) of the event classes the rows use.
pub const USER_MESSAGE: &[&str] = &[
    "UserMessageEvent",
    "StartEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];
pub const CHUNK: &[&str] = &["ChunkEvent", "DisplayEvent"];
pub const LLM_STOP: &[&str] = &[
    "LLMStopEvent",
    "LLMEvent",
    "SemanticEvent",
    "StopEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];
pub const HITL_CHAT_REQUEST: &[&str] = &[
    "HumanInTheLoopChatRequestEvent",
    "HumanInTheLoopRequestEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];
pub const HITL_CHAT_RESPONSE: &[&str] = &[
    "HumanInTheLoopChatResponseEvent",
    "HumanInTheLoopResponseEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];

/// One display event: its delivery key (event type `display_event`), its class's parents and `created_at` (ns).
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// `(agent_class, agent_id)`.
    pub agent: (&'a str, &'a str),
    pub thread: &'a str,
    pub display: &'a str,
    pub run: &'a str,
    pub event_id: &'a str,
    /// The class name (`event_name`).
    pub name: &'a str,
    pub parents: &'a [&'a str],
    pub created_at: i64,
}

impl Event<'_> {
    /// The persisted row, with `fields` (the class's own fields) as the payload, to which the base fields are
    /// added: `event_id`, `created_at` (unless `fields` has one, which a test may make malformed), `_event_name`
    /// and `_parent_event_names`.
    pub fn row(&self, fields: Value) -> Value {
        let mut data = fields;
        data["event_id"] = json!(self.event_id);
        if data.get("created_at").is_none() {
            data["created_at"] = json!(self.created_at);
        }
        data["_event_name"] = json!(self.name);
        data["_parent_event_names"] = json!(self.parents);
        json!({
            "agent_class": self.agent.0, "agent_id": self.agent.1, "thread_id": self.thread,
            "display_id": self.display, "run_id": self.run, "event_id": self.event_id,
            "event_type": "display_event", "event_name": self.name, "event_parents": self.parents,
            "event_data": data,
        })
    }
}

/// A user message's own fields: one ChatMessage with one text block.
pub fn user_message(text: &str) -> Value {
    json!({"messages": [{"role": "user", "additional_kwargs": {}, "blocks": [{"block_type": "text", "text": text}]}]})
}

/// A chunk's own fields.
pub fn chunk(text: &str) -> Value {
    json!({"content": text, "model_name": "m"})
}

/// The NATS subject a row is published on (`agent.<8 key fields>`; a missing field is empty).
pub fn subject(row: &Value) -> String {
    DeliveryKey::from_fields(KEY_FIELDS.map(|name| row[name].as_str().unwrap_or_default()))
        .to_subject()
}

/// The payload a row is published with: its `event_data` as JSON.
pub fn payload(row: &Value) -> Vec<u8> {
    serde_json::to_vec(&row["event_data"]).expect("event_data serializes")
}

/// A row as a store document.
pub fn document(row: &Value) -> Document {
    mongodb::bson::to_document(row).expect("a row converts to BSON")
}

/// Publishes `rows` into JetStream one after the other, each once the stream holding the one before has stored it.
/// A core publish into a replicated stream is dropped when the stream's leader cannot take it at that moment (no
/// error reaches a publisher without a reply subject); a test that counts what the workers must receive publishes
/// so.
pub async fn publish_stored(context: &async_nats::jetstream::Context, rows: &[Value]) {
    for row in rows {
        context
            .publish(subject(row), payload(row).into())
            .await
            .expect("publish")
            .await
            .expect("stored by its stream");
    }
}

/// Publishes rows on NATS as aihub does: the row's 9-token subject, `event_data` as the JSON payload.
///
/// # Panics
/// When the client cannot publish or flush.
pub async fn publish(client: &async_nats::Client, rows: &[Value]) {
    for row in rows {
        client
            .publish(subject(row), payload(row).into())
            .await
            .expect("publish");
    }
    client.flush().await.expect("flush");
}
