//! The hot set handed over across restarts ([design 2.5](../../docs/design.md#2.5)): a worker writes the ids of
//! the threads it read most recently to a NATS key-value bucket every `HISTORY_VIEW_WARM_SNAPSHOT_SECS` and when it
//! stops; a starting worker reads them and hydrates those threads before it turns ready, so a rollout does not send
//! every active thread's next read to the store.
//!
//! This module owns the bucket and the task around it: opening (or creating) the bucket and checking the
//! permissions once, with one warning and the feature off when they are missing; the key (the partition, or one
//! shared key: pod names change at every rollout); the writes, bounded by the server's `max_payload` and warned
//! about at a limited rate when they fail; and the order of the task (read, warm up, release readiness, write
//! periodically, write once more at the stop). The format is [`snapshot`]; the hot set's choice and the warm-up's
//! hydrations are the cache's ([`crate::cache::ViewCache::hot_set`], [`warm_up`]).
//!
//! The bucket is used on a NATS connection of its own: a request NATS refuses for want of a permission is reported
//! on its connection as a server error, which on the live connection would count as a gap.

mod metrics;
mod pace;
mod settings;
pub mod snapshot;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use async_nats::jetstream::{self, ErrorCode};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use metrics::{WarmMetrics, WarmState};
pub use pace::{WarmPlan, WarmReport, warm_up};
pub use settings::WarmSettings;

use crate::cache::ViewCache;
use crate::partition::Partitioning;
use crate::readiness::Readiness;
use crate::store::StoreReads;

/// The key of the hot set when workers are not partitioned: every replica writes it, the last write wins.
pub const SHARED_KEY: &str = "all";

/// Bytes of a put besides the value that count against `max_payload`, kept free.
const PUT_OVERHEAD: usize = 1024;

/// A failed write is warned about at most this often (the first one at once).
const WRITE_WARNING_INTERVAL: Duration = Duration::from_secs(600);

/// The key of a worker's hot set: its partition's, or [`SHARED_KEY`].
pub fn key(partitioning: Option<&Partitioning>) -> String {
    partitioning.map_or_else(
        || SHARED_KEY.to_owned(),
        |p| format!("partition-{}", p.partition),
    )
}

/// How long a hot set is kept in the bucket (its `max_age`, set when the worker creates it): the longer of the
/// cache's idle time (a thread unread for longer would have left the old worker's cache too) and three snapshot
/// periods (a set must outlive the time to the next write).
pub fn max_age(settings: &WarmSettings, cache_idle: Duration) -> Duration {
    cache_idle.max(settings.snapshot * 3)
}

/// Why the bucket cannot be used; each names the permission it needs.
#[derive(Debug, thiserror::Error)]
pub enum HotSetError {
    #[error("cannot look up the bucket (stream info on KV_{bucket})")]
    Info {
        bucket: String,
        #[source]
        source: async_nats::jetstream::context::KeyValueError,
    },
    #[error("the bucket does not exist and cannot be created (stream create on KV_{bucket})")]
    Create {
        bucket: String,
        #[source]
        source: async_nats::jetstream::context::CreateKeyValueError,
    },
    #[error("cannot read key {key} (direct get on KV_{bucket})")]
    Get {
        bucket: String,
        key: String,
        #[source]
        source: kv::EntryError,
    },
    #[error("cannot write key {key} (publish on $KV.{bucket}.>)")]
    Put {
        bucket: String,
        key: String,
        #[source]
        source: kv::PutError,
    },
    #[error("the bucket did not answer within HISTORY_VIEW_WARM_MAX_SECS")]
    Timeout,
}

/// The bucket, opened, and this worker's key in it.
pub struct HotSet {
    bucket: kv::Store,
    name: String,
    key: String,
    max_threads: usize,
    /// The most bytes a value may have: the server's `max_payload` less [`PUT_OVERHEAD`].
    max_value: usize,
    /// When a failed write was last warned about.
    warned_at: std::sync::Mutex<Option<Instant>>,
}

