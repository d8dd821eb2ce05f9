//! `Config`: every setting, as a flag with a `HISTORY_VIEW_*` environment fallback and a documented default.
//! Values are parsed into typed values here, so a bad one stops start-up with a message naming the setting.
//! Secret settings (the Mongo URI, the API token, credentials in the NATS URL) are never printed: `--help` hides
//! their environment values, and they are checked after clap has parsed them ([`Config::try_load_from`]) so that
//! a bad one is refused by name without echoing its value.

use std::net::SocketAddr;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};

use crate::cache::CacheSettings;
use crate::http::ConnectionLimits;
use crate::partition::{Partitioning, StreamSettings};
pub use crate::setting::{Inspector, LogFormat, Secret, Source};
use crate::shadow::ShadowSettings;
use crate::source::JetStreamSettings;
use crate::store::{IndexHints, StoreSettings};

pub const DEFAULT_SUBJECT: &str = "agent.*.*.*.*.*.display_event.*.*";
pub const DEFAULT_INDEX_HINT: &str = "thread_id_1_event_type_1_event_parents_1";
pub const DEFAULT_FILL_INDEX_HINT: &str = "display_id_1";
/// Added to the persister-lag bound for the default JetStream replay window: the replay must reach back at least the
/// bound (plus the clock-skew margin) for a restarted worker's first reads to complete views.
pub const DEFAULT_REPLAY_MARGIN: Duration = Duration::from_secs(3);
/// 256 MiB: enough for tens of thousands of active threads; beyond it the least useful views are evicted (and
/// hydrated again on their next read).
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// chat-history-view: serves aihub chat histories from a live view of NATS display events, falling back to the
/// `agent_events` collection in MongoDB.
#[derive(Debug, Clone, Parser)]
#[command(version, about)]
#[deny(missing_docs)]
pub struct Config {
    /// NATS server URL; may hold credentials, which are never printed.
    #[arg(long, env = "HISTORY_VIEW_NATS_URL", default_value = "nats://127.0.0.1:4222", hide_env_values = true, value_parser = secret)]
    pub nats_url: Secret,

    /// Where live events come from: core subscribes to the subject below on Core NATS (nothing new to run; a
    /// disconnect or a restart of NATS empties what is served from memory); jetstream consumes aihub's class streams,
    /// resumed by sequence, so a reconnect keeps the views (needs JetStream and read access to those streams).
    #[arg(long, env = "HISTORY_VIEW_SOURCE", default_value = "core", value_enum)]
    pub source: Source,

    /// The JetStream source's class streams, by name; * matches any run of characters. Streams are looked for again
    /// every second, so a new agent class is picked up.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_STREAMS", default_value = "agent_*_stream", value_parser = parse_stream_pattern)]
    pub jetstream_streams: String,

    /// Seconds of the class streams the JetStream source replays at start; by default the persister-lag bound plus
    /// 3 s, the least that lets a restarted worker serve from memory as soon as it has caught up. 0: no replay.
    #[arg(long = "jetstream-replay-secs", env = "HISTORY_VIEW_JETSTREAM_REPLAY_SECS", value_parser = parse_secs_or_zero)]
    pub jetstream_replay: Option<Duration>,

    /// The JetStream source's Core witness: a Core subscription to the display-event subjects; an event no
    /// consumed stream delivered (no stream for its class, a full stream with discard new, a leader without quorum)
    /// makes its thread hydrate again. Off by default: it costs about 1.2x the worker's CPU per event (P12), and a
    /// partitioned worker would receive every event on Core.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_WITNESS", default_value = "false", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub jetstream_witness: bool,

    /// Workers the threads are partitioned among (JetStream source only): each consumes its partition of one
    /// stream that sources the class streams through a subject transform, and forwards reads of other threads to
    /// their owner (HISTORY_VIEW_PEER_URL). 1: every worker holds every thread.
    #[arg(long, env = "HISTORY_VIEW_PARTITIONS", default_value = "1", value_parser = parse_partitions)]
    pub partitions: u32,

    /// This worker's partition, 0 to HISTORY_VIEW_PARTITIONS - 1; by default the ordinal ending the host name (a
    /// StatefulSet pod's, `chv-2`).
    #[arg(long, env = "HISTORY_VIEW_PARTITION", value_parser = parse_partition)]
    pub partition: Option<u32>,

    /// The partitioned stream: no subjects of its own, it sources every class stream.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_STREAM", default_value = "CHAT_HISTORY_VIEW", value_parser = parse_stream_name)]
    pub jetstream_stream: String,

    /// Whether a partitioned worker creates the partitioned stream when it does not exist and adds each new class
    /// stream to its sources; false: it only binds to a stream an operator made.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_CREATE_STREAM", default_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub jetstream_create_stream: bool,

    /// The first token of the partitioned stream's subjects: `<prefix>.<partition>.agent.…`.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX", default_value = "chv", value_parser = parse_token)]
    pub jetstream_subject_prefix: String,

    /// Seconds the partitioned stream keeps an event (it needs only the replay window of a restarting worker).
    #[arg(long = "jetstream-max-age-secs", env = "HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS", default_value = "300", value_parser = parse_secs)]
    pub jetstream_max_age: Duration,

    /// Most bytes the partitioned stream keeps (oldest events go first), with a unit as for the cache budget;
    /// unset: no limit but the age.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_MAX_BYTES", value_parser = parse_bytes)]
    pub jetstream_max_bytes: Option<u64>,

