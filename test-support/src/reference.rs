//! A deliberately naive reference for aihub's chat history: persisted `agent_events` rows (JSON, in store order)
//! and the read's optional primary identity become the `messages` of the contract's HistoryResponse
//! (`docs/contract.md`, sections 4 to 7), plus the metadata-only warnings aihub would log.
//!
//! Why it exists: the worker's projector (`src/project.rs` over `src/decode`) is built for speed and memory (a
//! compact decoded event, a view kept sorted, one code path for NATS payloads and BSON rows). A test that takes
//! that projector's output as the expected answer only checks that the worker agrees with itself. This module is
//! the second, independent implementation the end-to-end tests compare the served answers with, and which the
//! property tests hold the projector to. It therefore shares no code with the worker (it does not use the
//! `chat_history_view` crate at all), reads the rows as plain `serde_json::Value`s, and follows the contract's
//! text step by step, in the contract's words, with no attention to speed: every step makes its own pass over
//! the rows.
//!
//! Where the contract leaves a detail open, the choice made here is marked `Chosen:`.

use std::collections::{HashMap, HashSet};

use base64::Engine as _;
use serde_json::{Map, Value, json};

const USER_AGENT: &str = "UserAgent";
const USER_MESSAGE: &str = "UserMessageEvent";
const HITL_RESPONSE: &str = "HumanInTheLoopResponseEvent";
const CHUNK: &str = "ChunkEvent";
const HITL_REQUEST: &str = "HumanInTheLoopRequestEvent";
const STOP: &str = "StopEvent";
/// The parents that make a `UserAgent` row a visibility marker (5.1).
const MARKERS: [&str; 2] = [USER_MESSAGE, HITL_RESPONSE];
/// The five projectable families (5.1).
const FAMILIES: [&str; 5] = [USER_MESSAGE, HITL_RESPONSE, CHUNK, HITL_REQUEST, STOP];
/// The delivery key's fields, in the key's order (6).
const KEY_FIELDS: [&str; 8] = [
    "agent_class",
    "agent_id",
    "thread_id",
    "display_id",
    "run_id",
    "event_type",
    "event_name",
    "event_id",
];
/// llama-index's `MessageRole` values (a ChatMessage's `role` must be one of them).
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

/// The exception classes aihub's projector catches; the `error_type` of a warning (5.7).
const TYPE_ERROR: &str = "TypeError";
const VALUE_ERROR: &str = "ValueError";
const VALIDATION_ERROR: &str = "ValidationError";

/// Why an event was skipped: the name of the Python exception aihub would have raised.
type Failure = &'static str;

/// One metadata-only warning, as the conformance cases list them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub event_id: String,
    /// `TypeError`, `ValueError`, `ValidationError` or `UnsupportedAudioFormat`.
    pub error_type: String,
    /// `str(format)` of an unsupported audio block (`None` for the other warnings).
    pub audio_format: Option<String>,
}

/// What a read of a thread answers.
#[derive(Debug, Clone, PartialEq)]
pub struct History {
    /// The HistoryResponse `messages`: `[{"role", "content": [parts]}]` (5.6).
    pub messages: Value,
    /// In the order aihub logs them.
    pub warnings: Vec<Warning>,
    /// Whether a marker made any display visible (the worker's Conversations API answers 404 otherwise).
    pub visible: bool,
    /// `created_at` of the first visible event in history order (after validation, dedup and sorting), which the
    /// worker's Conversations API gives as the conversation's `created_at`.
    pub first_visible_at: Option<i64>,
}

/// A read of `thread_id` with the optional primary identity `(agent_class, agent_id)`: the store's query (section
/// 4), then the projector over what it returns.
///
/// The query keeps the rows of the thread that are display events; its visibility and family filters are the
/// projector's own, which runs them again (5.1). `rows` are taken in the order given, as the store returned them.
pub fn history(thread_id: &str, rows: &[Value], primary: Option<(&str, &str)>) -> History {
    let queried: Vec<Value> = rows
        .iter()
        .filter(|row| row["thread_id"] == thread_id && row["event_type"] == "display_event")
        .cloned()
        .collect();
    project(&queried, primary)
}

