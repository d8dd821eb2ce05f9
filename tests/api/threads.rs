//! Random threads in the persisted row shape: several displays (some hidden, some made visible later by a HITL
//! answer), agents delegating on shared displays, duplicates, malformed and unknown events. Used by the property
//! tests and by the convergence test of the live and store paths.

use proptest::prelude::*;
use serde_json::{Value, json};
use test_support::rows::Event;

pub const PRIMARY: (&str, &str) = ("PrimaryAgent", "primary");

/// One event of a generated thread, before it becomes a row.
#[derive(Debug, Clone)]
pub struct EventSpec {
    kind: u8,
    display: u8,
    agent: u8,
    created_at: u8,
    text: String,
    flag: bool,
}

fn spec() -> impl Strategy<Value = EventSpec> {
    (0u8..10, 0u8..4, 0u8..3, 0u8..24, "[ab]{0,3}", any::<bool>()).prop_map(
        |(kind, display, agent, created_at, text, flag)| EventSpec {
            kind,
            display,
            agent,
            created_at,
            text,
            flag,
        },
    )
}

/// A thread: its rows in a canonical order, then the same rows with each repeated 1 to 3 times and shuffled.
#[derive(Debug, Clone)]
pub struct Thread {
    pub rows: Vec<Value>,
    pub delivered: Vec<Value>,
}

pub fn thread(thread_id: String) -> impl Strategy<Value = Thread> {
    prop::collection::vec((spec(), 1usize..4), 1..40).prop_flat_map(move |specs| {
        let rows: Vec<Value> = specs
            .iter()
            .enumerate()
            .map(|(i, (spec, _))| row(&thread_id, i, spec))
            .collect();
        let delivered: Vec<Value> = specs
            .iter()
            .zip(&rows)
            .flat_map(|((_, copies), row)| std::iter::repeat_n(row.clone(), *copies))
            .collect();
        (Just(rows), Just(delivered).prop_shuffle())
            .prop_map(|(rows, delivered)| Thread { rows, delivered })
    })
}

fn agent(n: u8) -> (&'static str, &'static str) {
    match n {
        0 => PRIMARY,
        1 => ("Worker", "w1"),
        _ => ("Nested", "n1"),
    }
}

fn row(thread_id: &str, i: usize, spec: &EventSpec) -> Value {
    let event_id = format!("e{i:03}");
    let display = format!("d{}", spec.display);
    let run = format!("r{}", spec.agent);
    let mut created_at = None;
    let text = if spec.text.is_empty() {
        "z".to_owned()
    } else {
        spec.text.clone()
    };
    let (agent_class, agent_id, name, parents, data): (&str, &str, &str, &[&str], Value) =
        match spec.kind {
            0 => (
                "UserAgent",
                "user-1",
                "UserMessageEvent",
                &[
                    "UserMessageEvent",
                    "StartEvent",
                    "ControlAndDisplayEvent",
                    "DisplayEvent",
                    "ControlEvent",
                ],
                json!({"messages": [{"role": "user", "additional_kwargs": {}, "blocks": [
                {"block_type": "text", "text": format!("u{i}")},
                {"block_type": "image", "url": if spec.flag { json!("https://example.com/i.png") } else { Value::Null }}]}]}),
            ),
            1 => (
                "UserAgent",
                "user-1",
                "HumanInTheLoopChatResponseEvent",
                &[
                    "HumanInTheLoopChatResponseEvent",
                    "HumanInTheLoopResponseEvent",
                    "ControlAndDisplayEvent",
                ],
                json!({"response": if spec.flag { json!(true) } else { json!(format!("answer {i}")) },
                   "request_event": {"question": 5}}),
            ),
            2 | 3 => {
                let (class, id) = agent(spec.agent);
                (
                    class,
                    id,
                    "ChunkEvent",
                    &["ChunkEvent", "DisplayEvent"],
                    json!({"content": spec.text, "model_name": "m"}),
                )
            }
            4 => {
                let (class, id) = agent(spec.agent);
                (
                    class,
                    id,
                    "HumanInTheLoopChatRequestEvent",
                    &[
                        "HumanInTheLoopChatRequestEvent",
                        "HumanInTheLoopRequestEvent",
                        "ControlAndDisplayEvent",
                    ],
                    json!({"question": format!("q{i}?"), "hitl_type": "chat"}),
                )
            }
            5 | 6 => {
                let (class, id) = agent(spec.agent);
                let contents = if spec.flag && spec.kind == 6 {
                    json!("invalid")
                } else {
                    json!([{"type": "text", "text": text}])
                };
                (
                    class,
                    id,
                    "LLMStopEvent",
                    &[
                        "LLMStopEvent",
                        "LLMEvent",
                        "SemanticEvent",
                        "StopEvent",
                        "ControlAndDisplayEvent",
                    ],
                    json!({"output_messages": [{"role": "assistant", "contents": contents}]}),
                )
            }
            7 => (
                "Retriever",
                "r1",
                "RetrievalAgentInTheLoopResponseEvent",
                &[
                    "RetrievalAgentInTheLoopResponseEvent",
                    "AgentInTheLoopResponseEvent",
                    "ControlAndDisplayEvent",
                ],
                json!({"content": 5, "question": null}),
            ),
            8 => {
                // Malformed ordering metadata or payload on a relevant event.
                if spec.flag {
                    created_at = Some(json!("not-an-integer"));
                }
                let (class, id) = agent(spec.agent);
                (
                    class,
                    id,
                    "ChunkEvent",
                    &["ChunkEvent", "DisplayEvent"],
                    json!({"content": if spec.flag { json!("ok") } else { json!(12345) }}),
                )
            }
            _ => {
                // A UserMessageEvent that is not a UserAgent marker: inert.
                let (class, id) = agent(spec.agent);
                (
                    class,
                    id,
                    "UserMessageEvent",
                    &["UserMessageEvent", "StartEvent"],
                    json!({"messages": []}),
                )
            }
        };
    let mut fields = data;
    if let Some(malformed) = created_at {
        fields["created_at"] = malformed;
    }
    Event {
        agent: (agent_class, agent_id),
        thread: thread_id,
        display: &display,
        run: &run,
        event_id: &event_id,
        name,
        parents,
        created_at: i64::from(spec.created_at),
    }
    .row(fields)
}

/// The NATS subject a row is published on.
pub use test_support::rows::subject;

/// `count` random threads named `<prefix>-<i>`, the same ones on every run.
pub fn generated(prefix: &str, count: usize) -> Vec<(String, Thread)> {
    use proptest::strategy::{Strategy, ValueTree};
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    (0..count)
        .map(|i| {
            let id = format!("{prefix}-{i}");
            let thread = thread(id.clone())
                .new_tree(&mut runner)
                .expect("a thread")
                .current();
            (id, thread)
        })
        .collect()
}
