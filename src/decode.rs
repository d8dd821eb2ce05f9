//! One decoder for both inputs: a NATS payload (JSON bytes) and a persisted `agent_events` row (BSON) become the
//! same compact [`ViewEvent`].
//!
//! The family filter runs first, on the parents list alone (`_parent_event_names` in a payload, `event_parents` in
//! a row). Events outside the five projectable families (UserMessageEvent, HumanInTheLoopResponseEvent, ChunkEvent,
//! HumanInTheLoopRequestEvent, StopEvent) are [`Decoded::Irrelevant`] and nothing else of them is read: unknown
//! agent-specific events are never deserialized (contract section 10). A relevant event has exactly the one field
//! its projector branch needs decoded (`messages`, `response`, `content`, `question` or `output_messages`), plus
//! `created_at`. Malformed fields are not errors here: they are kept as the error type aihub would raise
//! ([`ErrorType`]), because whether they produce a warning depends on visibility, which only the projector knows.
//!
//! The user-content rules emulate what aihub's projector gets from llama-index's `ChatMessage.model_validate`
//! (contract 5.5); the stop rules emulate core `Message.model_validate` (contract 7). Choices where the contract
//! is uncertain are marked `Chosen:` below.

use std::borrow::Cow;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use mongodb::bson::RawDocument;
use mongodb::bson::raw::{RawArray, RawBsonRef};
use serde::Serialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::subject::{DeliveryKey, KEY_FIELDS};

/// The only `event_type` that history reads (stage 2 of the store query filters on it too).
pub const DISPLAY_EVENT: &str = "display_event";
/// The agent class of user-originated marker events.
pub const USER_AGENT: &str = "UserAgent";

/// The exception class aihub's projector would have raised for a malformed event; it is the `error_type` of the
/// metadata-only warning (contract 5.7).
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

/// One OpenAI content part of a history message (contract 5.6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    Text { text: String },
    ImageUrl { image_url: ImageUrl },
    InputAudio { input_audio: InputAudio },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ImageUrl {
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InputAudio {
    /// Base64 text, as llama-index keeps audio bytes.
    pub data: String,
    pub format: String,
}

/// A user turn's content as aihub computes it from the last ChatMessage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserContent {
    /// Formats of audio blocks that carried data but were dropped as unsupported, in block order. Each becomes an
    /// `UnsupportedAudioFormat` warning when the event is projected.
    pub unsupported_audio: Vec<Box<str>>,
    pub parts: Result<Vec<Part>, ErrorType>,
}

/// What a relevant event contributes, by the first projector branch it matches (contract 5.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// Branch 1: a `UserAgent` UserMessageEvent (a marker).
    UserMessage(UserContent),
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewEvent {
    pub key: DeliveryKey,
    /// `event_data.created_at` in nanoseconds, or the error aihub's ordering validation raises.
    pub created_at: Result<i64, ErrorType>,
    pub body: Body,
}

impl ViewEvent {
    /// A marker makes its display client-visible: a `UserAgent` user message or HITL response.
    pub fn is_marker(&self) -> bool {
        matches!(self.body, Body::UserMessage(_) | Body::HitlAnswer(_))
    }

