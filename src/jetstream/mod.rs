//! The JetStream source (`HISTORY_VIEW_SOURCE=jetstream`): aihub's class streams (`agent_<Class>_stream`, found by
//! a name pattern and looked for again every second), each consumed on its display-event subjects by a consumer
//! loop of the worker's own that resumes by stream sequence, so that a reconnect, a lost delivery or a restarted
//! server is not a gap. The worker creates no stream (nats-server refuses one overlapping aihub's) and only
//! ephemeral consumers. Events go through the Core path's subject → decode → view ([`Ingest::handle`]).
//!
//! What is a gap is decided on every resume, as [design 2.1](../../docs/design.md#2.1) argues: the stream kept its
//! identity (same creation time, same leader) and still holds the message after the last one applied, or it is a
//! gap ([`Coverage::gap`]). A resumed consumer is behind until it has delivered what the stream held
//! ([`crate::coverage::CatchUp`]): complete views are served from memory only then.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::Info;
use async_nats::jetstream::{self, Context, ErrorCode};
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use crate::coverage::Coverage;
use crate::ingest::Ingest;
use crate::metrics::{Metrics, ResumeOutcome};
use crate::partition::{Partitioning, StreamSettings};

mod partitioned;

/// A source of the partitioned stream that has not been heard from for this long is stalled: the worker is behind
/// until it is active again with nothing left to copy (nats-server hears from a healthy source every second or so,
/// idle or not).
const SOURCE_STALL: Duration = Duration::from_secs(5);
/// How often the class streams are listed (new ones are consumed) and each consumed stream's identity is checked.
const DISCOVERY_INTERVAL: Duration = Duration::from_secs(1);
/// How often the server sends an idle heartbeat to a pull consumer's request; two missed ones end the loop, which
/// resumes.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// How long one pull request waits for messages.
const EXPIRES: Duration = Duration::from_secs(10);
/// An ephemeral consumer nobody pulls from is removed by the server after this long.
const INACTIVE_THRESHOLD: Duration = Duration::from_secs(60);
/// Added to the moment coverage starts after a replay: the server's clock may run behind the worker's, so a replay
/// asked from a worker moment may start later than asked.
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(1);
/// Backoff between attempts to (re)create a consumer.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What the JetStream source is configured with.
#[derive(Debug, Clone)]
pub struct JetStreamSettings {
    /// `HISTORY_VIEW_JETSTREAM_STREAMS`: the class streams' names; `*` matches any run of characters.
    pub streams: String,
    /// `HISTORY_VIEW_JETSTREAM_REPLAY_SECS`: how far back a start replays.
    pub replay: Duration,
    /// `HISTORY_VIEW_SUBJECT`: the display-event subjects; each stream is consumed on its subjects' intersection
    /// with it.
    pub subject: String,
    /// `HISTORY_VIEW_PARTITIONS` > 1: this worker's partition and the partitioned stream it consumes instead of the
    /// class streams.
    pub partitioned: Option<(Partitioning, StreamSettings)>,
}

/// The JetStream source. Cloning is cheap.
#[derive(Clone)]
pub struct JetStreamSource {
    inner: Arc<Inner>,
}

