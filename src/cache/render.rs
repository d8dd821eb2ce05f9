//! Rendering a view into the answer of a read: the body, its ETag and where it came from, reused while the view
//! has not changed, and the projector's warnings logged once per view.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use bytes::Bytes;
use serde::Serialize;

use crate::metrics::Metrics;
use crate::project::{HistoryMessage, Identity, Projection};
use crate::view::ThreadView;

/// Where a read's answer came from; also the `X-History-Source` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// No store query was awaited on the read path.
    Cache,
    Store,
}

impl Source {
    pub const ALL: [Source; 2] = [Source::Cache, Source::Store];

    /// The `source` label of the read metrics and the `X-History-Source` header's value.
    pub fn label(self) -> &'static str {
        match self {
            Source::Cache => "cache",
            Source::Store => "store",
        }
    }
}

/// A rendered history response.
#[derive(Debug, Clone)]
pub struct Answer {
    /// `{"thread_id": ..., "messages": [...]}`.
    pub body: Bytes,
    /// A strong validator of `body` (quoted), equal for equal bodies whatever their source.
    pub etag: String,
    pub source: Source,
    /// The instant up to which the answer holds every event that reached NATS (`X-History-Covered-Through`), if
    /// one is known.
    pub covered_through: Option<std::time::SystemTime>,
}

/// An answer rendered from one version of a view for one primary identity.
struct Rendered {
    version: u64,
    primary: Option<Identity>,
    answer: Answer,
}

/// The response body's shape.
#[derive(Serialize)]
struct HistoryBody<'a> {
    thread_id: &'a str,
    messages: &'a [HistoryMessage],
}

/// What rendering keeps between reads of one view (the entry's `rendering`, taken while holding the view).
#[derive(Default)]
pub struct Rendering {
    /// The last rendered answer, reused while the view and the primary identity are the same.
    last: Option<Rendered>,
    /// Warnings already logged for this view (hashes of their identity), so a malformed event is warned about once,
    /// not on every read.
    warned: HashSet<u64>,
}

impl Rendering {
    /// Renders `view` of `thread_id` for `primary`, reusing the last rendering while the view has not changed.
    /// Warnings not logged for this view before are logged (and counted in `metrics`).
    pub fn render(
        &mut self,
        thread_id: &str,
        view: &mut ThreadView,
        primary: Option<&Identity>,
        source: Source,
        metrics: &Metrics,
    ) -> Answer {
        if let Some(last) = self.last.as_ref()
            && last.version == view.version()
            && last.primary.as_ref() == primary
        {
            return Answer {
                source,
                ..last.answer.clone()
            };
        }
        let projection = view.project(primary);
        metrics.malformed_warnings(log_new_warnings(&mut self.warned, &projection));
        let answer = answer(thread_id, &projection, source);
        self.last = Some(Rendered {
            version: view.version(),
            primary: primary.cloned(),
            answer: answer.clone(),
        });
        answer
    }

    /// The bytes the last rendering holds, for the cache's weigher.
    pub fn bytes(&self) -> usize {
        self.last.as_ref().map_or(0, |last| {
            last.answer.body.len() + last.answer.etag.len() + 64
        })
    }

    /// Forgets the last rendering (its memory is freed now); the warnings logged stay logged.
    pub fn forget(&mut self) {
        self.last = None;
    }
}

/// Logs the warnings not in `warned` yet and records them; returns how many.
fn log_new_warnings(warned: &mut HashSet<u64>, projection: &Projection) -> usize {
    let mut logged = 0;
    for warning in &projection.warnings {
        let mut hasher = DefaultHasher::new();
        let identity = (
            &warning.event_id,
            &warning.display_id,
            &warning.run_id,
            &warning.event_name,
        );
        identity.hash(&mut hasher);
        warning.error_type().hash(&mut hasher);
        if warned.insert(hasher.finish()) {
            warning.log();
            logged += 1;
        }
    }
    logged
}

/// Serialises a projection into the response body and its ETag.
fn answer(thread_id: &str, projection: &Projection, source: Source) -> Answer {
    let body = serde_json::to_vec(&HistoryBody {
        thread_id,
        messages: &projection.history.messages,
    })
    // Serialising strings and vectors of plain structs cannot fail.
    .unwrap_or_default();
    let mut hasher = DefaultHasher::new();
    body.hash(&mut hasher);
    Answer {
        etag: format!("\"{:016x}\"", hasher.finish()),
        body: Bytes::from(body),
        source,
        covered_through: None,
    }
}