    /// Approximate heap bytes held, for the cache weigher.
    pub fn heap_bytes(&self) -> usize {
        fn text(r: &Result<Box<str>, ErrorType>) -> usize {
            r.as_ref().map_or(0, |s| s.len())
        }
        let body = match &self.body {
            Body::UserMessage(u) => {
                let parts = u.parts.as_ref().map_or(0, |parts| {
                    parts
                        .iter()
                        .map(|p| {
                            std::mem::size_of::<Part>()
                                + match p {
                                    Part::Text { text } => text.len(),
                                    Part::ImageUrl { image_url } => image_url.url.len(),
                                    Part::InputAudio { input_audio } => {
                                        input_audio.data.len() + input_audio.format.len()
                                    }
                                }
                        })
                        .sum()
                });
                parts
                    + u.unsupported_audio
                        .iter()
                        .map(|f| f.len() + 16)
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

/// The five projectable families, as a bit set of a parents list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Families(u8);

impl Families {
    const USER_MESSAGE: u8 = 1;
    const HITL_RESPONSE: u8 = 2;
    const CHUNK: u8 = 4;
    const HITL_REQUEST: u8 = 8;
    const STOP: u8 = 16;

    fn add(&mut self, parent: &str) {
        self.0 |= match parent {
            "UserMessageEvent" => Self::USER_MESSAGE,
            "HumanInTheLoopResponseEvent" => Self::HITL_RESPONSE,
            "ChunkEvent" => Self::CHUNK,
            "HumanInTheLoopRequestEvent" => Self::HITL_REQUEST,
            "StopEvent" => Self::STOP,
            _ => 0,
        }
    }

    fn has(self, bit: u8) -> bool {
        self.0 & bit != 0
    }
}

/// The projector branch an event takes; decided from the key and the parents alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Branch {
    UserMessage,
    HitlAnswer,
    Chunk,
    HitlQuestion,
    Stop,
    Inert,
}

impl Branch {
    /// The family filter and branch choice of contract 5.1 and 5.4 (first match wins).
    fn classify(key: &DeliveryKey, families: Families) -> Option<Branch> {
        if families.0 == 0 || key.event_type() != DISPLAY_EVENT {
            return None;
        }
        let user = key.agent_class() == USER_AGENT;
        Some(if user && families.has(Families::USER_MESSAGE) {
            Branch::UserMessage
        } else if user && families.has(Families::HITL_RESPONSE) {
            Branch::HitlAnswer
        } else if families.has(Families::CHUNK) {
            Branch::Chunk
        } else if families.has(Families::HITL_REQUEST) {
            Branch::HitlQuestion
        } else if families.has(Families::STOP) {
            Branch::Stop
        } else {
            Branch::Inert
        })
    }

    /// The one `event_data` field this branch reads.
    fn field(self) -> Option<&'static str> {
        match self {
            Branch::UserMessage => Some("messages"),
            Branch::HitlAnswer => Some("response"),
            Branch::Chunk => Some("content"),
            Branch::HitlQuestion => Some("question"),
            Branch::Stop => Some("output_messages"),
            Branch::Inert => None,
        }
    }

    fn decode(self, field: Option<&Value>) -> Body {
        match self {
            Branch::UserMessage => Body::UserMessage(user_content(field)),
            Branch::HitlAnswer => Body::HitlAnswer(match field {
                Some(Value::Bool(true)) => Ok("true".into()),
                Some(Value::Bool(false)) => Ok("false".into()),
                other => non_empty_text(other),
            }),
            Branch::Chunk => Body::Chunk(non_empty_text(field)),
            Branch::HitlQuestion => Body::HitlQuestion(non_empty_text(field)),
            Branch::Stop => Body::Stop(full_answer(field)),
            Branch::Inert => Body::Inert,
        }
    }
}

fn non_empty_text(value: Option<&Value>) -> Result<Box<str>, ErrorType> {
    match value {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.as_str().into()),
        _ => Err(ErrorType::ValueError),
    }
}

/// `created_at` must be an integer and not a bool (contract 6). A missing `event_data` mapping is a TypeError too.
///
/// Chosen: integers outside int64 (which MongoDB cannot store) count as malformed.
fn created_at(value: Option<&Value>) -> Result<i64, ErrorType> {
    match value {
        Some(Value::Number(n)) => n.as_i64().ok_or(ErrorType::TypeError),
        _ => Err(ErrorType::TypeError),
    }
}

// ---------------------------------------------------------------------------------------------------------------
// NATS payloads (JSON)
// ---------------------------------------------------------------------------------------------------------------

/// The fields of a payload the decoder may read, borrowed unparsed. Every other key is skipped without being
/// parsed into values. A repeated key keeps its last value, as Python's `json.loads` does.
#[derive(Default)]
struct PayloadHead<'a> {
    parents: Option<&'a RawValue>,
    created_at: Option<&'a RawValue>,
    messages: Option<&'a RawValue>,
    response: Option<&'a RawValue>,
    content: Option<&'a RawValue>,
    question: Option<&'a RawValue>,
    output_messages: Option<&'a RawValue>,
    /// False when the payload is JSON but not an object.
    is_object: bool,
}

impl<'a> PayloadHead<'a> {
    fn field(&self, name: &str) -> Option<&'a RawValue> {
        match name {
            "messages" => self.messages,
            "response" => self.response,
            "content" => self.content,
            "question" => self.question,
            "output_messages" => self.output_messages,
            _ => None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for PayloadHead<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeadVisitor;
        impl<'de> Visitor<'de> for HeadVisitor {
            type Value = PayloadHead<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an event payload")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut head = PayloadHead {
                    is_object: true,
                    ..PayloadHead::default()
                };
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let slot = match key.as_ref() {
                        "_parent_event_names" => &mut head.parents,
                        "created_at" => &mut head.created_at,
                        "messages" => &mut head.messages,
                        "response" => &mut head.response,
                        "content" => &mut head.content,
                        "question" => &mut head.question,
                        "output_messages" => &mut head.output_messages,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(head)
            }
            // Any other JSON value is a payload that is not an object: no parents, so no family.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(PayloadHead::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
        }
        deserializer.deserialize_any(HeadVisitor)
    }
}

