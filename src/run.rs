//! The run model ([design 3.1](../docs/design.md#3.1)): what the runs made of a thread's answer, read from one
//! traced projection. Each assistant message's parts in projector order (its text blocks and its HITL questions),
//! and the state of the thread's latest run, one state machine: `running`, `awaiting_input`, `finished`,
//! `stalled`. Its `ended` (finished or awaiting input) is the projector's finished runs
//! ([`crate::project::Projection::finished_runs`]), which the items' `status` and `wait_for_run` read; the resume
//! dialects (`http/resume.rs`) read the whole machine.
//!
//! Pure: a projection and its trace in, the model out; the stall bound is applied by the reader, with its clock.

use std::collections::HashMap;
use std::time::Duration;

use crate::decode::{Body, ViewEvent};
use crate::project::{Fate, Projection, Role, StopFate, Trace};

/// A run is `stalled` when it has not ended and its latest event is older than this ([design 3.1]): a failed run
/// ends with an `ExceptionEvent`, which is not a display event the worker holds, so it would look running forever.
///
/// [design 3.1]: ../docs/design.md#3.1
pub const STALLED_AFTER: Duration = Duration::from_secs(120);

/// A part of an assistant message, in projector order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunPart {
    /// Text (chunks, and what a stop supplied by the prefix rule) up to the next question or the message's end, and
    /// the byte length of each event's piece of it, in projector order.
    Text { text: String, pieces: Vec<u32> },
    /// A HITL question: its event's id and its text.
    Question { event_id: Box<str>, text: String },
}

/// The state of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// It has not ended, and its latest event is recent.
    Running,
    /// It ended on a HITL question, and no answer followed yet.
    AwaitingInput,
    /// A stop ended it (of the read's primary agent, of any agent when the read names none).
    Finished,
    /// It has not ended, and nothing of it came for [`STALLED_AFTER`]. Never terminal: an event moves it back.
    Stalled,
}

impl RunState {
    pub fn label(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::AwaitingInput => "awaiting_input",
            Self::Finished => "finished",
            Self::Stalled => "stalled",
        }
    }

    /// Whether more of the run may still come (running or stalled).
    pub fn open(self) -> bool {
        matches!(self, Self::Running | Self::Stalled)
    }
}

/// How a run ended, by the projector's rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Ended {
    #[default]
    No,
    Question,
    Stop,
}

/// A run that wrote an assistant message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub run_id: Box<str>,
    /// The assistant messages it joined, in order (indexes into the history).
    pub messages: Vec<usize>,
    /// The last of them, and that message's item id.
    pub message: usize,
    pub item_id: String,
    ended: Ended,
    /// `created_at` (nanoseconds) of its first and latest events the projector met.
    pub first_event_ns: Option<i64>,
    pub last_event_ns: Option<i64>,
}

impl Run {
    /// The run's state at `now_ns` (nanoseconds since the Unix epoch).
    pub fn state(&self, now_ns: i64) -> RunState {
        match self.ended {
            Ended::Stop => RunState::Finished,
            Ended::Question => RunState::AwaitingInput,
            Ended::No => {
                let stall = i64::try_from(STALLED_AFTER.as_nanos()).unwrap_or(i64::MAX);
                match self.last_event_ns {
                    Some(last) if now_ns.saturating_sub(last) > stall => RunState::Stalled,
                    _ => RunState::Running,
                }
            }
        }
    }
}

/// The run model of one answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Runs {
    /// Per message of the history: an assistant message's parts (their texts concatenated are its text); empty
    /// for a user message.
    pub parts: Vec<Vec<RunPart>>,
    /// Every run that wrote an assistant message, in the order their messages come (a run that joined several,
    /// at its last).
    pub runs: Vec<Run>,
    /// The thread's latest run: the last run to join the last message, when that is an assistant message.
    pub latest: Option<Run>,
}

