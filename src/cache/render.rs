//! Rendering a view into the answer of a read, in the form the read asks for (`form.rs`): rendered once per view
//! version and identity and reused while the view has not changed, the last few versions' message digests kept for
//! resumed feeds, and the projector's warnings logged once per view.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use super::form::{Answer, AnswerSource, Facts, Form, Forms};
use super::metrics::ViewMetrics;
use crate::project::{Identity, Projection};
use crate::view::ThreadView;

/// The forms rendered from one version of a view for one primary identity.
struct Rendered {
    version: u64,
    primary: Option<Identity>,
    facts: Arc<Facts>,
    forms: Forms,
}

/// How many versions' per-message digests are kept for resumed feeds (with their identity).
const RECENT_DIGESTS: usize = 8;

/// How many identities' renderings of one view version are kept (a thread read for its primary agent and without
/// an identity, say, does not re-render on every alternation).
const RENDERED_IDENTITIES: usize = 4;

/// What rendering keeps between reads of one view (the entry's `rendering`, taken while holding the view).
#[derive(Default)]
pub struct Rendering {
    /// Renderings of the view's current version, the most recently made last; at most [`RENDERED_IDENTITIES`].
    rendered: Vec<Rendered>,
    /// Warnings already logged for this view (hashes of their identity), so a malformed event is warned about once,
    /// not on every read.
    warned: HashSet<u64>,
    /// The per-message digests of the last few versions rendered for the feed, oldest first.
    recent: VecDeque<(u64, Option<Identity>, Arc<[u64]>)>,
}

impl Rendering {
    /// Renders `view` of `thread_id` for `primary` in form `F`, reusing what was rendered from this version of the
    /// view for this identity. Warnings not logged for this view before are logged (and counted in `metrics`).
    pub fn render<F: Form>(
        &mut self,
        thread_id: &str,
        view: &mut ThreadView,
        primary: Option<&Identity>,
        source: AnswerSource,
        metrics: &ViewMetrics,
    ) -> Answer<F> {
        let version = view.version();
        self.keep_version(version);
        view.sort_order();
        let view: &ThreadView = view;
        let project = || {
            if F::TRACED {
                view.project_traced(primary)
            } else {
                (view.project_sorted(primary), Vec::new())
            }
        };
        let (at, projected) = match self
            .rendered
            .iter()
            .position(|r| r.primary.as_ref() == primary)
        {
            Some(at) => (at, None),
            None => {
                if self.rendered.len() == RENDERED_IDENTITIES {
                    self.rendered.remove(0);
                }
                let (projection, trace) = project();
                metrics
                    .cache
                    .malformed_warnings(log_new_warnings(&mut self.warned, &projection));
                self.rendered.push(Rendered {
                    version,
                    primary: primary.cloned(),
                    facts: Arc::new(Facts::of(&projection)),
                    forms: Forms::default(),
                });
                (self.rendered.len() - 1, Some((projection, trace)))
            }
        };
        let rendered = &mut self.rendered[at];
        let body = match F::slot(&mut rendered.forms) {
            Some(body) => Arc::clone(body),
            slot => {
                // Only another form of this version was rendered: project again for this one (its warnings were
                // logged when the first form was rendered).
                let (projection, trace) = projected.unwrap_or_else(project);
                let body = Arc::clone(slot.insert(Arc::new(F::render(
                    thread_id,
                    view,
                    &projection,
                    &trace,
                ))));
                if let Some(digests) = body.digests() {
                    if self.recent.len() == RECENT_DIGESTS {
                        self.recent.pop_front();
                    }
                    self.recent.push_back((version, primary.cloned(), digests));
                }
                body
            }
        };
        Answer {
            body,
            facts: Arc::clone(&rendered.facts),
            source,
            covered_through: None,
            version,
            generation: 0,
        }
    }