/// The projector (sections 5 to 7) over rows as the store's query returns them.
pub fn project(rows: &[Value], primary: Option<(&str, &str)>) -> History {
    let mut warnings = Vec::new();

    // 5.1: visibility by markers, then the family filter. Reads neither event_data nor event_type.
    let visible_displays: HashSet<&str> = rows
        .iter()
        .filter(|row| row["agent_class"] == USER_AGENT)
        .filter(|row| parents(row).iter().any(|p| MARKERS.contains(p)))
        .filter_map(|row| row["display_id"].as_str())
        .collect();
    let candidates = rows.iter().filter(|row| {
        row["display_id"]
            .as_str()
            .is_some_and(|d| visible_displays.contains(d))
            && parents(row).iter().any(|p| FAMILIES.contains(p))
    });

    // 6: validation (in input order, before sorting), dedup keeping the first, sort.
    let mut seen: HashSet<Vec<String>> = HashSet::new();
    let mut ordered: Vec<(i64, Vec<String>, &Value)> = Vec::new();
    for row in candidates {
        // The key first, then created_at.
        let checked = delivery_key(row).and_then(|key| created_at(row).map(|at| (at, key)));
        match checked {
            Err(failure) => warnings.push(malformed(row, failure)),
            Ok((at, key)) => {
                if seen.insert(key.clone()) {
                    ordered.push((at, key, row));
                }
            }
        }
    }
    // (created_at, event_id, full key); Rust compares strings by UTF-8 bytes, which is Python's code-point order.
    ordered.sort_by(|a, b| (a.0, &a.1[7], &a.1).cmp(&(b.0, &b.1[7], &b.1)));
    let first_visible_at = ordered.first().map(|(at, _, _)| *at);

    // 5.4: the dispatch, first matching branch wins.
    let mut transcript = Transcript::default();
    for (_, key, row) in ordered {
        let (agent_class, agent_id, display) = (&key[0], &key[1], key[3].as_str());
        let names = parents(row);
        let has = |name: &str| names.contains(&name);
        let data = row["event_data"].as_object().expect("validated: a mapping");
        let outcome = if agent_class == USER_AGENT && has(USER_MESSAGE) {
            transcript.start_user_segment(display);
            let (parts, unsupported_audio) = user_parts(data);
            for format in unsupported_audio {
                warnings.push(Warning {
                    event_id: event_id(row),
                    error_type: "UnsupportedAudioFormat".into(),
                    audio_format: Some(format),
                });
            }
            parts.and_then(|parts| transcript.add_user_parts(display, parts))
        } else if agent_class == USER_AGENT && has(HITL_RESPONSE) {
            transcript.start_user_segment(display);
            let text = match data.get("response") {
                Some(Value::Bool(true)) => Ok("true".to_owned()),
                Some(Value::Bool(false)) => Ok("false".to_owned()),
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                _ => Err(VALUE_ERROR),
            };
            text.and_then(|text| transcript.add_user_parts(display, vec![text_part(&text)]))
        } else if has(CHUNK) {
            non_empty_string(data.get("content"))
                .and_then(|text| transcript.add_assistant_text(display, &text))
        } else if has(HITL_REQUEST) {
            non_empty_string(data.get("question"))
                .and_then(|text| transcript.add_assistant_text(display, &text))
        } else if has(STOP) && primary.is_some_and(|(c, i)| c == agent_class && i == agent_id) {
            // 7: terminal recovery by the prefix rule.
            full_answer(data).and_then(|full| {
                let suffix = missing_suffix(transcript.streamed(display), &full).to_owned();
                if suffix.is_empty() {
                    Ok(())
                } else {
                    transcript.add_assistant_text(display, &suffix)
                }
            })
        } else {
            Ok(())
        };
        if let Err(failure) = outcome {
            warnings.push(malformed(row, failure));
        }
    }

    History {
        messages: transcript.render(),
        warnings,
        visible: !visible_displays.is_empty(),
        first_visible_at,
    }
}

