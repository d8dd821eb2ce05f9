//! Partitioned sourcing (`HISTORY_VIEW_PARTITIONS` > 1): every interval, the class streams are listed, the
//! partitioned stream is bound (created, and each new class stream added to its sources, unless
//! `HISTORY_VIEW_JETSTREAM_CREATE_STREAM=false`) and checked, and what changed upstream of it is judged ([design
//! 2.1.5](../../docs/design.md#2.1.5)): a class stream sourced for the first time after the start, recreated, deleted or
//! under a new leader is a gap; one not sourced at all, or a source that stalled, keeps the worker behind. The one
//! consumer loop, on `<prefix>.<k>.>`, is the class streams' (`consumer.rs`), so every retention case of the
//! partitioned stream itself is judged there.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::stream::{Config, Source};
use tokio_util::sync::CancellationToken;

use super::api::{Api, JsApiError, SourceState, Start, StreamState};
use super::discovery::lock;
use super::rule::{self, Refusals, Seen};
use super::upstream::{Upstream, copied_from};
use super::{CLOCK_SKEW_MARGIN, JetStreamSource, Lane, Sink, SourceEvent};
use crate::coverage::Stamp;
use crate::partition::{Partitioning, StreamSettings};

/// The header nats-server puts on a message a source copied: its class stream and origin sequence.
const SOURCE_HEADER: &str = "Nats-Stream-Source";

/// A source of the partitioned stream not heard from for this long is stalled: the worker is behind until it is
/// active again with nothing left to copy (nats-server hears from a healthy source every second or so, idle or
/// not).
const SOURCE_STALL: Duration = Duration::from_secs(5);

/// A class stream as last seen: a change is a gap.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    created: SystemTime,
    leader: Option<String>,
}

/// Why the partitioned stream could not be bound this round.
enum Unbound {
    /// Made with other settings: the worker stops.
    Refused(String),
    /// Not reachable, not there yet (and not to be created), or an update lost a race: try again next round.
    Later(String),
}

impl<A: Api, S: Sink> JetStreamSource<A, S> {
    /// Runs the partitioned source until `stop`.
    ///
    /// # Errors
    /// The partitioned stream exists with another partition count or prefix.
    pub(super) async fn run_partitioned(
        self,
        partitioning: Partitioning,
        stream: StreamSettings,
        stop: CancellationToken,
    ) -> anyhow::Result<()> {
        // From here on a class stream that still holds its first message is sourced from it.
        let mut started: Option<SystemTime> = None;
        let mut classes: HashMap<String, Identity> = HashMap::new();
        let mut sourced: HashSet<String> = HashSet::new();
        let mut warned_unbound = false;
        // Per class stream seen upstream, whether it refuses display events.
        let mut upstream: HashMap<String, Refusals> = HashMap::new();
        // As often as the consumer's checks: each round's readings of the class streams prove their parts of the
        // covered-through instant.
        let mut rounds = Self::rounds(self.inner.tracker.freshness().prove_every());
        loop {
            if Self::next_round(&mut rounds, &stop).await {
                return Ok(());
            }
            if let Some(names) = self.list_streams().await {
                let seen = self.identities(&names, &classes, &mut upstream).await;
                match self
                    .bind(&partitioning, &stream, &names, started, &seen)
                    .await
                {
                    Err(Unbound::Refused(reason)) => anyhow::bail!(reason),
                    Err(Unbound::Later(reason)) => {
                        if !warned_unbound {
                            tracing::warn!(stream = %stream.name, %reason, "cannot bind the partitioned stream yet; trying every interval");
                            warned_unbound = true;
                        }
                    }
                    Ok(state) => {
                        warned_unbound = false;
                        let now_sourced = source_names(&state.config);
                        let start = if started.is_some() {
                            self.judge_upstream(&classes, &seen, &sourced, &now_sourced);
                            // Deleted and created again (its loop recorded the gap): all of it.
                            Start::All
                        } else {
                            // From the round that binds the stream (see `run_class_streams`).
                            let replay_from = SystemTime::now() - self.inner.settings.replay;
                            if self.start_partitioned(&state, replay_from).await {
                                started = Some(SystemTime::now());
                            }
                            Start::Time(replay_from)
                        };
                        if started.is_some() {
                            self.spawn_consumer(stream.name.clone(), start, &stop);
                            self.track_unsourced(&names, &now_sourced);
                            classes = seen;
                            sourced = now_sourced;
                        }
                    }
                }
            }
        }
    }