    /// The per-message digests of `version` rendered for `primary` by the feed, if they are still kept.
    pub fn recent_digests(&self, version: u64, primary: Option<&Identity>) -> Option<Arc<[u64]>> {
        self.recent
            .iter()
            .find(|(v, p, _)| *v == version && p.as_ref() == primary)
            .map(|(_, _, digests)| Arc::clone(digests))
    }

    /// The bytes the renderings hold (and the recent digests), for the cache's weigher.
    pub fn bytes(&self) -> usize {
        let recent: usize = self.recent.iter().map(|(_, _, d)| d.len() * 8 + 64).sum();
        recent
            + self
                .rendered
                .iter()
                .map(|r| r.forms.bytes() + r.facts.bytes())
                .sum::<usize>()
    }

    /// Drops the renderings of any version but `version`.
    pub fn keep_version(&mut self, version: u64) {
        self.rendered.retain(|r| r.version == version);
    }

    /// Forgets the renderings (their memory is freed now); the warnings logged stay logged.
    pub fn forget(&mut self) {
        self.rendered.clear();
        self.recent.clear();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::form::HistoryBody;
    use crate::cache::items::Items;
    use crate::decode::testing::live_event as event;

    fn view() -> ThreadView {
        let mut view = ThreadView::new();
        view.insert(event(
            "agent.UserAgent.u.t.d.r0.display_event.UserMessageEvent.u1",
            r#"{"_parent_event_names": ["UserMessageEvent"], "created_at": 1,
                "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "q"}]}]}"#,
        ));
        view.insert(event(
            "agent.A.a.t.d.r1.display_event.ChunkEvent.c1",
            r#"{"_parent_event_names": ["ChunkEvent"], "created_at": 2, "content": "a"}"#,
        ));
        view
    }

    fn render<F: Form>(
        rendering: &mut Rendering,
        view: &mut ThreadView,
        primary: Option<&Identity>,
    ) -> Arc<F> {
        rendering
            .render::<F>(
                "t",
                view,
                primary,
                AnswerSource::Cache,
                &ViewMetrics::registered().0,
            )
            .body
    }

    /// A form is rendered once per version and identity: reads alternating between identities and forms reuse
    /// what was rendered; a change of the view renders again.
    #[test]
    fn renderings_are_kept_per_identity_and_form_until_the_view_changes() {
        let mut view = view();
        let mut rendering = Rendering::default();
        let primary = Identity {
            agent_class: "A".into(),
            agent_id: "a".into(),
        };
        let first = render::<HistoryBody>(&mut rendering, &mut view, Some(&primary));
        let anonymous = render::<HistoryBody>(&mut rendering, &mut view, None);
        let items = render::<Items>(&mut rendering, &mut view, Some(&primary));
        assert!(Arc::ptr_eq(
            &first,
            &render::<HistoryBody>(&mut rendering, &mut view, Some(&primary))
        ));
        assert!(Arc::ptr_eq(
            &anonymous,
            &render::<HistoryBody>(&mut rendering, &mut view, None)
        ));
        assert!(Arc::ptr_eq(
            &items,
            &render::<Items>(&mut rendering, &mut view, Some(&primary))
        ));
        assert!(rendering.bytes() >= first.body.len() + anonymous.body.len() + items.bytes());
        view.insert(event(
            "agent.A.a.t.d.r1.display_event.ChunkEvent.c2",
            r#"{"_parent_event_names": ["ChunkEvent"], "created_at": 3, "content": "b"}"#,
        ));
        let changed = render::<HistoryBody>(&mut rendering, &mut view, Some(&primary));
        assert!(!Arc::ptr_eq(&first, &changed));
        assert_ne!(first.etag, changed.etag);
        // Only the new version's renderings are held.
        assert_eq!(
            rendering.bytes(),
            changed.bytes() + Facts::default().bytes()
        );
        // At most four identities are kept.
        for n in 0..6 {
            let other = Identity {
                agent_class: format!("C{n}"),
                agent_id: "x".into(),
            };
            render::<HistoryBody>(&mut rendering, &mut view, Some(&other));
        }
        assert_eq!(rendering.rendered.len(), RENDERED_IDENTITIES);
    }
}
