//! The run form of an answer ([design 3.1](../../docs/design.md#3.1)): the run model ([`crate::run`]) with each
//! message's item id and content, rendered once per view version and identity from a traced projection, for the
//! resume dialects (`http/resume.rs`).

use crate::decode::Part;
use crate::project::{Projection, Role, Trace};
use crate::run::{Run, RunPart, runs};

/// One message as the resume dialects show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMessage {
    /// The message's item id (`msg_…`), as the Conversations items give it.
    pub id: String,
    pub role: Role,
    /// A user message's content.
    pub user: Vec<Part>,
    /// An assistant message's parts, in projector order.
    pub parts: Vec<RunPart>,
}

/// An answer's messages, its runs and its latest run.
#[derive(Debug, Default)]
pub struct RunView {
    pub messages: Vec<RunMessage>,
    /// Every run that wrote an assistant message ([`crate::run::Runs::runs`]).
    pub runs: Vec<Run>,
    pub latest: Option<Run>,
}

impl RunView {
    pub fn new(projection: &Projection, trace: &Trace<'_>) -> Self {
        let model = runs(projection, trace);
        let messages = projection
            .history
            .messages
            .iter()
            .zip(&projection.provenance)
            .zip(model.parts)
            .map(|((message, provenance), parts)| RunMessage {
                id: provenance.id(),
                role: message.role,
                user: match message.role {
                    Role::User => message.content.clone(),
                    Role::Assistant => Vec::new(),
                },
                parts,
            })
            .collect();
        Self {
            messages,
            runs: model.runs,
            latest: model.latest,
        }
    }

    /// Bytes held, for the cache's weigher.
    pub fn bytes(&self) -> usize {
        64 + self
            .runs
            .iter()
            .map(|r| 96 + r.run_id.len() + r.item_id.len())
            .sum::<usize>()
            + self
                .messages
                .iter()
                .map(|m| {
                    96 + m.id.len()
                        + m.user.iter().map(part_bytes).sum::<usize>()
                        + m.parts
                            .iter()
                            .map(|p| match p {
                                RunPart::Text { text, pieces } => {
                                    48 + text.len() + 4 * pieces.len()
                                }
                                RunPart::Question { event_id, text } => {
                                    56 + event_id.len() + text.len()
                                }
                            })
                            .sum::<usize>()
                })
                .sum::<usize>()
    }
}

fn part_bytes(part: &Part) -> usize {
    64 + match part {
        Part::Text { text } => text.len(),
        Part::ImageUrl { image_url } => image_url.url.len(),
        Part::InputAudio { input_audio } => input_audio.data.len() + input_audio.format.len(),
    }
}