    /// The identity of each class stream; one whose state cannot be read this round keeps its last identity.
    /// Each reading with a quorum is judged against what its source is known to have copied ([`Upstream::read`]):
    /// messages it removed before its source passed them are a gap, and it moves the class stream's part of the
    /// covered-through instant. A class stream that does not answer, has no quorum, or is not read at all (a
    /// listing that fails or a round that hangs) proves nothing, so its part stays where it was and answers from
    /// memory stop within the bound; a new leader is then a gap. A class stream that refuses events holds the
    /// instant like a consumed one.
    async fn identities(
        &self,
        names: &[String],
        last: &HashMap<String, Identity>,
        upstream: &mut HashMap<String, Refusals>,
    ) -> HashMap<String, Identity> {
        let tracker = &self.inner.tracker;
        let timeout = tracker.timing().request_timeout;
        let coverage = tracker.coverage();
        let mut seen = HashMap::new();
        for name in names {
            let lane = Lane::Unconfirmed(name.clone());
            let refusals = upstream.entry(name.clone()).or_insert_with(|| {
                // First seen: behind until a round reads it with a quorum.
                tracker.track_upstream(name);
                tracker.resuming(&lane);
                Refusals::default()
            });
            let copied_before = lock(&self.inner.upstream)
                .entry(name.clone())
                .or_default()
                .copied();
            let asked = coverage.now();
            match tokio::time::timeout(timeout, self.inner.api.stream_state(name)).await {
                Ok(Ok(state)) => {
                    let returned = coverage.now();
                    if state.quorum {
                        tracker.emit(SourceEvent::Cleared(&lane));
                        let judged = lock(&self.inner.upstream)
                            .entry(name.clone())
                            .or_default()
                            .read(
                                copied_before,
                                asked,
                                returned,
                                state.first_seq,
                                state.last_seq,
                            );
                        if let Some(cause) = rule::gap(Seen::Upstream { lost: judged.lost }) {
                            tracker.emit(SourceEvent::Gap {
                                stream: name,
                                cause,
                                at: None,
                            });
                        }
                        if let Some(covered) = judged.covered {
                            tracker.emit(SourceEvent::Upstream {
                                stream: name,
                                covered,
                            });
                        }
                    } else {
                        tracing::debug!(class_stream = %name, "a class stream's leader has not heard from a quorum of its replicas");
                    }
                    self.judge_class_refusal(name, &state, refusals);
                    seen.insert(
                        name.clone(),
                        Identity {
                            created: state.created,
                            leader: state.leader,
                        },
                    );
                }
                _ => {
                    tracing::debug!(class_stream = %name, "a class stream's state cannot be read");
                    if let Some(identity) = last.get(name) {
                        seen.insert(name.clone(), identity.clone());
                    }
                }
            }
        }
        upstream.retain(|name, refusals| {
            let listed = names.contains(name);
            if !listed {
                tracker.emit(SourceEvent::Cleared(&Lane::Unconfirmed(name.clone())));
                tracker.forget_upstream(name);
                lock(&self.inner.upstream).remove(name);
                if let Some(was) = refusals.now {
                    tracker.emit(SourceEvent::Refusing {
                        stream: name,
                        now: None,
                        was: Some(was),
                    });
                }
            }
            listed
        });
        seen
    }

    /// Whether a class stream upstream refuses display events now (full with `discard: new`, sealed, subjects that
    /// no longer cover those it was first seen with).
    fn judge_class_refusal(&self, name: &str, state: &StreamState, refusals: &mut Refusals) {
        if let Some(was) = refusals.judge(state, Some(&self.inner.settings.subject)) {
            self.inner.tracker.emit(SourceEvent::Refusing {
                stream: name,
                now: refusals.now,
                was,
            });
        }
    }

    /// A delivery of the partitioned stream was applied: its class stream's source had passed everything before it.
    pub(super) fn copied_applied(&self, headers: Option<&async_nats::HeaderMap>) {
        let Some((stream, seq)) = headers
            .and_then(|headers| headers.get(SOURCE_HEADER))
            .and_then(|value| copied_from(value.as_str()))
        else {
            return;
        };
        if let Some(upstream) = lock(&self.inner.upstream).get_mut(stream) {
            upstream.applied(seq);
        }
    }

