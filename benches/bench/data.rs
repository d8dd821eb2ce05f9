//! The events the bench stores and streams, in aihub's persisted row shape (`test_support::rows`):
//! `UserAgent` user messages (the markers that make a display visible) and chunks of about 100 bytes. A row becomes
//! a store document, or a NATS message: the row's 9-token subject with `event_data` as the JSON payload (and, as
//! aihub's publisher sends it, a `traceparent` header where a measurement asks for one).

use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator};
use serde_json::Value;
pub use test_support::rows::document;
use test_support::rows::{self, Event};

/// First `created_at` (ns); events of a thread are 1 µs apart in sequence order.
const BASE_CREATED_AT: i64 = 1_764_000_000_000_000_000;
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
    let text = format!("question {seq}: what does the quarterly report say?");
    Event {
        agent: USER,
        thread,
        display,
        run: "run-1",
        event_id: &event_id(thread, seq),
        name: "UserMessageEvent",
        parents: rows::USER_MESSAGE,
        created_at: created_at(seq),
    }
    .row(rows::user_message(&text))
}

/// Event `seq` of a one-display thread as published: its marker first, then chunks.
pub fn thread_event(thread: &str, seq: usize) -> Message {
    let display = display(thread, 0, 1);
    let row = if seq == 0 {
        marker(thread, &display, seq)
    } else {
        chunk(thread, &display, seq)
    };
    Message::from_row(&row)
}

/// A chunk of about 100 bytes of answer text on `display`.
pub fn chunk(thread: &str, display: &str, seq: usize) -> Value {
    chunk_with_text(thread, display, seq, &format!("{seq:08} {FILLER} "))
}

/// A chunk with the given text.
pub fn chunk_with_text(thread: &str, display: &str, seq: usize, text: &str) -> Value {
    Event {
        agent: AGENT,
        thread,
        display,
        run: "run-1",
        event_id: &event_id(thread, seq),
        name: "ChunkEvent",
        parents: rows::CHUNK,
        created_at: created_at(seq),
    }
    .row(rows::chunk(text))
}

/// A row as aihub publishes it, serialized once up front.
#[derive(Clone)]
pub struct Message {
    pub subject: Subject,
    pub payload: Bytes,
    /// The NATS headers aihub's publisher adds ([`Message::with_traceparent`]), if any.
    pub headers: Option<HeaderMap>,
}

impl Message {
    pub fn from_row(row: &Value) -> Self {
        Self {
            subject: Subject::from(rows::subject(row)),
            payload: Bytes::from(rows::payload(row)),
            headers: None,
        }
    }

    /// The message with the W3C `traceparent` aihub's publisher injects into every message: a fresh random trace
    /// id and span id (its publish span's) and flags `01`, as its publisher samples everything.
    pub fn with_traceparent(mut self) -> Self {
        let ids = RandomIdGenerator::default();
        let traceparent = format!("00-{}-{}-01", ids.new_trace_id(), ids.new_span_id());
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", traceparent.as_str());
        self.headers = Some(headers);
        self
    }

    pub async fn publish(&self, client: &async_nats::Client) {
        let published = match &self.headers {
            Some(headers) => {
                client
                    .publish_with_headers(
                        self.subject.clone(),
                        headers.clone(),
                        self.payload.clone(),
                    )
                    .await
            }
            None => {
                client
                    .publish(self.subject.clone(), self.payload.clone())
                    .await
            }
        };
        published.expect("publish to NATS");
    }
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