impl HotSet {
    /// Opens the bucket (creating it if it is missing), reads this worker's key, and writes the value back, so that
    /// every permission the hand-over needs is tried once, now.
    ///
    /// # Returns
    /// The bucket and the value stored under the key, if any.
    ///
    /// # Errors
    /// [`HotSetError`] naming the step that failed.
    pub async fn open(
        client: async_nats::Client,
        settings: &WarmSettings,
        key: String,
        max_age: Duration,
    ) -> Result<(Self, Option<bytes::Bytes>), HotSetError> {
        let max_payload = client.server_info().max_payload;
        let js = jetstream::new(client);
        let name = settings.bucket.clone();
        let bucket = match js.get_key_value(name.as_str()).await {
            Ok(bucket) => bucket,
            Err(error) if bucket_missing(&error) => js
                .create_key_value(kv::Config {
                    bucket: name.clone(),
                    description:
                        "chat-history-view: the threads each worker read most recently (ids only), \
                                  for the next worker's warm-up"
                            .to_owned(),
                    history: 1,
                    max_age,
                    storage: jetstream::stream::StorageType::File,
                    ..kv::Config::default()
                })
                .await
                .map_err(|source| HotSetError::Create {
                    bucket: name.clone(),
                    source,
                })?,
            Err(source) => {
                return Err(HotSetError::Info {
                    bucket: name,
                    source,
                });
            }
        };
        let stored = bucket
            .get(key.as_str())
            .await
            .map_err(|source| HotSetError::Get {
                bucket: name.clone(),
                key: key.clone(),
                source,
            })?;
        let hot = Self {
            bucket,
            name,
            key,
            max_threads: settings.max_threads,
            max_value: max_payload.saturating_sub(PUT_OVERHEAD).max(PUT_OVERHEAD),
            warned_at: std::sync::Mutex::new(None),
        };
        // The value back as it was (or an empty set): what the next write replaces anyway.
        let value = stored.clone().unwrap_or_else(|| {
            let (empty, _) = snapshot::encode([], now_ms(), hot.max_value);
            empty.into()
        });
        hot.put(value).await?;
        Ok((hot, stored))
    }

    /// Writes the hot set of `views`, then of `inherited` those it does not hold, under this worker's key.
    ///
    /// # Returns
    /// How many thread ids it holds.
    ///
    /// # Errors
    /// [`HotSetError::Put`].
    pub async fn write<S: StoreReads>(
        &self,
        views: &ViewCache<S>,
        inherited: &[String],
    ) -> Result<usize, HotSetError> {
        let threads = views.hot_set(self.max_threads, inherited);
        let (value, kept) =
            snapshot::encode(threads.iter().map(String::as_str), now_ms(), self.max_value);
        self.put(value.into()).await?;
        Ok(kept)
    }

    async fn put(&self, value: bytes::Bytes) -> Result<(), HotSetError> {
        self.bucket
            .put(self.key.as_str(), value)
            .await
            .map(|_| ())
            .map_err(|source| HotSetError::Put {
                bucket: self.name.clone(),
                key: self.key.clone(),
                source,
            })
    }

    /// [`HotSet::write`], its failure warned about at most every [`WRITE_WARNING_INTERVAL`].
    async fn write_logged<S: StoreReads>(
        &self,
        views: &ViewCache<S>,
        inherited: &Inherited,
        why: &'static str,
    ) {
        match self.write(views, inherited.threads()).await {
            Ok(threads) => tracing::debug!(threads, why, key = %self.key, "hot set written"),
            Err(error) => {
                let now = Instant::now();
                let mut warned_at = self
                    .warned_at
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if warned_at.is_none_or(|at| now >= at + WRITE_WARNING_INTERVAL) {
                    *warned_at = Some(now);
                    tracing::warn!(error = %error, cause = %source_of(&error), bucket = %self.name, why, "cannot write the hot set; the next worker will start with an older one or none");
                }
            }
        }
    }
}

/// The hot set this worker was handed (its own threads), kept for the cache's idle time: until then the threads of it
/// that this worker holds no entry for (the warm-up was stopped or hit its deadline before them, or they were
/// evicted) are handed on after its own, so a worker stopped during its warm-up hands the same set on. After the
/// idle time the old worker's cache would have dropped them too.
struct Inherited {
    threads: Vec<String>,
    until: Instant,
}

impl Inherited {
    fn threads(&self) -> &[String] {
        if Instant::now() < self.until {
            &self.threads
        } else {
            &[]
        }
    }
}

/// What the hand-over task needs besides the cache and readiness.
pub struct Handover {
    /// The bucket's own NATS connection.
    pub client: async_nats::Client,
    pub settings: WarmSettings,
    pub partitioning: Option<Partitioning>,
    /// `HISTORY_VIEW_CACHE_IDLE_SECS`, for the bucket's `max_age`.
    pub cache_idle: Duration,
    /// The warm-up's metrics.
    pub metrics: Arc<WarmMetrics>,
}