    /// After the start: a class stream sourced for the first time, recreated, under a new leader, or deleted, is a
    /// gap (recorded after the source was added, so that every event it did not bring is older than the gap).
    fn judge_upstream(
        &self,
        before: &HashMap<String, Identity>,
        now: &HashMap<String, Identity>,
        sourced_before: &HashSet<String>,
        sourced_now: &HashSet<String>,
    ) {
        let newly_sourced: Vec<&String> = sourced_now.difference(sourced_before).collect();
        let changed: Vec<&String> = now
            .iter()
            .filter(|(name, identity)| before.get(*name).is_some_and(|b| b != *identity))
            .map(|(name, _)| name)
            .collect();
        let deleted: Vec<&String> = before.keys().filter(|n| !now.contains_key(*n)).collect();
        if newly_sourced.is_empty() && changed.is_empty() && deleted.is_empty() {
            return;
        }
        tracing::warn!(
            newly_sourced = ?newly_sourced,
            recreated_or_new_leader = ?changed,
            deleted = ?deleted,
            "class streams changed upstream of the partitioned stream"
        );
        let tracker = &self.inner.tracker;
        let at = SystemTime::now() + CLOCK_SKEW_MARGIN;
        if let Some(cause) = rule::gap(Seen::Upstream { lost: true }) {
            tracker.emit(SourceEvent::Gap {
                stream: &self.partitioned_name(),
                cause,
                at: Some(at),
            });
        }
    }

    fn partitioned_name(&self) -> String {
        self.inner
            .settings
            .partitioned
            .as_ref()
            .map(|(_, stream)| stream.name.clone())
            .unwrap_or_default()
    }

    /// A class stream the partitioned stream does not source keeps the worker behind (its events reach the views
    /// only through the store) until it is sourced.
    fn track_unsourced(&self, names: &[String], sourced: &HashSet<String>) {
        let tracker = &self.inner.tracker;
        for name in names {
            let lane = Lane::Unsourced(name.clone());
            if sourced.contains(name) {
                tracker.emit(SourceEvent::Cleared(&lane));
            } else {
                tracker.emit(SourceEvent::Blocked {
                    lane: &lane,
                    why: Some("a class stream is no source of the partitioned stream: its threads are served from the store"),
                });
            }
        }
    }

    /// The partitioned stream's sources, as a check's first reading `before` found them: one not heard from for
    /// [`SOURCE_STALL`] keeps the worker behind until it is active again, has nothing left to copy and the consumer
    /// has applied what it delivered (`drained`): the events it holds back reach the stream once it recovers, but a
    /// view served meanwhile would lack them. `caught_up`: the sources a check has proved passed their class streams
    /// as far as those held when nats-server last heard from them ([`super::rule::Proved::caught_up`]).
    pub(super) fn judge_sources(
        &self,
        before: &StreamState,
        drained: bool,
        caught_up: &[(String, Stamp)],
    ) {
        let tracker = &self.inner.tracker;
        for source in &before.sources {
            let lane = Lane::Stalled(source.name.clone());
            if stalled(source) {
                tracker.emit(SourceEvent::Blocked {
                    lane: &lane,
                    why: Some("a source of the partitioned stream stalled: reads go to the store until it recovers"),
                });
            } else if source.lag == 0 && drained && tracker.coverage().catch_up().is_behind(&lane) {
                tracing::info!(source = %source.name, "a stalled source of the partitioned stream recovered");
                tracker.emit(SourceEvent::Cleared(&lane));
            }
        }
        let mut upstream = lock(&self.inner.upstream);
        for (name, contact) in caught_up {
            if let Some(class) = upstream.get_mut(name) {
                class.caught_up_at(*contact);
            }
        }
    }

