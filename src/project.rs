//! The pure projector: a thread's decoded events and the read's primary identity become the OpenAI-style
//! [`HistoryResponse`] plus the metadata-only warnings aihub would log (contract sections [5](../docs/contract.md#5),
//! [6](../docs/contract.md#6) and [7](../docs/contract.md#7)). No I/O, no async: the same function serves the live view
//! and the store path, so equal event sets give identical output.

use std::collections::{BTreeSet, HashMap, HashSet};

use md5::{Digest, Md5};
use serde::Serialize;

use crate::decode::{Body, ErrorType, Family, Part, ViewEvent};
use crate::subject::DeliveryKey;

/// The agent a read is made for (`<agent_class>/<agent_id>` of the OpenAI model name). It gates terminal recovery:
/// only its own stop events may supply the unstreamed end of an answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub agent_class: String,
    pub agent_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

/// One history message; `content` is always a list of parts, never a plain string ([contract
/// 5.6](../docs/contract.md#5.6)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HistoryMessage {
    pub role: Role,
    pub content: Vec<Part>,
}

/// aihub's `HistoryResponse`: `{"messages": [...]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HistoryResponse {
    pub messages: Vec<HistoryMessage>,
}

/// Why an event was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarningKind {
    /// "Skipping malformed visible history event", with the exception class aihub would have caught.
    Malformed(ErrorType),
    /// "Skipping visible history audio block with unsupported format"; the event's other parts survive.
    UnsupportedAudio { format: Box<str> },
}

/// A metadata-only warning about one visible event ([contract 5.7](../docs/contract.md#5.7)). It never carries payload
/// text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub thread_id: String,
    pub display_id: String,
    pub run_id: String,
    pub event_id: String,
    pub event_name: String,
    pub kind: WarningKind,
}

impl Warning {
    fn new(event: &ViewEvent, kind: WarningKind) -> Self {
        let key = &event.key;
        Self {
            thread_id: key.thread_id().to_owned(),
            display_id: key.display_id().to_owned(),
            run_id: key.run_id().to_owned(),
            event_id: key.event_id().to_owned(),
            event_name: key.event_name().to_owned(),
            kind,
        }
    }

    /// The `error_type` field of the log line.
    pub fn error_type(&self) -> &str {
        match &self.kind {
            WarningKind::Malformed(t) => t.as_str(),
            WarningKind::UnsupportedAudio { .. } => "UnsupportedAudioFormat",
        }
    }

    /// Emits the warning as aihub does: a fixed message and metadata fields only.
    pub fn log(&self) {
        let (thread_id, display_id, run_id, event_id, event_name) = (
            self.thread_id.as_str(),
            self.display_id.as_str(),
            self.run_id.as_str(),
            self.event_id.as_str(),
            self.event_name.as_str(),
        );
        let error_type = self.error_type();
        match &self.kind {
            WarningKind::Malformed(_) => tracing::warn!(
                thread_id,
                display_id,
                run_id,
                event_id,
                event_name,
                error_type,
                "Skipping malformed visible history event"
            ),
            WarningKind::UnsupportedAudio { format } => tracing::warn!(
                thread_id,
                display_id,
                run_id,
                event_id,
                event_name,
                error_type,
                audio_format = &**format,
                "Skipping visible history audio block with unsupported format"
            ),
        }
    }
}

/// The projector's result: the history and the warnings, in the order aihub logs them, and what the history's
/// other forms need ([design 3.1](../docs/design.md#3.1)): each message's provenance, the runs that finished, when
/// the conversation began.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Projection {
    pub history: HistoryResponse,
    pub warnings: Vec<Warning>,
    /// One per message of `history`, in the same order.
    pub provenance: Vec<Provenance>,
    /// The runs that finished: a stop event of the primary agent (of any agent when the read has no identity) or a
    /// HITL request of the run, well-formed or not, that no answer of the run followed (the agent goes on with the
    /// run once answered).
    pub finished_runs: BTreeSet<Box<str>>,
    /// Whether any display is client-visible (a thread without one has no conversation).
    pub visible: bool,
    /// `created_at` (nanoseconds) of the first visible event in history order.
    pub first_visible_at: Option<i64>,
}

