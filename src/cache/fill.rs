//! Fills: the stored events of displays a live marker made visible in a complete view, read off the read path in
//! batches, so the view is served from memory again without a hydration ([design 2](../../docs/design.md#2)).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use opentelemetry::trace::TraceContextExt;
use tokio::sync::mpsc;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::entry::Entry;
use super::metrics::FillOutcome;
use super::work::{Outcome, Ticket};
use super::{LimitPath, ViewCache, link_current_span};
use crate::decode::ViewEvent;
use crate::store::{Bounds, StoreReads};
use crate::telemetry::trace;
use crate::view::ViewState;

/// Most views one fill query serves.
const FILL_BATCH: usize = 64;

/// A view waiting for a fill, with its entry's store job: readers of the entry wait for the fill.
pub struct FillRequest {
    entry: Arc<Entry>,
    ticket: Ticket,
    /// The span that asked for the fill (a read's hydration, an ingested event's `process` span, a fill before
    /// it), when tracing is on and one was current: the fill's span joins its trace.
    asked_by: Option<opentelemetry::Context>,
}

impl<S: StoreReads> ViewCache<S> {
    /// Asks for a fill of the displays a live marker made visible in a complete view: queued now if the entry's
    /// store side is idle, otherwise after the job in flight ([`super::work`]). A read that comes next waits for
    /// the fill (and answers from memory once it is done) instead of hydrating.
    pub(super) fn schedule_fill(&self, entry: &Arc<Entry>) {
        if let Some(ticket) = entry.store.want_fill() {
            self.queue_fill(Arc::clone(entry), ticket);
        }
    }

    pub(super) fn queue_fill(&self, entry: Arc<Entry>, ticket: Ticket) {
        let request = FillRequest {
            entry,
            ticket,
            asked_by: super::current_context(),
        };
        if self.fills.try_send(request).is_err() {
            // The queue is full (or the service is stopping): no fill; the ticket is dropped with the request. The
            // view stays partial (a display is left uncovered), so the next read hydrates.
            self.metrics.cache.fill(FillOutcome::Error);
        }
    }

