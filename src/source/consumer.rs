//! One consumed stream's loop: creates an ephemeral consumer where the [`Position`] says, applies its deliveries,
//! and checks the stream every [`crate::freshness::Freshness::prove_every`] (right after each consumer is created too): a reading
//! of the stream, the consumer's state, a second reading ([`Position::judge`], [`Position::confirm`]), which prove
//! the stream's part of the covered-through instant ([`Position::covered`]) and whether it still takes display
//! events ([`rule::refusal`]). A request
//! that fails or outlasts [`super::Timing::request_timeout`], a delivery lost on the way, two missed heartbeats
//! or a lost connection end the consumer; the next one resumes after the last message applied, and the stream is
//! behind until that one has caught up ([design 2.1.4](../../docs/design.md#2.1.4)).

use std::time::Duration;

use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

use super::api::{Api, Consumer, ConsumerState, Delivery, JsApiError, Start, StreamState};
use super::rule::{self, Judgement, Position, Refusals, Seen};
use super::{GapCause, JetStreamSource, Lane, Sink, SourceEvent, filter_subjects};

/// Backoff between attempts to (re)create a consumer.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// How one consumer ended.
enum Ended {
    Stopped,
    /// The stream no longer exists.
    Deleted,
    /// The stream holds no display-event subjects.
    NoSubjects,
    /// Another stream under the same name (its gap is recorded): consume it from its start.
    Recreated,
    /// Anything else: resume (after a backoff if nothing was read).
    Resume {
        progressed: bool,
    },
}

/// What a stream's loop keeps across its consumers.
#[derive(Default)]
struct Watched {
    /// Whether the stream refuses display events, and the filters it was first consumed on (class streams).
    refusals: Refusals,
    /// The filters of the consumer now.
    filters: Vec<String>,
}

/// A request of a check or a resume that failed or took too long.
enum Failed {
    Deleted,
    Other,
}

impl From<Failed> for Ended {
    fn from(failed: Failed) -> Self {
        match failed {
            Failed::Deleted => Ended::Deleted,
            Failed::Other => Ended::Resume { progressed: false },
        }
    }
}

