//! The partitioned source (`HISTORY_VIEW_PARTITIONS` > 1): every second, the class streams are listed, the
//! partitioned stream is bound (created, and each new class stream added to its sources, unless
//! `HISTORY_VIEW_JETSTREAM_CREATE_STREAM=false`) and checked, and what changed upstream of it is judged ([design
//! 2.1](../../docs/design.md#2.1)): a class stream sourced for the first time after the start, recreated, deleted or
//! under a new leader is a gap; one not sourced at all keeps the worker behind. The one consumer loop, on
//! `<prefix>.<k>.>`, is the class streams' ([`super::JetStreamSource::consume`]).

use std::collections::{HashMap, HashSet};
use std::time::SystemTime;

use async_nats::jetstream::stream::{Config, Info};
use tokio_util::sync::CancellationToken;

use super::{
    CLOCK_SKEW_MARGIN, DISCOVERY_INTERVAL, JetStreamSource, Start, is_not_found, leader, lock, wall,
};
use crate::partition::{Partitioning, StreamSettings};

/// The catch-up key of a class stream that matches the pattern but is no source of the partitioned stream.
fn unsourced_key(class_stream: &str) -> String {
    format!("unsourced:{class_stream}")
}

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

impl JetStreamSource {
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
        let replay_from = SystemTime::now() - self.inner.settings.replay;
        let mut started = false;
        let mut classes: HashMap<String, Identity> = HashMap::new();
        let mut sourced: HashSet<String> = HashSet::new();
        let mut warned_unbound = false;
        loop {
            if let Ok(names) = self.list_streams().await {
                let seen = self.identities(&names, &classes).await;
                match self.bind(&partitioning, &stream, &names).await {
                    Err(Unbound::Refused(reason)) => anyhow::bail!(reason),
                    Err(Unbound::Later(reason)) => {
                        if !warned_unbound {
                            tracing::warn!(stream = %stream.name, %reason, "cannot bind the partitioned stream yet; trying every second");
                            warned_unbound = true;
                        }
                    }
                    Ok(info) => {
                        warned_unbound = false;
                        let now_sourced = source_names(&info.config);
                        let start = if started {
                            self.judge_upstream(&classes, &seen, &sourced, &now_sourced);
                            // Deleted and created again (its loop recorded the gap): all of it.
                            Start::All
                        } else {
                            started = self.start_partitioned(&info, replay_from).await;
                            Start::Since(replay_from)
                        };
                        if started {
                            if lock(&self.inner.consumed).insert(stream.name.clone()) {
                                self.inner.coverage.catch_up().track(&stream.name);
                                tokio::spawn(self.clone().consume(
                                    stream.name.clone(),
                                    start,
                                    stop.clone(),
                                ));
                            }
                            self.track_unsourced(&names, &now_sourced);
                            classes = seen;
                            sourced = now_sourced;
                        }
                    }
                }
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(DISCOVERY_INTERVAL) => {}
            }
        }
    }

    /// The identity of each class stream; one whose state cannot be read this round keeps its last identity.
    async fn identities(
        &self,
        names: &[String],
        last: &HashMap<String, Identity>,
    ) -> HashMap<String, Identity> {
        let mut seen = HashMap::new();
        for name in names {
            match self.stream_info(name).await {
                Ok(info) => {
                    seen.insert(
                        name.clone(),
                        Identity {
                            created: wall(info.created),
                            leader: leader(&info),
                        },
                    );
                }
                Err(_) => {
                    if let Some(identity) = last.get(name) {
                        seen.insert(name.clone(), identity.clone());
                    }
                }
            }
        }
        seen
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
            "class streams changed upstream of the partitioned stream: a gap"
        );
        self.record_gap_at(self.inner.coverage.now().plus(CLOCK_SKEW_MARGIN));
    }

    /// A class stream the partitioned stream does not source keeps the worker behind (its events reach the views
    /// only through the store) until it is sourced.
    fn track_unsourced(&self, names: &[String], sourced: &HashSet<String>) {
        let catch_up = self.inner.coverage.catch_up();
        let mut unsourced = lock(&self.inner.unsourced);
        for name in names {
            let key = unsourced_key(name);
            if sourced.contains(name) {
                if unsourced.remove(name) {
                    catch_up.forget(&key);
                }
            } else if unsourced.insert(name.clone()) {
                tracing::warn!(class_stream = %name, "a class stream is no source of the partitioned stream: its threads are served from the store");
                catch_up.track(&key);
            }
        }
        let gone: Vec<String> = unsourced
            .iter()
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        for name in gone {
            unsourced.remove(&name);
            catch_up.forget(&unsourced_key(&name));
        }
    }

    /// Binds the partitioned stream: creates it (sourcing every class stream from now) or adds the class streams it
    /// does not source yet, when allowed; checks it was made for this partition count and prefix.
    async fn bind(
        &self,
        partitioning: &Partitioning,
        settings: &StreamSettings,
        class_streams: &[String],
    ) -> Result<Info, Unbound> {
        let context = &self.inner.context;
        let info = match context.get_stream(&settings.name).await {
            Ok(mut stream) => stream
                .info()
                .await
                .cloned()
                .map_err(|e| Unbound::Later(e.to_string()))?,
            Err(error) if is_not_found(&error) && settings.create => {
                let sources = self.sources_from_now(partitioning, class_streams).await?;
                return match context.create_stream(settings.config(sources)).await {
                    Ok(mut stream) => {
                        tracing::info!(stream = %settings.name, partitions = partitioning.partitions, "created the partitioned stream");
                        stream
                            .info()
                            .await
                            .cloned()
                            .map_err(|e| Unbound::Later(e.to_string()))
                    }
                    // Another worker may have created it a moment before: bound next round.
                    Err(error) => Err(Unbound::Later(error.to_string())),
                };
            }
            Err(error) if is_not_found(&error) => {
                return Err(Unbound::Later(
                    "it does not exist and HISTORY_VIEW_JETSTREAM_CREATE_STREAM is false".into(),
                ));
            }
            Err(error) => return Err(Unbound::Later(error.to_string())),
        };
        partitioning
            .check(&settings.name, &info.config)
            .map_err(Unbound::Refused)?;
        let sourced = source_names(&info.config);
        let missing: Vec<&String> = class_streams
            .iter()
            .filter(|name| !sourced.contains(*name))
            .collect();
        if missing.is_empty() || !settings.create {
            return Ok(info);
        }
        let missing: Vec<String> = missing.into_iter().cloned().collect();
        let added = self.sources_from_now(partitioning, &missing).await?;
        let mut config = info.config.clone();
        config.sources.get_or_insert_with(Vec::new).extend(added);
        tracing::info!(class_streams = ?missing, "adding class streams to the partitioned stream's sources");
        context
            .update_stream(config)
            .await
            .map_err(|e| Unbound::Later(e.to_string()))
    }

    /// Sources for `class_streams` from now on: each from the sequence after its last one, read before the instant
    /// coverage may start from is taken (so every message stored after that instant is sourced).
    async fn sources_from_now(
        &self,
        partitioning: &Partitioning,
        class_streams: &[String],
    ) -> Result<Vec<async_nats::jetstream::stream::Source>, Unbound> {
        let mut next = Vec::with_capacity(class_streams.len());
        for name in class_streams {
            let info = self
                .stream_info(name)
                .await
                .map_err(|e| Unbound::Later(format!("{name}: {e}")))?;
            next.push(info.state.last_sequence + 1);
        }
        let now = SystemTime::now();
        Ok(class_streams
            .iter()
            .zip(next)
            .map(|(name, next)| partitioning.source(name, now, next))
            .collect())
    }

    /// Starts coverage on the partitioned stream: as for a class stream, and no earlier than the latest start of
    /// its sources (what a class stream held before its source started was never copied).
    async fn start_partitioned(&self, info: &Info, replay_from: SystemTime) -> bool {
        let latest_source = info
            .config
            .sources
            .iter()
            .flatten()
            .filter_map(|source| source.start_time.map(wall))
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        self.start_coverage(
            std::slice::from_ref(&info.config.name),
            replay_from.max(latest_source),
        )
        .await
    }
}

fn source_names(config: &Config) -> HashSet<String> {
    config
        .sources
        .iter()
        .flatten()
        .map(|source| source.name.clone())
        .collect()
}