    /// Replicas of the partitioned stream when the worker creates it.
    #[arg(long, env = "HISTORY_VIEW_JETSTREAM_REPLICAS", default_value = "1", value_parser = parse_replicas)]
    pub jetstream_replicas: usize,

    /// Base URL of the worker owning partition {partition}, for reads of threads another worker owns (the request's
    /// path and query are appended), e.g. http://chv-{partition}.chv-headless:8080.
    #[arg(long, env = "HISTORY_VIEW_PEER_URL", value_parser = parse_peer_url)]
    pub peer_url: Option<String>,

    /// Subject to subscribe to for display events.
    #[arg(long, env = "HISTORY_VIEW_SUBJECT", default_value = DEFAULT_SUBJECT, value_parser = parse_subject)]
    pub subject: String,

    /// Messages the NATS subscription buffers before the client drops them as a slow consumer (which downgrades every
    /// view).
    #[arg(long, env = "HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY", default_value = "65536", value_parser = parse_capacity)]
    pub nats_subscription_capacity: usize,

    /// Seconds between the NATS client's pings; the client gives up on a server that leaves two pings unanswered, so a
    /// frozen server or a half-open link is noticed about three intervals after its last answer, and every view is
    /// downgraded.
    #[arg(long, env = "HISTORY_VIEW_NATS_PING_INTERVAL_SECS", default_value = "4", value_parser = parse_secs)]
    pub nats_ping_interval: Duration,

    /// MongoDB connection string; may hold credentials and is never logged.
    #[arg(long, env = "HISTORY_VIEW_MONGODB_URI", default_value = "mongodb://127.0.0.1:27017", hide_env_values = true, value_parser = secret)]
    pub mongodb_uri: Secret,

    /// Database holding aihub's event collection.
    #[arg(long, env = "HISTORY_VIEW_MONGODB_DATABASE", default_value = "aihub", value_parser = parse_name)]
    pub mongodb_database: String,

    /// Collection of persisted agent events.
    #[arg(long, env = "HISTORY_VIEW_MONGODB_COLLECTION", default_value = "agent_events", value_parser = parse_name)]
    pub mongodb_collection: String,

    /// Index both store stages name as a hint; empty disables the hint. A missing index slows reads down, it does not
    /// break them.
    #[arg(long, env = "HISTORY_VIEW_MONGODB_INDEX_HINT", default_value = DEFAULT_INDEX_HINT)]
    pub mongodb_index_hint: String,

    /// Index a fill names as its hint; a fill reads the stored events of a display a live marker just made visible;
    /// empty disables the hint.
    #[arg(long, env = "HISTORY_VIEW_MONGODB_FILL_INDEX_HINT", default_value = DEFAULT_FILL_INDEX_HINT)]
    pub mongodb_fill_index_hint: String,

    /// Address the HTTP API listens on; port 0 picks a free port.
    #[arg(long, env = "HISTORY_VIEW_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,

    /// Address of a listener of its own for the orchestrator's probes, serving /healthz, /readyz and /metrics only:
    /// clients that fill the API's connection cap cannot starve it. Unset: the probes share the API's listener
    /// (and its reserve of 16 connections).
    #[arg(long, env = "HISTORY_VIEW_PROBE_LISTEN")]
    pub probe_listen: Option<SocketAddr>,

    /// Byte budget of the view cache, a plain number or with a KiB/MiB/GiB (or KB/MB/GB) suffix.
    #[arg(long, env = "HISTORY_VIEW_CACHE_MAX_BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub cache_max_bytes: u64,

    /// Seconds a thread view may go unused before it is dropped.
    #[arg(long = "cache-idle-secs", env = "HISTORY_VIEW_CACHE_IDLE_SECS", default_value = "3600", value_parser = parse_secs)]
    pub cache_idle: Duration,

    /// Milliseconds a read may wait for the store before it answers 503.
    #[arg(long = "store-timeout-ms", env = "HISTORY_VIEW_STORE_TIMEOUT_MS", default_value = "2000", value_parser = parse_millis)]
    pub store_timeout: Duration,

    /// Most store reads of whole threads (hydrations and background re-reads) at once; a read beyond it waits for one
    /// to finish within its store timeout, then answers 503. Each may hold up to a thread's events in memory. The
    /// default is the MongoDB driver's connection pool size.
    #[arg(long, env = "HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS", default_value = "10", value_parser = parse_hydrations)]
    pub max_concurrent_hydrations: usize,

    /// Most bytes of a thread's events (as held in memory, a plain number or with a unit as for the cache budget) one
    /// view or store read may hold; a read of a larger thread answers 507 thread_too_large, and a live view that grows
    /// past it leaves the cache. The default is hundreds of times a long chat.
    #[arg(long, env = "HISTORY_VIEW_MAX_THREAD_BYTES", default_value = "64MiB", value_parser = parse_thread_bytes)]
    pub max_thread_bytes: usize,

    /// Bound, in milliseconds, on how long after publishing an event aihub's persister has written it; 0 allowed. A
    /// view is served from memory only if its store read started at least this long after the worker last could have
    /// missed one of the thread's events (start, reconnect, gap, eviction, store outage). Raise it when
    /// history_view_persister_lag_exceeded_total grows; a larger bound only delays when a view becomes complete (a
    /// background re-read does it, not a reader).
    #[arg(long = "persist-lag-ms", env = "HISTORY_VIEW_PERSIST_LAG_MS", default_value = "2000", value_parser = parse_millis_or_zero)]
    pub persist_lag: Duration,

