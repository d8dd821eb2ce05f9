//! What the fuzz targets assert, shared with the replay of the committed corpus in `make test`
//! (`tests/api/fuzz_corpus.rs`): no input panics a decoder, what a decoder keeps is linear in its input, and one
//! event decodes to the same view event from its NATS form (subject and JSON payload) and from the row aihub's
//! persister writes from it.

use arbitrary::Arbitrary;
use chat_history_view::decode::{Decoded, MAX_STORED_DEPTH, decode_payload, decode_row};
use chat_history_view::subject::DeliveryKey;
use mongodb::bson::RawDocument;
use serde_json::{Map, Number, Value};

/// The most a decoded key or event may hold for an input of `len` bytes: linear in the input, plus the fixed
/// cost of its parts.
pub fn bound(len: usize) -> usize {
    4 * len + 4096
}

/// The subject parser: a subject it accepts is rebuilt exactly from the key, and the key is complete.
pub fn subject(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(key) = DeliveryKey::parse_subject(text) {
        assert_eq!(key.to_subject(), text);
        assert_eq!(key.missing_field(), None);
        assert!(key.heap_bytes() <= bound(data.len()));
    }
}

/// Subjects a payload is decoded under (the first byte picks one): one per projector branch, a name no family
/// claims, and a control event.
const PAYLOAD_SUBJECTS: [&str; 7] = [
    "agent.UserAgent.u.t.d.r.display_event.UserMessageEvent.e",
    "agent.UserAgent.u.t.d.r.display_event.HumanInTheLoopResponseEvent.e",
    "agent.A.a.t.d.r.display_event.ChunkEvent.e",
    "agent.A.a.t.d.r.display_event.HumanInTheLoopRequestEvent.e",
    "agent.A.a.t.d.r.display_event.StopEvent.e",
    "agent.A.a.t.d.r.display_event.SomethingElse.e",
    "agent.A.a.t.d.r.control_event.ChunkEvent.e",
];

/// The JSON payload decoder: any bytes under any of [`PAYLOAD_SUBJECTS`].
pub fn payload(data: &[u8]) {
    let Some((&pick, payload)) = data.split_first() else {
        return;
    };
    let subject = PAYLOAD_SUBJECTS[usize::from(pick) % PAYLOAD_SUBJECTS.len()];
    let key = DeliveryKey::parse_subject(subject).expect("a fixed subject parses");
    if let Ok(Decoded::Event(event)) = decode_payload(key, payload) {
        assert!(event.heap_bytes() <= bound(data.len()));
    }
}

/// The BSON row decoder: any bytes that frame a document (the driver hands the decoder framed documents; what is
/// inside may be anything).
pub fn row(data: &[u8]) {
    let Ok(row) = RawDocument::from_bytes(data) else {
        return;
    };
    if let Decoded::Event(event) = decode_row(row) {
        assert!(event.heap_bytes() <= bound(data.len()));
    }
}

/// One generated event, from which both of its forms are built.
#[derive(Debug, Arbitrary)]
pub struct Event {
    agent_class: AgentClass,
    name: Name,
    /// Parents beyond the name's own chain (aihub lists every ancestor class).
    extra_parents: Vec<Text>,
    control: bool,
    /// agent_id, thread_id, display_id, run_id, event_id.
    ids: [Token; 5],
    created_at: CreatedAt,
    /// The branch's field; `None` leaves it out.
    field: Option<Json>,
    /// Other `event_data` fields.
    other: Vec<(Text, Json)>,
}

#[derive(Debug, Arbitrary)]
enum AgentClass {
    User,
    Agent(Token),
}

/// The event's class: one of the five families (some by a subclass), or any other name.
#[derive(Debug, Arbitrary)]
enum Name {
    UserMessage,
    HitlChatResponse,
    Chunk,
    HitlChatRequest,
    LlmStop,
    Other(Token),
}

impl Name {
    /// The event name and its parents list as aihub writes it (the class first, then its ancestors).
    fn chain(&self) -> Vec<String> {
        let chain: &[&str] = match self {
            Name::UserMessage => &[
                "UserMessageEvent",
                "StartEvent",
                "ControlAndDisplayEvent",
                "DisplayEvent",
                "ControlEvent",
            ],
            Name::HitlChatResponse => &[
                "HumanInTheLoopChatResponseEvent",
                "HumanInTheLoopResponseEvent",
                "ControlAndDisplayEvent",
            ],
            Name::Chunk => &["ChunkEvent", "DisplayEvent"],
            Name::HitlChatRequest => &[
                "HumanInTheLoopChatRequestEvent",
                "HumanInTheLoopRequestEvent",
                "ControlAndDisplayEvent",
            ],
            Name::LlmStop => &["LLMStopEvent", "StopEvent", "ControlAndDisplayEvent"],
            Name::Other(token) => return vec![token.get()],
        };
        chain.iter().map(|s| (*s).to_owned()).collect()
    }

    /// The `event_data` field the name's branch reads.
    fn field(&self) -> &'static str {
        match self {
            Name::UserMessage => "messages",
            Name::HitlChatResponse => "response",
            Name::Chunk => "content",
            Name::HitlChatRequest => "question",
            Name::LlmStop | Name::Other(_) => "output_messages",
        }
    }
}

/// A subject token: never empty, never holding a dot.
#[derive(Debug, Arbitrary)]
struct Token(String);

