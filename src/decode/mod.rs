//! One decoder for both inputs: a NATS payload (JSON bytes, `json`) and a persisted `agent_events` row (BSON,
//! `bson`) become the same compact [`ViewEvent`].
//!
//! The family filter runs first, on the parents list alone (`_parent_event_names` in a payload, `event_parents` in
//! a row). Events outside the five projectable families ([`Family`]) are [`Decoded::Irrelevant`] and nothing else
//! of them is read: unknown agent-specific events are never deserialized
//! ([contract 10](../../docs/contract.md#10)). A relevant event has exactly the one field its projector branch needs
//! decoded ([`Family::field`]), plus `created_at`. Malformed fields are not errors here: they are kept as the error
//! type aihub would raise ([`ErrorType`]), because whether they produce a warning depends on visibility, which only
//! the projector knows.
//!
//! The field rules shared by both inputs live beside them: `user_content` emulates what aihub's projector gets
//! from llama-index's `ChatMessage.model_validate` ([contract 5.5](../../docs/contract.md#5.5)), `stop` emulates
//! core `Message.model_validate` ([contract 7](../../docs/contract.md#7)). Choices where the contract is uncertain
//! are marked `Chosen:`.

mod bson;
mod family;
mod json;
mod stop;
mod user_content;

use std::fmt;

use serde::Serialize;
use serde_json::Value;

pub use self::bson::{EVENT_DATA_FIELDS, decode_row, row_key};
pub use self::family::Family;
pub use self::json::{MAX_STORED_DEPTH, decode_payload};

use self::family::Branch;
use self::stop::full_answer;
use self::user_content::user_content;
use crate::subject::DeliveryKey;

/// The only `event_type` that history reads (stage 2 of the store query filters on it too).
pub const DISPLAY_EVENT: &str = "display_event";
/// The agent class of user-originated marker events.
pub const USER_AGENT: &str = "UserAgent";

/// The exception class aihub's projector would have raised for a malformed event; it is the `error_type` of the
/// metadata-only warning ([contract 5.7](../../docs/contract.md#5.7)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ErrorType {
    TypeError,
    ValueError,
    ValidationError,
}

impl ErrorType {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorType::TypeError => "TypeError",
            ErrorType::ValueError => "ValueError",
            ErrorType::ValidationError => "ValidationError",
        }
    }
}

impl fmt::Display for ErrorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One OpenAI content part of a history message ([contract 5.6](../../docs/contract.md#5.6)).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
    InputAudio { input_audio: InputAudio },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct ImageUrl {
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct InputAudio {
    /// Base64 text, as llama-index keeps audio bytes.
    pub data: String,
    pub format: String,
}

/// A user turn's content as aihub computes it from the last ChatMessage.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UserContent {
    /// Formats of audio blocks that carried data but were dropped as unsupported, in block order. Each becomes an
    /// `UnsupportedAudioFormat` warning when the event is projected.
    pub unsupported_audio: Vec<Box<str>>,
    pub parts: Result<Vec<Part>, ErrorType>,
}

/// What a relevant event contributes, by the first projector branch it matches ([contract
/// 5.4](../../docs/contract.md#5.4)).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Body {
    /// Branch 1: a `UserAgent` UserMessageEvent (a marker). Boxed: one event in many is one, and inline its 48
    /// bytes would make every event 24 bytes larger.
    UserMessage(Box<UserContent>),
    /// Branch 2: a `UserAgent` HITL response (a marker); the answer text.
    HitlAnswer(Result<Box<str>, ErrorType>),
    /// Branch 3: a chunk from any agent; its content.
    Chunk(Result<Box<str>, ErrorType>),
    /// Branch 4: a HITL request from any agent; its question.
    HitlQuestion(Result<Box<str>, ErrorType>),
    /// Branch 5 candidate: a stop event; the full answer of its last output message (possibly empty). Whether it
    /// counts depends on the read's primary identity.
    Stop(Result<Box<str>, ErrorType>),
    /// A family member no branch takes (a UserMessageEvent or HITL response from a non-`UserAgent`). It still
    /// passes validation, so malformed ordering metadata on it is warned about.
    Inert,
}

/// A relevant event in compact form: what the view stores and the projector reads.
#[derive(Debug, Clone)]
pub struct ViewEvent {
    pub key: DeliveryKey,
    /// `event_data.created_at` in nanoseconds, or the error aihub's ordering validation raises.
    pub created_at: Result<i64, ErrorType>,
    pub body: Body,
    /// When the worker received it live, in whole seconds since the Unix epoch: the ingest's clock on Core NATS,
    /// the stream's timestamp (when the server stored it) with JetStream; [`STORED`] for a stored row. Not what
    /// the event is (equality leaves it out): what tells, with the persister-lag bound, whether the store must have
    /// had it by a moment ([`crate::view::ThreadView::hydrated`]).
    pub arrived: u32,
}

/// The `arrived` of an event read from the store: stored, whenever it arrived.
pub const STORED: u32 = 0;

impl PartialEq for ViewEvent {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key && self.created_at == other.created_at && self.body == other.body
    }
}