/// `msg_` and the 32 lowercase hex digits of an item id's digest.
pub fn format_item_id(digest: &[u8; 16]) -> String {
    use std::fmt::Write as _;
    let mut id = String::with_capacity(36);
    id.push_str("msg_");
    for byte in digest {
        let _ = write!(id, "{byte:02x}");
    }
    id
}

/// Where one message came from: its first event, and the runs whose events it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// The delivery key of the message's first event (in history order).
    pub first: DeliveryKey,
    /// The runs whose events joined the message, in the order they first joined it, and whether each finished.
    pub runs: Vec<RunState>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunState {
    pub run_id: Box<str>,
    pub finished: bool,
}

impl Provenance {
    /// The message's id: `msg_` and the hex MD5 digest of its first event's key (each field length-prefixed).
    /// It changes only when an earlier event joins the message, never when messages before it change.
    pub fn id(&self) -> String {
        format_item_id(&self.id_digest())
    }

    /// The digest [`Provenance::id`] shows.
    pub fn id_digest(&self) -> [u8; 16] {
        let mut digest = Md5::new();
        for field in self.first.fields() {
            digest.update((field.len() as u64).to_le_bytes());
            digest.update(field.as_bytes());
        }
        digest.finalize().into()
    }

    /// Whether the message is still being written: its last run has not finished. (A user message's runs are the
    /// user's; only assistant messages are ever in progress, see [`Turn`].)
    pub fn in_progress(&self) -> bool {
        self.runs.last().is_some_and(|run| !run.finished)
    }
}

/// What the projector did with one event: what `explain` reports ([design 3.3](../docs/design.md#3.3)). Recorded by
/// the projector itself as it projects ([`project_view_traced`]), so it cannot disagree with the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Its content joined message `message` (an index into the history).
    Counted { message: usize },
    /// On a display no `UserAgent` marker made visible: nothing of it was read.
    DisplayNotVisible,
    /// A family member no projector branch takes (a user message or HITL answer not from `UserAgent`).
    NoBranch,
    /// Skipped with a metadata-only warning: the rule it broke.
    Malformed { error_type: ErrorType, rule: Rule },
    /// A stop event, and what the prefix rule ([contract 7](../docs/contract.md#7)) did with it.
    Stop(StopFate),
}

/// The rule a malformed event broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A delivery-key field is missing or not a non-empty string (ordering validation).
    KeyField(&'static str),
    /// `created_at` is not an integer (ordering validation).
    CreatedAt,
    /// The one `event_data` field its branch reads (`messages`, `response`, `content`, `question`,
    /// `output_messages`) failed that branch's rules.
    Field(&'static str),
}

/// What the prefix rule did with a stop event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopFate {
    /// What streamed was a strict prefix of the full answer: the rest (its last `bytes` bytes) joined message
    /// `message`.
    Supplied { message: usize, bytes: usize },
    /// What streamed already was the full answer (or the answer was empty).
    NothingToAdd,
    /// What streamed is not a prefix of the full answer: nothing was added.
    Diverged,
    /// Not the read's primary agent: its answer is never read.
    NotPrimary,
    /// The read has no primary identity: no stop event supplies anything.
    NoIdentity,
}

/// The events a traced projection recorded, each with its fate, in the order the projector met them (hidden and
/// rejected events first).
pub type Trace<'a> = Vec<(&'a ViewEvent, Fate)>;

/// The rule an event failing ordering validation broke.
fn validation_rule(event: &ViewEvent) -> Rule {
    event
        .key
        .missing_field()
        .map_or(Rule::CreatedAt, Rule::KeyField)
}

/// Displays on which a `UserAgent` marker landed: the client-visible surfaces ([contract
/// 5.1](../docs/contract.md#5.1)). Computed over every event, malformed ones included: a malformed marker still makes
/// its display visible.
pub fn visible_displays<'a>(events: impl IntoIterator<Item = &'a ViewEvent>) -> HashSet<&'a str> {
    events
        .into_iter()
        .filter(|e| e.is_marker())
        .map(|e| e.key.display_id())
        .collect()
}

