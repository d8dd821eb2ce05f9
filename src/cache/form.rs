//! What a read can ask for and what it gets: the forms a view is rendered in ([`Form`]: the history body, the
//! Conversations items, the feed's transcript, the explain fates) and the [`Answer`] that carries one, with the
//! [`Facts`] every form shares and its [`AnswerSource`]. Rendering them once per view version is `render.rs`.

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use super::etag::etag_of;
use super::items::Items;
use super::runs::RunView;
use super::transcript::Transcript;
use crate::explain::ViewFates;
use crate::project::{HistoryMessage, Projection, Trace};
use crate::view::ThreadView;

/// Where a read's answer came from; also the `X-History-Source` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerSource {
    /// No store query was awaited on the read path.
    Cache,
    Store,
}

impl AnswerSource {
    pub const ALL: [AnswerSource; 2] = [AnswerSource::Cache, AnswerSource::Store];

    /// The `source` label of the read metrics and the `X-History-Source` header's value.
    pub fn label(self) -> &'static str {
        match self {
            AnswerSource::Cache => "cache",
            AnswerSource::Store => "store",
        }
    }
}

/// A read's answer: its body in the form the read asked for, what every form shares, and where it came from.
#[derive(Debug)]
pub struct Answer<F> {
    pub body: Arc<F>,
    pub facts: Arc<Facts>,
    pub source: AnswerSource,
    /// The instant up to which the answer holds every event that reached NATS (`X-History-Covered-Through`), if
    /// one is known.
    pub covered_through: Option<std::time::SystemTime>,
    /// The view's version it was rendered from (a version restarts in a new entry).
    pub version: u64,
    /// The cache entry's generation (0: no entry, a read from the store alone): with the version, it names the
    /// answer across evictions and restarts.
    pub generation: u64,
}

impl<F> Clone for Answer<F> {
    fn clone(&self) -> Self {
        Self {
            body: Arc::clone(&self.body),
            facts: Arc::clone(&self.facts),
            source: self.source,
            covered_through: self.covered_through,
            version: self.version,
            generation: self.generation,
        }
    }
}

/// What every form of one rendering shares ([`Projection`]'s facts beside the messages).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// The runs that finished (see [`Projection::finished_runs`]).
    pub finished_runs: BTreeSet<Box<str>>,
    /// Whether any display is client-visible.
    pub visible: bool,
    /// `created_at` (nanoseconds) of the first visible event.
    pub first_visible_at: Option<i64>,
}

impl Facts {
    pub(super) fn of(projection: &Projection) -> Self {
        Self {
            finished_runs: projection.finished_runs.clone(),
            visible: projection.visible,
            first_visible_at: projection.first_visible_at,
        }
    }

    pub fn run_finished(&self, run_id: &str) -> bool {
        self.finished_runs.contains(run_id)
    }

    pub(super) fn bytes(&self) -> usize {
        64 + self
            .finished_runs
            .iter()
            .map(|run| run.len() + 48)
            .sum::<usize>()
    }
}

/// A form a view is rendered in: the history body, or the Conversations items ([`Items`]). Each is rendered from
/// a projection at most once per view version and identity, and kept until the view changes.
pub trait Form: Sized {
    /// Whether this form needs each event's fate: its projection is then traced
    /// ([`crate::project::project_view_traced`]).
    const TRACED: bool = false;
    /// Whether reads in this form are explains: their store work runs within the explain share
    /// ([`super::scan`]), so that explains cannot take the hydration slots history reads need.
    const EXPLAIN: bool = false;
    /// Renders the form from a projection of `view`, and its trace when [`Form::TRACED`] (empty otherwise).
    fn render(
        thread_id: &str,
        view: &ThreadView,
        projection: &Projection,
        trace: &Trace<'_>,
    ) -> Self;
    /// Where a rendering keeps this form.
    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>>;
    /// Bytes held, for the cache's weigher.
    fn bytes(&self) -> usize;
    /// Per-message digests, kept for a few versions so that a resumed feed finds what changed since.
    fn digests(&self) -> Option<Arc<[u64]>> {
        None
    }
}

/// The forms rendered so far from one version of a view for one identity.
#[derive(Default)]
pub struct Forms {
    history: Option<Arc<HistoryBody>>,
    items: Option<Arc<Items>>,
    transcript: Option<Arc<Transcript>>,
    fates: Option<Arc<ViewFates>>,
    runs: Option<Arc<RunView>>,
}

impl Forms {
    pub(super) fn bytes(&self) -> usize {
        self.history.as_ref().map_or(0, |h| h.bytes())
            + self.items.as_ref().map_or(0, |i| i.bytes())
            + self.transcript.as_ref().map_or(0, |t| t.bytes())
            + self.fates.as_ref().map_or(0, |f| f.bytes())
            + self.runs.as_ref().map_or(0, |r| r.bytes())
    }
}

/// A rendered history response.
#[derive(Debug)]
pub struct HistoryBody {
    /// `{"thread_id": ..., "messages": [...]}`.
    pub body: Bytes,
    /// A strong validator of `body` (quoted), equal for equal bodies whatever their source.
    pub etag: String,
}

impl Form for HistoryBody {
    fn render(
        thread_id: &str,
        _view: &ThreadView,
        projection: &Projection,
        _trace: &Trace<'_>,
    ) -> Self {
        let body = serde_json::to_vec(&HistoryJson {
            thread_id,
            messages: &projection.history.messages,
        })
        // Serialising strings and vectors of plain structs cannot fail.
        .unwrap_or_default();
        Self {
            etag: etag_of(&body),
            body: Bytes::from(body),
        }
    }

    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>> {
        &mut forms.history
    }

    fn bytes(&self) -> usize {
        self.body.len() + self.etag.len() + 64
    }
}

impl Form for Items {
    fn render(
        _thread_id: &str,
        _view: &ThreadView,
        projection: &Projection,
        _trace: &Trace<'_>,
    ) -> Self {
        Items::new(projection)
    }

    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>> {
        &mut forms.items
    }

    fn bytes(&self) -> usize {
        Items::bytes(self)
    }
}

impl Form for Transcript {
    fn render(
        _thread_id: &str,
        _view: &ThreadView,
        projection: &Projection,
        _trace: &Trace<'_>,
    ) -> Self {
        Transcript::new(projection)
    }

    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>> {
        &mut forms.transcript
    }

    fn bytes(&self) -> usize {
        Transcript::bytes(self)
    }

    fn digests(&self) -> Option<Arc<[u64]>> {
        Some(Arc::clone(&self.digests))
    }
}

impl Form for ViewFates {
    const TRACED: bool = true;
    const EXPLAIN: bool = true;

    fn render(
        _thread_id: &str,
        view: &ThreadView,
        projection: &Projection,
        trace: &Trace<'_>,
    ) -> Self {
        ViewFates::new(view, projection, trace)
    }

    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>> {
        &mut forms.fates
    }

    fn bytes(&self) -> usize {
        ViewFates::bytes(self)
    }
}

impl Form for RunView {
    const TRACED: bool = true;

    fn render(
        _thread_id: &str,
        _view: &ThreadView,
        projection: &Projection,
        trace: &Trace<'_>,
    ) -> Self {
        RunView::new(projection, trace)
    }

    fn slot(forms: &mut Forms) -> &mut Option<Arc<Self>> {
        &mut forms.runs
    }

    fn bytes(&self) -> usize {
        RunView::bytes(self)
    }
}

/// The history body's shape.
#[derive(Serialize)]
struct HistoryJson<'a> {
    thread_id: &'a str,
    messages: &'a [HistoryMessage],
}