/// Families named by a raw `_parent_event_names` value; non-string elements are ignored, a non-list names none.
fn json_families(raw: &RawValue) -> Families {
    let mut families = Families::default();
    if let Ok(list) = serde_json::from_str::<Vec<Cow<'_, str>>>(raw.get()) {
        list.iter().for_each(|p| families.add(p));
    } else if let Ok(Value::Array(list)) = serde_json::from_str::<Value>(raw.get()) {
        list.iter()
            .filter_map(Value::as_str)
            .for_each(|p| families.add(p));
    }
    families
}

/// The deepest document MongoDB stores: 100 levels, each document or array adding one, the row itself the first
/// and its `event_data` (the payload) the second. aihub's persister cannot store a payload nested deeper, so no
/// history ever holds such an event, and the live path drops it too (else a view would hold an event the store
/// can never have). Chosen: MongoDB's documented limit; FerretDB, aihub's production backend, documents none, and
/// a lower limit there would only drop fewer events than the store does for payloads no agent produces.
pub const MAX_STORED_DEPTH: usize = 100;

/// How deeply a JSON text nests arrays and objects (the payload object itself is 1); brackets inside strings do
/// not count.
fn nesting_depth(json: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &byte in json {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

fn parse_raw(raw: Option<&RawValue>) -> Option<Value> {
    // A RawValue is already valid JSON, so this only fails past serde_json's nesting limit; treat that as absent.
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

/// Decodes a NATS display-event payload delivered under `key` (parsed from the subject).
///
/// Chosen: when the payload has no `_parent_event_names` list, the subject's `event_name` stands in for it. aihub's
/// persister computes the parents of a known class itself, so a base-family event without the list is still
/// stored as that family; unknown events without the list stay irrelevant either way.
///
/// # Errors
/// [`DecodeError`] when the payload is not JSON at all.
pub fn decode_payload(key: DeliveryKey, payload: &[u8]) -> Result<Decoded, DecodeError> {
    let head: PayloadHead<'_> = match serde_json::from_slice(payload) {
        Ok(head) => head,
        Err(source) => return Err(DecodeError { key, source }),
    };
    let families = match head.parents {
        Some(raw) => json_families(raw),
        None if head.is_object => {
            let mut families = Families::default();
            families.add(key.event_name());
            families
        }
        None => Families::default(),
    };
    let Some(branch) = Branch::classify(&key, families) else {
        return Ok(Decoded::Irrelevant);
    };
    if nesting_depth(payload) + 1 > MAX_STORED_DEPTH {
        return Ok(Decoded::Irrelevant);
    }
    let field = branch.field().and_then(|name| parse_raw(head.field(name)));
    let created_at = created_at(parse_raw(head.created_at).as_ref());
    Ok(Decoded::Event(ViewEvent {
        key,
        created_at,
        body: branch.decode(field.as_ref()),
    }))
}

// ---------------------------------------------------------------------------------------------------------------
// Store rows (BSON)
// ---------------------------------------------------------------------------------------------------------------

/// The `event_data` fields the decoder may read. The store projects only these, the delivery key's fields
/// ([`KEY_FIELDS`]) and `event_parents`.
pub const EVENT_DATA_FIELDS: [&str; 6] = [
    "created_at",
    "messages",
    "response",
    "content",
    "question",
    "output_messages",
];

/// Decodes one persisted row. The delivery key comes from the row's top-level fields (`event_id` is the row's, which
/// aihub takes from the payload); a missing or non-string field is kept empty and reported by the projector.
pub fn decode_row(row: &RawDocument) -> Decoded {
    let text = |name: &str| match row.get(name) {
        Ok(Some(RawBsonRef::String(s))) => s,
        _ => "",
    };
    let key = DeliveryKey::from_fields(KEY_FIELDS.map(text));
    let mut families = Families::default();
    if let Ok(Some(RawBsonRef::Array(parents))) = row.get("event_parents") {
        for parent in parents.into_iter().flatten() {
            if let RawBsonRef::String(p) = parent {
                families.add(p);
            }
        }
    }
    let Some(branch) = Branch::classify(&key, families) else {
        return Decoded::Irrelevant;
    };
    let (created_at, field) = match row.get("event_data") {
        Ok(Some(RawBsonRef::Document(data))) => {
            let get = |name: &str| data.get(name).ok().flatten().map(bson_to_json);
            (
                created_at(get("created_at").as_ref()),
                branch.field().and_then(get),
            )
        }
        // event_data is not a mapping: aihub's ordering validation raises TypeError before any branch runs.
        _ => (Err(ErrorType::TypeError), None),
    };
    Decoded::Event(ViewEvent {
        key,
        created_at,
        body: branch.decode(field.as_ref()),
    })
}

/// Converts a BSON value into the JSON model the field rules read.
///
/// Chosen: binary data becomes a list of byte values, which the byte-field rules treat exactly like the legacy
/// int-list form (both become bytes in llama-index). Types JSON cannot express (ObjectId, dates, decimals, ...)
/// become an object `{"$bsonType": ...}`, so they fail every string, number and list check as pydantic would.
fn bson_to_json(value: RawBsonRef<'_>) -> Value {
    match value {
        RawBsonRef::Double(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
        RawBsonRef::String(s) => Value::String(s.to_owned()),
        RawBsonRef::Array(items) => Value::Array(array_to_json(items)),
        RawBsonRef::Document(doc) => Value::Object(
            doc.into_iter()
                .flatten()
                .map(|(k, v)| (k.to_owned(), bson_to_json(v)))
                .collect(),
        ),
        RawBsonRef::Boolean(b) => Value::Bool(b),
        RawBsonRef::Null | RawBsonRef::Undefined => Value::Null,
        RawBsonRef::Int32(i) => Value::from(i),
        RawBsonRef::Int64(i) => Value::from(i),
        RawBsonRef::Binary(bin) => {
            Value::Array(bin.bytes.iter().map(|&b| Value::from(b)).collect())
        }
        other => serde_json::json!({ "$bsonType": format!("{:?}", other.element_type()) }),
    }
}

fn array_to_json(items: &RawArray) -> Vec<Value> {
    items.into_iter().flatten().map(bson_to_json).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// User content (contract 5.5): the last ChatMessage, validated as llama-index would.
// ---------------------------------------------------------------------------------------------------------------

/// llama-index `MessageRole` values; `ChatMessage.role` must be one of them when present.
const MESSAGE_ROLES: [&str; 8] = [
    "system",
    "developer",
    "user",
    "assistant",
    "function",
    "tool",
    "chatbot",
    "model",
];

fn user_content(messages: Option<&Value>) -> UserContent {
    let mut unsupported_audio = Vec::new();
    let parts = user_parts(messages, &mut unsupported_audio);
    UserContent {
        unsupported_audio,
        parts,
    }
}

fn user_parts(
    messages: Option<&Value>,
    unsupported_audio: &mut Vec<Box<str>>,
) -> Result<Vec<Part>, ErrorType> {
    use ErrorType::{TypeError, ValidationError, ValueError};
    let Some(Value::Array(messages)) = messages else {
        return Err(ValueError);
    };
    let Some(last) = messages.last() else {
        return Err(ValueError);
    };
    let Value::Object(last) = last else {
        return Err(TypeError);
    };
    let Some(Value::Array(blocks)) = last.get("blocks") else {
        return Err(TypeError);
    };
    let mut kept = Vec::with_capacity(blocks.len());
    for block in blocks {
        let Value::Object(block) = block else {
            return Err(TypeError);
        };
        if let Some("text" | "image" | "audio") = block.get("block_type").and_then(Value::as_str) {
            kept.push(block);
        }
    }

    // ChatMessage.model_validate: role and additional_kwargs, then every kept block.
    // Chosen: `role` is validated against llama-index's MessageRole enum (as model_validate does) but its value
    // is otherwise ignored: the last message is always a user turn.
    match last.get("role") {
        None => {}
        Some(Value::String(role)) if MESSAGE_ROLES.contains(&role.as_str()) => {}
        Some(_) => return Err(ValidationError),
    }
    if !matches!(last.get("additional_kwargs"), None | Some(Value::Object(_))) {
        return Err(ValidationError);
    }
    let blocks = kept
        .into_iter()
        .map(Block::validate)
        .collect::<Result<Vec<_>, _>>()?;

    let mut parts = Vec::new();
    for block in blocks {
        match block {
            Block::Text(text) if !text.is_empty() => parts.push(Part::Text { text }),
            Block::Text(_) => {}
            Block::Image(Some(url)) => parts.push(Part::ImageUrl {
                image_url: ImageUrl { url },
            }),
            // Inline images (bytes or path, no url) cannot be given back to a client: dropped silently.
            Block::Image(None) => {}
            Block::Audio { data, format } => match (format.as_deref(), data) {
                (Some(f @ ("wav" | "mp3")), Some(data)) => parts.push(Part::InputAudio {
                    input_audio: InputAudio {
                        data,
                        format: f.to_owned(),
                    },
                }),
                (Some("wav" | "mp3"), None) => {}
                (_, Some(_)) => {
                    // str(format) in aihub: a missing format renders as Python's "None".
                    unsupported_audio.push(format.as_deref().unwrap_or("None").into());
                }
                (_, None) => {}
            },
        }
    }
    if parts.is_empty() {
        return Err(ValueError);
    }
    Ok(parts)
}

/// A content block after validation, holding only what history emits.
enum Block {
    Text(String),
    /// The normalised url, if any.
    Image(Option<String>),
    /// `data`: base64 text of non-empty audio bytes; `format`: as given, or guessed from the bytes when absent.
    Audio {
        data: Option<String>,
        format: Option<String>,
    },
}

impl Block {
    fn validate(block: &serde_json::Map<String, Value>) -> Result<Block, ErrorType> {
        let optional_text = |name: &str| match block.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(ErrorType::ValidationError),
        };
        match block.get("block_type").and_then(Value::as_str) {
            Some("text") => match block.get("text") {
                Some(Value::String(text)) => Ok(Block::Text(text.clone())),
                _ => Err(ErrorType::ValidationError),
            },
            Some("image") => {
                bytes_field(block.get("image"))?;
                // Chosen: `path` is accepted as any string; llama-index's FilePath would also require the file to
                // exist on the aihub host, which cannot be checked from here.
                optional_text("path")?;
                optional_text("image_mimetype")?;
                optional_text("detail")?;
                Ok(Block::Image(url_field(block.get("url"))?))
            }
            Some("audio") => {
                let audio = bytes_field(block.get("audio"))?;
                optional_text("path")?;
                url_field(block.get("url"))?;
                let mut format = optional_text("format")?.map(str::to_owned);
                let data = match audio {
                    Some(bytes) if !bytes.is_empty() => {
                        // llama-index keeps audio base64-encoded: bytes that already are strict base64 stay as
                        // they are, anything else is encoded. The format is guessed from the decoded bytes when
                        // none was given.
                        let (data, decoded) = match strict_base64_decode(&bytes) {
                            Some(decoded) => {
                                (String::from_utf8_lossy(&bytes).into_owned(), decoded)
                            }
                            None => (BASE64.encode(&bytes), bytes),
                        };
                        if format.as_deref().is_none_or(str::is_empty) {
                            format = guess_audio_format(&decoded).map(str::to_owned);
                        }
                        Some(data)
                    }
                    _ => None,
                };
                Ok(Block::Audio { data, format })
            }
            // Only text, image and audio blocks are kept before validation.
            _ => Err(ErrorType::ValidationError),
        }
    }
}

/// A pydantic `bytes | None` field after aihub's legacy normalisation: a list of ints 0..=255 (bools excluded)
/// becomes bytes; a string becomes its UTF-8 bytes (pydantic's lax mode); anything else fails validation.
fn bytes_field(value: Option<&Value>) -> Result<Option<Vec<u8>>, ErrorType> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_bytes().to_vec())),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::Number(n) => n.as_u64().and_then(|b| u8::try_from(b).ok()),
                _ => None,
            })
            .collect::<Option<Vec<u8>>>()
            .map(Some)
            .ok_or(ErrorType::ValidationError),
        Some(_) => Err(ErrorType::ValidationError),
    }
}