impl<A: Api, S: Sink> JetStreamSource<A, S> {
    /// Consumes `name` from `first` (then after the last message applied) until `stop` or the stream is deleted.
    pub(super) async fn consume(self, name: String, first: Start, stop: CancellationToken) {
        let tracker = &self.inner.tracker;
        let lane = Lane::Stream(name.clone());
        tracker.emit(SourceEvent::StreamAdded(&name));
        let mut first = first;
        let mut position: Option<Position> = None;
        let mut watched = Watched::default();
        let mut backoff = MIN_BACKOFF;
        loop {
            match self
                .consume_once(&name, &lane, first, &mut position, &mut watched, &stop)
                .await
            {
                Ended::Stopped => break,
                Ended::Deleted => {
                    if let Some(cause) = rule::gap(Seen::Deleted) {
                        tracker.emit(SourceEvent::Gap {
                            stream: &name,
                            cause,
                            at: None,
                        });
                    }
                    break;
                }
                Ended::NoSubjects => {
                    tracing::warn!(
                        stream = name,
                        "the stream holds no display-event subjects; not consumed"
                    );
                    // Still listed as consumed, so that the next listing does not take it for a new stream.
                    tracker.emit(SourceEvent::StreamRemoved(&name));
                    return;
                }
                Ended::Recreated => {
                    position = None;
                    first = Start::All;
                }
                Ended::Resume { progressed } => {
                    if progressed {
                        backoff = MIN_BACKOFF;
                    }
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        if let Some(was) = watched.refusals.now.take() {
            tracker.emit(SourceEvent::Refusing {
                stream: &name,
                now: None,
                was: Some(was),
            });
        }
        tracker.emit(SourceEvent::StreamRemoved(&name));
        self.forget_consumed(&name);
    }

    /// One request within the request timeout.
    async fn request<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, JsApiError>>,
    ) -> Result<T, Failed> {
        match timeout(self.inner.tracker.timing().request_timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(JsApiError::NotFound)) => Err(Failed::Deleted),
            Ok(Err(error)) => {
                tracing::debug!(%error, "a JetStream request failed");
                Err(Failed::Other)
            }
            Err(_) => {
                tracing::debug!("a JetStream request took longer than the check allows");
                Err(Failed::Other)
            }
        }
    }

    async fn stream_state(&self, name: &str) -> Result<StreamState, Failed> {
        self.request(self.inner.api.stream_state(name)).await
    }

    /// A reading to judge `read` by: taken again with the deleted sequences when the count alone cannot tell
    /// whether an unread message was deleted ([`Position::needs_deleted_list`]).
    async fn judged_state(&self, name: &str, read: &Position) -> Result<StreamState, Failed> {
        let state = self.stream_state(name).await?;
        if read.needs_deleted_list(&state) {
            return self
                .request(self.inner.api.stream_state_with_deleted(name))
                .await;
        }
        Ok(state)
    }

    /// Creates a consumer where `position` says (judging the resume) and applies its deliveries until it ends.
    async fn consume_once(
        &self,
        name: &str,
        lane: &Lane,
        first: Start,
        position: &mut Option<Position>,
        watched: &mut Watched,
        stop: &CancellationToken,
    ) -> Ended {
        let tracker = &self.inner.tracker;
        let generation = tracker.resuming(lane);
        let mut epochs = tracker.coverage().catch_up().epochs();
        let (mut consumer, position) =
            match self.open_consumer(name, first, position, watched).await {
                Ok(opened) => opened,
                Err(ended) => return ended,
            };
        let mut delivered = 0u64;
        let mut caught_up = false;
        let mut checks = tokio::time::interval(tracker.freshness().prove_every());
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // One cancellation future for the whole loop, not one registered and dropped per message.
        let stopped = stop.cancelled();
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                biased;
                () = &mut stopped => return Ended::Stopped,
                _ = epochs.changed() => {
                    tracing::debug!(stream = name, "the connection was lost; resuming the consumer");
                    return Ended::Resume { progressed: delivered > 0 };
                }
                // The first tick is at once: a new consumer is checked before anything is served from memory.
                _ = checks.tick() => {
                    match self.check(name, generation, position, watched, &mut consumer, delivered).await {
                        Ok(drained) => caught_up |= drained,
                        Err(ended) => return ended,
                    }
                }
                delivery = consumer.next() => {
                    let delivery = match delivery {
                        Some(Ok(delivery)) => delivery,
                        Some(Err(error)) => {
                            tracing::debug!(stream = name, %error, "the consumer ended; resuming");
                            return Ended::Resume { progressed: delivered > 0 };
                        }
                        None => return Ended::Resume { progressed: delivered > 0 },
                    };
                    if delivery.consumer_seq != delivered + 1 {
                        // A delivery was lost on the way (AckNone: the server does not send it again). Resume from
                        // the last one applied.
                        tracing::info!(stream = name, "a delivery was lost; resuming the consumer");
                        return Ended::Resume { progressed: delivered > 0 };
                    }
                    delivered = delivery.consumer_seq;
                    self.apply(name, &delivery, position).await;
                    if delivery.pending == 0 && !caught_up {
                        // Caught up as far as this consumer knows: confirm it now rather than at the next tick.
                        match self.check(name, generation, position, watched, &mut consumer, delivered).await {
                            Ok(drained) => caught_up |= drained,
                            Err(ended) => return ended,
                        }
                    }
                }
            }
        }
    }

    /// Reads the stream's state, judges the resume from `position` (the first reading sets it), and creates a
    /// consumer on the stream's display-event subjects from where the judgement says; the ending instead when the
    /// stream is gone, recreated, or captures no display events.
    async fn open_consumer<'p>(
        &self,
        name: &str,
        first: Start,
        position: &'p mut Option<Position>,
        watched: &mut Watched,
    ) -> Result<(A::Consumer, &'p mut Position), Ended> {
        let state = match position.as_ref() {
            Some(read) => self.judged_state(name, read).await,
            None => self.stream_state(name).await,
        };
        let state = state.map_err(Ended::from)?;
        let start = match position.as_mut() {
            None => {
                *position = Some(Position::new(&state));
                first
            }
            Some(read) => match self.judge(name, read, &state, true) {
                Some(()) => read.next_start(first),
                None => return Err(Ended::Recreated),
            },
        };
        let Some(position) = position.as_mut() else {
            return Err(Ended::Resume { progressed: false });
        };
        let filters = match &self.inner.settings.partitioned {
            Some((partitioning, _)) => vec![partitioning.filter_subject()],
            None => filter_subjects(&state.subjects, &self.inner.settings.subject),
        };
        if filters.is_empty() && watched.refusals.consumed_on.is_none() {
            return Err(Ended::NoSubjects);
        }
        if self.inner.settings.partitioned.is_none() {
            watched
                .refusals
                .consumed_on
                .get_or_insert_with(|| filters.clone());
            if filters.is_empty() {
                // It captured display events once and captures none now (its subjects were edited): no consumer
                // can be made on them; it refuses them until its subjects cover them again.
                self.judge_refusal(name, &state, watched);
                return Err(Ended::Resume { progressed: false });
            }
        }
        let consumer = self
            .request(self.inner.api.create_consumer(name, filters.clone(), start))
            .await?;
        watched.filters = filters;
        Ok((consumer, position))
    }

    /// Applies one delivery: to the sink by its original subject, then as the read-through position.
    async fn apply(&self, name: &str, delivery: &Delivery, position: &mut Position) {
        let subject = delivery.subject.as_str();
        let subject = match &self.inner.settings.partitioned {
            Some((partitioning, _)) => partitioning.original_subject(subject).unwrap_or(subject),
            None => subject,
        };
        self.inner
            .sink
            .apply(
                subject,
                &delivery.payload,
                delivery.headers.as_ref(),
                delivery.arrived,
            )
            .await;
        if self.inner.settings.partitioned.is_some() {
            self.copied_applied(delivery.headers.as_ref());
        }
        position.applied = Some(delivery.stream_seq);
        self.inner.tracker.emit(SourceEvent::Applied {
            stream: name,
            subject,
            sequence: delivery.stream_seq,
            pending: delivery.pending,
        });
    }

    /// Judges a reading of `name` against `read` and records what it lost (and, `resuming`, a resume that lost
    /// nothing); `None` if it is another stream now.
    fn judge(
        &self,
        name: &str,
        read: &mut Position,
        state: &StreamState,
        resuming: bool,
    ) -> Option<()> {
        let tracker = &self.inner.tracker;
        match read.judge(state) {
            Judgement::Recreated => {
                tracker.emit(SourceEvent::Gap {
                    stream: name,
                    cause: GapCause::Recreated,
                    at: None,
                });
                None
            }
            Judgement::Continues(lost) => {
                for cause in &lost {
                    tracker.emit(SourceEvent::Gap {
                        stream: name,
                        cause: *cause,
                        at: None,
                    });
                }
                if lost.is_empty() && resuming {
                    tracker.emit(SourceEvent::Continued);
                }
                Some(())
            }
        }
    }

    /// A check: a reading of the stream, the consumer's state, a reading after it. Records any loss, raises the
    /// read-through position, records what it proves applied (the stream's part of the covered-through instant) and
    /// whether the stream refuses display events, and returns whether the consumer was drained. Any request that
    /// fails or takes too long ends the consumer (the stream's part stays where it was until the next one proves
    /// more).
    async fn check(
        &self,
        name: &str,
        generation: u64,
        position: &mut Position,
        watched: &mut Watched,
        consumer: &mut A::Consumer,
        delivered: u64,
    ) -> Result<bool, Ended> {
        let coverage = self.inner.tracker.coverage();
        let asked = coverage.now();
        let before = self.stream_state(name).await.map_err(Ended::from)?;
        let consumer_state: ConsumerState =
            self.request(consumer.state()).await.map_err(Ended::from)?;
        let after = self
            .judged_state(name, position)
            .await
            .map_err(Ended::from)?;
        if self.judge(name, position, &after, false).is_none() {
            return Err(Ended::Recreated);
        }
        let drained = position.confirm(&before, &consumer_state, delivered);
        self.judge_refusal(name, &after, watched);
        if self.inner.settings.partitioned.is_none() {
            let now = filter_subjects(&after.subjects, &self.inner.settings.subject);
            let seen = Seen::Subjects {
                consumed_on: &watched.filters,
                now: &now,
            };
            if let Some(cause) = rule::gap(seen) {
                // Its subjects were edited: a consumer on the new filters, after a gap (messages on subjects the old
                // filters left out were passed unread).
                tracing::warn!(
                    stream = name,
                    "the stream's subjects changed; consuming it on its new subjects"
                );
                self.inner.tracker.emit(SourceEvent::Gap {
                    stream: name,
                    cause,
                    at: None,
                });
                return Err(Ended::Resume { progressed: true });
            }
        }
        if !rule::proves(&after) {
            // Its leader may be storing nothing: nothing proved, so the stream's part of the instant stays behind.
            tracing::debug!(
                stream = name,
                "the stream's leader has not heard from a quorum of its replicas lately"
            );
            return Ok(false);
        }
        let proved = position.covered(asked, &before);
        self.inner.tracker.emit(SourceEvent::Confirmed {
            stream: name,
            generation,
            drained,
            covered: proved.covered,
        });
        if self.inner.settings.partitioned.is_some() {
            self.judge_sources(&before, drained, &proved.caught_up);
        }
        Ok(drained)
    }

    /// Records whether the stream (its reading `state`) refuses display events now.
    fn judge_refusal(&self, name: &str, state: &StreamState, watched: &mut Watched) {
        let subject = match self.inner.settings.partitioned {
            // The partitioned stream has the sources' subjects, not its own.
            Some(_) => None,
            None => Some(self.inner.settings.subject.as_str()),
        };
        if let Some(was) = watched.refusals.judge(state, subject) {
            self.inner.tracker.emit(SourceEvent::Refusing {
                stream: name,
                now: watched.refusals.now,
                was,
            });
        }
    }
}
