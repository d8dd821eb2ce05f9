//! A read's answer ([design 2.1](../../docs/design.md#2.1)): from memory when the view is complete and the serving
//! rule allows it (the live source has proved, within the window, that it applied everything published before the
//! read: [`crate::freshness::Freshness::serves`]), otherwise from the store, through a hydration this read runs or
//! one it waits for.

use super::*;

/// Runs `read`, the cache's part of a read, inside a `cache` span ([design 5](../../docs/design.md#5), "Traces"): a
/// hydration, a fill's wait or a store read are its children; it records where the answer came from
/// (`chat_history_view.source`, as `X-History-Source`), or that the read failed.
pub(super) async fn in_cache_span<F>(
    read: impl Future<Output = Result<Answer<F>, ReadError>>,
) -> Result<Answer<F>, ReadError> {
    let span = tracing::info_span!(
        "cache",
        otel.kind = "internal",
        chat_history_view.source = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    let answer = read.instrument(span.clone()).await;
    match &answer {
        Ok(answer) => span.record("chat_history_view.source", answer.source.label()),
        Err(_) => span.record("otel.status_code", "error"),
    };
    answer
}

impl<S: StoreReads> ViewCache<S> {
    /// Answers a history read: from memory when the view is complete; otherwise it runs a hydration or waits for
    /// the store job in flight (a hydration, whose outcome it shares, or a fill, after which it looks again).
    ///
    /// # Errors
    /// [`ReadError`] when the view needed the store and the store failed (or was busy), or the thread is too large.
    pub async fn read<F: Form>(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer<F>, ReadError> {
        in_cache_span(self.read_through(thread_id, primary)).await
    }

    /// [`ViewCache::read`], inside its `cache` span.
    async fn read_through<F: Form>(
        &self,
        thread_id: &str,
        primary: Option<&Identity>,
    ) -> Result<Answer<F>, ReadError> {
        let mut entry = self.entry(thread_id).await;
        entry.read_now(&self.coverage);
        let unproven = !self.freshness.serves() && self.state(&entry) == ViewState::Complete;
        if unproven && !self.coverage.catch_up().blocked() {
            // The source has not proved it applied everything stored up to the window before now (a consumer
            // behind its stream, a resumed one, a frozen link): the complete view may lack it. Wait for it within
            // part of the read's time, then read the store; not for a lane that lasts until someone acts, nor for
            // a view that needs the store anyway.
            self.freshness
                .wait(Instant::now() + self.bounds.store_timeout / 2)
                .await;
        }
        if let Some(answer) = self.current_answer(&mut entry, primary).await {
            // Live events that arrived while the view was held were applied by its holder (this reader, maybe),
            // after the live path checked the limit: a view they took past it leaves now instead of answering.
            if self.leave_if_too_large(&entry, LimitPath::Live).await {
                return Err(self.too_large());
            }
            self.metrics.cache.hit();
            return Ok(answer);
        }
        if unproven && !self.freshness.serves() {
            self.metrics.cache.unproven_read();
        }
        self.metrics.cache.miss();
        // An explain's hydration runs within the explain share ([`scan`]): its permit is taken before the store job
        // starts, so a history read that joins the job never waits behind explains beyond their share.
        let _share = if F::EXPLAIN {
            let permit = self.explain_permit(self.bounds.store_deadline()).await?;
            if let Some(answer) = self.complete_answer(&entry, primary, AnswerSource::Store) {
                return Ok(answer);
            }
            Some(permit)
        } else {
            None
        };
        loop {
            if entry.too_large.load(Ordering::Acquire) {
                return Err(self.too_large());
            }
            match entry.store.begin_hydration() {
                Begin::Run(ticket) => {
                    self.hydrate(&entry, Hydration::OnRead, ticket, None)
                        .await?;
                    let answer = self.render(&entry, primary);
                    self.reweigh(&entry).await;
                    return Ok(answer);
                }
                Begin::Wait(waiter) => match waiter.outcome().await {
                    // Answer from what was read even when the view stays partial (the next read hydrates again).
                    Outcome::Hydrated => return Ok(self.render(&entry, primary)),
                    Outcome::Failed if entry.too_large.load(Ordering::Acquire) => {
                        return Err(self.too_large());
                    }
                    Outcome::Failed => return Err(ReadError::ConcurrentReadFailed),
                    Outcome::LookAgain => {}
                },
            }
            if let Some(answer) = self.complete_answer(&entry, primary, AnswerSource::Store) {
                return Ok(answer);
            }
        }
    }

    /// The answer from memory of `entry` if it is complete and still the thread's current entry once the serving
    /// rule held ([`ViewCache::complete_answer`]). An entry the cache let go of while this read held it may lack
    /// events applied to its successor since; the read then looks at the successor (once: a churning thread goes to
    /// the store), and `entry` becomes it.
    ///
    /// Why this order keeps the promise: the rule held at some instant, so every event it requires was applied by
    /// then; the entry was current after that instant, so it was current when each of those events was applied
    /// after its creation, and those applied to a predecessor made it partial ([`ViewCache::apply`]).
    async fn current_answer<F: Form>(
        &self,
        entry: &mut Arc<Entry>,
        primary: Option<&Identity>,
    ) -> Option<Answer<F>> {
        for _ in 0..2 {
            let answer = self.complete_answer(entry, primary, AnswerSource::Cache)?;
            let current = self.entry(&entry.thread_id).await;
            if Arc::ptr_eq(&current, entry) {
                return Some(answer);
            }
            current.read_now(&self.coverage);
            *entry = current;
        }
        None
    }

    /// The entry's view state as of its thread's current coverage epoch.
    pub(super) fn state(&self, entry: &Entry) -> ViewState {
        entry
            .lock_view(&self.metrics)
            .state(self.coverage.epoch(entry.bucket))
    }

    /// The answer of a complete view; `None` (and the view downgraded if it was complete as of an older epoch: a
    /// gap or a removal happened since) otherwise, and while the source has not proved that it applied everything
    /// stored up to the window before now (the rule, [`Freshness::serves`]: the view may lack what its stream still
    /// holds).
    pub(super) fn complete_answer<F: Form>(
        &self,
        entry: &Entry,
        primary: Option<&Identity>,
        source: AnswerSource,
    ) -> Option<Answer<F>> {
        if !self.freshness.serves() {
            return None;
        }
        let mut view = entry.lock_view(&self.metrics);
        let epoch = self.coverage.epoch(entry.bucket);
        if view.state(epoch) == ViewState::Complete {
            let mut answer = entry.render(&mut view, primary, source, &self.metrics);
            // Complete: every live event up to the last one applied, and what the store held before.
            answer.covered_through = self.freshness.covered_through().max(entry.stored_through());
            if source == AnswerSource::Cache {
                self.sample(entry, &view, answer.covered_through);
            }
            return Some(answer);
        }
        if view.downgrade_if_stale(epoch) {
            self.metrics.cache.views_downgraded(1);
        }
        None
    }

    /// The view's answer as it is, after a store read.
    pub(super) fn render<F: Form>(&self, entry: &Entry, primary: Option<&Identity>) -> Answer<F> {
        let mut view = entry.lock_view(&self.metrics);
        let mut answer = entry.render(&mut view, primary, AnswerSource::Store, &self.metrics);
        answer.covered_through = entry.stored_through();
        answer
    }

    /// Up to when a store read that starts now will cover a thread: now less the persister-lag bound.
    pub(super) fn store_covers_through(&self) -> std::time::SystemTime {
        std::time::SystemTime::now()
            .checked_sub(self.bounds.persist_lag)
            .unwrap_or(std::time::UNIX_EPOCH)
    }
}