/// The run model of `projection`, from the `trace` the projector recorded with it.
pub fn runs(projection: &Projection, trace: &Trace<'_>) -> Runs {
    let messages = &projection.history.messages;
    let mut parts: Vec<Vec<RunPart>> = vec![Vec::new(); messages.len()];
    let assistant = |message: usize| {
        messages
            .get(message)
            .is_some_and(|m| m.role == Role::Assistant)
    };
    // What each run's events say, in one pass (runs and trace are both as long as the thread).
    let mut facts: HashMap<&str, RunFacts> = HashMap::new();
    for (event, fate) in trace {
        if !matches!(fate, Fate::DisplayNotVisible) {
            facts
                .entry(event.key.run_id())
                .or_default()
                .add(event, fate);
        }
        match (fate, &event.body) {
            (Fate::Counted { message }, Body::Chunk(Ok(text))) if assistant(*message) => {
                push_text(&mut parts[*message], text);
            }
            (Fate::Counted { message }, Body::HitlQuestion(Ok(text))) if assistant(*message) => {
                parts[*message].push(RunPart::Question {
                    event_id: event.key.event_id().into(),
                    text: text.to_string(),
                });
            }
            (Fate::Stop(StopFate::Supplied { message, bytes }), Body::Stop(Ok(full)))
                if assistant(*message) =>
            {
                let suffix = full.get(full.len().saturating_sub(*bytes)..).unwrap_or("");
                push_text(&mut parts[*message], suffix);
            }
            _ => {}
        }
    }
    // Each run with the assistant messages it joined, in the order runs first joined one.
    let mut joined: Vec<(&str, Vec<usize>)> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (at, provenance) in projection.provenance.iter().enumerate() {
        if !assistant(at) {
            continue;
        }
        for run in &provenance.runs {
            let slot = *index.entry(&run.run_id).or_insert_with(|| {
                joined.push((&run.run_id, Vec::new()));
                joined.len() - 1
            });
            joined[slot].1.push(at);
        }
    }
    joined.sort_by_key(|(_, messages)| messages.last().copied());
    let runs: Vec<Run> = joined
        .into_iter()
        .map(|(run_id, messages)| {
            let facts = facts.get(run_id).copied().unwrap_or_default();
            run_of(projection, facts, messages, run_id)
        })
        .collect();
    let latest = messages
        .len()
        .checked_sub(1)
        .filter(|&last| assistant(last))
        .and_then(|last| {
            let run = projection.provenance.get(last)?.runs.last()?;
            runs.iter().find(|r| r.run_id == run.run_id).cloned()
        });
    Runs {
        parts,
        runs,
        latest,
    }
}

/// Appends `text` (one event's piece) to the message's open text block, or opens one.
fn push_text(parts: &mut Vec<RunPart>, text: &str) {
    let piece = u32::try_from(text.len()).unwrap_or(u32::MAX);
    match parts.last_mut() {
        Some(RunPart::Text { text: open, pieces }) => {
            open.push_str(text);
            pieces.push(piece);
        }
        _ => parts.push(RunPart::Text {
            text: text.to_owned(),
            pieces: vec![piece],
        }),
    }
}

/// What a run's events (those the projector met on visible displays) say: how it ended (the last of its events
/// that may end it, in projector order) and when its first and latest events were created.
#[derive(Debug, Clone, Copy, Default)]
struct RunFacts {
    ended: Ended,
    first_event_ns: Option<i64>,
    last_event_ns: Option<i64>,
}

impl RunFacts {
    fn add(&mut self, event: &ViewEvent, fate: &Fate) {
        if let Ok(at) = event.created_at {
            self.first_event_ns = Some(self.first_event_ns.map_or(at, |first| first.min(at)));
            self.last_event_ns = self.last_event_ns.max(Some(at));
        }
        match (&event.body, fate) {
            (_, _) if self.ended == Ended::Stop => {}
            (Body::HitlQuestion(_), _) => self.ended = Ended::Question,
            // The answer carries the question's run id: the run goes on.
            (Body::HitlAnswer(_), _) => self.ended = Ended::No,
            (Body::Stop(_), Fate::Stop(StopFate::NotPrimary)) => {}
            (Body::Stop(_), _) => self.ended = Ended::Stop,
            _ => {}
        }
    }
}