/// The hand-over task: opens the bucket and reads the hot set, warms it up (`/readyz` waits for this, at most
/// `HISTORY_VIEW_WARM_MAX_SECS`), then writes the hot set every snapshot period and once more when `stop` is
/// cancelled (at the start of the drain: after the shutdown delay, before the drain ends). Without the bucket the
/// feature is off after one warning, and readiness is released at once.
pub async fn run<S: StoreReads>(
    handover: Handover,
    views: ViewCache<S>,
    readiness: Readiness,
    stop: CancellationToken,
) {
    let Handover {
        client,
        settings,
        partitioning,
        cache_idle,
        metrics,
    } = handover;
    let started = Instant::now();
    let deadline = started + settings.max_wait;
    let key = key(partitioning.as_ref());
    let opening = HotSet::open(
        client,
        &settings,
        key.clone(),
        max_age(&settings, cache_idle),
    );
    let opened = tokio::select! {
        biased;
        () = stop.cancelled() => {
            readiness.set_warmed();
            return;
        }
        opened = tokio::time::timeout_at(deadline, opening) => opened.unwrap_or(Err(HotSetError::Timeout)),
    };
    let (hot, stored) = match opened {
        Ok(opened) => opened,
        Err(error) => {
            tracing::warn!(error = %error, cause = %source_of(&error), bucket = %settings.bucket, key = %key, "the hot set's bucket cannot be used: no warm-up at start and no hand-over at stop (the worker starts cold); grant the permissions (the runbook, Warm restarts) or set HISTORY_VIEW_WARM_MAX_THREADS=0");
            readiness.set_warmed();
            return;
        }
    };
    let threads = stored.map_or_else(Vec::new, |value| {
        match snapshot::decode(&value, settings.max_threads) {
            Ok(snapshot) => {
                let age = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH + Duration::from_millis(snapshot.written_at_ms))
                    .unwrap_or_default();
                tracing::info!(threads = snapshot.threads.len(), skipped = snapshot.skipped, age = ?age, key = %key, "hot set read");
                snapshot.threads
            }
            Err(error) => {
                tracing::warn!(error = %error, bucket = %settings.bucket, key = %key, "the stored hot set is not used");
                Vec::new()
            }
        }
    });
    // Written for this partition; a change of the partition count moves threads elsewhere.
    let threads: Vec<String> = match &partitioning {
        Some(partitioning) => threads
            .into_iter()
            .filter(|t| partitioning.owns(t))
            .collect(),
        None => threads,
    };
    let plan = WarmPlan {
        rate: settings.rate,
        deadline,
    };
    let inherited = Inherited {
        threads: threads.clone(),
        until: started + cache_idle,
    };
    let report = tokio::select! {
        biased;
        () = stop.cancelled() => None,
        report = warm_up(&views, threads, plan, &metrics) => Some(report),
    };
    readiness.set_warmed();
    let Some(report) = report else {
        hot.write_logged(&views, &inherited, "stop").await;
        return;
    };
    tracing::info!(
        listed = report.listed,
        hydrated = report.hydrated,
        skipped = report.skipped,
        failed = report.failed,
        pending = report.pending,
        hit_max = report.hit_deadline,
        duration = ?started.elapsed(),
        "warm-up done"
    );
    loop {
        tokio::select! {
            biased;
            () = stop.cancelled() => {
                hot.write_logged(&views, &inherited, "stop").await;
                return;
            }
            () = tokio::time::sleep(settings.snapshot) => hot.write_logged(&views, &inherited, "period").await,
        }
    }
}

/// Whether looking the bucket up failed because its stream does not exist.
fn bucket_missing(error: &async_nats::jetstream::context::KeyValueError) -> bool {
    use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<GetStreamError>())
        .is_some_and(|source| {
            matches!(source.kind(), GetStreamErrorKind::JetStream(error) if error.error_code() == ErrorCode::STREAM_NOT_FOUND)
        })
}

/// The cause of `error`'s cause chain, for the log.
fn source_of(error: &HotSetError) -> String {
    let mut causes = Vec::new();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        causes.push(cause.to_string());
        source = cause.source();
    }
    causes.join(": ")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}