/// Ordering validation ([contract 6](../docs/contract.md#6)): every key field a non-empty string (ValueError), then
/// `created_at` an integer.
pub fn validate(event: &ViewEvent) -> Result<i64, ErrorType> {
    if event.key.missing_field().is_some() {
        return Err(ErrorType::ValueError);
    }
    event.created_at
}

/// The reference projector: events in store order, projected exactly as aihub does (visibility, then validation of
/// the visible events in input order, dedup by delivery key with the first occurrence winning, sort by
/// `(created_at, event_id, key)`, transcript). The worker itself serves views through [`project_view`]; this one
/// is what the tests and the fuzz targets hold it to (the conformance cases, and the property that both agree).
pub fn project(events: &[ViewEvent], primary: Option<&Identity>) -> Projection {
    let visible = visible_displays(events);
    let any_visible = !visible.is_empty();
    let mut warnings = Vec::new();
    let mut seen = HashSet::new();
    let mut ordered = Vec::with_capacity(events.len());
    for event in events
        .iter()
        .filter(|e| visible.contains(e.key.display_id()))
    {
        match validate(event) {
            Err(error) => warnings.push(Warning::new(event, WarningKind::Malformed(error))),
            Ok(created_at) => {
                if seen.insert(&event.key) {
                    ordered.push((created_at, event));
                }
            }
        }
    }
    ordered.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.key.cmp(&b.1.key)));
    let mut projection = build(ordered.into_iter().map(|(_, e)| e), primary, warnings, None);
    projection.visible = any_visible;
    projection
}

/// Projects a thread view: `ordered` holds valid, deduplicated events already in sort order, `rejected` the events
/// that failed validation (they still count for visibility and are warned about when visible). Gives the same
/// result as [`project`] over the same events.
pub fn project_view<'a>(
    ordered: impl Iterator<Item = &'a ViewEvent> + Clone,
    rejected: &'a [ViewEvent],
    primary: Option<&Identity>,
) -> Projection {
    projected(ordered, rejected, primary, None)
}

/// [`project_view`], recording every event's [`Fate`] as it goes.
pub fn project_view_traced<'a>(
    ordered: impl Iterator<Item = &'a ViewEvent> + Clone,
    rejected: &'a [ViewEvent],
    primary: Option<&Identity>,
) -> (Projection, Trace<'a>) {
    let mut trace = Vec::new();
    let projection = projected(ordered, rejected, primary, Some(&mut trace));
    (projection, trace)
}

fn projected<'a>(
    ordered: impl Iterator<Item = &'a ViewEvent> + Clone,
    rejected: &'a [ViewEvent],
    primary: Option<&Identity>,
    mut trace: Option<&mut Trace<'a>>,
) -> Projection {
    let visible = visible_displays(ordered.clone().chain(rejected));
    let mut warnings = Vec::new();
    for event in rejected {
        let shown = visible.contains(event.key.display_id());
        let error = validate(event).err();
        if shown && let Some(error) = error {
            warnings.push(Warning::new(event, WarningKind::Malformed(error)));
        }
        if let Some(trace) = trace.as_deref_mut() {
            let fate = match error {
                Some(error_type) if shown => Fate::Malformed {
                    error_type,
                    rule: validation_rule(event),
                },
                _ => Fate::DisplayNotVisible,
            };
            trace.push((event, fate));
        }
    }
    if let Some(trace) = trace.as_deref_mut() {
        let hidden = ordered
            .clone()
            .filter(|e| !visible.contains(e.key.display_id()));
        trace.extend(hidden.map(|e| (e, Fate::DisplayNotVisible)));
    }
    let mut projection = build(
        ordered.filter(|e| visible.contains(e.key.display_id())),
        primary,
        warnings,
        trace,
    );
    projection.visible = !visible.is_empty();
    projection
}