    /// Binds the partitioned stream: creates it (sourcing every class stream from now) or adds the class streams it
    /// does not source yet, when allowed; checks it was made for this partition count and prefix. A class stream
    /// created after `started` that still holds its first message is sourced from it.
    async fn bind(
        &self,
        partitioning: &Partitioning,
        settings: &StreamSettings,
        class_streams: &[String],
        started: Option<SystemTime>,
        identities: &HashMap<String, Identity>,
    ) -> Result<StreamState, Unbound> {
        let api = &self.inner.api;
        let state = match api.stream_state(&settings.name).await {
            Ok(state) => state,
            Err(JsApiError::NotFound) if settings.create => {
                let sources = self
                    .sources_from_now(partitioning, class_streams, None, identities)
                    .await?;
                return match api.create_stream(settings.config(sources)).await {
                    Ok(state) => {
                        tracing::info!(stream = %settings.name, partitions = partitioning.partitions, "created the partitioned stream");
                        Ok(state)
                    }
                    // Another worker may have created it a moment before: bound next round.
                    Err(error) => Err(Unbound::Later(error.to_string())),
                };
            }
            Err(JsApiError::NotFound) => {
                return Err(Unbound::Later(
                    "it does not exist and HISTORY_VIEW_JETSTREAM_CREATE_STREAM is false".into(),
                ));
            }
            Err(error) => return Err(Unbound::Later(error.to_string())),
        };
        partitioning
            .check(&settings.name, &state.config)
            .map_err(Unbound::Refused)?;
        let sourced = source_names(&state.config);
        let missing: Vec<String> = class_streams
            .iter()
            .filter(|name| !sourced.contains(*name))
            .cloned()
            .collect();
        if missing.is_empty() || !settings.create {
            return Ok(state);
        }
        let added = self
            .sources_from_now(partitioning, &missing, started, identities)
            .await?;
        let mut config = state.config.clone();
        config.sources.get_or_insert_with(Vec::new).extend(added);
        tracing::info!(class_streams = ?missing, "adding class streams to the partitioned stream's sources");
        api.update_stream(config)
            .await
            .map_err(|e| Unbound::Later(e.to_string()))
    }

    /// Sources for `class_streams`: a class stream created after `started` (the worker's coverage began) that
    /// still holds its first message, from that message (nats-server honours a start sequence for a source that
    /// has copied nothing yet); any other from the sequence after its last one, read before the instant coverage
    /// may start from is taken (so every message stored after that instant is sourced; what it held before is a
    /// gap or older than the coverage start).
    async fn sources_from_now(
        &self,
        partitioning: &Partitioning,
        class_streams: &[String],
        started: Option<SystemTime>,
        identities: &HashMap<String, Identity>,
    ) -> Result<Vec<Source>, Unbound> {
        let mut next = Vec::with_capacity(class_streams.len());
        for name in class_streams {
            let state = self
                .inner
                .api
                .stream_state(name)
                .await
                .map_err(|e| Unbound::Later(format!("{name}: {e}")))?;
            let new_since_start = started.is_some_and(|started| {
                state.created >= started
                    && identities
                        .get(name)
                        .is_none_or(|i| i.created == state.created)
            });
            let start = if new_since_start && state.first_seq <= 1 {
                1
            } else {
                state.last_seq + 1
            };
            lock(&self.inner.upstream)
                .entry(name.clone())
                .or_insert_with(|| Upstream::starting_after(start - 1));
            next.push(start);
        }
        let now = SystemTime::now();
        Ok(class_streams
            .iter()
            .zip(next)
            .map(|(name, sequence)| partitioning.source(name, now, sequence))
            .collect())
    }

    /// Starts coverage on the partitioned stream: as for a class stream, and no earlier than the latest start of
    /// its sources (what a class stream held before its source started was never copied).
    async fn start_partitioned(&self, state: &StreamState, replay_from: SystemTime) -> bool {
        let latest_source = state
            .config
            .sources
            .iter()
            .flatten()
            .filter_map(|source| source.start_time.map(super::api::wall))
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        self.start_coverage(
            std::slice::from_ref(&state.name),
            replay_from.max(latest_source),
        )
        .await
    }
}

/// Whether nats-server has not heard from a source for [`SOURCE_STALL`].
fn stalled(source: &SourceState) -> bool {
    source.active.is_none_or(|active| active > SOURCE_STALL)
}

fn source_names(config: &Config) -> HashSet<String> {
    config
        .sources
        .iter()
        .flatten()
        .map(|source| source.name.clone())
        .collect()
}
