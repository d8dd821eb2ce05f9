//! Hydrations: a thread's two-stage store read merged with the live events its view holds, completed only by the
//! persister-lag rule ([design 2.1.1](../../docs/design.md#2.1.1)); and the one background re-read of a view that
//! rule held partial. Each hydration is a `hydrate` span ([design 5](../../docs/design.md#5), "Traces"), its two
//! store queries its children.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tracing::Instrument;

use super::entry::Entry;
use super::form::{Answer, AnswerSource, Form};
use super::metrics::RereadResult;
use super::render::Rendering;
use super::work::{Begin, Outcome, Ticket};
use super::{LimitPath, ReadError, ViewCache, link_current_span};
use crate::coverage::{ReadVerdict, Stamp};
use crate::decode::ViewEvent;
use crate::freshness;
use crate::project::Identity;
use crate::store::{Bounds, Hydration, StoreError, StoreReads, VisibleDisplays};
use crate::telemetry::trace;
use crate::view::{ThreadView, ViewState, display_bytes};

impl<S: StoreReads> ViewCache<S> {
    /// Runs the hydration `ticket` allows and hands its outcome to the readers that waited for it; a fill wanted
    /// meanwhile is queued after it. It runs in `slot` when its caller took one (the warm-up, [`super::warm`]),
    /// otherwise it waits for one.
    ///
    /// # Errors
    /// [`ReadError`] when no slot freed in time, the store failed, or the thread is too large; the view stays
    /// partial.
    pub(super) async fn hydrate(
        &self,
        entry: &Arc<Entry>,
        hydration: Hydration,
        ticket: Ticket,
        slot: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ReadError> {
        // Its span is a child of the read that runs it (the readers that join it wait inside their own `cache`
        // spans); a background re-read's or the warm-up's is a root. The live events held are merged inside it.
        let span = tracing::info_span!(
            "hydrate",
            otel.kind = "internal",
            otel.status_code = tracing::field::Empty,
        );
        let result = self
            .read_and_merge(entry, hydration, slot)
            .instrument(span.clone())
            .await;
        let outcome = match result {
            Ok(()) => Outcome::Hydrated,
            Err(_) => {
                span.record("otel.status_code", "error");
                Outcome::Failed
            }
        };
        if let Some(fill) = ticket.finish(outcome) {
            // The fill wanted meanwhile follows this hydration: it is parented to it.
            span.in_scope(|| self.queue_fill(Arc::clone(entry), fill));
        }
        result
    }

    /// Reads the thread from the store and merges the live events held; marks the view complete when the coverage
    /// verdict allows it, or schedules a re-read for when it will.
    async fn read_and_merge(
        &self,
        entry: &Arc<Entry>,
        hydration: Hydration,
        slot: Option<OwnedSemaphorePermit>,
    ) -> Result<(), ReadError> {
        let deadline = self.bounds.store_deadline();
        // Waiting for a slot counts against the read's store timeout.
        let _slot = match slot {
            Some(slot) => (Some(slot), None),
            None => (None, Some(self.hydration_slot(deadline).await?)),
        };
        let start = self.coverage.read_start_now(entry.bucket, entry.floor);
        let covers_through = freshness::millis(self.store_covers_through());
        let (visible, events) = match self
            .read_thread(&entry.thread_id, hydration, deadline)
            .await
        {
            Ok(rows) => rows,
            Err(error) => {
                if let StoreError::TooLarge { .. } = error {
                    self.leave_too_large(entry, LimitPath::Read).await;
                }
                self.metrics.cache.hydration(false);
                return Err(error.into());
            }
        };
        if visible.skipped_markers > 0 {
            self.metrics.cache.markers_skipped(visible.skipped_markers);
            if !entry.skipped_markers_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    thread_id = &*entry.thread_id,
                    skipped = visible.skipped_markers,
                    "Skipping visibility markers whose display_id is not a string"
                );
            }
        }
        let verdict = self.coverage.verdict(&start);
        let (deferred, fill, links) = {
            let mut view = entry.lock_view(&self.metrics);
            let live = std::mem::take(&mut *view);
            // An event that arrived the bound and the clock margin before the first query (or a row read before)
            // that the rows lack was stored once and deleted since ([design 2.1.8](../../docs/design.md#2.1.8)).
            let margin = u64::try_from(self.checks.clocks().margin.as_millis()).unwrap_or(u64::MAX);
            let (hydrated, orphaned) = ThreadView::hydrated(
                events,
                visible.displays,
                live,
                covers_through.saturating_sub(margin),
            );
            *view = hydrated;
            if orphaned > 0 {
                self.metrics.cache.orphaned_events(orphaned);
            }
            // The live events merged (those waiting beside the view included, applied as it was taken) keep their
            // publishers' contexts; the hydration's span links to them.
            let links = if trace::enabled() {
                view.recent_publishers(trace::MAX_LINKS)
            } else {
                Vec::new()
            };
            entry
                .stored_through
                .fetch_max(covers_through, Ordering::AcqRel);
            match verdict {
                ReadVerdict::Complete(epoch) => {
                    view.mark_complete(epoch);
                    // A live marker on a display the store did not return yet (not persisted when stage 1 ran):
                    // fill it, off the read path.
                    (None, view.needs_fill(epoch), links)
                }
                // Partial only because the bound has not passed: read again once it has.
                ReadVerdict::Deferred(until) => (Some(until), false, links),
                ReadVerdict::Uncovered => (None, false, links),
            }
        };
        link_current_span(links);
        // The stored events fit, but with the live ones held the view may not.
        if self.leave_if_too_large(entry, LimitPath::Read).await {
            return Err(self.too_large());
        }
        self.metrics.cache.hydration(true);
        if let Some(until) = deferred {
            self.schedule_reread(entry, until);
        }
        if fill {
            // The hydration is still this entry's store job: the fill follows it.
            self.schedule_fill(entry);
        }
        Ok(())
    }

    /// Answers a read of a thread this worker must not cache (a partitioned worker's read of another worker's
    /// thread) from the store alone, bounded like a hydration: a slot, the store timeout, the per-thread limit.
    ///
    /// # Errors
    /// [`ReadError`] as for a hydration.
    pub async fn read_uncached<F: Form>(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer<F>, ReadError> {
        super::answer::in_cache_span(self.read_store_only(thread_id, primary)).await
    }

    /// [`ViewCache::read_uncached`], inside its `cache` span.
    async fn read_store_only<F: Form>(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer<F>, ReadError> {
        let deadline = self.bounds.store_deadline();
        // An explain's read runs within the explain share ([`super::scan`]).
        let _share = if F::EXPLAIN {
            Some(self.explain_permit(deadline).await?)
        } else {
            None
        };
        let _slot = self.hydration_slot(deadline).await?;
        let covers_through = self.store_covers_through();
        let (visible, events) = self
            .read_thread(thread_id, Hydration::OnRead, deadline)
            .await?;
        let (mut view, _) = ThreadView::hydrated(events, visible.displays, ThreadView::new(), 0);
        let mut answer = Rendering::default().render(
            thread_id,
            &mut view,
            primary,
            AnswerSource::Store,
            &self.metrics,
        );
        answer.covered_through = Some(covers_through);
        Ok(answer)
    }

    /// A hydration slot, waited for until `deadline`.
    ///
    /// # Errors
    /// [`ReadError::Busy`] when none freed in time (counted).
    pub(super) async fn hydration_slot(
        &self,
        deadline: Instant,
    ) -> Result<tokio::sync::SemaphorePermit<'_>, ReadError> {
        match tokio::time::timeout_at(deadline, self.hydration_slots.acquire()).await {
            Ok(Ok(slot)) => Ok(slot),
            _ => {
                self.metrics.cache.hydration_slot_timeout();
                Err(ReadError::Busy)
            }
        }
    }

    /// The two-stage query of `thread_id` ([contract 4](../../docs/contract.md#4)) within `deadline` and
    /// `HISTORY_VIEW_MAX_THREAD_BYTES` (the displays count against it as the view holds them).
    ///
    /// # Errors
    /// [`StoreError`] from either stage; `TooLarge` naming the per-thread limit.
    async fn read_thread(
        &self,
        thread_id: &str,
        hydration: Hydration,
        deadline: Instant,
    ) -> Result<(VisibleDisplays, Vec<ViewEvent>), StoreError> {
        let limit = self.settings.max_thread_bytes;
        let bounds = Bounds {
            deadline,
            budget: limit,
        };
        let visible = self
            .store
            .visible_displays(thread_id, hydration, bounds)
            .await
            .map_err(|error| self.limit_met(error, thread_id))?;
        if visible.displays.is_empty() {
            // Fail closed: legacy threads without markers reconstruct as empty history ([contract
            // 4](../../docs/contract.md#4)). Any client can ask for a thread that does not exist, so the warning is
            // rate-limited.
            if self.no_marker_warnings.allow() {
                tracing::warn!(
                    thread_id,
                    "No client-visible display marker found for thread history"
                );
            }
            return Ok((visible, Vec::new()));
        }
        let displays: usize = visible.displays.iter().map(|d| display_bytes(d)).sum();
        let bounds = Bounds {
            deadline,
            budget: limit.saturating_sub(displays),
        };
        let events = self
            .store
            .display_events(thread_id, &visible.displays, hydration, bounds)
            .await
            .map_err(|error| self.limit_met(error, thread_id))?;
        Ok((visible, events))
    }

    /// A store read stopped by its budget is a read past the per-thread limit: warned about (rate-limited, metadata
    /// only) and named by the limit; other errors pass through.
    pub(super) fn limit_met(&self, error: StoreError, thread_id: &str) -> StoreError {
        let StoreError::TooLarge { .. } = error else {
            return error;
        };
        let limit = self.settings.max_thread_bytes;
        if self.too_large_warnings.allow() {
            tracing::warn!(
                thread_id,
                limit_bytes = limit,
                "A thread's stored events exceed HISTORY_VIEW_MAX_THREAD_BYTES; its reads answer 507"
            );
        }
        StoreError::TooLarge { limit }
    }

    /// Re-reads `entry` from the store at `until` in the background (one scheduled per entry at a time), so a view
    /// held partial by the persister-lag bound becomes complete without a reader waiting for the store.
    fn schedule_reread(&self, entry: &Arc<Entry>, until: Stamp) {
        if !entry.store.schedule_reread() {
            return;
        }
        let views = self.clone();
        let entry = Arc::clone(entry);
        let at = self.coverage.instant(until);
        tokio::spawn(async move {
            tokio::select! {
                biased;
                () = views.stop.cancelled() => return,
                () = tokio::time::sleep_until(at) => {}
            }
            entry.store.reread_due();
            views.reread(&entry).await;
        });
    }

    /// The background re-read: unless the view is complete by now, hydrates it (after the store job in flight, if
    /// any: a reader's hydration may complete it first).
    async fn reread(&self, entry: &Arc<Entry>) {
        loop {
            if self.state(entry) == ViewState::Complete {
                return;
            }
            match entry.store.begin_hydration() {
                Begin::Run(ticket) => {
                    let result = match self.hydrate(entry, Hydration::Reread, ticket, None).await {
                        Err(_) => RereadResult::Error,
                        Ok(()) => match self.state(entry) {
                            ViewState::Complete => RereadResult::Complete,
                            ViewState::Partial => RereadResult::Partial,
                        },
                    };
                    self.metrics.cache.reread(result);
                    self.reweigh(entry).await;
                    return;
                }
                Begin::Wait(waiter) => {
                    waiter.outcome().await;
                }
            }
        }
    }
}