/// An image or audio `url`: a string is parsed as pydantic's `AnyUrl` does (pydantic-core uses the `url` crate, so
/// `Url`'s serialisation is the normalised form); an unparsable string or a non-string fails validation.
fn url_field(value: Option<&Value>) -> Result<Option<String>, ErrorType> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => url::Url::parse(s)
            .map(|u| Some(String::from(u)))
            .map_err(|_| ErrorType::ValidationError),
        Some(_) => Err(ErrorType::ValidationError),
    }
}

/// Python's `base64.b64decode(data, validate=True)`: only the standard alphabet with at most two trailing `=`,
/// and complete quads (a `=` where a quad has fewer than two characters is ignored, as binascii does).
/// Returns `None` where Python raises.
fn strict_base64_decode(data: &[u8]) -> Option<Vec<u8>> {
    let body_len = data.iter().rposition(|&b| b != b'=').map_or(0, |i| i + 1);
    let padding = data.len() - body_len;
    if padding > 2
        || !data[..body_len]
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    {
        return None;
    }
    match body_len % 4 {
        0 => {}
        // binascii needs the quad completed by padding.
        2 if padding == 2 => {}
        3 if padding >= 1 => {}
        _ => return None,
    }
    // binascii also accepts non-zero trailing bits, which the default engines reject.
    const LENIENT: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireNone),
    );
    LENIENT.decode(&data[..body_len]).ok()
}