/// The strings of a row's `event_parents`; a non-list counts as empty (5.1).
fn parents(row: &Value) -> Vec<&str> {
    match &row["event_parents"] {
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

/// The 8-tuple; each element must be a non-empty string, else ValueError("Missing <field>") (6).
fn delivery_key(row: &Value) -> Result<Vec<String>, Failure> {
    KEY_FIELDS
        .iter()
        .map(|field| match row[*field].as_str() {
            Some(s) if !s.is_empty() => Ok(s.to_owned()),
            _ => Err(VALUE_ERROR),
        })
        .collect()
}

/// `event_data` must be a mapping and its `created_at` an integer, not a bool, not a float (6). Else TypeError.
fn created_at(row: &Value) -> Result<i64, Failure> {
    let Some(data) = row["event_data"].as_object() else {
        return Err(TYPE_ERROR);
    };
    match data.get("created_at") {
        Some(Value::Number(n)) => n.as_i64().ok_or(TYPE_ERROR),
        _ => Err(TYPE_ERROR),
    }
}

fn event_id(row: &Value) -> String {
    row["event_id"].as_str().unwrap_or_default().to_owned()
}

fn malformed(row: &Value, failure: Failure) -> Warning {
    Warning {
        event_id: event_id(row),
        error_type: failure.to_owned(),
        audio_format: None,
    }
}

fn non_empty_string(value: Option<&Value>) -> Result<String, Failure> {
    match value {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(VALUE_ERROR),
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// 7: what streamed is kept; the rest of the full answer is added only when what streamed is a prefix of it.
fn missing_suffix<'a>(streamed: &str, full: &'a str) -> &'a str {
    if !full.is_empty() && full.starts_with(streamed) {
        &full[streamed.len()..]
    } else if streamed.is_empty() {
        full
    } else {
        ""
    }
}

/// 7: the full answer of a stop: `""` unless `output_messages` is a non-empty list; else its last element
/// validated as core `Message` (ValidationError), and its `content`, the joined text of its text `contents`.
///
/// Chosen: `role` a string (required); `name`, `tool_call_id`, `function_call_name`, `function_call_arguments_json`
/// strings or null; `tool_calls` a list or null; `contents` null or a list of objects whose `type` is `text` (with
/// a string `text`), `image` or `audio`.
fn full_answer(data: &Map<String, Value>) -> Result<String, Failure> {
    let last = match data.get("output_messages") {
        Some(Value::Array(messages)) if !messages.is_empty() => &messages[messages.len() - 1],
        _ => return Ok(String::new()),
    };
    let Value::Object(message) = last else {
        return Err(VALIDATION_ERROR);
    };
    let string_or_null = |name: &str| {
        matches!(
            message.get(name),
            None | Some(Value::Null | Value::String(_))
        )
    };
    let valid = matches!(message.get("role"), Some(Value::String(_)))
        && [
            "name",
            "tool_call_id",
            "function_call_name",
            "function_call_arguments_json",
        ]
        .into_iter()
        .all(string_or_null)
        && matches!(
            message.get("tool_calls"),
            None | Some(Value::Null | Value::Array(_))
        );
    if !valid {
        return Err(VALIDATION_ERROR);
    }
    let mut content = String::new();
    match message.get("contents") {
        None | Some(Value::Null) => {}
        Some(Value::Array(blocks)) => {
            for block in blocks {
                // (Indexing a non-object gives null, which matches no type.)
                match (block["type"].as_str(), &block["text"]) {
                    (Some("text"), Value::String(text)) => content.push_str(text),
                    (Some("image" | "audio"), _) => {}
                    _ => return Err(VALIDATION_ERROR),
                }
            }
        }
        Some(_) => return Err(VALIDATION_ERROR),
    }
    Ok(content)
}

/// 5.5: the user parts of a user message: those of its last ChatMessage, and the formats of the audio blocks
/// dropped as unsupported (each one a warning, logged even when the event then fails for lack of parts).
fn user_parts(data: &Map<String, Value>) -> (Result<Vec<Value>, Failure>, Vec<String>) {
    let mut unsupported_audio = Vec::new();
    let parts = user_parts_into(data, &mut unsupported_audio);
    (parts, unsupported_audio)
}

fn user_parts_into(
    data: &Map<String, Value>,
    unsupported_audio: &mut Vec<String>,
) -> Result<Vec<Value>, Failure> {
    // The raw checks, in order.
    let last = match data.get("messages") {
        Some(Value::Array(messages)) if !messages.is_empty() => &messages[messages.len() - 1],
        _ => return Err(VALUE_ERROR),
    };
    let Value::Object(message) = last else {
        return Err(TYPE_ERROR);
    };
    let Some(Value::Array(blocks)) = message.get("blocks") else {
        return Err(TYPE_ERROR);
    };
    if !blocks.iter().all(Value::is_object) {
        return Err(TYPE_ERROR);
    }
    // Other block types are dropped before validation.
    let blocks: Vec<&Value> = blocks
        .iter()
        .filter(|b| matches!(b["block_type"].as_str(), Some("text" | "image" | "audio")))
        .collect();

    // ChatMessage.model_validate, after the legacy byte-list normalisation of image and audio data.
    // Chosen: `role` is validated as llama-index's MessageRole (absent means the default, user), though its value
    // does not matter: the last message is always a user turn.
    let role_valid = match message.get("role") {
        None => true,
        Some(role) => role.as_str().is_some_and(|r| MESSAGE_ROLES.contains(&r)),
    };
    if !role_valid {
        return Err(VALIDATION_ERROR);
    }
    if !matches!(
        message.get("additional_kwargs"),
        None | Some(Value::Object(_))
    ) {
        return Err(VALIDATION_ERROR);
    }
    let blocks: Vec<Block> = blocks
        .into_iter()
        .map(validate_block)
        .collect::<Result<_, _>>()?;

    // Each validated block as OpenAI parts.
    let mut parts = Vec::new();
    for block in blocks {
        match block {
            Block::Text(text) => {
                if !text.is_empty() {
                    parts.push(text_part(&text));
                }
            }
            Block::Image { url } => {
                // Images without a url (inline bytes or a path) are dropped silently.
                if let Some(url) = url {
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
            }
            Block::Audio { audio, format } => {
                let supported = matches!(format.as_deref(), Some("wav" | "mp3"));
                if !supported {
                    // Chosen: "when it has audio data" is read as non-empty bytes (llama-index's `if not audio`).
                    if audio.as_ref().is_some_and(|a| !a.is_empty()) {
                        unsupported_audio.push(format.unwrap_or_else(|| "None".to_owned()));
                    }
                    continue;
                }
                // "If the format is supported and `audio` is bytes": empty bytes included. Audio without bytes
                // (url-only) is dropped.
                if let Some(audio) = audio {
                    let data = String::from_utf8(audio).expect("base64 text is ASCII");
                    parts.push(json!({"type": "input_audio", "input_audio": {"data": data, "format": format}}));
                }
            }
        }
    }
    if parts.is_empty() {
        return Err(VALUE_ERROR);
    }
    Ok(parts)
}

/// A llama-index content block after validation, reduced to what history uses.
enum Block {
    Text(String),
    /// `str(url)` of the block's url, normalised as pydantic's AnyUrl does.
    Image {
        url: Option<String>,
    },
    /// `audio`: the block's bytes after llama-index's validator, which keeps them base64-encoded; `format`: as
    /// given, or guessed from the decoded bytes when none was given.
    Audio {
        audio: Option<Vec<u8>>,
        format: Option<String>,
    },
}

fn validate_block(block: &Value) -> Result<Block, Failure> {
    let optional_string = |name: &str| match &block[name] {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        _ => Err(VALIDATION_ERROR),
    };
    match block["block_type"].as_str() {
        Some("text") => match &block["text"] {
            Value::String(text) => Ok(Block::Text(text.clone())),
            _ => Err(VALIDATION_ERROR),
        },
        Some("image") => {
            bytes_field(&block["image"])?;
            // Chosen: `path` (a pydantic FilePath) is any string: whether the file exists on aihub's host cannot
            // be known here.
            optional_string("path")?;
            optional_string("image_mimetype")?;
            optional_string("detail")?;
            Ok(Block::Image {
                url: url_field(&block["url"])?,
            })
        }
        Some("audio") => {
            let audio = bytes_field(&block["audio"])?;
            optional_string("path")?;
            url_field(&block["url"])?;
            let mut format = optional_string("format")?;
            let audio = match audio {
                // llama-index's validator: bytes that are already base64 stay as they are, other bytes are
                // encoded; the format is guessed from the decoded bytes when none is given.
                Some(bytes) if !bytes.is_empty() => {
                    let (kept, decoded) = match python_b64decode_validate(&bytes) {
                        Some(decoded) => (bytes, decoded),
                        None => (
                            base64::engine::general_purpose::STANDARD
                                .encode(&bytes)
                                .into_bytes(),
                            bytes,
                        ),
                    };
                    if format.as_deref().is_none_or(str::is_empty) {
                        format = guess_audio_format(&decoded).map(str::to_owned);
                    }
                    Some(kept)
                }
                other => other,
            };
            Ok(Block::Audio { audio, format })
        }
        _ => unreachable!("only text, image and audio blocks are validated"),
    }
}

/// A pydantic `bytes | None` field after aihub's legacy normalisation: a list of ints 0..=255 (no bools) becomes
/// bytes; a string is its UTF-8 bytes (pydantic's lax mode); anything else fails validation.
fn bytes_field(value: &Value) -> Result<Option<Vec<u8>>, Failure> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone().into_bytes())),
        Value::Array(items) => {
            let mut bytes = Vec::new();
            for item in items {
                // serde_json has no bool-as-int: a JSON `true` is never a Number, so bools are excluded already.
                match item.as_u64().and_then(|n| u8::try_from(n).ok()) {
                    Some(byte) => bytes.push(byte),
                    None => return Err(VALIDATION_ERROR),
                }
            }
            Ok(Some(bytes))
        }
        _ => Err(VALIDATION_ERROR),
    }
}