    /// The fraction of reads answered from memory (0 to 1; 0 turns it off) whose view is compared with the store
    /// once the persister-lag bound has passed since the read (a shadow check): a row the view lacks is
    /// counted, logged with metadata only, and healed (the view's next read hydrates).
    #[arg(long, env = "HISTORY_VIEW_SHADOW_SAMPLE", default_value = "0.01", value_parser = parse_fraction)]
    pub shadow_sample: f64,

    /// Most shadow checks started per second; a sampled read beyond it is dropped and counted, never queued.
    #[arg(long, env = "HISTORY_VIEW_SHADOW_MAX_PER_SEC", default_value = "5", value_parser = parse_rate)]
    pub shadow_max_per_sec: u32,

    /// Milliseconds a stored row's `_id` time (the persister host's clock, whole seconds) may be off the worker's
    /// clock: a row counts as surely stored before a read only if its `_id` time plus a second plus this margin is
    /// before the read; rows inside the band are `uncertain`, never a failure. 0 to 60000.
    #[arg(long = "shadow-clock-margin-ms", env = "HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS", default_value = "1000", value_parser = parse_margin)]
    pub shadow_clock_margin: Duration,

    /// HTTP connections served at once; beyond them a few more are accepted for the probes and /metrics only, and the
    /// rest are closed.
    #[arg(long, env = "HISTORY_VIEW_HTTP_MAX_CONNECTIONS", default_value = "1024", value_parser = parse_connections)]
    pub http_max_connections: usize,

    /// History reads answered at once; a read beyond it answers 503 overloaded at once.
    #[arg(long, env = "HISTORY_VIEW_HTTP_MAX_IN_FLIGHT", default_value = "256", value_parser = parse_connections)]
    pub http_max_in_flight: usize,

    /// Reads waiting for a run (`wait_for_run`) at once; they take no in-flight permit (this bounds them instead), and
    /// one beyond it answers 503 overloaded at once.
    #[arg(long, env = "HISTORY_VIEW_HTTP_MAX_WAITING", default_value = "1024", value_parser = parse_connections)]
    pub http_max_waiting: usize,

    /// Live feeds (`history/stream`) open at once; each holds a connection (within HISTORY_VIEW_HTTP_MAX_CONNECTIONS)
    /// and no read permit, and one beyond it answers 503 overloaded at once.
    #[arg(long, env = "HISTORY_VIEW_HTTP_MAX_STREAMS", default_value = "256", value_parser = parse_connections)]
    pub http_max_streams: usize,

    /// Seconds from a request's first byte to the end of its headers before the connection is closed.
    #[arg(long, env = "HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS", default_value = "10", value_parser = parse_secs)]
    pub http_header_timeout: Duration,

    /// Seconds a connection may stay open without a request before it is closed.
    #[arg(long, env = "HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS", default_value = "60", value_parser = parse_secs)]
    pub http_idle_timeout: Duration,

    /// Seconds allowed for draining in-flight requests on shutdown.
    #[arg(long = "shutdown-drain-secs", env = "HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", default_value = "5", value_parser = parse_secs)]
    pub shutdown_drain: Duration,

    /// Bearer token required on /v1/* when set; never logged.
    #[arg(long, env = "HISTORY_VIEW_API_TOKEN", hide_env_values = true, value_parser = secret)]
    pub api_token: Option<Secret>,

    /// The thread inspector page (/inspect/threads/{id}; it shows message text): auto (served unless
    /// HISTORY_VIEW_API_TOKEN is set, because a browser's page cannot send the token without it being typed in),
    /// on, or off.
    #[arg(
        long,
        env = "HISTORY_VIEW_INSPECTOR",
        default_value = "auto",
        value_enum
    )]
    pub inspector: Inspector,

    /// Log format: json, text, or auto (text on a terminal, json otherwise). Filtering follows RUST_LOG (default info).
    #[arg(
        long,
        env = "HISTORY_VIEW_LOG_FORMAT",
        default_value = "auto",
        value_enum
    )]
    pub log_format: LogFormat,
}