    /// Runs the queued fills until the service stops: every request queued while a fill query is in flight goes
    /// into the next one, so many threads' turns share one store query.
    pub(super) async fn run_fills(self, mut requests: mpsc::Receiver<FillRequest>) {
        loop {
            let first = tokio::select! {
                biased;
                () = self.stop.cancelled() => return,
                request = requests.recv() => match request {
                    Some(request) => request,
                    None => return,
                },
            };
            let mut batch = vec![first];
            while batch.len() < FILL_BATCH {
                match requests.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            self.fill(batch).await;
        }
    }

    /// Reads the stored events of the uncovered displays of a batch of views in one query and merges them. A view
    /// stays complete if it was complete when the fill started and no gap or removal happened since: then its
    /// hydration read started at least the persister-lag bound after its coverage start, so every event of these
    /// displays published before that start is in the store now, and every later one was applied live ([design
    /// 2.1.1]). A failed fill leaves the views partial, so their next reads hydrate, and fails the readers that waited
    /// for it.
    ///
    /// [design 2.1.1]: ../../docs/design.md#2.1.1
    async fn fill(&self, batch: Vec<FillRequest>) {
        // One `fill` span per query ([design 5](../../docs/design.md#5), "Traces"), a child of the first span that
        // asked for one of its views and linked to the others (at most `MAX_LINKS`); a root the configured
        // sampler decides when none did. The stored and waiting live events are merged inside it.
        let span = tracing::info_span!(
            "fill",
            otel.kind = "internal",
            otel.status_code = tracing::field::Empty,
        );
        let mut asked_by = batch.iter().filter_map(|request| request.asked_by.as_ref());
        if let Some(first) = asked_by.next() {
            // Err: the span is disabled; there is nothing to parent.
            let _ = span.set_parent(first.clone());
        }
        for other in asked_by.take(trace::MAX_LINKS) {
            span.add_link(other.span().span_context().clone());
        }
        self.fill_views(batch).instrument(span).await;
    }

    /// [`ViewCache::fill`], inside its span.
    async fn fill_views(&self, batch: Vec<FillRequest>) {
        let mut work: Vec<(FillRequest, Vec<Box<str>>)> = Vec::with_capacity(batch.len());
        let mut threads = HashSet::new();
        for request in batch {
            let entry = &request.entry;
            // From here on a new uncovered display needs a fill of its own.
            request.ticket.fill_reading();
            let epoch = self.coverage.epoch(entry.bucket);
            let displays = {
                let view = entry.lock_view(&self.metrics);
                view.needs_fill(epoch).then(|| view.uncovered_displays())
            };
            // Two entries of one thread (one of them on its way out) cannot share a query's rows: the second
            // waits for its next read's hydration.
            match displays {
                Some(displays) if threads.insert(entry.thread_id.clone()) => {
                    work.push((request, displays));
                }
                _ => self.finish_fill(request, Outcome::LookAgain),
            }
        }
        if work.is_empty() {
            return;
        }
        let wanted: Vec<(&str, &[Box<str>])> = work
            .iter()
            .map(|(request, displays)| (&*request.entry.thread_id, displays.as_slice()))
            .collect();
        let bounds = Bounds {
            deadline: self.bounds.store_deadline(),
            budget: self.settings.max_thread_bytes.saturating_mul(wanted.len()),
        };
        let events = match self.store.fill_events(&wanted, bounds).await {
            Ok(events) => events,
            Err(error) => {
                tracing::Span::current().record("otel.status_code", "error");
                tracing::warn!(views = work.len(), %error, "filling newly visible displays failed; their next reads hydrate");
                for (request, _) in work {
                    if request.entry.lock_view(&self.metrics).downgrade() {
                        self.metrics.cache.views_downgraded(1);
                    }
                    self.metrics.cache.fill(FillOutcome::Error);
                    // Readers that waited for the fill fail with it rather than queue another store timeout.
                    self.finish_fill(request, Outcome::Failed);
                }
                return;
            }
        };
        let index: HashMap<&str, usize> = wanted
            .iter()
            .enumerate()
            .map(|(i, (thread, _))| (*thread, i))
            .collect();
        let mut per_view: Vec<Vec<ViewEvent>> = work.iter().map(|_| Vec::new()).collect();
        for event in events {
            if let Some(&i) = index.get(event.key.thread_id())
                && wanted[i].1.iter().any(|d| **d == *event.key.display_id())
            {
                per_view[i].push(event);
            }
        }
        let mut links = Vec::new();
        for ((request, displays), events) in work.into_iter().zip(per_view) {
            let entry = &request.entry;
            {
                let mut view = entry.lock_view(&self.metrics);
                view.fill(&displays, events);
                if trace::enabled() {
                    links.push(view.recent_publishers_on(&displays, trace::MAX_LINKS));
                }
            }
            if !self.leave_if_too_large(entry, LimitPath::Live).await {
                let outcome = match self.state(entry) {
                    ViewState::Complete => FillOutcome::Complete,
                    ViewState::Partial => FillOutcome::Partial,
                };
                self.metrics.cache.fill(outcome);
                self.reweigh(entry).await;
            }
            self.finish_fill(request, Outcome::LookAgain);
        }
        link_current_span(fair_links(links, trace::MAX_LINKS));
    }

    /// Ends a fill's store job; a fill wanted meanwhile (a display uncovered after this one read its displays) is
    /// queued next.
    fn finish_fill(&self, request: FillRequest, outcome: Outcome) {
        let FillRequest { entry, ticket, .. } = request;
        if let Some(next) = ticket.finish(outcome) {
            self.queue_fill(entry, next);
        }
    }
}

/// At most `limit` of the views' links (each view's latest first), taken from the views in turn, so that one view
/// of the batch with many live events does not crowd the others out.
fn fair_links<T>(per_view: Vec<Vec<T>>, limit: usize) -> Vec<T> {
    let mut views: Vec<_> = per_view.into_iter().map(Vec::into_iter).collect();
    let mut links = Vec::new();
    while links.len() < limit {
        let before = links.len();
        for view in &mut views {
            if links.len() == limit {
                break;
            }
            links.extend(view.next());
        }
        if links.len() == before {
            break;
        }
    }
    links
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_links_at_most_the_bound_taking_each_view_in_turn() {
        // (view, its n-th latest context)
        let crowded: Vec<_> = (1..=40).map(|n| (1, n)).collect();
        let links = fair_links(
            vec![crowded, vec![(2, 1)], Vec::new(), vec![(3, 1), (3, 2)]],
            trace::MAX_LINKS,
        );
        assert_eq!(links.len(), trace::MAX_LINKS);
        assert_eq!(&links[..5], [(1, 1), (2, 1), (3, 1), (1, 2), (3, 2)]);
        assert_eq!(links[5..], (3..=29).map(|n| (1, n)).collect::<Vec<_>>());
        assert_eq!(fair_links(vec![vec![(1, 1)], Vec::new()], 32), [(1, 1)]);
        assert!(fair_links(Vec::<Vec<(u8, u8)>>::new(), 32).is_empty());
    }
}
