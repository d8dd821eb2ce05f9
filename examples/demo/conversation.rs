//! The demo conversation: what aihub publishes for two turns of a realistic thread, and the history a client of
//! the primary agent `RAGAgent/wiki` should get back.
//!
//! Turn 1 (display `…d1`): a user question; the primary streams part of its answer, a delegate sharing the display
//! streams more, a delegate on its own display works hidden, and the primary's stop completes the truncated stream.
//! Turn 2 (display `…d2`): a new question; a travel delegate on a hidden display (`…d3`) asks a HITL question, the
//! user's answer lands on that display (making it visible), and the delegate resumes there.

use aihub_rows::{self as rows, Event};
use serde_json::{Value, json};

pub const PRIMARY: (&str, &str) = ("RAGAgent", "wiki");

/// The expected transcript: (role, text) per message.
pub const EXPECTED: [(&str, &str); 6] = [
    ("user", "What is the capital of France?"),
    ("assistant", "Paris is the capital of France, on the Seine."),
    ("user", "Can you book me a trip there?"),
    ("assistant", "Which dates should I book?"),
    ("user", "Next weekend"),
    ("assistant", "Booked: Paris, next weekend."),
];

/// One event of the conversation, before it becomes a row.
struct Step<'a> {
    agent: (&'a str, &'a str),
    display: &'a str,
    run: &'a str,
    name: &'a str,
    parents: &'a [&'a str],
    data: Value,
}

const USER: (&str, &str) = ("UserAgent", "u-ada");
const HITL_RESPONSE: &[&str] = &[
    "TripDatesResponseEvent",
    "HumanInTheLoopChatResponseEvent",
    "HumanInTheLoopResponseEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];
const AITL_RESPONSE: &[&str] = &[
    "RetrievalAgentInTheLoopResponseEvent",
    "AgentInTheLoopResponseEvent",
    "ControlAndDisplayEvent",
    "DisplayEvent",
    "ControlEvent",
];

fn user_message(text: &str) -> Value {
    json!({"locale": "en", "user": {"id": "u-ada", "name": "Ada", "email": "ada@example.org", "roles": ["user"]},
           "messages": [{"role": "user", "additional_kwargs": {}, "blocks": [{"block_type": "text", "text": text}]}],
           "files": null, "requested_features": []})
}

/// The events in publish order, as rows in the persisted shape (subject fields plus `event_data`).
pub fn rows(thread: &str) -> Vec<Value> {
    let d1 = format!("{thread}d1");
    let d2 = format!("{thread}d2");
    let d3 = format!("{thread}d3");
    let hidden = format!("{thread}dh");
    let events = [
        Step {
            agent: USER,
            display: &d1,
            run: "r1",
            name: "UserMessageEvent",
            parents: rows::USER_MESSAGE,
            data: user_message("What is the capital of France?"),
        },
        Step {
            agent: PRIMARY,
            display: &d1,
            run: "r1",
            name: "ChunkEvent",
            parents: rows::CHUNK,
            data: rows::chunk("Paris is "),
        },
        Step {
            agent: PRIMARY,
            display: &d1,
            run: "r1",
            name: "ChunkEvent",
            parents: rows::CHUNK,
            data: rows::chunk("the capital"),
        },
        Step {
            agent: ("FactChecker", "fc1"),
            display: &hidden,
            run: "r1x",
            name: "ChunkEvent",
            parents: rows::CHUNK,
            data: rows::chunk("HIDDEN: checking sources"),
        },
        Step {
            agent: ("Retriever", "ret1"),
            display: &hidden,
            run: "r1x",
            name: "RetrievalAgentInTheLoopResponseEvent",
            parents: AITL_RESPONSE,
            data: json!({"stop_event": {"whatever": true}, "created_at": "not even an integer"}),
        },
        Step {
            agent: ("GeoAgent", "geo1"),
            display: &d1,
            run: "r1g",
            name: "ChunkEvent",
            parents: rows::CHUNK,
            data: rows::chunk(" of France"),
        },
        Step {
            agent: PRIMARY,
            display: &d1,
            run: "r1",
            name: "LLMStopEvent",
            parents: rows::LLM_STOP,
            data: json!({"output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": "Paris is the capital of France, on the Seine."}]}]}),
        },
        Step {
            agent: USER,
            display: &d2,
            run: "r2",
            name: "UserMessageEvent",
            parents: rows::USER_MESSAGE,
            data: user_message("Can you book me a trip there?"),
        },
        Step {
            agent: ("TravelAgent", "trips"),
            display: &d3,
            run: "r3",
            name: "HumanInTheLoopChatRequestEvent",
            parents: rows::HITL_CHAT_REQUEST,
            data: json!({"question": "Which dates should I book?", "hitl_type": "chat"}),
        },
        Step {
            agent: USER,
            display: &d3,
            run: "r3",
            name: "TripDatesResponseEvent",
            parents: HITL_RESPONSE,
            data: json!({"response": "Next weekend", "request_event": {"question": "Which dates should I book?"}}),
        },
        Step {
            agent: ("TravelAgent", "trips"),
            display: &d3,
            run: "r3",
            name: "ChunkEvent",
            parents: rows::CHUNK,
            data: rows::chunk("Booked: Paris, next weekend."),
        },
    ];
    events
        .into_iter()
        .enumerate()
        .map(|(i, step)| {
            let event_id = format!("{thread}e{i:02}");
            Event {
                agent: step.agent,
                thread,
                display: step.display,
                run: step.run,
                event_id: &event_id,
                name: step.name,
                parents: step.parents,
                created_at: 1_764_000_000_000_000_000 + i as i64 * 1_000_000,
            }
            .row(step.data)
        })
        .collect()
}

/// The transcript of a history body as (role, text) pairs.
pub fn transcript(body: &Value) -> Vec<(String, String)> {
    body["messages"]
        .as_array()
        .map(|messages| {
            messages
                .iter()
                .map(|m| {
                    let text = m["content"]
                        .as_array()
                        .map(|parts| {
                            parts
                                .iter()
                                .filter_map(|p| p["text"].as_str())
                                .collect::<Vec<_>>()
                                .join("")
                        })
                        .unwrap_or_default();
                    (m["role"].as_str().unwrap_or_default().to_owned(), text)
                })
                .collect()
        })
        .unwrap_or_default()
}