/// Run `run_id`, which joined `messages`, from its events' `facts`; ended only when the projector counts it
/// finished.
fn run_of(projection: &Projection, facts: RunFacts, messages: Vec<usize>, run_id: &str) -> Run {
    let message = messages.last().copied().unwrap_or_default();
    let RunFacts {
        mut ended,
        first_event_ns,
        last_event_ns,
    } = facts;
    if !projection.finished_runs.contains(run_id) {
        ended = Ended::No;
    }
    Run {
        run_id: run_id.into(),
        messages,
        message,
        item_id: projection
            .provenance
            .get(message)
            .map(crate::project::Provenance::id)
            .unwrap_or_default(),
        ended,
        first_event_ns,
        last_event_ns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::ViewEvent;
    use crate::decode::testing::{chunk, live_event, user};
    use crate::project::{Identity, project};

    const SECOND: i64 = 1_000_000_000;

    fn question(run: &str, id: &str, at: i64, text: &str) -> ViewEvent {
        live_event(
            &format!("agent.A.a.t.d.{run}.display_event.HumanInTheLoopChatRequestEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["HumanInTheLoopRequestEvent"], "created_at": at,
                "question": text})
            .to_string(),
        )
    }

    fn answer(id: &str, at: i64, text: &str) -> ViewEvent {
        live_event(
            &format!("agent.UserAgent.u.t.d.ru{id}.display_event.HumanInTheLoopChatResponseEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["HumanInTheLoopResponseEvent"], "created_at": at,
                "response": text})
            .to_string(),
        )
    }

    fn stop(agent: &str, run: &str, id: &str, at: i64, full: &str) -> ViewEvent {
        live_event(
            &format!("agent.{agent}.a.t.d.{run}.display_event.LLMStopEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["LLMStopEvent", "StopEvent"], "created_at": at,
                "output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": full}]}]})
            .to_string(),
        )
    }

    fn primary() -> Identity {
        Identity {
            agent_class: "A".into(),
            agent_id: "a".into(),
        }
    }

    /// The model of `events` projected with the primary identity, as the cache renders it (traced).
    fn model(events: &[ViewEvent]) -> (Projection, Runs) {
        let mut ordered: Vec<&ViewEvent> = events.iter().collect();
        ordered.sort_by_key(|e| (e.created_at.unwrap_or(0), e.key.clone()));
        let identity = primary();
        let (projection, trace) =
            crate::project::project_view_traced(ordered.into_iter(), &[], Some(&identity));
        assert_eq!(projection.history, project(events, Some(&identity)).history);
        let runs = runs(&projection, &trace);
        (projection, runs)
    }

    fn text_part(text: &str, pieces: &[u32]) -> RunPart {
        RunPart::Text {
            text: text.into(),
            pieces: pieces.to_vec(),
        }
    }

    /// The parts' texts concatenated: the message's text.
    fn text(parts: &[RunPart]) -> String {
        parts
            .iter()
            .map(|p| match p {
                RunPart::Text { text, .. } => text.as_str(),
                RunPart::Question { text, .. } => text.as_str(),
            })
            .collect()
    }

    fn message_text(projection: &Projection, at: usize) -> String {
        serde_json::to_value(&projection.history.messages[at].content).unwrap()[0]["text"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn a_run_streams_asks_is_answered_and_finishes() {
        let t0 = 1_000 * SECOND;
        let mut events = vec![user("d", "u1", t0, "Q"), chunk("r1", "c1", t0 + 1, "Hel")];
        let (_, runs) = model(&events);
        let latest = runs.latest.clone().unwrap();
        assert_eq!((&*latest.run_id, latest.message), ("r1", 1));
        assert_eq!(latest.state(t0 + SECOND), RunState::Running);
        assert_eq!(
            latest.state(t0 + 1 + STALLED_AFTER.as_nanos() as i64 + 1),
            RunState::Stalled
        );
        assert_eq!(runs.parts, vec![vec![], vec![text_part("Hel", &[3])]]);

        events.push(chunk("r1", "c2", t0 + 2, "lo. "));
        events.push(question("r1", "q1", t0 + 3, "Proceed?"));
        let (projection, runs) = model(&events);
        assert_eq!(
            runs.parts[1],
            vec![
                text_part("Hello. ", &[3, 4]),
                RunPart::Question {
                    event_id: "q1".into(),
                    text: "Proceed?".into()
                }
            ]
        );
        assert_eq!(text(&runs.parts[1]), message_text(&projection, 1));
        // Awaiting input however long it waits: a question ends the run.
        let latest = runs.latest.unwrap();
        assert_eq!(latest.state(t0 + 10_000 * SECOND), RunState::AwaitingInput);

        // The answer is a user turn: no run writes the last message.
        events.push(answer("h1", t0 + 4, "yes"));
        assert_eq!(model(&events).1.latest, None);

        // The next run streams, and its stop supplies the unstreamed end (the prefix rule).
        events.push(chunk("r2", "c3", t0 + 5, "Do"));
        events.push(stop("A", "r2", "s2", t0 + 6, "Done."));
        let (projection, runs) = model(&events);
        // Two pieces: the chunk's, and the end the stop supplied.
        assert_eq!(runs.parts[3], vec![text_part("Done.", &[2, 3])]);
        assert_eq!(text(&runs.parts[3]), message_text(&projection, 3));
        assert_eq!(runs.latest.clone().unwrap().state(t0), RunState::Finished);
        // Every run at its message, in order: the question ended r1, the stop r2.
        let states: Vec<_> = runs
            .runs
            .iter()
            .map(|r| (&*r.run_id, r.message, r.state(t0)))
            .collect();
        assert_eq!(
            states,
            [
                ("r1", 1, RunState::AwaitingInput),
                ("r2", 3, RunState::Finished)
            ]
        );
        assert_eq!(runs.runs[1].first_event_ns, Some(t0 + 5));
    }

    #[test]
    fn a_stop_of_another_agent_ends_nothing_and_a_question_after_text_splits_the_blocks() {
        let t0 = 1_000 * SECOND;
        let events = vec![
            user("d", "u1", t0, "Q"),
            chunk("r1", "c1", t0 + 1, "a"),
            question("r1", "q1", t0 + 2, "b?"),
            chunk("r1", "c2", t0 + 3, "c"),
            stop("Other", "r1", "s1", t0 + 4, "whatever"),
        ];
        let (projection, runs) = model(&events);
        assert_eq!(
            runs.parts[1],
            vec![
                text_part("a", &[1]),
                RunPart::Question {
                    event_id: "q1".into(),
                    text: "b?".into()
                },
                text_part("c", &[1]),
            ]
        );
        assert_eq!(text(&runs.parts[1]), message_text(&projection, 1));
        // The question ended the run (the projector counts it finished); the other agent's stop does not change it.
        assert_eq!(runs.latest.unwrap().state(t0), RunState::AwaitingInput);
    }

    /// aihub's answer carries its question's run id, and the agent goes on with that run.
    fn answer_of(run: &str, id: &str, at: i64, text: &str) -> ViewEvent {
        live_event(
            &format!("agent.UserAgent.u.t.d.{run}.display_event.HumanInTheLoopChatResponseEvent.{id}"),
            &serde_json::json!({"_parent_event_names": ["HumanInTheLoopResponseEvent"], "created_at": at,
                "response": text})
            .to_string(),
        )
    }

    #[test]
    fn an_answer_reopens_the_run_its_question_ended_and_only_a_stop_ends_it_for_good() {
        let t0 = 1_000 * SECOND;
        let mut events = vec![
            user("d", "u1", t0, "Q"),
            chunk("r1", "c1", t0 + 1, "a"),
            question("r1", "q1", t0 + 2, "b?"),
        ];
        let (projection, runs) = model(&events);
        assert!(projection.finished_runs.contains("r1"));
        assert_eq!(runs.latest.unwrap().state(t0), RunState::AwaitingInput);
        events.push(answer_of("r1", "h1", t0 + 3, "yes"));
        events.push(chunk("r1", "c2", t0 + 4, "c"));
        let (projection, runs) = model(&events);
        assert!(
            !projection.finished_runs.contains("r1"),
            "answered, the run goes on"
        );
        assert!(projection.provenance[3].in_progress());
        let latest = runs.latest.unwrap();
        assert_eq!((latest.message, latest.state(t0)), (3, RunState::Running));
        events.push(stop("A", "r1", "s1", t0 + 5, "c"));
        events.push(answer_of("r1", "h2", t0 + 6, "late answer"));
        let (projection, runs) = model(&events);
        assert!(
            projection.finished_runs.contains("r1"),
            "a stop ends it for good"
        );
        assert_eq!(runs.runs[0].state(t0), RunState::Finished);
    }

    #[test]
    fn a_thread_without_an_assistant_message_last_has_no_latest_run() {
        let (_, runs) = model(&[user("d", "u1", 1, "Q")]);
        assert_eq!(runs.latest, None);
        assert!(runs.runs.is_empty());
        assert_eq!(runs.parts, vec![Vec::<RunPart>::new()]);
        assert_eq!(model(&[]).1, Runs::default());
    }
}