impl Config {
    /// The configuration from the command line and the environment; a bad value exits as clap does (status 2),
    /// naming the setting.
    pub fn load() -> Self {
        Self::try_load_from(std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    /// Parses `args` (the program name first) and the environment, then checks the secret settings, whose
    /// errors name the setting but never the value.
    ///
    /// # Errors
    /// A value clap or a check refuses.
    pub fn try_load_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut config = Self::try_parse_from(args)?;
        let checks = [
            (
                "--nats-url (HISTORY_VIEW_NATS_URL)",
                check_nats_url(&config.nats_url),
            ),
            (
                "--mongodb-uri (HISTORY_VIEW_MONGODB_URI)",
                check_mongodb_uri(&config.mongodb_uri),
            ),
            (
                "--api-token (HISTORY_VIEW_API_TOKEN)",
                config.api_token.as_ref().map_or(Ok(()), check_token),
            ),
        ];
        if let Err((setting, reason)) = config.resolve_partition(std::env::var("HOSTNAME").ok()) {
            return Err(Self::command().error(
                ErrorKind::ValueValidation,
                format!("invalid value for {setting}: {reason}"),
            ));
        }
        for (setting, check) in checks {
            if let Err(reason) = check {
                return Err(Self::command().error(
                    ErrorKind::ValueValidation,
                    format!("invalid value for {setting}: {reason} (the value is not shown: it may hold credentials)"),
                ));
            }
        }
        Ok(config)
    }

    /// Checks the partition settings together and takes this worker's partition from `host` (the host name) when
    /// it is not set.
    fn resolve_partition(&mut self, host: Option<String>) -> Result<(), (&'static str, String)> {
        const PARTITION: &str = "--partition (HISTORY_VIEW_PARTITION)";
        if self.partitions == 1 {
            return match self.partition {
                Some(p) if p > 0 => Err((
                    PARTITION,
                    format!("is {p}, but HISTORY_VIEW_PARTITIONS is 1"),
                )),
                _ => Ok(()),
            };
        }
        if self.source != Source::JetStream {
            return Err((
                "--partitions (HISTORY_VIEW_PARTITIONS)",
                "needs HISTORY_VIEW_SOURCE=jetstream (the partitions are a JetStream subject transform)".into(),
            ));
        }
        if self.peer_url.is_none() {
            return Err((
                "--peer-url (HISTORY_VIEW_PEER_URL)",
                "must be set when HISTORY_VIEW_PARTITIONS > 1 (reads of other workers' threads go there)".into(),
            ));
        }
        let partition = match self.partition {
            Some(p) => p,
            None => host.as_deref().and_then(ordinal).ok_or((
                PARTITION,
                "is not set and the host name ends in no ordinal (-<n>, as a StatefulSet pod's)"
                    .into(),
            ))?,
        };
        if partition >= self.partitions {
            return Err((
                PARTITION,
                format!(
                    "is {partition}, not below HISTORY_VIEW_PARTITIONS ({})",
                    self.partitions
                ),
            ));
        }
        self.partition = Some(partition);
        Ok(())
    }

    /// The partitioning of a partitioned worker; `None` with one partition.
    pub fn partitioning(&self) -> Option<Partitioning> {
        (self.partitions > 1).then(|| Partitioning {
            partitions: self.partitions,
            partition: self.partition.unwrap_or(0),
            prefix: self.jetstream_subject_prefix.clone(),
        })
    }

    /// The limits of the HTTP accept loop.
    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.http_max_connections,
            header_timeout: self.http_header_timeout,
            idle_timeout: self.http_idle_timeout,
        }
    }

    /// The NATS URL with any credentials replaced by `***`, for messages.
    pub fn nats_url_for_display(&self) -> String {
        redact_userinfo(self.nats_url.expose())
    }

    /// The configured hydration index hint, or `None` when disabled.
    pub fn index_hint(&self) -> Option<&str> {
        Some(self.mongodb_index_hint.trim()).filter(|h| !h.is_empty())
    }

    /// What the store client needs.
    pub fn store_settings(&self) -> StoreSettings {
        StoreSettings {
            database: self.mongodb_database.clone(),
            collection: self.mongodb_collection.clone(),
            hints: self.index_hints(),
            timeout: self.store_timeout,
            persist_lag: self.persist_lag,
            shadow: self.shadow_sample > 0.0,
        }
    }

    /// Whether the JetStream source keeps a Core witness.
    pub fn witness(&self) -> bool {
        self.source == Source::JetStream && self.jetstream_witness
    }

    /// What the JetStream source needs.
    pub fn jetstream_settings(&self) -> JetStreamSettings {
        JetStreamSettings {
            streams: self.jetstream_streams.clone(),
            replay: self
                .jetstream_replay
                .unwrap_or(self.persist_lag + DEFAULT_REPLAY_MARGIN),
            subject: self.subject.clone(),
            partitioned: self.partitioning().map(|partitioning| {
                (
                    partitioning,
                    StreamSettings {
                        name: self.jetstream_stream.clone(),
                        create: self.jetstream_create_stream,
                        max_age: self.jetstream_max_age,
                        max_bytes: self.jetstream_max_bytes,
                        replicas: self.jetstream_replicas,
                    },
                )
            }),
        }
    }

    /// What the shadow checks need.
    pub fn shadow_settings(&self) -> ShadowSettings {
        ShadowSettings {
            sample: self.shadow_sample,
            max_per_sec: self.shadow_max_per_sec,
            clock_margin: self.shadow_clock_margin,
            persist_lag: self.persist_lag,
            // A dead link is noticed about three ping intervals after the server's last word ([design 2.1](../docs/design.md#2.1)).
            window: self.nats_ping_interval * 3,
            store_timeout: self.store_timeout,
        }
    }

    /// What the view cache needs.
    pub fn cache_settings(&self) -> CacheSettings {
        CacheSettings {
            max_bytes: self.cache_max_bytes,
            idle: self.cache_idle,
            concurrent_hydrations: self.max_concurrent_hydrations,
            store_timeout: self.store_timeout,
            max_thread_bytes: self.max_thread_bytes,
            shadow: self.shadow_settings(),
        }
    }

    /// The hints of every store query.
    fn index_hints(&self) -> IndexHints {
        IndexHints {
            thread: self.index_hint().map(str::to_owned),
            display: Some(self.mongodb_fill_index_hint.trim())
                .filter(|h| !h.is_empty())
                .map(str::to_owned),
        }
    }
}

/// Keeps a secret setting as given; it is checked after parsing so that clap never echoes it.
fn secret(value: &str) -> Result<Secret, std::convert::Infallible> {
    Ok(Secret::new(value))
}

fn check_nats_url(url: &Secret) -> Result<(), String> {
    url.expose()
        .parse::<async_nats::ServerAddr>()
        .map(|_| ())
        .map_err(|_| "not a NATS server address (nats://host:port)".to_owned())
}

