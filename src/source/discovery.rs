//! The JetStream source's head: finds aihub's class streams (`agent_<Class>_stream`, by the name pattern
//! `HISTORY_VIEW_JETSTREAM_STREAMS`, listed every [`super::Timing::interval`]) and runs one consumer loop for each
//! (`consumer.rs`), or binds the partitioned stream (`partitioned.rs`). The first listing starts coverage at the
//! replay window; a stream found later is consumed from its start, after a gap. It fails closed: with no matching
//! stream, JetStream unavailable, or the listing refused, nothing is served from memory and `/readyz` says why
//! ([design 2.1.3](../../docs/design.md#2.1.3)). The worker creates no class stream and only ephemeral consumers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::api::{Api, JsApiError, Start};
use super::rule::{self, Seen};
use super::upstream::Upstream;
use super::{CLOCK_SKEW_MARGIN, Lane, Refusal, Sink, SourceEvent, Tracker};
use crate::partition::{Partitioning, StreamSettings};

/// How long listing the streams may take: several pages of names. Nothing served waits for it (each consumed
/// stream's own checks keep the views safe); it only finds streams.
const LISTING_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a lasting failure to find a stream is logged again.
const REPEAT_ERROR: Duration = Duration::from_secs(60);

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
pub struct JetStreamSource<A: Api, S: Sink> {
    pub(super) inner: Arc<Inner<A, S>>,
}

impl<A: Api, S: Sink> Clone for JetStreamSource<A, S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

