//! The pure projector: a thread's decoded events and the read's primary identity become the OpenAI-style
//! [`HistoryResponse`] plus the metadata-only warnings aihub would log (contract sections [5](../docs/contract.md#5),
//! [6](../docs/contract.md#6) and [7](../docs/contract.md#7)). No I/O, no async: the same function serves the live view
//! and the store path, so equal event sets give identical output.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::decode::{Body, ErrorType, Part, ViewEvent};

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

/// The projector's result: the history and the warnings, in the order aihub logs them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Projection {
    pub history: HistoryResponse,
    pub warnings: Vec<Warning>,
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
    build(ordered.into_iter().map(|(_, e)| e), primary, warnings)
}

/// Projects a thread view: `ordered` holds valid, deduplicated events already in sort order, `rejected` the events
/// that failed validation (they still count for visibility and are warned about when visible). Gives the same
/// result as [`project`] over the same events.
pub fn project_view<'a>(
    ordered: impl Iterator<Item = &'a ViewEvent> + Clone,
    rejected: &'a [ViewEvent],
    primary: Option<&Identity>,
) -> Projection {
    let visible = visible_displays(ordered.clone().chain(rejected));
    let warnings = rejected
        .iter()
        .filter(|e| visible.contains(e.key.display_id()))
        .filter_map(|e| {
            validate(e)
                .err()
                .map(|t| Warning::new(e, WarningKind::Malformed(t)))
        })
        .collect();
    build(
        ordered.filter(|e| visible.contains(e.key.display_id())),
        primary,
        warnings,
    )
}

/// The transcript builder of [contract 5.3](../docs/contract.md#5.3) driven by the dispatch of
/// [5.4](../docs/contract.md#5.4).
fn build<'a>(
    events: impl Iterator<Item = &'a ViewEvent>,
    primary: Option<&Identity>,
    mut warnings: Vec<Warning>,
) -> Projection {
    let mut transcript = Transcript::default();
    for event in events {
        let display = event.key.display_id();
        let mut warn =
            |error: ErrorType| warnings.push(Warning::new(event, WarningKind::Malformed(error)));
        match &event.body {
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
                    Ok(parts) => transcript.add_user_parts(display, parts.iter().cloned()),
                    Err(error) => {
                        warnings.push(Warning::new(event, WarningKind::Malformed(*error)))
                    }
                }
            }
            Body::HitlAnswer(answer) => {
                transcript.start_user_segment(display);
                match answer {
                    Ok(text) => transcript.add_user_parts(
                        display,
                        [Part::Text {
                            text: text.to_string(),
                        }],
                    ),
                    Err(error) => warn(*error),
                }
            }
            Body::Chunk(text) | Body::HitlQuestion(text) => match text {
                Ok(text) => transcript.add_assistant_text(display, text),
                Err(error) => warn(*error),
            },
            Body::Stop(full_answer) => {
                let is_primary = primary.is_some_and(|p| {
                    p.agent_class == event.key.agent_class() && p.agent_id == event.key.agent_id()
                });
                if is_primary {
                    match full_answer {
                        Ok(full) => {
                            let suffix = missing_suffix(transcript.streamed(display), full);
                            if !suffix.is_empty() {
                                let suffix = suffix.to_owned();
                                transcript.add_assistant_text(display, &suffix);
                            }
                        }
                        Err(error) => warn(*error),
                    }
                }
            }
            Body::Inert => {}
        }
    }
    Projection {
        history: transcript.finish(),
        warnings,
    }
}

/// The prefix rule ([contract 7](../docs/contract.md#7)): the unstreamed remainder when what streamed is an exact
/// prefix of the full answer; nothing when they diverge. `str::strip_prefix` compares bytes, so slicing after it is
/// always on a boundary.
pub fn missing_suffix<'a>(streamed: &str, full: &'a str) -> &'a str {
    full.strip_prefix(streamed).unwrap_or("")
}

/// A message being built, with the display it belongs to (merging is per display).
struct Turn<'a> {
    role: Role,
    display: &'a str,
    content: Vec<Part>,
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
    fn add_user_parts(&mut self, display: &'a str, parts: impl IntoIterator<Item = Part>) {
        self.start_user_segment(display);
        match self.messages.last_mut() {
            Some(turn) if turn.role == Role::User && turn.display == display => {
                turn.content.extend(parts)
            }
            _ => self.messages.push(Turn {
                role: Role::User,
                display,
                content: parts.into_iter().collect(),
            }),
        }
    }

    fn add_assistant_text(&mut self, display: &'a str, text: &str) {
        match self.messages.last_mut() {
            Some(turn) if turn.role == Role::Assistant && turn.display == display => {
                match turn.content.last_mut() {
                    Some(Part::Text { text: last }) => last.push_str(text),
                    _ => turn.content.push(Part::Text {
                        text: text.to_owned(),
                    }),
                }
            }
            _ => self.messages.push(Turn {
                role: Role::Assistant,
                display,
                content: vec![Part::Text {
                    text: text.to_owned(),
                }],
            }),
        }
        self.assistant_text
            .entry(display)
            .or_default()
            .push_str(text);
    }

    fn finish(self) -> HistoryResponse {
        HistoryResponse {
            messages: self
                .messages
                .into_iter()
                .map(|turn| HistoryMessage {
                    role: turn.role,
                    content: turn.content,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_rule_matches_the_live_contract() {
        assert_eq!(missing_suffix("", "whole answer"), "whole answer");
        assert_eq!(missing_suffix("whole ", "whole answer"), "answer");
        assert_eq!(missing_suffix("whole answer", "whole answer"), "");
        assert_eq!(missing_suffix("diverged", "whole answer"), "");
        assert_eq!(missing_suffix("", ""), "");
        assert_eq!(missing_suffix("x", ""), "");
        assert_eq!(missing_suffix("é", "éa"), "a");
    }
}