/// `scheme://user:password@host...` with the user and password replaced by `***`.
fn redact_userinfo(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest
            .split('/')
            .next()
            .and_then(|authority| authority.rfind('@'))
        {
            Some(at) => format!("{scheme}://***{}", &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

fn parse_subject(value: &str) -> Result<String, String> {
    let tokens: Vec<&str> = value.split('.').collect();
    if value.is_empty()
        || tokens
            .iter()
            .any(|t| t.is_empty() || t.contains(char::is_whitespace))
    {
        return Err(
            "must be a NATS subject: dot-separated, non-empty tokens without whitespace".into(),
        );
    }
    if tokens[0] != "agent" && tokens[0] != "*" {
        return Err("must match aihub agent subjects (agent.…)".into());
    }
    Ok(value.to_owned())
}

/// A seed list (`mongodb://`) or an SRV name (`mongodb+srv://`, resolved by the driver when it first connects, see
/// [`crate::store::Store::connect`]); the rest of the syntax is the driver's to check.
fn check_mongodb_uri(uri: &Secret) -> Result<(), String> {
    let value = uri.expose();
    if value.starts_with("mongodb://") || value.starts_with("mongodb+srv://") {
        Ok(())
    } else {
        Err("must start with mongodb:// or mongodb+srv://".into())
    }
}

/// A stream name pattern: NATS stream name characters and `*`.
fn parse_stream_pattern(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value.contains(['.', '>', ' ', '/', '\\', '\0'])
        || value.chars().any(char::is_control)
    {
        Err("must be a stream name, with * for any run of characters (no . > space / \\)".into())
    } else {
        Ok(value.to_owned())
    }
}

/// A stream name: no `.`, `*`, `>`, space, path separators or control characters.
fn parse_stream_name(value: &str) -> Result<String, String> {
    if value.contains('*') {
        return Err("must be a stream name (no *)".into());
    }
    parse_stream_pattern(value)
}

/// One subject token: no `.`, wildcards or whitespace.
fn parse_token(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value.contains(['.', '*', '>'])
        || value.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        Err("must be one subject token (no . * > or whitespace)".into())
    } else {
        Ok(value.to_owned())
    }
}

fn parse_partitions(value: &str) -> Result<u32, String> {
    match parse_positive(value)? {
        n if n > 1024 => Err("must be at most 1024".into()),
        n => Ok(n as u32),
    }
}

fn parse_partition(value: &str) -> Result<u32, String> {
    match value.trim().parse::<u32>() {
        Ok(n) if n < 1024 => Ok(n),
        Ok(_) => Err("must be below 1024".into()),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

fn parse_replicas(value: &str) -> Result<usize, String> {
    match parse_positive(value)? {
        n if n > 5 => Err("must be at most 5 (JetStream's limit)".into()),
        n => Ok(n as usize),
    }
}

/// `http://host[:port][/base]` with `{partition}` somewhere in it.
fn parse_peer_url(value: &str) -> Result<String, String> {
    if !value.contains("{partition}") {
        return Err("must contain {partition} (the owner's partition number goes there)".into());
    }
    let example = value.replace("{partition}", "0");
    match url::Url::parse(&example) {
        Ok(url) if url.scheme() == "http" && url.host().is_some() && url.query().is_none() => {
            Ok(value.trim_end_matches('/').to_owned())
        }
        Ok(url) if url.scheme() != "http" => Err("must be an http:// URL (peers are reached inside the cluster)".into()),
        _ => Err("must be an http:// base URL without a query, e.g. http://chv-{partition}.chv-headless:8080".into()),
    }
}

/// The ordinal ending a StatefulSet pod's host name (`chv-2` is 2).
fn ordinal(host: &str) -> Option<u32> {
    let (_, number) = host.rsplit_once('-')?;
    number.parse().ok()
}

fn parse_name(value: &str) -> Result<String, String> {
    if value.is_empty() || value.contains(['/', '\\', '.', ' ', '"', '$', '\0']) {
        Err("must be a non-empty name without / \\ . space \" $".into())
    } else {
        Ok(value.to_owned())
    }
}

/// A token with whitespace or control characters (a trailing newline from a file, say) could never be presented
/// in an `Authorization` header as it is: refused at start rather than refusing every request.
fn check_token(token: &Secret) -> Result<(), String> {
    let value = token.expose();
    if value.is_empty() {
        Err("must not be empty when set (unset it to disable authentication)".into())
    } else if value
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || !c.is_ascii())
    {
        Err("must be printable ASCII without whitespace (a trailing newline, for example)".into())
    } else {
        Ok(())
    }
}

fn parse_positive(value: &str) -> Result<u64, String> {
    match value.trim().parse::<u64>() {
        Ok(0) => Err("must be greater than 0".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

fn parse_capacity(value: &str) -> Result<usize, String> {
    parse_positive(value).and_then(|n| usize::try_from(n).map_err(|_| "is too large".to_owned()))
}

fn parse_hydrations(value: &str) -> Result<usize, String> {
    match parse_capacity(value)? {
        n if n > 1024 => Err("must be at most 1024".into()),
        n => Ok(n),
    }
}

/// A byte size for the per-thread limit: at least 64 KiB (less would refuse ordinary chats).
fn parse_thread_bytes(value: &str) -> Result<usize, String> {
    match parse_bytes(value)? {
        n if n < 64 << 10 => Err("must be at least 64KiB".into()),
        n => usize::try_from(n).map_err(|_| "is too large".to_owned()),
    }
}

fn parse_connections(value: &str) -> Result<usize, String> {
    match parse_capacity(value)? {
        n if n > 1 << 20 => Err("must be at most 1048576".into()),
        n => Ok(n),
    }
}

fn parse_secs(value: &str) -> Result<Duration, String> {
    parse_positive(value).map(Duration::from_secs)
}

fn parse_millis(value: &str) -> Result<Duration, String> {
    parse_positive(value).map(Duration::from_millis)
}

/// Seconds, 0 included; at most a day.
fn parse_secs_or_zero(value: &str) -> Result<Duration, String> {
    match value.trim().parse::<u64>() {
        Ok(n) if n <= 86_400 => Ok(Duration::from_secs(n)),
        Ok(_) => Err("must be at most 86400 (a day)".into()),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

/// Milliseconds, 0 included; at most a day (a larger bound is a typo, not a setting).
fn parse_millis_or_zero(value: &str) -> Result<Duration, String> {
    match value.trim().parse::<u64>() {
        Ok(n) if n <= 86_400_000 => Ok(Duration::from_millis(n)),
        Ok(_) => Err("must be at most 86400000 (a day)".into()),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

/// A fraction from 0 to 1 (a decimal number).
fn parse_fraction(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        Ok(_) => Err("must be between 0 and 1".into()),
        Err(e) => Err(format!("must be a decimal number from 0 to 1: {e}")),
    }
}

/// Checks per second: 1 to 10000.
fn parse_rate(value: &str) -> Result<u32, String> {
    match parse_positive(value)? {
        n @ 1..=10_000 => Ok(u32::try_from(n).unwrap_or(10_000)),
        _ => Err("must be at most 10000".into()),
    }
}

/// A clock margin in milliseconds: 0 to 60000.
fn parse_margin(value: &str) -> Result<Duration, String> {
    match value.trim().parse::<u64>() {
        Ok(n) if n <= 60_000 => Ok(Duration::from_millis(n)),
        Ok(_) => Err("must be at most 60000 (a minute)".into()),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

/// A byte size: digits with an optional binary (KiB, MiB, GiB) or decimal (KB, MB, GB) suffix.
pub fn parse_bytes(value: &str) -> Result<u64, String> {
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "ki" => 1 << 10,
        "mib" | "mi" => 1 << 20,
        "gib" | "gi" => 1 << 30,
        "kb" | "k" => 1_000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit `{other}` (use KiB, MiB, GiB, KB, MB or GB)"
            ));
        }
    };
    let number = parse_positive(digits)?;
    number
        .checked_mul(multiplier)
        .ok_or_else(|| "is too large".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        Config::try_load_from(std::iter::once("chat-history-view").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_match_the_documented_values() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.subject, DEFAULT_SUBJECT);
        assert_eq!(config.mongodb_collection, "agent_events");
        assert_eq!(config.index_hint(), Some(DEFAULT_INDEX_HINT));
        assert_eq!(config.cache_max_bytes, DEFAULT_CACHE_MAX_BYTES);
        assert_eq!(config.max_thread_bytes, 64 << 20);
        assert_eq!(config.store_timeout, Duration::from_millis(2000));
        assert_eq!(config.shutdown_drain, Duration::from_secs(5));
        assert_eq!(config.persist_lag, Duration::from_millis(2000));
        assert_eq!(config.nats_ping_interval, Duration::from_secs(4));
        assert_eq!(config.listen.port(), 8080);
        assert!(config.probe_listen.is_none());
        assert!(config.api_token.is_none());
        assert_eq!(config.shadow_sample, 0.01);
        assert_eq!(config.shadow_max_per_sec, 5);
        assert_eq!(config.shadow_clock_margin, Duration::from_millis(1000));
    }

    #[test]
    fn bad_values_fail_naming_the_setting() {
        for (args, setting) in [
            (&["--cache-max-bytes", "lots"][..], "--cache-max-bytes"),
            (&["--store-timeout-ms", "0"][..], "--store-timeout-ms"),
            (&["--listen", "nowhere"][..], "--listen"),
            (&["--probe-listen", "nowhere"][..], "--probe-listen"),
            (&["--mongodb-uri", "postgres://x"][..], "--mongodb-uri"),
            (&["--nats-url", "nats://a b"][..], "--nats-url"),
            (&["--log-format", "xml"][..], "--log-format"),
            (&["--shadow-sample", "1.5"][..], "--shadow-sample"),
            (&["--shadow-sample", "NaN"][..], "--shadow-sample"),
            (&["--shadow-max-per-sec", "0"][..], "--shadow-max-per-sec"),
            (
                &["--shadow-clock-margin-ms", "60001"][..],
                "--shadow-clock-margin-ms",
            ),
            (&["--subject", "agent..x"][..], "--subject"),
            (&["--persist-lag-ms=-1"][..], "--persist-lag-ms"),
            (&["--persist-lag-ms", "2s"][..], "--persist-lag-ms"),
            (&["--max-thread-bytes", "1KiB"][..], "--max-thread-bytes"),
            (&["--nats-ping-interval", "0"][..], "--nats-ping-interval"),
            (
                &["--nats-subscription-capacity", "0"][..],
                "--nats-subscription-capacity",
            ),
        ] {
            let error = parse(args).unwrap_err();
            // A refused value, not an unknown flag (whose message names the flag too).
            assert!(
                matches!(
                    error.kind(),
                    ErrorKind::ValueValidation | ErrorKind::InvalidValue
                ),
                "{error}"
            );
            assert!(error.to_string().contains(setting), "{error}");
        }
    }

    #[test]
    fn bad_secrets_fail_naming_the_setting_without_their_value() {
        for (args, setting) in [
            (
                &["--mongodb-uri", "postgres://u:hunter2@x"][..],
                "--mongodb-uri",
            ),
            (&["--nats-url", "nats://u:hunter2@a b"][..], "--nats-url"),
            (&["--api-token", "hunter2\n"][..], "--api-token"),
            (&["--api-token", "hunter2 x"][..], "--api-token"),
            (&["--api-token", ""][..], "--api-token"),
        ] {
            let message = parse(args).unwrap_err().to_string();
            assert!(message.contains(setting), "{message}");
            assert!(!message.contains("hunter2"), "{message}");
        }
    }

    #[test]
    fn credentials_in_the_nats_url_are_redacted_for_display() {
        assert_eq!(redact_userinfo("nats://u:pw@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_userinfo("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_userinfo("tls://tok@h/x@y"), "tls://***@h/x@y");
    }

    #[test]
    fn byte_sizes_accept_units() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("2 GB"), Ok(2_000_000_000));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
    }

    #[test]
    fn secrets_are_redacted_in_debug_output() {
        let config =
            parse(&["--api-token", "s3cret", "--mongodb-uri", "mongodb://u:pw@h"]).unwrap();
        let debug = format!("{config:?}");
        assert!(
            !debug.contains("s3cret") && !debug.contains("pw@h"),
            "{debug}"
        );
    }

    #[test]
    fn a_zero_persist_lag_is_allowed() {
        assert_eq!(
            parse(&["--persist-lag-ms", "0"]).unwrap().persist_lag,
            Duration::ZERO
        );
    }

    #[test]
    fn the_jetstream_source_is_opt_in_and_replays_past_the_bound_by_default() {
        let core = parse(&[]).unwrap();
        assert_eq!(core.source, Source::Core);
        let js = parse(&["--source", "jetstream", "--persist-lag-ms", "1500"]).unwrap();
        assert_eq!(js.source, Source::JetStream);
        let settings = js.jetstream_settings();
        assert_eq!(settings.replay, Duration::from_millis(4_500));
        assert_eq!(settings.streams, "agent_*_stream");
        let explicit = parse(&["--jetstream-replay-secs", "0"]).unwrap();
        assert_eq!(explicit.jetstream_settings().replay, Duration::ZERO);
    }

    #[test]
    fn bad_jetstream_settings_fail_at_start_naming_the_setting() {
        for (flag, value) in [
            ("--source", "kafka"),
            ("--jetstream-streams", "agent.*"),
            ("--jetstream-streams", ""),
            ("--jetstream-replay-secs", "86401"),
        ] {
            let error = parse(&[flag, value]).unwrap_err().to_string();
            assert!(error.contains(flag), "{flag}={value}: {error}");
        }
    }

    #[test]
    fn partitioned_workers_are_jetstream_workers_with_peers_and_a_partition() {
        let peers = [
            "--source",
            "jetstream",
            "--peer-url",
            "http://chv-{partition}.h:8080",
        ];
        let args = |extra: &[&'static str]| {
            peers
                .iter()
                .chain(["--partitions", "3"].iter())
                .chain(extra)
                .copied()
                .collect::<Vec<_>>()
        };
        let config = parse(&args(&["--partition", "2"])).unwrap();
        let partitioning = config.partitioning().unwrap();
        assert_eq!((partitioning.partitions, partitioning.partition), (3, 2));
        assert_eq!(partitioning.prefix, "chv");
        let (_, stream) = config.jetstream_settings().partitioned.unwrap();
        assert_eq!(stream.name, "CHAT_HISTORY_VIEW");
        assert_eq!(stream.max_age, Duration::from_secs(300));
        assert!(stream.create && stream.max_bytes.is_none());
        assert!(parse(&[]).unwrap().partitioning().is_none());

        // The partition from a StatefulSet pod's host name.
        let mut from_host =
            Config::try_parse_from(std::iter::once("chat-history-view").chain(args(&[]))).unwrap();
        from_host.resolve_partition(Some("chv-1".into())).unwrap();
        assert_eq!(from_host.partitioning().unwrap().partition, 1);
        let mut no_ordinal = from_host.clone();
        no_ordinal.partition = None;
        let (setting, _) = no_ordinal
            .resolve_partition(Some("worker".into()))
            .unwrap_err();
        assert!(setting.contains("HISTORY_VIEW_PARTITION"));

        for (args, setting) in [
            (args(&["--partition", "3"]), "HISTORY_VIEW_PARTITION"),
            (
                vec![
                    "--partitions",
                    "2",
                    "--partition",
                    "0",
                    "--peer-url",
                    "http://p{partition}:1",
                ],
                "HISTORY_VIEW_PARTITIONS",
            ),
            (
                vec![
                    "--source",
                    "jetstream",
                    "--partitions",
                    "2",
                    "--partition",
                    "0",
                ],
                "HISTORY_VIEW_PEER_URL",
            ),
            (vec!["--partition", "1"], "HISTORY_VIEW_PARTITION"),
            (
                vec!["--peer-url", "http://no-placeholder:8080"],
                "--peer-url",
            ),
            (
                vec!["--peer-url", "https://p{partition}:8080"],
                "--peer-url",
            ),
            (vec!["--partitions", "0"], "--partitions"),
            (
                vec!["--jetstream-subject-prefix", "a.b"],
                "--jetstream-subject-prefix",
            ),
            (vec!["--jetstream-stream", "A*"], "--jetstream-stream"),
            (vec!["--jetstream-replicas", "6"], "--jetstream-replicas"),
            (
                vec!["--jetstream-max-bytes", "lots"],
                "--jetstream-max-bytes",
            ),
        ] {
            let error = parse(&args).unwrap_err().to_string();
            assert!(error.contains(setting), "{args:?}: {error}");
        }
    }

    #[test]
    fn srv_uris_are_accepted() {
        let config = parse(&[
            "--mongodb-uri",
            "mongodb+srv://cluster.example.org/?tls=false",
        ])
        .unwrap();
        assert!(config.mongodb_uri.expose().starts_with("mongodb+srv://"));
    }

    #[test]
    fn an_empty_index_hint_disables_it() {
        assert_eq!(
            parse(&["--mongodb-index-hint", ""]).unwrap().index_hint(),
            None
        );
    }

    /// Deployments set these flags and environment variables: a rename here breaks them.
    #[test]
    fn setting_names_are_pinned() {
        let pinned = [
            ("nats-url", "HISTORY_VIEW_NATS_URL"),
            ("source", "HISTORY_VIEW_SOURCE"),
            ("jetstream-streams", "HISTORY_VIEW_JETSTREAM_STREAMS"),
            (
                "jetstream-replay-secs",
                "HISTORY_VIEW_JETSTREAM_REPLAY_SECS",
            ),
            ("jetstream-witness", "HISTORY_VIEW_JETSTREAM_WITNESS"),
            ("partitions", "HISTORY_VIEW_PARTITIONS"),
            ("partition", "HISTORY_VIEW_PARTITION"),
            ("jetstream-stream", "HISTORY_VIEW_JETSTREAM_STREAM"),
            (
                "jetstream-create-stream",
                "HISTORY_VIEW_JETSTREAM_CREATE_STREAM",
            ),
            (
                "jetstream-subject-prefix",
                "HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX",
            ),
            (
                "jetstream-max-age-secs",
                "HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS",
            ),
            ("jetstream-max-bytes", "HISTORY_VIEW_JETSTREAM_MAX_BYTES"),
            ("jetstream-replicas", "HISTORY_VIEW_JETSTREAM_REPLICAS"),
            ("peer-url", "HISTORY_VIEW_PEER_URL"),
            ("subject", "HISTORY_VIEW_SUBJECT"),
            (
                "nats-subscription-capacity",
                "HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY",
            ),
            ("nats-ping-interval", "HISTORY_VIEW_NATS_PING_INTERVAL_SECS"),
            ("mongodb-uri", "HISTORY_VIEW_MONGODB_URI"),
            ("mongodb-database", "HISTORY_VIEW_MONGODB_DATABASE"),
            ("mongodb-collection", "HISTORY_VIEW_MONGODB_COLLECTION"),
            ("mongodb-index-hint", "HISTORY_VIEW_MONGODB_INDEX_HINT"),
            (
                "mongodb-fill-index-hint",
                "HISTORY_VIEW_MONGODB_FILL_INDEX_HINT",
            ),
            ("listen", "HISTORY_VIEW_LISTEN"),
            ("probe-listen", "HISTORY_VIEW_PROBE_LISTEN"),
            ("cache-max-bytes", "HISTORY_VIEW_CACHE_MAX_BYTES"),
            ("cache-idle-secs", "HISTORY_VIEW_CACHE_IDLE_SECS"),
            ("store-timeout-ms", "HISTORY_VIEW_STORE_TIMEOUT_MS"),
            (
                "max-concurrent-hydrations",
                "HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS",
            ),
            ("max-thread-bytes", "HISTORY_VIEW_MAX_THREAD_BYTES"),
            ("persist-lag-ms", "HISTORY_VIEW_PERSIST_LAG_MS"),
            ("shadow-sample", "HISTORY_VIEW_SHADOW_SAMPLE"),
            ("shadow-max-per-sec", "HISTORY_VIEW_SHADOW_MAX_PER_SEC"),
            (
                "shadow-clock-margin-ms",
                "HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS",
            ),
            ("http-max-connections", "HISTORY_VIEW_HTTP_MAX_CONNECTIONS"),
            ("http-max-in-flight", "HISTORY_VIEW_HTTP_MAX_IN_FLIGHT"),
            ("http-max-waiting", "HISTORY_VIEW_HTTP_MAX_WAITING"),
            ("http-max-streams", "HISTORY_VIEW_HTTP_MAX_STREAMS"),
            (
                "http-header-timeout",
                "HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS",
            ),
            ("http-idle-timeout", "HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS"),
            ("shutdown-drain-secs", "HISTORY_VIEW_SHUTDOWN_DRAIN_SECS"),
            ("api-token", "HISTORY_VIEW_API_TOKEN"),
            ("inspector", "HISTORY_VIEW_INSPECTOR"),
            ("log-format", "HISTORY_VIEW_LOG_FORMAT"),
        ];
        let command = Config::command();
        let settings: Vec<(&str, String)> = command
            .get_arguments()
            .filter_map(|arg| {
                let env = arg.get_env()?.to_string_lossy().into_owned();
                Some((arg.get_long()?, env))
            })
            .collect();
        let pinned: Vec<(&str, String)> = pinned
            .iter()
            .map(|(flag, env)| (*flag, (*env).to_owned()))
            .collect();
        assert_eq!(settings, pinned);
    }
}