/// The transcript builder of [contract 5.3](../docs/contract.md#5.3) driven by the dispatch of
/// [5.4](../docs/contract.md#5.4); with `trace`, each event's [`Fate`] is recorded.
fn build<'a>(
    events: impl Iterator<Item = &'a ViewEvent>,
    primary: Option<&Identity>,
    mut warnings: Vec<Warning>,
    mut trace: Option<&mut Trace<'a>>,
) -> Projection {
    let mut transcript = Transcript::default();
    let mut finished_runs = BTreeSet::new();
    // The runs a stop ended: an answer re-opens only a run a question ended.
    let mut stopped_runs: BTreeSet<&str> = BTreeSet::new();
    let mut first_visible_at = None;
    for event in events {
        first_visible_at = first_visible_at.or(event.created_at.ok());
        let display = event.key.display_id();
        let mut malformed = |error: ErrorType, field: &'static str| {
            warnings.push(Warning::new(event, WarningKind::Malformed(error)));
            Fate::Malformed {
                error_type: error,
                rule: Rule::Field(field),
            }
        };
        let fate = match &event.body {
            Body::UserMessage(content) => {
                transcript.start_user_segment(display);
                for format in &content.unsupported_audio {
                    warnings.push(Warning::new(
                        event,
                        WarningKind::UnsupportedAudio {
                            format: format.clone(),
                        },
                    ));
                }
                match &content.parts {
                    Ok(parts) => transcript.add_user_parts(event, parts.iter().cloned()),
                    Err(error) => {
                        warnings.push(Warning::new(event, WarningKind::Malformed(*error)));
                        Fate::Malformed {
                            error_type: *error,
                            rule: Rule::Field(Family::UserMessage.field()),
                        }
                    }
                }
            }
            Body::HitlAnswer(answer) => {
                // aihub's answer carries its question's run id, and the agent goes on with that run: the answer
                // re-opens a run its question ended ([design 3.1](../docs/design.md#3.1)).
                let run = event.key.run_id();
                if !stopped_runs.contains(run) {
                    finished_runs.remove(run);
                }
                transcript.start_user_segment(display);
                match answer {
                    Ok(text) => transcript.add_user_parts(
                        event,
                        [Part::Text {
                            text: text.to_string(),
                        }],
                    ),
                    Err(error) => malformed(*error, Family::HitlResponse.field()),
                }
            }
            Body::Chunk(text) => match text {
                Ok(text) => transcript.add_assistant_text(event, text),
                Err(error) => malformed(*error, Family::Chunk.field()),
            },
            Body::HitlQuestion(text) => {
                finished_runs.insert(event.key.run_id().into());
                match text {
                    Ok(text) => transcript.add_assistant_text(event, text),
                    Err(error) => malformed(*error, Family::HitlRequest.field()),
                }
            }
            Body::Stop(full_answer) => {
                let is_primary = primary.is_some_and(|p| {
                    p.agent_class == event.key.agent_class() && p.agent_id == event.key.agent_id()
                });
                if primary.is_none() || is_primary {
                    finished_runs.insert(event.key.run_id().into());
                    stopped_runs.insert(event.key.run_id());
                }
                match full_answer {
                    _ if primary.is_none() => Fate::Stop(StopFate::NoIdentity),
                    _ if !is_primary => Fate::Stop(StopFate::NotPrimary),
                    Ok(full) => match missing_suffix(transcript.streamed(display), full) {
                        None if !full.is_empty() => Fate::Stop(StopFate::Diverged),
                        None | Some("") => Fate::Stop(StopFate::NothingToAdd),
                        Some(suffix) => {
                            let suffix = suffix.to_owned();
                            match transcript.add_assistant_text(event, &suffix) {
                                Fate::Counted { message } => Fate::Stop(StopFate::Supplied {
                                    message,
                                    bytes: suffix.len(),
                                }),
                                other => other,
                            }
                        }
                    },
                    Err(error) => malformed(*error, Family::Stop.field()),
                }
            }
            Body::Inert => Fate::NoBranch,
        };
        if let Some(trace) = trace.as_deref_mut() {
            trace.push((event, fate));
        }
    }
    let (history, provenance) = transcript.finish(&finished_runs);
    Projection {
        history,
        warnings,
        provenance,
        finished_runs,
        visible: false,
        first_visible_at,
    }
}

/// The prefix rule ([contract 7](../docs/contract.md#7)): the unstreamed remainder when what streamed is a prefix
/// of the full answer (empty when it is all of it); `None` when they diverge, and then nothing is added.
/// `str::strip_prefix` compares bytes, so slicing after it is always on a boundary.
pub fn missing_suffix<'a>(streamed: &str, full: &'a str) -> Option<&'a str> {
    full.strip_prefix(streamed)
}