struct Inner {
    context: Context,
    ingest: Ingest,
    coverage: Coverage,
    metrics: Metrics,
    settings: JetStreamSettings,
    /// The streams a consumer loop runs for. A loop whose stream was deleted takes its name out, so that a stream
    /// created again under it is found and consumed as a new one.
    consumed: Mutex<HashSet<String>>,
    /// Partitioned: class streams that are no source of the partitioned stream, and sources of it that stalled;
    /// each keeps the worker behind.
    unsourced: Mutex<HashSet<String>>,
    stalled: Mutex<HashSet<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A set of names, changed by single inserts and removals: a panic cannot leave it torn.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a stream's consumption stands, for the next resume.
#[derive(Debug, Clone)]
struct Position {
    /// The stream's identity when it was last read.
    created: SystemTime,
    leader: Option<String>,
    /// The stream's first sequence when this reading of it began, raised to one past its last sequence whenever the
    /// consumer was seen with nothing pending: a resume continues only if the stream still holds the message after
    /// this (or after the last one applied), so that losing messages the worker had read through, or that its
    /// filter leaves out, is no gap.
    floor: u64,
    /// The stream sequence of the last message applied; `None` before the first.
    last_applied: Option<u64>,
    /// Where a consumer starts while nothing is applied.
    start: Start,
}

/// How a stream loop's consumer ended.
enum Ended {
    Stopped,
    /// The stream no longer exists.
    Deleted,
    /// Anything else: resume (after a backoff if nothing was read).
    Resume {
        progressed: bool,
    },
}

/// The first consumer of a stream: a replay from a moment (at start), or everything it holds (a stream that
/// appeared later).
#[derive(Debug, Clone, Copy)]
enum Start {
    Since(SystemTime),
    All,
}

impl JetStreamSource {
    pub fn new(
        client: async_nats::Client,
        ingest: Ingest,
        coverage: Coverage,
        metrics: Metrics,
        settings: JetStreamSettings,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                context: jetstream::new(client),
                ingest,
                coverage,
                metrics,
                settings,
                consumed: Mutex::new(HashSet::new()),
                unsourced: Mutex::new(HashSet::new()),
                stalled: Mutex::new(HashSet::new()),
            }),
        }
    }

    /// Consumes the class streams, or this worker's partition of the partitioned stream, until `stop`.
    ///
    /// # Errors
    /// The partitioned stream was made for another partition count or prefix.
    pub async fn run(self, stop: CancellationToken) -> anyhow::Result<()> {
        match self.inner.settings.partitioned.clone() {
            Some((partitioning, stream)) => self.run_partitioned(partitioning, stream, stop).await,
            None => {
                self.run_class_streams(stop).await;
                Ok(())
            }
        }
    }

    /// Consumes the class streams until `stop`: the first listing replays each stream from the replay window and
    /// starts coverage; a stream listed later is consumed from its start, after a gap (events of its class
    /// published before it existed were captured by no stream).
    async fn run_class_streams(self, stop: CancellationToken) {
        let replay_from = SystemTime::now() - self.inner.settings.replay;
        let mut started = false;
        loop {
            match self.list_streams().await {
                Ok(names) => {
                    let new: Vec<String> = names
                        .into_iter()
                        .filter(|n| !lock(&self.inner.consumed).contains(n))
                        .collect();
                    let start = if started {
                        if !new.is_empty() {
                            tracing::info!(streams = ?new, "new class streams: a gap (events of their classes before them were in no stream)");
                            self.record_gap();
                        }
                        Start::All
                    } else {
                        started = self.start_coverage(&new, replay_from).await;
                        Start::Since(replay_from)
                    };
                    if started {
                        for name in new {
                            lock(&self.inner.consumed).insert(name.clone());
                            self.inner.coverage.catch_up().track(&name);
                            tokio::spawn(self.clone().consume(name, start, stop.clone()));
                        }
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "cannot list the class streams; trying again");
                }
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return,
                () = tokio::time::sleep(DISCOVERY_INTERVAL) => {}
            }
        }
    }

    /// The names of the streams matching the pattern.
    async fn list_streams(&self) -> Result<Vec<String>, async_nats::Error> {
        let mut names = self.inner.context.stream_names();
        let mut matching = Vec::new();
        while let Some(name) = names.next().await {
            let name = name?;
            if matches_pattern(&self.inner.settings.streams, &name) {
                matching.push(name);
            }
        }
        Ok(matching)
    }

    /// Starts coverage at the latest of the replay start and, per stream, its creation and its oldest message
    /// (what it no longer holds was delivered to no consumer of the worker's), plus the clock-skew margin. Returns
    /// whether it could read every stream's state.
    async fn start_coverage(&self, streams: &[String], replay_from: SystemTime) -> bool {
        let mut from = replay_from;
        for name in streams {
            let info = match self.stream_info(name).await {
                Ok(info) => info,
                Err(error) => {
                    tracing::debug!(stream = %name, %error, "cannot read a class stream's state; trying again");
                    return false;
                }
            };
            let oldest = if info.state.messages > 0 {
                info.state.first_timestamp
            } else {
                info.state.last_timestamp
            };
            from = from.max(wall(info.created)).max(wall(oldest));
        }
        let coverage = &self.inner.coverage;
        // Not capped at now: a stream created a moment ago must still get the margin.
        let at = coverage.stamp_of(from).plus(CLOCK_SKEW_MARGIN);
        if coverage.confirm_live(coverage.connection(), at) {
            tracing::info!(
                streams = streams.len(),
                replay_secs = self.inner.settings.replay.as_secs(),
                "JetStream source started: coverage starts at the replay window"
            );
        }
        true
    }

    async fn stream_info(&self, name: &str) -> Result<Info, async_nats::Error> {
        let mut stream = self.inner.context.get_stream(name).await?;
        Ok(stream.info().await?.clone())
    }

    /// One stream's consumer loop, until `stop` or the stream is deleted: creates a consumer, applies its messages,
    /// and on any failure resumes from the last message applied.
    async fn consume(self, name: String, start: Start, stop: CancellationToken) {
        let mut position: Option<Position> = None;
        let mut backoff = MIN_BACKOFF;
        let freshness = self.inner.ingest.freshness();
        freshness.track_stream(&name);
        loop {
            match self.consume_once(&name, start, &mut position, &stop).await {
                Ended::Stopped => {
                    freshness.forget_stream(&name);
                    return;
                }
                Ended::Deleted => {
                    tracing::warn!(stream = %name, "a class stream was deleted: a gap");
                    self.record_gap();
                    freshness.forget_stream(&name);
                    self.inner.coverage.catch_up().forget(&name);
                    lock(&self.inner.consumed).remove(&name);
                    return;
                }
                Ended::Resume { progressed } => {
                    if progressed {
                        backoff = MIN_BACKOFF;
                    }
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Creates a consumer where `position` says (judging the resume) and applies its messages until it ends.
    async fn consume_once(
        &self,
        name: &str,
        start: Start,
        position: &mut Option<Position>,
        stop: &CancellationToken,
    ) -> Ended {
        let catch_up = self.inner.coverage.catch_up();
        let epoch = catch_up.epoch();
        let mut epochs = catch_up.epochs();
        let mut stream = match self.inner.context.get_stream(name).await {
            Ok(stream) => stream,
            Err(error) if is_not_found(&error) => return Ended::Deleted,
            Err(error) => {
                tracing::debug!(stream = name, %error, "cannot reach a class stream; resuming");
                return Ended::Resume { progressed: false };
            }
        };
        let info = match stream.info().await {
            Ok(info) => info.clone(),
            Err(error) => {
                tracing::debug!(stream = name, %error, "cannot read a class stream's state; resuming");
                return Ended::Resume { progressed: false };
            }
        };
        let deliver_policy = self.resume_policy(name, start, position, &info);
        let partitioning = self.inner.settings.partitioned.as_ref().map(|(p, _)| p);
        let filter_subjects = match partitioning {
            Some(partitioning) => vec![partitioning.filter_subject()],
            None => filter_subjects(&info.config.subjects, &self.inner.settings.subject),
        };
        if filter_subjects.is_empty() {
            tracing::warn!(
                stream = name,
                "the class stream holds no display-event subjects; not consumed"
            );
            catch_up.forget(name);
            return Ended::Stopped;
        }
        let mut consumer = match stream
            .create_consumer(pull::Config {
                deliver_policy,
                ack_policy: AckPolicy::None,
                filter_subjects,
                inactive_threshold: INACTIVE_THRESHOLD,
                memory_storage: true,
                ..pull::Config::default()
            })
            .await
        {
            Ok(consumer) => consumer,
            Err(error) => {
                tracing::debug!(stream = name, %error, "cannot create a consumer; resuming");
                return Ended::Resume { progressed: false };
            }
        };
        let freshness = self.inner.ingest.freshness();
        let asked = SystemTime::now();
        match consumer.info().await {
            Ok(info) if info.num_pending == 0 => {
                catch_up.caught_up(name, epoch);
                freshness.stream_covered(name, asked);
            }
            Ok(info) => self.inner.metrics.jetstream_pending(name, info.num_pending),
            Err(_) => return Ended::Resume { progressed: false },
        }
        let mut messages = match consumer
            .stream()
            .heartbeat(HEARTBEAT)
            .expires(EXPIRES)
            .messages()
            .await
        {
            Ok(messages) => messages,
            Err(error) => {
                tracing::debug!(stream = name, %error, "cannot pull from the consumer; resuming");
                return Ended::Resume { progressed: false };
            }
        };
        let mut delivered = 0u64;
        let mut identity = tokio::time::interval(DISCOVERY_INTERVAL);
        identity.tick().await;
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
                _ = identity.tick() => {
                    let Ok(now) = stream.info().await.cloned() else { continue };
                    let Some(position) = position.as_mut() else { continue };
                    if !same_stream(position, wall(now.created), leader(&now).as_deref()) {
                        tracing::info!(stream = name, "the class stream changed under its consumer; resuming");
                        return Ended::Resume { progressed: delivered > 0 };
                    }
                    // Asked after the stream's state: nothing pending means every message up to its last one then
                    // was read, so a later loss of older (filtered-out) messages is no loss.
                    let asked = SystemTime::now();
                    let consumer_info = consumer.info().await.ok();
                    if let Some(info) = &consumer_info
                        && info.num_pending == 0
                    {
                        position.floor = position.floor.max(now.state.last_sequence + 1);
                    }
                    // Nothing left to deliver, and every message delivered applied (consumer sequences count only
                    // the messages the filter let through, so filtered-out ones cannot hold this back).
                    let drained = consumer_info.is_some_and(|info| {
                        info.num_pending == 0 && delivered >= info.delivered.consumer_sequence
                    });
                    if drained {
                        // Everything the stream held when asked has been applied.
                        freshness.stream_covered(name, asked);
                    }
                    if partitioning.is_some() {
                        self.judge_sources(&now, drained);
                    }
                }
                message = messages.next() => {
                    let message = match message {
                        Some(Ok(message)) => message,
                        Some(Err(error)) => {
                            tracing::debug!(stream = name, %error, "the consumer failed; resuming");
                            return Ended::Resume { progressed: delivered > 0 };
                        }
                        None => return Ended::Resume { progressed: delivered > 0 },
                    };
                    let (stream_sequence, consumer_sequence, pending, published) = match message.info() {
                        Ok(info) => (info.stream_sequence, info.consumer_sequence, info.pending, info.published),
                        Err(_) => return Ended::Resume { progressed: delivered > 0 },
                    };
                    if consumer_sequence != delivered + 1 {
                        // A delivery was lost on the way (AckNone: the server does not send it again). Resume
                        // from the last one applied.
                        tracing::info!(stream = name, "a delivery was lost; resuming the consumer");
                        return Ended::Resume { progressed: delivered > 0 };
                    }
                    delivered = consumer_sequence;
                    let subject = message.subject.as_str();
                    let subject = partitioning.and_then(|p| p.original_subject(subject)).unwrap_or(subject);
                    self.inner.ingest.handle_event(subject, &message.payload).await;
                    if let Some(position) = position.as_mut() {
                        position.last_applied = Some(stream_sequence);
                    }
                    self.inner.metrics.jetstream_applied(name, stream_sequence, pending);
                    if pending == 0 {
                        catch_up.caught_up(name, epoch);
                        // Nothing was left behind it when it was delivered: every message stored up to it is applied.
                        freshness.stream_covered(name, wall(published));
                    }
                }
            }
        }
    }

    /// A gap: every complete view is partial from now on ([`Coverage::gap`]), counted as a resume outcome.
    fn record_gap(&self) {
        self.record_gap_at(self.inner.coverage.now());
    }

    fn record_gap_at(&self, at: crate::coverage::Stamp) {
        self.inner.metrics.jetstream_resume(ResumeOutcome::Gap);
        self.inner.coverage.gap(at);
    }

    /// The partitioned stream's sources: one not heard from for [`SOURCE_STALL`] keeps the worker behind until it
    /// is active again, has nothing left to copy and the consumer has applied what it delivered (`drained`): the
    /// events it holds back reach the stream once it recovers, but a view served meanwhile would lack them.
    fn judge_sources(&self, info: &Info, drained: bool) {
        let catch_up = self.inner.coverage.catch_up();
        let mut stalled = lock(&self.inner.stalled);
        for source in &info.sources {
            let key = format!("stalled:{}", source.name);
            let stale = source.active.is_none_or(|active| active > SOURCE_STALL);
            if stale {
                if stalled.insert(source.name.clone()) {
                    tracing::warn!(source = %source.name, "a source of the partitioned stream stalled: reads go to the store until it recovers");
                    catch_up.track(&key);
                }
            } else if source.lag == 0 && drained && stalled.remove(&source.name) {
                tracing::info!(source = %source.name, "a stalled source of the partitioned stream recovered");
                catch_up.forget(&key);
            }
        }
    }

    /// Where the next consumer starts, and whether this resume is a gap (counted and recorded here).
    fn resume_policy(
        &self,
        name: &str,
        start: Start,
        position: &mut Option<Position>,
        info: &Info,
    ) -> DeliverPolicy {
        let fresh = |start| Position {
            created: wall(info.created),
            leader: leader(info),
            floor: info.state.first_sequence,
            last_applied: None,
            start,
        };
        let next = match position.take() {
            None => fresh(start),
            Some(previous) if keeps_identity(&previous, info) => {
                self.inner
                    .metrics
                    .jetstream_resume(ResumeOutcome::Continued);
                previous
            }
            Some(_) => {
                tracing::warn!(
                    stream = name,
                    "a class stream was recreated, lost messages not read yet, or changed its leader: a gap"
                );
                self.record_gap();
                // Everything the stream holds now, as a stream seen for the first time after the start.
                fresh(Start::All)
            }
        };
        let policy = match (next.last_applied, next.start) {
            (Some(last), _) => DeliverPolicy::ByStartSequence {
                start_sequence: last + 1,
            },
            (None, Start::Since(at)) => DeliverPolicy::ByStartTime {
                start_time: at.into(),
            },
            (None, Start::All) => DeliverPolicy::All,
        };
        *position = Some(next);
        policy
    }
}

/// Whether the stream is still the one `position` read: created at the same moment, under the same leader, and
/// still holding the message after the last one applied.
fn keeps_identity(position: &Position, info: &Info) -> bool {
    continues(
        position,
        wall(info.created),
        leader(info).as_deref(),
        info.state.first_sequence,
    )
}

/// Whether a stream created at `created` and led by `leader` is the one `position` read.
fn same_stream(position: &Position, created: SystemTime, leader: Option<&str>) -> bool {
    position.created == created && position.leader.as_deref() == leader
}

/// The resume rule on plain values: a stream created at `created`, led by `leader`, whose oldest message is
/// `first_sequence`, continues what `position` read.
fn continues(
    position: &Position,
    created: SystemTime,
    leader: Option<&str>,
    first_sequence: u64,
) -> bool {
    same_stream(position, created, leader)
        && first_sequence
            <= position
                .last_applied
                .map_or(0, |last| last + 1)
                .max(position.floor)
}

/// A server timestamp on the wall clock; the zero time of an empty stream (year 1) as the epoch.
fn wall(at: time::OffsetDateTime) -> SystemTime {
    if at.unix_timestamp() <= 0 {
        SystemTime::UNIX_EPOCH
    } else {
        at.into()
    }
}

/// The leader of a replicated stream. A stream of one replica has none that matters: its "leader" is the one server
/// holding it, named anew when that server restarts, which is no gap (it recovers the stream from its files before
/// it accepts clients, so publishers' reconnect buffers land in it).
fn leader(info: &Info) -> Option<String> {
    if info.config.num_replicas <= 1 {
        return None;
    }
    info.cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
}

fn is_not_found(error: &jetstream::context::GetStreamError) -> bool {
    matches!(error.kind(), GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (`agent_*_stream`).
pub fn matches_pattern(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    let (first, rest) = parts.split_first().expect("split yields at least one part");
    let Some(mut tail) = name.strip_prefix(first) else {
        return false;
    };
    let Some((last, middle)) = rest.split_last() else {
        return tail.is_empty();
    };
    for part in middle {
        match tail.find(part) {
            Some(at) => tail = &tail[at + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

/// The consumer's filter subjects: each of the stream's subjects intersected with the display-event `subject`,
/// token by token (a literal meets `*` or itself; `>` takes the rest of the other). Subjects that cannot meet are
/// left out.
pub fn filter_subjects(stream_subjects: &[String], subject: &str) -> Vec<String> {
    let mut filters: Vec<String> = stream_subjects
        .iter()
        .filter_map(|stream_subject| intersect(stream_subject, subject))
        .collect();
    filters.sort();
    filters.dedup();
    filters
}

fn intersect(a: &str, b: &str) -> Option<String> {
    let (a, b): (Vec<&str>, Vec<&str>) = (a.split('.').collect(), b.split('.').collect());
    let mut out = Vec::new();
    for i in 0.. {
        match (a.get(i), b.get(i)) {
            (None, None) => break,
            (Some(&">"), _) => {
                out.extend(b.get(i..).unwrap_or_default());
                break;
            }
            (_, Some(&">")) => {
                out.extend(a.get(i..).unwrap_or_default());
                break;
            }
            (Some(&"*"), Some(y)) => out.push(*y),
            (Some(x), Some(&"*")) => out.push(*x),
            (Some(x), Some(y)) if x == y => out.push(*x),
            _ => return None,
        }
    }
    Some(out.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_continues_only_the_same_stream_under_the_same_leader_with_nothing_lost() {
        let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let position = Position {
            created,
            leader: Some("n1".into()),
            floor: 1,
            last_applied: Some(41),
            start: Start::All,
        };
        assert!(continues(&position, created, Some("n1"), 1));
        assert!(
            continues(&position, created, Some("n1"), 42),
            "the next message is still held"
        );
        assert!(
            !continues(&position, created, Some("n1"), 43),
            "message 42 was lost unread"
        );
        assert!(
            !continues(&position, created + Duration::from_secs(1), Some("n1"), 1),
            "recreated"
        );
        assert!(
            !continues(&position, created, Some("n2"), 1),
            "a new leader"
        );
        let read_through = Position {
            floor: 61,
            ..position.clone()
        };
        assert!(
            continues(&read_through, created, Some("n1"), 61),
            "messages the consumer had read through (filtered out) may go"
        );
        let unread = Position {
            last_applied: None,
            floor: 7,
            ..position
        };
        assert!(continues(&unread, created, Some("n1"), 7));
        assert!(
            !continues(&unread, created, Some("n1"), 8),
            "nothing applied yet, but message 7 was lost unread"
        );
    }

    #[test]
    fn stream_names_match_the_pattern_with_any_run_for_a_star() {
        assert!(matches_pattern("agent_*_stream", "agent_UserAgent_stream"));
        assert!(matches_pattern("agent_*_stream", "agent__stream"));
        assert!(!matches_pattern(
            "agent_*_stream",
            "agent_UserAgent_streams"
        ));
        assert!(!matches_pattern("agent_*_stream", "CHAT_HISTORY_VIEW"));
        assert!(matches_pattern("exact", "exact"));
        assert!(!matches_pattern("exact", "exactly"));
        assert!(matches_pattern("*", "anything"));
        assert!(matches_pattern("a*b*c", "a-b-b-c"));
    }

    #[test]
    fn a_class_stream_is_consumed_on_its_display_event_subjects_only() {
        let subject = "agent.*.*.*.*.*.display_event.*.*";
        assert_eq!(
            filter_subjects(&["agent.Primary.*.*.*.*.*.*.*".into()], subject),
            vec!["agent.Primary.*.*.*.*.display_event.*.*".to_owned()]
        );
        assert_eq!(
            filter_subjects(&["agent.Primary.>".into()], subject),
            vec!["agent.Primary.*.*.*.*.display_event.*.*".to_owned()]
        );
        assert!(filter_subjects(&["agent.Primary.*.*.*.*.control.*.*".into()], subject).is_empty());
        assert!(filter_subjects(&["other.>".into()], subject).is_empty());
    }
}