impl Eq for ViewEvent {}

/// Whole seconds since the Unix epoch of `at`, as an event's `arrived` (at least 1: 0 is [`STORED`]).
pub fn arrival(at: std::time::SystemTime) -> u32 {
    at.duration_since(std::time::UNIX_EPOCH).map_or(1, |since| {
        u32::try_from(since.as_secs()).unwrap_or(u32::MAX).max(1)
    })
}

impl ViewEvent {
    /// A marker makes its display client-visible: a `UserAgent` user message or HITL response.
    pub fn is_marker(&self) -> bool {
        matches!(self.body, Body::UserMessage(_) | Body::HitlAnswer(_))
    }

    /// Heap bytes held, each allocation as the allocator rounds it, for the cache weigher.
    pub fn heap_bytes(&self) -> usize {
        use crate::memory::allocated;
        fn text(r: &Result<Box<str>, ErrorType>) -> usize {
            r.as_ref().map_or(0, |s| allocated(s.len()))
        }
        let body = match &self.body {
            Body::UserMessage(u) => {
                let boxed = allocated(std::mem::size_of::<UserContent>());
                let parts = u.parts.as_ref().map_or(0, |parts| {
                    allocated(parts.capacity() * std::mem::size_of::<Part>())
                        + parts
                            .iter()
                            .map(|p| match p {
                                Part::Text { text } => allocated(text.capacity()),
                                Part::ImageUrl { image_url } => allocated(image_url.url.capacity()),
                                Part::InputAudio { input_audio } => {
                                    allocated(input_audio.data.capacity())
                                        + allocated(input_audio.format.capacity())
                                }
                            })
                            .sum::<usize>()
                });
                boxed
                    + parts
                    + allocated(u.unsupported_audio.capacity() * 16)
                    + u.unsupported_audio
                        .iter()
                        .map(|f| allocated(f.len()))
                        .sum::<usize>()
            }
            Body::HitlAnswer(t) | Body::Chunk(t) | Body::HitlQuestion(t) | Body::Stop(t) => text(t),
            Body::Inert => 0,
        };
        self.key.heap_bytes() + body
    }
}

/// The decoder's verdict on one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Not a display event of the five families: dropped without reading its payload.
    Irrelevant,
    Event(ViewEvent),
}

/// A NATS payload that cannot be read at all (not JSON). aihub's persister could not store it either.
#[derive(Debug, thiserror::Error)]
#[error("payload is not valid JSON")]
pub struct DecodeError {
    /// The delivery the payload came with, for metadata-only logging.
    pub key: DeliveryKey,
    #[source]
    source: serde_json::Error,
}

/// What `branch` makes of the one field it reads.
fn body(branch: Branch, field: Option<&Value>) -> Body {
    let Branch::Reads(family) = branch else {
        return Body::Inert;
    };
    match family {
        Family::UserMessage => Body::UserMessage(Box::new(user_content(field))),
        Family::HitlResponse => Body::HitlAnswer(match field {
            Some(Value::Bool(true)) => Ok("true".into()),
            Some(Value::Bool(false)) => Ok("false".into()),
            other => non_empty_text(other),
        }),
        Family::Chunk => Body::Chunk(non_empty_text(field)),
        Family::HitlRequest => Body::HitlQuestion(non_empty_text(field)),
        Family::Stop => Body::Stop(full_answer(field)),
    }
}

fn non_empty_text(value: Option<&Value>) -> Result<Box<str>, ErrorType> {
    match value {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.as_str().into()),
        _ => Err(ErrorType::ValueError),
    }
}

/// `created_at` must be an integer and not a bool ([contract 6](../../docs/contract.md#6)). A missing `event_data`
/// mapping is a TypeError too.
///
/// Chosen: integers outside int64 (which MongoDB cannot store) count as malformed.
fn created_at(value: Option<&Value>) -> Result<i64, ErrorType> {
    match value {
        Some(Value::Number(n)) => n.as_i64().ok_or(ErrorType::TypeError),
        _ => Err(ErrorType::TypeError),
    }
}

/// What the decoder's tests share: a delivery key, a decoded payload and its body; and, for the tests of what is
/// built from events (renderings, items), one relevant event decoded from a live subject and payload.
#[cfg(test)]
pub(crate) mod testing {
    use serde_json::Value;

    use super::{Body, DISPLAY_EVENT, Decoded, decode_payload};
    use crate::subject::DeliveryKey;

    pub fn key(agent_class: &str, event_name: &str) -> DeliveryKey {
        DeliveryKey::from_fields([
            agent_class,
            "id",
            "t",
            "d",
            "r",
            DISPLAY_EVENT,
            event_name,
            "e1",
        ])
    }

    pub fn payload(key: DeliveryKey, value: Value) -> Decoded {
        decode_payload(key, value.to_string().as_bytes()).unwrap()
    }