/// A message being built, with the display it belongs to (merging is per display), its first event and the runs
/// whose events joined it.
struct Turn<'a> {
    role: Role,
    display: &'a str,
    content: Vec<Part>,
    first: &'a DeliveryKey,
    runs: Vec<&'a str>,
}

impl<'a> Turn<'a> {
    fn new(role: Role, event: &'a ViewEvent, content: Vec<Part>) -> Self {
        Self {
            role,
            display: event.key.display_id(),
            content,
            first: &event.key,
            runs: vec![event.key.run_id()],
        }
    }

    fn joined(&mut self, event: &'a ViewEvent) {
        let run = event.key.run_id();
        if !self.runs.contains(&run) {
            self.runs.push(run);
        }
    }
}

#[derive(Default)]
struct Transcript<'a> {
    messages: Vec<Turn<'a>>,
    /// Assistant text added on each display since the last user segment there: what a stop's answer is compared
    /// with.
    assistant_text: HashMap<&'a str, String>,
}

impl<'a> Transcript<'a> {
    fn start_user_segment(&mut self, display: &'a str) {
        self.assistant_text.insert(display, String::new());
    }

    fn streamed(&self, display: &str) -> &str {
        self.assistant_text.get(display).map_or("", String::as_str)
    }

    /// Same-role merging is per display: a user message continues only a user message on the same display.
    fn add_user_parts(
        &mut self,
        event: &'a ViewEvent,
        parts: impl IntoIterator<Item = Part>,
    ) -> Fate {
        let display = event.key.display_id();
        self.start_user_segment(display);
        match self.messages.last_mut() {
            Some(turn) if turn.role == Role::User && turn.display == display => {
                turn.content.extend(parts);
                turn.joined(event);
            }
            _ => self
                .messages
                .push(Turn::new(Role::User, event, parts.into_iter().collect())),
        }
        self.counted()
    }

    /// The fate of an event that just joined the last message.
    fn counted(&self) -> Fate {
        Fate::Counted {
            message: self.messages.len() - 1,
        }
    }

    fn add_assistant_text(&mut self, event: &'a ViewEvent, text: &str) -> Fate {
        let display = event.key.display_id();
        match self.messages.last_mut() {
            Some(turn) if turn.role == Role::Assistant && turn.display == display => {
                match turn.content.last_mut() {
                    Some(Part::Text { text: last }) => last.push_str(text),
                    _ => turn.content.push(Part::Text {
                        text: text.to_owned(),
                    }),
                }
                turn.joined(event);
            }
            _ => self.messages.push(Turn::new(
                Role::Assistant,
                event,
                vec![Part::Text {
                    text: text.to_owned(),
                }],
            )),
        }
        self.assistant_text
            .entry(display)
            .or_default()
            .push_str(text);
        self.counted()
    }

    /// The messages and their provenance. A user message is never in progress: its runs are marked finished.
    fn finish(self, finished_runs: &BTreeSet<Box<str>>) -> (HistoryResponse, Vec<Provenance>) {
        let mut provenance = Vec::with_capacity(self.messages.len());
        let messages = self
            .messages
            .into_iter()
            .map(|turn| {
                provenance.push(Provenance {
                    first: turn.first.clone(),
                    runs: turn
                        .runs
                        .iter()
                        .map(|&run| RunState {
                            run_id: run.into(),
                            finished: turn.role == Role::User || finished_runs.contains(run),
                        })
                        .collect(),
                });
                HistoryMessage {
                    role: turn.role,
                    content: turn.content,
                }
            })
            .collect();
        (HistoryResponse { messages }, provenance)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_rule_matches_the_live_contract() {
        assert_eq!(missing_suffix("", "whole answer"), Some("whole answer"));
        assert_eq!(missing_suffix("whole ", "whole answer"), Some("answer"));
        assert_eq!(missing_suffix("whole answer", "whole answer"), Some(""));
        assert_eq!(missing_suffix("diverged", "whole answer"), None);
        assert_eq!(missing_suffix("", ""), Some(""));
        assert_eq!(missing_suffix("x", ""), None);
        assert_eq!(missing_suffix("é", "éa"), Some("a"));
    }
}