/// An `AnyUrl` field: `str(AnyUrl(s))`, which is what the `url` crate (pydantic-core's URL parser) serialises.
///
/// Chosen: a string that does not parse as a URL fails validation (rather than being kept as a plain string).
fn url_field(value: &Value) -> Result<Option<String>, Failure> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => url::Url::parse(s)
            .map(|url| Some(url.to_string()))
            .map_err(|_| VALIDATION_ERROR),
        _ => Err(VALIDATION_ERROR),
    }
}

/// Python's `base64.b64decode(data, validate=True)`: `None` where it raises. The input must match
/// `[A-Za-z0-9+/]*={0,2}`; binascii then needs the last quad completed: 2 leftover characters with `==`, 3 with at
/// least one `=`, none with any padding; 1 leftover character is an error. Non-zero trailing bits are accepted.
fn python_b64decode_validate(data: &[u8]) -> Option<Vec<u8>> {
    let body_len = data.iter().take_while(|&&b| b != b'=').count();
    let (body, padding) = data.split_at(body_len);
    let alphabet = |b: &u8| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/';
    if !body.iter().all(alphabet) || padding.len() > 2 || padding.iter().any(|&b| b != b'=') {
        return None;
    }
    let complete = match body.len() % 4 {
        0 => true,
        2 => padding.len() == 2,
        3 => !padding.is_empty(),
        _ => false,
    };
    if !complete {
        return None;
    }
    let lenient = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::RequireNone),
    );
    lenient.decode(body).ok()
}