impl Token {
    fn get(&self) -> String {
        let token: String = self.0.chars().filter(|c| *c != '.').take(64).collect();
        if token.is_empty() { "x".into() } else { token }
    }
}

/// A string: one of the words the decoders look for, or any other.
#[derive(Debug, Arbitrary)]
enum Text {
    Known(u8),
    Any(String),
}

const WORDS: [&str; 24] = [
    "role",
    "user",
    "assistant",
    "system",
    "blocks",
    "block_type",
    "text",
    "image",
    "audio",
    "url",
    "path",
    "format",
    "wav",
    "mp3",
    "content",
    "contents",
    "type",
    "additional_kwargs",
    "created_at",
    "response",
    "question",
    "messages",
    "output_messages",
    "_parent_event_names",
];

impl Text {
    fn get(&self) -> String {
        match self {
            Text::Known(n) => WORDS[usize::from(*n) % WORDS.len()].to_owned(),
            Text::Any(s) => s.clone(),
        }
    }
}

#[derive(Debug, Arbitrary)]
enum CreatedAt {
    Ns(i64),
    Other(Json),
    Missing,
}

/// A JSON value (what both forms can carry: no unsigned integers beyond i64, no non-finite numbers).
#[derive(Debug, Arbitrary)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Text),
    List(Vec<Json>),
    Map(Vec<(Text, Json)>),
}

impl Json {
    fn get(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(n) => Value::Number((*n).into()),
            Json::Float(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
            Json::Str(text) => Value::String(text.get()),
            Json::List(items) => Value::Array(items.iter().map(Json::get).collect()),
            Json::Map(entries) => Value::Object(
                entries
                    .iter()
                    .map(|(key, value)| (key.get(), value.get()))
                    .collect(),
            ),
        }
    }
}

/// The event's NATS form (subject and JSON payload) and its persisted row ([`stored_row`]).
pub fn forms(event: &Event) -> (String, Vec<u8>, Value) {
    let agent_class = match &event.agent_class {
        AgentClass::User => "UserAgent".to_owned(),
        AgentClass::Agent(token) => token.get(),
    };
    let [agent_id, thread_id, display_id, run_id, event_id] = event.ids.each_ref().map(Token::get);
    let mut parents = event.name.chain();
    let event_name = parents[0].clone();
    parents.extend(event.extra_parents.iter().map(Text::get));
    let event_type = if event.control {
        "control_event"
    } else {
        "display_event"
    };

    let mut data = Map::new();
    for (key, value) in &event.other {
        data.insert(key.get(), value.get());
    }
    match &event.created_at {
        CreatedAt::Ns(ns) => drop(data.insert("created_at".into(), (*ns).into())),
        CreatedAt::Other(json) => drop(data.insert("created_at".into(), json.get())),
        CreatedAt::Missing => drop(data.remove("created_at")),
    }
    match &event.field {
        Some(json) => drop(data.insert(event.name.field().into(), json.get())),
        None => drop(data.remove(event.name.field())),
    }
    data.insert("event_id".into(), event_id.clone().into());
    data.insert("_event_name".into(), event_name.clone().into());
    data.insert("_parent_event_names".into(), parents.into());
    let payload = Value::Object(data);

    let subject = format!(
        "agent.{agent_class}.{agent_id}.{thread_id}.{display_id}.{run_id}.{event_type}.{event_name}.{event_id}"
    );
    let bytes = serde_json::to_vec(&payload).expect("a JSON value serializes");
    let row = stored_row(&subject, payload);
    (subject, bytes, row)
}

/// The row aihub's persister writes for a message on `subject` whose payload reads as `data`: the subject's
/// tokens, the payload's `event_id`, the payload as `event_data` and its parents list as `event_parents`
/// ([contract 3](../docs/contract.md#3)).
pub fn stored_row(subject: &str, data: Value) -> Value {
    let key = DeliveryKey::parse_subject(subject).expect("a display-event subject");
    serde_json::json!({
        "agent_class": key.agent_class(), "agent_id": key.agent_id(), "thread_id": key.thread_id(),
        "display_id": key.display_id(), "run_id": key.run_id(), "event_type": key.event_type(),
        "event_name": key.event_name(), "event_id": data["event_id"], "event_parents": data["_parent_event_names"],
        "event_data": data,
    })
}

/// Both forms of `event` decode to the same verdict.
pub fn same_event(event: &Event) {
    let (subject, payload, row) = forms(event);
    let key = DeliveryKey::parse_subject(&subject).expect("a generated subject parses");
    let live = decode_payload(key, &payload).expect("a generated payload is JSON");
    // MongoDB keeps documents nested at most MAX_STORED_DEPTH levels deep: a deeper row is never stored, and the
    // live path drops the event as well.
    if depth(&row) > MAX_STORED_DEPTH {
        assert_eq!(live, Decoded::Irrelevant, "subject {subject}");
        return;
    }
    // Keys BSON cannot hold (a NUL byte) cannot be persisted: nothing to compare.
    let Ok(row) = mongodb::bson::to_raw_document_buf(&row) else {
        return;
    };
    assert_eq!(
        live,
        decode_row(&row),
        "subject {subject}, payload {}",
        String::from_utf8_lossy(&payload)
    );
}

/// How deeply `value` nests arrays and objects (a scalar is 0).
fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(entries) => 1 + entries.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}