/// The audio formats `filetype.guess` (used by llama-index) recognises that matter here.
///
/// Chosen: wav and mp3 (the supported ones) plus ogg and flac for the warning's `audio_format`; anything else is
/// reported as "None".
fn guess_audio_format(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [
            b'R',
            b'I',
            b'F',
            b'F',
            _,
            _,
            _,
            _,
            b'W',
            b'A',
            b'V',
            b'E',
            ..,
        ] => Some("wav"),
        [b'I', b'D', b'3', ..] | [0xFF, 0xFB | 0xF3 | 0xF2, ..] => Some("mp3"),
        [b'O', b'g', b'g', b'S', ..] => Some("ogg"),
        [b'f', b'L', b'a', b'C', ..] => Some("flac"),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Stop events (contract 7): the full answer of the last output message, validated as core `Message`.
// ---------------------------------------------------------------------------------------------------------------

/// `output_messages` that is not a non-empty list gives an empty answer; otherwise its last element must validate
/// as core `Message` and its `content` is the concatenated text of its `contents` text items.
///
/// Chosen: `role` must be a string; `name`, `function_call_name`, `function_call_arguments_json`, `tool_call_id`
/// strings or null; `tool_calls` a list or null; each `contents` item an object whose `type` is `text` (with a
/// string `text`), `image` or `audio` (their other fields are not checked).
fn full_answer(output_messages: Option<&Value>) -> Result<Box<str>, ErrorType> {
    let Some(Value::Array(messages)) = output_messages else {
        return Ok("".into());
    };
    let Some(last) = messages.last() else {
        return Ok("".into());
    };
    let invalid = ErrorType::ValidationError;
    let Value::Object(message) = last else {
        return Err(invalid);
    };
    if !matches!(message.get("role"), Some(Value::String(_))) {
        return Err(invalid);
    }
    for name in [
        "name",
        "function_call_name",
        "function_call_arguments_json",
        "tool_call_id",
    ] {
        if !matches!(
            message.get(name),
            None | Some(Value::Null | Value::String(_))
        ) {
            return Err(invalid);
        }
    }
    if !matches!(
        message.get("tool_calls"),
        None | Some(Value::Null | Value::Array(_))
    ) {
        return Err(invalid);
    }
    let mut content = String::new();
    match message.get("contents") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for item in items {
                let Value::Object(item) = item else {
                    return Err(invalid);
                };
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => match item.get("text") {
                        Some(Value::String(text)) => content.push_str(text),
                        _ => return Err(invalid),
                    },
                    Some("image" | "audio") => {}
                    _ => return Err(invalid),
                }
            }
        }
        Some(_) => return Err(invalid),
    }
    Ok(content.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(agent_class: &str, event_name: &str) -> DeliveryKey {
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

    fn payload(key: DeliveryKey, value: Value) -> Decoded {
        decode_payload(key, value.to_string().as_bytes()).unwrap()
    }

    fn body(decoded: Decoded) -> Body {
        match decoded {
            Decoded::Event(e) => e.body,
            Decoded::Irrelevant => panic!("expected a relevant event"),
        }
    }

    #[test]
    fn a_payload_nested_deeper_than_the_store_keeps_is_dropped() {
        // `k` nested arrays under output_messages: the payload nests k + 1 deep, its row k + 2.
        let stop = |k: usize| {
            let field = format!("{}{}", "[".repeat(k), "]".repeat(k));
            format!(
                r#"{{"_parent_event_names": ["StopEvent"], "created_at": 1, "note": "[[[[{{", "output_messages": {field}}}"#
            )
        };
        let decode = |k: usize| decode_payload(key("A", "StopEvent"), stop(k).as_bytes()).unwrap();
        assert!(matches!(decode(MAX_STORED_DEPTH - 2), Decoded::Event(_)));
        assert_eq!(decode(MAX_STORED_DEPTH - 1), Decoded::Irrelevant);
        assert_eq!(nesting_depth(br#"{"a": "[{\"[", "b": [{}]}"#), 3);
    }

    fn audio(value: Value, format: Value) -> Value {
        json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": [
            {"role": "user", "blocks": [{"block_type": "audio", "audio": value, "format": format}]}]})
    }

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
    fn a_payload_that_is_not_json_is_an_error() {
        assert!(decode_payload(key("A", "ChunkEvent"), b"{nope").is_err());
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
    fn a_repeated_key_keeps_its_last_value() {
        let raw =
            br#"{"_parent_event_names":["ChunkEvent"],"created_at":1,"content":"a","content":"b"}"#;
        let body = body(decode_payload(key("A", "ChunkEvent"), raw).unwrap());
        assert_eq!(body, Body::Chunk(Ok("b".into())));
    }

    #[test]
    fn missing_parents_fall_back_to_the_subject_event_name() {
        let b = body(payload(
            key("A", "ChunkEvent"),
            json!({"created_at": 1, "content": "x"}),
        ));
        assert_eq!(b, Body::Chunk(Ok("x".into())));
        let d = payload(
            key("A", "CustomEvent"),
            json!({"created_at": 1, "content": "x"}),
        );
        assert_eq!(d, Decoded::Irrelevant);
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

    #[test]
    fn legacy_int_list_audio_is_base64_encoded() {
        let bytes: Vec<u8> = b"encoded-audio".to_vec();
        let b = body(payload(
            key(USER_AGENT, "UserMessageEvent"),
            audio(json!(bytes), json!("wav")),
        ));
        let Body::UserMessage(content) = b else {
            panic!()
        };
        assert_eq!(
            content.parts,
            Ok(vec![Part::InputAudio {
                input_audio: InputAudio {
                    data: "ZW5jb2RlZC1hdWRpbw==".into(),
                    format: "wav".into()
                }
            }])
        );
    }

    #[test]
    fn audio_that_already_is_base64_is_kept() {
        let b = body(payload(
            key(USER_AGENT, "UserMessageEvent"),
            audio(json!("ZW5jb2RlZC1hdWRpbw=="), json!("mp3")),
        ));
        let Body::UserMessage(content) = b else {
            panic!()
        };
        assert_eq!(
            content.parts,
            Ok(vec![Part::InputAudio {
                input_audio: InputAudio {
                    data: "ZW5jb2RlZC1hdWRpbw==".into(),
                    format: "mp3".into()
                }
            }])
        );
    }

    #[test]
    fn boolean_byte_lists_fail_validation() {
        let b = body(payload(
            key(USER_AGENT, "UserMessageEvent"),
            audio(json!([true, false]), json!("wav")),
        ));
        let Body::UserMessage(content) = b else {
            panic!()
        };
        assert_eq!(content.parts, Err(ErrorType::ValidationError));
    }

    #[test]
    fn unsupported_audio_is_reported_and_a_missing_format_is_guessed() {
        let b = body(payload(
            key(USER_AGENT, "UserMessageEvent"),
            audio(json!("abc"), json!("ogg")),
        ));
        let Body::UserMessage(content) = b else {
            panic!()
        };
        assert_eq!(content.unsupported_audio, vec!["ogg".into()]);
        assert_eq!(content.parts, Err(ErrorType::ValueError));

        let wav: Vec<u8> = b"RIFF\0\0\0\0WAVEfmt ".to_vec();
        let b = body(payload(
            key(USER_AGENT, "UserMessageEvent"),
            audio(json!(wav), Value::Null),
        ));
        let Body::UserMessage(content) = b else {
            panic!()
        };
        assert!(
            matches!(&content.parts.unwrap()[0], Part::InputAudio { input_audio } if input_audio.format == "wav")
        );
    }

    #[test]
    fn strict_base64_matches_python_validate_true() {
        assert!(strict_base64_decode(b"ZW5jb2RlZC1hdWRpbw==").is_some());
        assert!(strict_base64_decode(b"abcd").is_some());
        assert!(strict_base64_decode(b"").is_some());
        assert!(strict_base64_decode(b"abc=").is_some());
        assert!(strict_base64_decode(b"ab==").is_some());
        assert!(strict_base64_decode(b"abc").is_none());
        assert!(strict_base64_decode(b"ab=").is_none());
        assert!(strict_base64_decode(b"a===").is_none());
        assert!(strict_base64_decode(b"encoded-audio").is_none());
        assert!(strict_base64_decode(b"ab cd").is_none());
        assert!(strict_base64_decode(b"abcde").is_none());
    }

    #[test]
    fn image_urls_are_normalised_and_invalid_ones_fail() {
        let msg = |url: Value| {
            json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": [
                {"role": "user", "blocks": [{"block_type": "image", "url": url}, {"block_type": "text", "text": "t"}]}]})
        };
        let Body::UserMessage(c) = body(payload(
            key(USER_AGENT, "U"),
            msg(json!("HTTPS://Example.COM")),
        )) else {
            panic!()
        };
        assert_eq!(
            c.parts.unwrap()[0],
            Part::ImageUrl {
                image_url: ImageUrl {
                    url: "https://example.com/".into()
                }
            }
        );
        let Body::UserMessage(c) = body(payload(key(USER_AGENT, "U"), msg(json!("not a url"))))
        else {
            panic!()
        };
        assert_eq!(c.parts, Err(ErrorType::ValidationError));
    }

    #[test]
    fn user_message_raw_checks_raise_the_contract_error_types() {
        let cases = [
            (json!([]), ErrorType::ValueError),
            (json!(null), ErrorType::ValueError),
            (json!(["x"]), ErrorType::TypeError),
            (json!([{"role": "user"}]), ErrorType::TypeError),
            (
                json!([{"role": "user", "blocks": ["x"]}]),
                ErrorType::TypeError,
            ),
            (
                json!([{"role": "user", "blocks": [{"block_type": "text", "text": 1}]}]),
                ErrorType::ValidationError,
            ),
            (
                json!([{"role": "wizard", "blocks": [{"block_type": "text", "text": "a"}]}]),
                ErrorType::ValidationError,
            ),
            (
                json!([{"role": "user", "blocks": [{"block_type": "document", "x": 1}]}]),
                ErrorType::ValueError,
            ),
        ];
        for (messages, expected) in cases {
            let Body::UserMessage(c) = body(payload(
                key(USER_AGENT, "U"),
                json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1, "messages": messages}),
            )) else {
                panic!()
            };
            assert_eq!(c.parts, Err(expected), "{messages}");
        }
    }

    #[test]
    fn stop_answers_follow_the_core_message_rules() {
        let stop = |om: Value| {
            body(payload(
                key("P", "LLMStopEvent"),
                json!({"_parent_event_names": ["LLMStopEvent", "StopEvent"], "created_at": 1, "output_messages": om}),
            ))
        };
        assert_eq!(stop(json!(null)), Body::Stop(Ok("".into())));
        assert_eq!(stop(json!([])), Body::Stop(Ok("".into())));
        assert_eq!(
            stop(
                json!([{"role": "assistant", "contents": [{"type": "text", "text": "a"}, {"type": "image", "url": "u"},
                                                          {"type": "text", "text": "b"}], "content": "ignored"}])
            ),
            Body::Stop(Ok("ab".into()))
        );
        assert_eq!(
            stop(json!([{"role": "assistant", "contents": "invalid"}])),
            Body::Stop(Err(ErrorType::ValidationError))
        );
        assert_eq!(
            stop(json!([{"contents": []}])),
            Body::Stop(Err(ErrorType::ValidationError))
        );
    }

    #[test]
    fn store_rows_decode_like_payloads() {
        let row = json!({"agent_class": "A", "agent_id": "id", "thread_id": "t", "display_id": "d", "run_id": "r",
            "event_id": "e1", "event_type": "display_event", "event_name": "ChunkEvent",
            "event_parents": ["ChunkEvent", "DisplayEvent"],
            "event_data": {"created_at": 7, "content": "Hel", "_parent_event_names": ["ignored"]}});
        let doc = mongodb::bson::to_raw_document_buf(&row).unwrap();
        let from_row = decode_row(&doc);
        let from_payload = payload(
            key("A", "ChunkEvent"),
            json!({"_parent_event_names": ["ChunkEvent", "DisplayEvent"], "created_at": 7, "content": "Hel"}),
        );
        assert_eq!(from_row, from_payload);
    }

    #[test]
    fn bson_binary_audio_is_treated_as_bytes() {
        use mongodb::bson::{Binary, doc, spec::BinarySubtype};
        let row = doc! {"agent_class": USER_AGENT, "agent_id": "id", "thread_id": "t", "display_id": "d",
        "run_id": "r", "event_id": "e1", "event_type": "display_event", "event_name": "UserMessageEvent",
        "event_parents": ["UserMessageEvent"],
        "event_data": {"created_at": 1_i64, "messages": [{"role": "user", "blocks": [
            {"block_type": "audio", "format": "wav",
             "audio": Binary { subtype: BinarySubtype::Generic, bytes: b"encoded-audio".to_vec() }}]}]}};
        let doc = mongodb::bson::RawDocumentBuf::from_document(&row).unwrap();
        let Decoded::Event(event) = decode_row(&doc) else {
            panic!()
        };
        let Body::UserMessage(content) = event.body else {
            panic!()
        };
        assert!(
            matches!(&content.parts.unwrap()[0], Part::InputAudio { input_audio } if input_audio.data == "ZW5jb2RlZC1hdWRpbw==")
        );
    }

    #[test]
    fn rows_with_missing_key_fields_keep_them_empty() {
        let row = json!({"agent_class": "A", "thread_id": "t", "display_id": "d", "run_id": 5,
            "event_id": "e1", "event_type": "display_event", "event_name": "ChunkEvent",
            "event_parents": ["ChunkEvent"], "event_data": "not a mapping"});
        let doc = mongodb::bson::to_raw_document_buf(&row).unwrap();
        let Decoded::Event(event) = decode_row(&doc) else {
            panic!()
        };
        assert_eq!(event.key.missing_field(), Some("agent_id"));
        assert_eq!(event.created_at, Err(ErrorType::TypeError));
    }
}