pub(super) struct Inner<A, S> {
    pub(super) api: A,
    pub(super) sink: S,
    pub(super) tracker: Tracker,
    pub(super) settings: JetStreamSettings,
    /// The streams a consumer loop runs for. A loop whose stream was deleted takes its name out, so that a stream
    /// created again under it is found and consumed as a new one.
    consumed: Mutex<HashSet<String>>,
    /// The fail-closed state, so that it is logged when it changes (and every [`REPEAT_ERROR`]).
    failing: Mutex<Option<(String, tokio::time::Instant)>>,
    /// Streams the name pattern misses that capture display-event subjects ([`Refusal::Unmatched`]).
    unmatched: Mutex<HashSet<String>>,
    /// Partitioned: what is known of each class stream upstream (fed by the rounds and the consumer loop).
    pub(super) upstream: Mutex<HashMap<String, Upstream>>,
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Changed by single inserts, removals and assignments: a panic cannot leave it torn.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<A: Api, S: Sink> JetStreamSource<A, S> {
    pub fn new(api: A, sink: S, tracker: Tracker, settings: JetStreamSettings) -> Self {
        Self {
            inner: Arc::new(Inner {
                api,
                sink,
                tracker,
                settings,
                consumed: Mutex::new(HashSet::new()),
                failing: Mutex::new(None),
                unmatched: Mutex::new(HashSet::new()),
                upstream: Mutex::new(HashMap::new()),
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

    /// Consumes the class streams until `stop`: the first listing that finds one replays each from the replay
    /// window and starts coverage; a stream found later is consumed from its start, after a gap (events of its
    /// class published before it existed were captured by no stream).
    async fn run_class_streams(self, stop: CancellationToken) {
        let mut started = false;
        let mut rounds = Self::rounds(self.inner.tracker.timing().interval);
        loop {
            if Self::next_round(&mut rounds, &stop).await {
                return;
            }
            if let Some(names) = self.list_streams().await {
                let new: Vec<String> = names
                    .into_iter()
                    .filter(|n| !lock(&self.inner.consumed).contains(n))
                    .collect();
                let start = if started {
                    if let Some(cause) = rule::gap(Seen::Found { after_start: true }) {
                        for name in &new {
                            self.inner.tracker.emit(SourceEvent::Gap {
                                stream: name,
                                cause,
                                at: None,
                            });
                        }
                    }
                    Start::All
                } else {
                    // From the listing that finds the streams: a worker that found none for a while replays only
                    // the window, not the time it waited.
                    let replay_from = SystemTime::now() - self.inner.settings.replay;
                    started = self.start_coverage(&new, replay_from).await;
                    Start::Time(replay_from)
                };
                if started {
                    for name in new {
                        self.spawn_consumer(name, start, &stop);
                    }
                }
            }
        }
    }

    /// A discovery round's clock: one round every `every` from the start of the last, however long its requests
    /// took (within it).
    pub(super) fn rounds(every: std::time::Duration) -> tokio::time::Interval {
        let mut rounds = tokio::time::interval(every);
        rounds.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        rounds
    }

    /// Waits for the next round; returns whether `stop` came first.
    pub(super) async fn next_round(
        rounds: &mut tokio::time::Interval,
        stop: &CancellationToken,
    ) -> bool {
        tokio::select! {
            biased;
            () = stop.cancelled() => true,
            _ = rounds.tick() => false,
        }
    }

    /// Runs a consumer loop for `name` unless one runs.
    pub(super) fn spawn_consumer(&self, name: String, start: Start, stop: &CancellationToken) {
        if lock(&self.inner.consumed).insert(name.clone()) {
            tokio::spawn(self.clone().consume(name, start, stop.clone()));
        }
    }

    /// A consumer loop ended.
    pub(super) fn forget_consumed(&self, name: &str) {
        let empty = {
            let mut consumed = lock(&self.inner.consumed);
            consumed.remove(name);
            consumed.is_empty()
        };
        if empty && self.inner.settings.partitioned.is_none() {
            self.fail_closed("every consumed stream is gone".into());
        }
    }

    /// The names of the streams matching the pattern; `None` (failing closed) when there are none or they cannot
    /// be listed.
    pub(super) async fn list_streams(&self) -> Option<Vec<String>> {
        let pattern = &self.inner.settings.streams;
        let listed = tokio::time::timeout(LISTING_TIMEOUT, self.inner.api.stream_names()).await;
        match listed {
            Ok(Ok(all)) => {
                let matching: Vec<String> = all
                    .iter()
                    .filter(|name| matches_pattern(pattern, name))
                    .cloned()
                    .collect();
                if matching.is_empty() {
                    let mut found: Vec<&String> = all.iter().take(20).collect();
                    found.sort();
                    self.fail_closed(format!(
                        "HISTORY_VIEW_JETSTREAM_STREAMS={pattern} matches no stream (found {} streams: {found:?})",
                        all.len()
                    ));
                    return None;
                }
                self.open();
                self.judge_unmatched().await;
                Some(matching)
            }
            Ok(Err(error @ (JsApiError::Unavailable(_) | JsApiError::Denied(_)))) => {
                self.fail_closed(format!(
                    "cannot list the streams for HISTORY_VIEW_JETSTREAM_STREAMS={pattern} (HISTORY_VIEW_SOURCE=jetstream needs JetStream and permission to list streams): {error}"
                ));
                None
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, "cannot list the streams; trying again");
                None
            }
            Err(_) => {
                tracing::debug!("listing the streams took too long; trying again");
                None
            }
        }
    }

    /// Streams the name pattern misses that capture display-event subjects: their classes' events may reach no
    /// consumed stream, so each is a refusing lane while it lasts. A listing that fails keeps the last judgement.
    async fn judge_unmatched(&self) {
        let settings = &self.inner.settings;
        let capturing = tokio::time::timeout(
            self.inner.tracker.timing().request_timeout,
            self.inner.api.streams_capturing(&settings.subject),
        )
        .await;
        let Ok(Ok(capturing)) = capturing else {
            tracing::debug!("cannot list the streams capturing display events; trying again");
            return;
        };
        let partitioned = settings.partitioned.as_ref().map(|(_, s)| s.name.as_str());
        let now: HashSet<String> = capturing
            .into_iter()
            .filter(|name| {
                !matches_pattern(&settings.streams, name) && Some(name.as_str()) != partitioned
            })
            .collect();
        let before = std::mem::replace(&mut *lock(&self.inner.unmatched), now.clone());
        for name in before.difference(&now) {
            self.inner.tracker.emit(SourceEvent::Refusing {
                stream: name,
                now: None,
                was: Some(Refusal::Unmatched),
            });
        }
        for name in now.difference(&before) {
            self.inner.tracker.emit(SourceEvent::Refusing {
                stream: name,
                now: Some(Refusal::Unmatched),
                was: None,
            });
        }
    }

    /// Nothing can be served from memory: `reason` is logged at ERROR when it changes (and every
    /// [`REPEAT_ERROR`]), `/readyz` answers 503, reads go to the store.
    fn fail_closed(&self, reason: String) {
        let now = tokio::time::Instant::now();
        let mut failing = lock(&self.inner.failing);
        let log = match failing.as_ref() {
            Some((last, at)) => *last != reason || now.duration_since(*at) >= REPEAT_ERROR,
            None => true,
        };
        if log {
            tracing::error!(%reason, "the JetStream source has no stream to consume: not ready, reads go to the store");
            *failing = Some((reason, now));
        }
        drop(failing);
        self.inner.tracker.emit(SourceEvent::Blocked {
            lane: &Lane::NoStream,
            why: None,
        });
    }

    /// A stream matches again.
    fn open(&self) {
        if lock(&self.inner.failing).take().is_some() {
            tracing::info!("the JetStream source found its streams again");
            self.inner
                .tracker
                .emit(SourceEvent::Cleared(&Lane::NoStream));
        }
    }

    /// Starts coverage at the latest of the replay start and, per stream, its creation and its oldest message
    /// (what it no longer holds was delivered to no consumer of the worker's), plus the clock-skew margin. Returns
    /// whether it could read every stream's state.
    pub(super) async fn start_coverage(&self, streams: &[String], replay_from: SystemTime) -> bool {
        let mut from = replay_from;
        for name in streams {
            let state = match tokio::time::timeout(
                self.inner.tracker.timing().request_timeout,
                self.inner.api.stream_state(name),
            )
            .await
            {
                Ok(Ok(state)) => state,
                _ => {
                    tracing::debug!(stream = %name, "cannot read a stream's state; trying again");
                    return false;
                }
            };
            from = from.max(state.created).max(state.first_time);
        }
        let coverage = self.inner.tracker.coverage();
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