    /// The relevant event a live `subject` and `payload` decode to.
    pub fn live_event(subject: &str, payload: &str) -> super::ViewEvent {
        match decode_payload(
            DeliveryKey::parse_subject(subject).unwrap(),
            payload.as_bytes(),
        ) {
            Ok(Decoded::Event(event)) => event,
            other => panic!("a relevant event expected, got {other:?}"),
        }
    }

    /// A `UserAgent` user message of thread `t` on `display` (it makes the display visible).
    pub fn user(display: &str, id: &str, at: i64, text: &str) -> super::ViewEvent {
        live_event(
            &format!("agent.UserAgent.u.t.{display}.ru{id}.display_event.UserMessageEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["UserMessageEvent"], "created_at": at,
                   "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": text}]}]})
            .to_string(),
        )
    }

    /// A chunk of agent `A/a`'s answer in `run` on display `d` of thread `t`.
    pub fn chunk(run: &str, id: &str, at: i64, text: &str) -> super::ViewEvent {
        live_event(
            &format!("agent.A.a.t.d.{run}.display_event.ChunkEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["ChunkEvent"], "created_at": at, "content": text})
                .to_string(),
        )
    }

    /// The stop of agent `A/a`'s `run` on display `d` of thread `t`.
    pub fn stop(run: &str, id: &str, at: i64) -> super::ViewEvent {
        live_event(
            &format!("agent.A.a.t.d.{run}.display_event.StopEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["StopEvent"], "created_at": at})
                .to_string(),
        )
    }

    pub fn body(decoded: Decoded) -> Body {
        match decoded {
            Decoded::Event(e) => e.body,
            Decoded::Irrelevant => panic!("expected a relevant event"),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::decode::testing::{body, key, payload};

    #[test]
    fn events_outside_the_families_are_irrelevant_even_when_their_payload_is_broken() {
        let decoded = payload(
            key("RAG", "RetrievalAgentInTheLoopResponseEvent"),
            json!({"_parent_event_names": ["RetrievalAgentInTheLoopResponseEvent", "AgentInTheLoopResponseEvent"],
                   "created_at": "bad", "content": 5}),
        );
        assert_eq!(decoded, Decoded::Irrelevant);
    }

    #[test]
    fn control_events_are_irrelevant() {
        let key = DeliveryKey::from_fields([
            "A",
            "id",
            "t",
            "d",
            "r",
            "control_event",
            "ChunkEvent",
            "e",
        ]);
        let decoded = payload(
            key,
            json!({"_parent_event_names": ["ChunkEvent"], "created_at": 1, "content": "x"}),
        );
        assert_eq!(decoded, Decoded::Irrelevant);
    }

    #[test]
    fn chunk_content_and_created_at_are_decoded() {
        let decoded = payload(
            key("A", "ChunkEvent"),
            json!({"_parent_event_names": ["ChunkEvent", "DisplayEvent"], "created_at": 7, "content": "Hel",
                   "display_name": {"en": "x"}}),
        );
        let Decoded::Event(event) = decoded else {
            panic!()
        };
        assert_eq!(event.created_at, Ok(7));
        assert_eq!(event.body, Body::Chunk(Ok("Hel".into())));
    }

    #[test]
    fn created_at_must_be_an_integer_and_not_a_bool_or_float() {
        for bad in [json!("1"), json!(1.0), json!(true), json!(null)] {
            let Decoded::Event(event) = payload(
                key("A", "ChunkEvent"),
                json!({"_parent_event_names": ["ChunkEvent"], "created_at": bad, "content": "x"}),
            ) else {
                panic!()
            };
            assert_eq!(event.created_at, Err(ErrorType::TypeError), "{bad}");
        }
    }

    #[test]
    fn branches_follow_the_contract_order() {
        let parents = json!(["ChunkEvent", "StopEvent", "HumanInTheLoopRequestEvent"]);
        let b = body(payload(
            key("A", "X"),
            json!({"_parent_event_names": parents, "created_at": 1, "content": "c", "question": "q"}),
        ));
        assert_eq!(b, Body::Chunk(Ok("c".into())));
        let b = body(payload(
            key("A", "X"),
            json!({"_parent_event_names": ["StopEvent", "HumanInTheLoopRequestEvent"], "created_at": 1, "question": "q"}),
        ));
        assert_eq!(b, Body::HitlQuestion(Ok("q".into())));
        let b = body(payload(
            key("A", "UserMessageEvent"),
            json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": []}),
        ));
        assert_eq!(b, Body::Inert);
    }

    #[test]
    fn hitl_answers_render_booleans_as_text() {
        for (value, expected) in [
            (json!(true), Ok("true".into())),
            (json!(false), Ok("false".into())),
            (json!("EU"), Ok("EU".into())),
            (json!(""), Err(ErrorType::ValueError)),
            (json!(1), Err(ErrorType::ValueError)),
        ] {
            let b = body(payload(
                key(USER_AGENT, "R"),
                json!({"_parent_event_names": ["R", "HumanInTheLoopResponseEvent"], "created_at": 1,
                       "response": value, "request_event": {"broken": true}}),
            ));
            assert_eq!(b, Body::HitlAnswer(expected));
        }
    }
}