/// The format `filetype.guess` gives audio bytes (as llama-index uses it), for the two supported formats.
///
/// Chosen: only wav (`RIFF....WAVE`) and mp3 (`ID3`, or an MPEG frame sync `FF FB`/`FF F3`/`FF F2`) are
/// recognised; anything else is no guess (reported as `None`).
fn guess_audio_format(bytes: &[u8]) -> Option<&'static str> {
    if bytes.len() >= 12 && &bytes[0..4] == b"RIFF" && &bytes[8..12] == b"WAVE" {
        Some("wav")
    } else if bytes.starts_with(b"ID3")
        || bytes.starts_with(&[0xFF, 0xFB])
        || bytes.starts_with(&[0xFF, 0xF3])
        || bytes.starts_with(&[0xFF, 0xF2])
    {
        Some("mp3")
    } else {
        None
    }
}

/// The transcript builder of 5.3.
#[derive(Default)]
struct Transcript {
    messages: Vec<Message>,
    /// Display id → the assistant text added on it since its last user segment.
    assistant_text_by_display: HashMap<String, String>,
}

struct Message {
    role: &'static str,
    display_id: String,
    content: Vec<Value>,
}

impl Transcript {
    fn start_user_segment(&mut self, display: &str) {
        self.assistant_text_by_display
            .insert(display.to_owned(), String::new());
    }

    fn add_user_parts(&mut self, display: &str, parts: Vec<Value>) -> Result<(), Failure> {
        self.assistant_text_by_display
            .insert(display.to_owned(), String::new());
        if parts.is_empty() {
            return Err(VALUE_ERROR);
        }
        match self.messages.last_mut() {
            Some(last) if last.role == "user" && last.display_id == display => {
                last.content.extend(parts)
            }
            _ => self.messages.push(Message {
                role: "user",
                display_id: display.to_owned(),
                content: parts,
            }),
        }
        Ok(())
    }

    fn add_assistant_text(&mut self, display: &str, text: &str) -> Result<(), Failure> {
        if text.is_empty() {
            return Err(VALUE_ERROR);
        }
        match self.messages.last_mut() {
            Some(last) if last.role == "assistant" && last.display_id == display => {
                match last.content.last_mut() {
                    Some(part) if part["type"] == "text" => {
                        let joined = format!("{}{text}", part["text"].as_str().unwrap_or_default());
                        part["text"] = Value::String(joined);
                    }
                    _ => last.content.push(text_part(text)),
                }
            }
            _ => self.messages.push(Message {
                role: "assistant",
                display_id: display.to_owned(),
                content: vec![text_part(text)],
            }),
        }
        self.assistant_text_by_display
            .entry(display.to_owned())
            .or_default()
            .push_str(text);
        Ok(())
    }

    fn streamed(&self, display: &str) -> &str {
        self.assistant_text_by_display
            .get(display)
            .map_or("", String::as_str)
    }

    /// 5.6: `{"role", "content": [parts]}`, without the display.
    fn render(self) -> Value {
        Value::Array(
            self.messages
                .into_iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect(),
        )
    }
}
