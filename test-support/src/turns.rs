//! aihub's read pattern as rows, for the multi-turn test and the benchmark's P7: a thread's turns, each on a new
//! display (or, when a HITL question is open, on the question's display, where the answer lands), the primary
//! agent streaming chunks and ending with a stop whose output has an unstreamed end, and every third turn a
//! nested helper on a hidden display that asks a HITL question, answered at the start of the next turn. Every text
//! starts with a token unique in its thread (`[a3.1]`, `[q4]`), which the promise's judge looks for
//! ([`crate::promise`]).

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::reference;
use crate::rows::{self, Event};

/// The agent whose turns these are; reads name it as the primary identity.
pub const PRIMARY: (&str, &str) = ("TurnAgent", "turn-agent-1");
const HELPER: (&str, &str) = ("HelperAgent", "helper-1");
const USER: (&str, &str) = ("UserAgent", "user-1");

/// One thread's conversation so far.
pub struct Conversation {
    pub thread: String,
    turn: usize,
    seq: usize,
    /// `created_at` of the last event (ns): the wall clock when it was built, as aihub stamps events.
    created_at: i64,
    /// The hidden display of an open HITL question.
    open_question: Option<String>,
    /// Every row published so far, in publish order.
    pub published: Vec<Value>,
}

impl Conversation {
    pub fn new(thread: impl Into<String>) -> Self {
        Self {
            thread: thread.into(),
            turn: 0,
            seq: 0,
            created_at: 0,
            open_question: None,
            published: Vec::new(),
        }
    }

    /// The next turn's rows, in publish order (also appended to `published`).
    pub fn next_turn(&mut self) -> Vec<Value> {
        let turn = self.turn;
        self.turn += 1;
        let mut out = Vec::new();
        let display = match self.open_question.take() {
            Some(hidden) => {
                out.push(self.row(
                    USER,
                    &hidden,
                    "HumanInTheLoopChatResponseEvent",
                    rows::HITL_CHAT_RESPONSE,
                    json!({"response": format!("[r{turn}]answer {turn}")}),
                ));
                hidden
            }
            None => {
                let display = format!("{}-d{turn}", self.thread);
                out.push(self.row(
                    USER,
                    &display,
                    "UserMessageEvent",
                    rows::USER_MESSAGE,
                    json!({"messages": [{"role": "user", "additional_kwargs": {},
                    "blocks": [{"block_type": "text", "text": format!("[q{turn}]question {turn}")}]}]}),
                ));
                display
            }
        };
        let mut streamed = String::new();
        for part in 0..3 {
            let text = format!("[a{turn}.{part}]answer {turn}.{part} ");
            streamed.push_str(&text);
            out.push(self.chunk(PRIMARY, &display, &text));
        }
        if turn % 3 == 1 {
            let hidden = format!("{}-h{turn}", self.thread);
            out.push(self.chunk(HELPER, &hidden, &format!("[h{turn}]helper {turn} ")));
            out.push(self.row(
                HELPER,
                &hidden,
                "HumanInTheLoopChatRequestEvent",
                rows::HITL_CHAT_REQUEST,
                json!({"question": format!("[k{turn}]may I ask {turn}?"), "hitl_type": "chat"}),
            ));
            self.open_question = Some(hidden);
        }
        let full = format!("{streamed}(end {turn})");
        out.push(self.row(PRIMARY, &display, "LLMStopEvent", rows::LLM_STOP, json!({"output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": full}]}]})));
        self.published.extend(out.iter().cloned());
        out
    }

    /// The history a read with the primary identity must answer: the naive reference ([`reference`], not the
    /// worker's own projector) over every published row.
    pub fn expected(&self) -> Value {
        let history = reference::history(&self.thread, &self.published, Some(PRIMARY));
        json!({"thread_id": self.thread, "messages": history.messages})
    }

    /// The query string of a read with the primary identity.
    pub fn query() -> String {
        format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1)
    }

    fn chunk(&mut self, agent: (&str, &str), display: &str, text: &str) -> Value {
        self.row(agent, display, "ChunkEvent", rows::CHUNK, rows::chunk(text))
    }

    fn row(
        &mut self,
        agent: (&str, &str),
        display: &str,
        name: &str,
        parents: &[&str],
        fields: Value,
    ) -> Value {
        self.seq += 1;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        self.created_at = now.max(self.created_at + 1);
        let event_id = format!("{}-e{:05}", self.thread, self.seq);
        let run = format!("{}-r{}", self.thread, self.turn);
        Event {
            agent,
            thread: &self.thread,
            display,
            run: &run,
            event_id: &event_id,
            name,
            parents,
            created_at: self.created_at,
        }
        .row(fields)
    }
}
