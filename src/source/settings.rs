//! The live source's settings: the NATS connection and subject ([`NatsSettings`], help heading "NATS") and the
//! JetStream source with its partitions ([`JetStreamArgs`], "JetStream and partitions"). Checks that need more
//! than one setting (a partition below the count, partitions only with JetStream) are in `config.rs`.

use std::path::PathBuf;
use std::time::Duration;

use crate::bounds::StoreBounds;
use crate::partition::{Partitioning, StreamSettings};
use crate::setting::{self, DAY, POSITIVE, Secret, Unit};

use super::JetStreamSettings;

/// The display-event subjects of every agent.
pub const DEFAULT_SUBJECT: &str = "agent.*.*.*.*.*.display_event.*.*";

/// Added to the persister-lag bound for the default JetStream replay window: the replay must reach back at least the
/// bound (plus the clock-skew margin) for a restarted worker's first reads to complete views.
pub const DEFAULT_REPLAY_MARGIN: Duration = Duration::from_secs(3);

/// Where live events come from (`HISTORY_VIEW_SOURCE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Source {
    /// A Core NATS subscription: nothing new to run; every disconnect is a gap.
    Core,
    /// aihub's JetStream class streams, resumed by sequence.
    #[value(name = "jetstream")]
    JetStream,
}

/// The NATS connection and what it subscribes to.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "NATS")]
#[deny(missing_docs)]
pub struct NatsSettings {
    /// NATS server URL, or several separated by commas; tls:// requires TLS. It may hold credentials
    /// (nats://user:password@host or nats://token@host), which are never printed. The settings below log in
    /// and set up TLS instead: at most one way to log in; every file is read and checked at start (rotating one
    /// takes a restart); an empty value counts as unset.
    #[arg(id = "nats_url", value_name = "NATS_URL", long = "nats-url", env = "HISTORY_VIEW_NATS_URL", default_value = "nats://127.0.0.1:4222", hide_env_values = true, value_parser = setting::secret)]
    pub url: Secret,

    /// A NATS credentials file (a user JWT and its NKey seed, as nsc writes it) to log in with. Read once at
    /// start: a new one takes a restart.
    #[arg(id = "nats_creds_file", value_name = "NATS_CREDS_FILE", long = "nats-creds-file", env = "HISTORY_VIEW_NATS_CREDS_FILE", value_parser = file)]
    pub creds_file: Option<PathBuf>,

    /// A file holding a NATS user's NKey seed (SU…) to log in with.
    #[arg(id = "nats_nkey_seed_file", value_name = "NATS_NKEY_SEED_FILE", long = "nats-nkey-seed-file", env = "HISTORY_VIEW_NATS_NKEY_SEED_FILE", value_parser = file)]
    pub nkey_seed_file: Option<PathBuf>,

    /// A file holding the token to log in to NATS with (a trailing line break is ignored).
    #[arg(id = "nats_token_file", value_name = "NATS_TOKEN_FILE", long = "nats-token-file", env = "HISTORY_VIEW_NATS_TOKEN_FILE", value_parser = file)]
    pub token_file: Option<PathBuf>,

    /// The NATS user to log in as, with the password in HISTORY_VIEW_NATS_PASSWORD_FILE.
    #[arg(
        id = "nats_user",
        value_name = "NATS_USER",
        long = "nats-user",
        env = "HISTORY_VIEW_NATS_USER"
    )]
    pub user: Option<String>,

    /// A file holding the password of HISTORY_VIEW_NATS_USER (a trailing line break is ignored).
    #[arg(id = "nats_password_file", value_name = "NATS_PASSWORD_FILE", long = "nats-password-file", env = "HISTORY_VIEW_NATS_PASSWORD_FILE", value_parser = file)]
    pub password_file: Option<PathBuf>,

    /// A PEM file of the CA certificates that verify the NATS server's certificate, instead of the system's. Any
    /// TLS setting requires TLS, whatever the URL's scheme.
    #[arg(id = "nats_tls_ca_file", value_name = "NATS_TLS_CA_FILE", long = "nats-tls-ca-file", env = "HISTORY_VIEW_NATS_TLS_CA_FILE", value_parser = file)]
    pub tls_ca_file: Option<PathBuf>,

    /// A PEM file of the client certificate (and its chain) to show a NATS server that asks for one, with its key
    /// in HISTORY_VIEW_NATS_TLS_KEY_FILE.
    #[arg(id = "nats_tls_cert_file", value_name = "NATS_TLS_CERT_FILE", long = "nats-tls-cert-file", env = "HISTORY_VIEW_NATS_TLS_CERT_FILE", value_parser = file)]
    pub tls_cert_file: Option<PathBuf>,

    /// A PEM file of the client certificate's private key.
    #[arg(id = "nats_tls_key_file", value_name = "NATS_TLS_KEY_FILE", long = "nats-tls-key-file", env = "HISTORY_VIEW_NATS_TLS_KEY_FILE", value_parser = file)]
    pub tls_key_file: Option<PathBuf>,

    /// Where live events come from: core subscribes to the subject below on Core NATS (nothing new to run; a
    /// disconnect or a restart of NATS empties what is served from memory); jetstream consumes aihub's class streams,
    /// resumed by sequence, so a reconnect keeps the views (needs JetStream and read access to those streams).
    #[arg(long, env = "HISTORY_VIEW_SOURCE", default_value = "core", value_enum)]
    pub source: Source,

    /// Subject to subscribe to for display events.
    #[arg(long, env = "HISTORY_VIEW_SUBJECT", default_value = DEFAULT_SUBJECT, value_parser = subject)]
    pub subject: String,

    /// Messages the NATS subscription buffers before the client drops them as a slow consumer (which downgrades every
    /// view).
    #[arg(id = "nats_subscription_capacity", value_name = "NATS_SUBSCRIPTION_CAPACITY", long = "nats-subscription-capacity", env = "HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY", default_value = "65536", value_parser = capacity)]
    pub subscription_capacity: usize,

    /// Seconds (or a duration with a unit) between the NATS client's pings; the client gives up on a server that
    /// leaves two pings unanswered, so a frozen server or a half-open link is noticed about three intervals after its
    /// last answer, and every view is downgraded.
    #[arg(id = "nats_ping_interval_secs", value_name = "NATS_PING_INTERVAL_SECS", long = "nats-ping-interval-secs", alias = "nats-ping-interval", env = "HISTORY_VIEW_NATS_PING_INTERVAL_SECS", default_value = "4", value_parser = ping_interval)]
    pub ping_interval: Duration,
}

impl NatsSettings {
    /// The NATS URL with any credentials replaced by `***`, for messages.
    pub fn url_for_display(&self) -> String {
        redact_userinfo(self.url.expose())
    }

    /// How long after a read a lost connection may still be noticed: two unanswered pings end it, about three
    /// intervals after the server's last word ([design 2.1.2](../../docs/design.md#2.1.2)).
    pub fn gap_window(&self) -> Duration {
        self.ping_interval * 3
    }
}

/// The JetStream source and its partitions, as given; [`JetStreamArgs::settings`] builds what the source needs.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "JetStream and partitions")]
#[deny(missing_docs)]
pub struct JetStreamArgs {
    /// The JetStream source's class streams, by name; * matches any run of characters. Streams are looked for again
    /// every second, so a new agent class is picked up.
    #[arg(id = "jetstream_streams", value_name = "JETSTREAM_STREAMS", long = "jetstream-streams", env = "HISTORY_VIEW_JETSTREAM_STREAMS", default_value = "agent_*_stream", value_parser = stream_pattern)]
    pub streams: String,

    /// Seconds (or a duration with a unit) of the class streams the JetStream source replays at start, at most a day;
    /// by default the persister-lag bound plus 3 s, the least that lets a restarted worker serve from memory as soon
    /// as it has caught up. 0: no replay.
    #[arg(id = "jetstream_replay_secs", value_name = "JETSTREAM_REPLAY_SECS", long = "jetstream-replay-secs", env = "HISTORY_VIEW_JETSTREAM_REPLAY_SECS", value_parser = replay)]
    pub replay: Option<Duration>,

    /// The JetStream source's Core witness: a Core subscription to the display-event subjects; an event no
    /// consumed stream delivered (no stream for its class, a full stream with discard new, a leader without quorum)
    /// makes its thread hydrate again. Off by default: it costs about 1.2x the worker's CPU per event (P12), and a
    /// partitioned worker would receive every event on Core.
    #[arg(id = "jetstream_witness", value_name = "JETSTREAM_WITNESS", long = "jetstream-witness", env = "HISTORY_VIEW_JETSTREAM_WITNESS", default_value = "false", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub witness: bool,

    /// Workers the threads are partitioned among (JetStream source only): each consumes its partition of one
    /// stream that sources the class streams through a subject transform, and forwards reads of other threads to
    /// their owner (HISTORY_VIEW_PEER_URL). 1: every worker holds every thread.
    #[arg(long, env = "HISTORY_VIEW_PARTITIONS", default_value = "1", value_parser = partitions)]
    pub partitions: u32,

    /// This worker's partition, 0 to HISTORY_VIEW_PARTITIONS - 1; by default (or when empty) the ordinal ending the
    /// host name (a StatefulSet pod's, `chv-2`).
    #[arg(long, env = "HISTORY_VIEW_PARTITION", value_parser = partition)]
    pub partition: Option<PartitionArg>,

    /// The partitioned stream: no subjects of its own, it sources every class stream.
    #[arg(id = "jetstream_stream", value_name = "JETSTREAM_STREAM", long = "jetstream-stream", env = "HISTORY_VIEW_JETSTREAM_STREAM", default_value = "CHAT_HISTORY_VIEW", value_parser = stream_name)]
    pub stream: String,

    /// Whether a partitioned worker creates the partitioned stream when it does not exist and adds each new class
    /// stream to its sources; false: it only binds to a stream an operator made.
    #[arg(id = "jetstream_create_stream", value_name = "JETSTREAM_CREATE_STREAM", long = "jetstream-create-stream", env = "HISTORY_VIEW_JETSTREAM_CREATE_STREAM", default_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub create_stream: bool,

    /// The first token of the partitioned stream's subjects: `<prefix>.<partition>.agent.…`.
    #[arg(id = "jetstream_subject_prefix", value_name = "JETSTREAM_SUBJECT_PREFIX", long = "jetstream-subject-prefix", env = "HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX", default_value = "chv", value_parser = token)]
    pub subject_prefix: String,

    /// Seconds (or a duration with a unit) the partitioned stream keeps an event, at most a day: it needs only the
    /// replay window of a restarting worker.
    #[arg(id = "jetstream_max_age_secs", value_name = "JETSTREAM_MAX_AGE_SECS", long = "jetstream-max-age-secs", env = "HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS", default_value = "300", value_parser = max_age)]
    pub max_age: Duration,

    /// Most bytes the partitioned stream keeps (oldest events go first), with a unit as for the cache budget;
    /// unset: no limit but the age.
    #[arg(id = "jetstream_max_bytes", value_name = "JETSTREAM_MAX_BYTES", long = "jetstream-max-bytes", env = "HISTORY_VIEW_JETSTREAM_MAX_BYTES", value_parser = setting::bytes)]
    pub max_bytes: Option<u64>,

    /// Replicas of the partitioned stream when the worker creates it, 1 to 5.
    #[arg(id = "jetstream_replicas", value_name = "JETSTREAM_REPLICAS", long = "jetstream-replicas", env = "HISTORY_VIEW_JETSTREAM_REPLICAS", default_value = "1", value_parser = replicas)]
    pub replicas: usize,

    /// Base URL of the worker owning partition {partition}, for reads of threads another worker owns (the request's
    /// path and query are appended), e.g. http://chv-{partition}.chv-headless:8080. Credentials in it
    /// (user:password@) are dropped: a forwarded request carries the caller's Authorization.
    #[arg(id = "peer_url", value_name = "PEER_URL", long = "peer-url", env = "HISTORY_VIEW_PEER_URL", value_parser = peer_url)]
    pub peer_url: Option<String>,
}

/// `HISTORY_VIEW_PARTITION` as given. clap hands an empty variable to the parser like any value, and a manifest may
/// well set it to nothing (a field reference to a label the cluster lacks), so the empty value parses to
/// `PartitionArg(None)`, which counts as unset: the host name's ordinal then decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionArg(pub Option<u32>);

impl JetStreamArgs {
    /// The partition given by the setting; `None` when it is unset or empty.
    pub fn given_partition(&self) -> Option<u32> {
        self.partition.and_then(|PartitionArg(partition)| partition)
    }

    /// The partitioning of a partitioned worker; `None` with one partition.
    pub fn partitioning(&self) -> Option<Partitioning> {
        (self.partitions > 1).then(|| Partitioning {
            partitions: self.partitions,
            partition: self.given_partition().unwrap_or(0),
            prefix: self.subject_prefix.clone(),
        })
    }

    /// What the JetStream source needs, reading `subject` and the persister-lag bound for the default replay.
    pub fn settings(&self, subject: &str, bounds: StoreBounds) -> JetStreamSettings {
        JetStreamSettings {
            streams: self.streams.clone(),
            replay: self
                .replay
                .unwrap_or(bounds.persist_lag + DEFAULT_REPLAY_MARGIN),
            subject: subject.to_owned(),
            partitioned: self.partitioning().map(|partitioning| {
                (
                    partitioning,
                    StreamSettings {
                        name: self.stream.clone(),
                        create: self.create_stream,
                        max_age: self.max_age,
                        max_bytes: self.max_bytes,
                        replicas: self.replicas,
                    },
                )
            }),
        }
    }
}

/// `scheme://user:password@host...` with the user and password replaced by `***`, in each URL of a
/// comma-separated list.
pub(crate) fn redact_userinfo(urls: &str) -> String {
    urls.split(',')
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

fn redact_one(url: &str) -> String {
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

/// A file's path; empty counts as unset, which the reader of the setting decides (a chart renders an unset value as
/// an empty string).
fn file(value: &str) -> Result<PathBuf, std::convert::Infallible> {
    Ok(PathBuf::from(value))
}

fn subject(value: &str) -> Result<String, String> {
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

fn capacity(value: &str) -> Result<usize, String> {
    setting::positive(value).and_then(|n| usize::try_from(n).map_err(|_| "is too large".to_owned()))
}

fn ping_interval(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, POSITIVE, DAY)
}

fn replay(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, Duration::ZERO, DAY)
}

fn max_age(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, POSITIVE, DAY * 365)
}

/// A stream name pattern: NATS stream name characters and `*`.
fn stream_pattern(value: &str) -> Result<String, String> {
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
fn stream_name(value: &str) -> Result<String, String> {
    if value.contains('*') {
        return Err("must be a stream name (no *)".into());
    }
    stream_pattern(value)
}

/// One subject token: no `.`, wildcards or whitespace.
fn token(value: &str) -> Result<String, String> {
    if value.is_empty()
        || value.contains(['.', '*', '>'])
        || value.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        Err("must be one subject token (no . * > or whitespace)".into())
    } else {
        Ok(value.to_owned())
    }
}

fn partitions(value: &str) -> Result<u32, String> {
    setting::count(value, 1024).map(|n| n as u32)
}

fn partition(value: &str) -> Result<PartitionArg, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(PartitionArg(None));
    }
    match value.parse::<u32>() {
        Ok(n) if n < 1024 => Ok(PartitionArg(Some(n))),
        Ok(_) => Err("must be below 1024".into()),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

fn replicas(value: &str) -> Result<usize, String> {
    match setting::positive(value)? {
        n if n > 5 => Err("must be at most 5 (JetStream's limit)".into()),
        n => Ok(n as usize),
    }
}

/// `http://host[:port][/base]` with `{partition}` somewhere in it.
fn peer_url(value: &str) -> Result<String, String> {
    if !value.contains("{partition}") {
        return Err("must contain {partition} (the owner's partition number goes there)".into());
    }
    // Never sent (hyper does not turn them into a header), and a client's debug lines would print them.
    let value = without_userinfo(value.trim());
    let example = value.replace("{partition}", "0");
    match url::Url::parse(&example) {
        Ok(url) if url.scheme() == "http" && url.host().is_some() && url.query().is_none() => {
            Ok(value.trim_end_matches('/').to_owned())
        }
        Ok(url) if url.scheme() != "http" => Err("must be an http:// URL (peers are reached inside the cluster)".into()),
        _ => Err("must be an http:// base URL without a query, e.g. http://chv-{partition}.chv-headless:8080".into()),
    }
}

/// `url` without the credentials of its authority (`scheme://user:password@host` → `scheme://host`).
fn without_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://{host}{path}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_the_peer_url_are_dropped() {
        assert_eq!(
            peer_url("http://u:pw@chv-{partition}.svc:8080/").unwrap(),
            "http://chv-{partition}.svc:8080"
        );
        assert_eq!(
            peer_url("http://tok@chv-{partition}:8080/base").unwrap(),
            "http://chv-{partition}:8080/base"
        );
        assert_eq!(
            peer_url("http://chv-{partition}:8080").unwrap(),
            "http://chv-{partition}:8080"
        );
        // An @ in the path is no credential.
        assert_eq!(
            peer_url("http://chv-{partition}:8080/a@b").unwrap(),
            "http://chv-{partition}:8080/a@b"
        );
    }

    #[test]
    fn credentials_in_the_nats_url_are_redacted_for_display() {
        assert_eq!(redact_userinfo("nats://u:pw@h:4222"), "nats://***@h:4222");
        assert_eq!(redact_userinfo("nats://h:4222"), "nats://h:4222");
        assert_eq!(redact_userinfo("tls://tok@h/x@y"), "tls://***@h/x@y");
        // Every URL of a list, not only the first.
        assert_eq!(
            redact_userinfo("nats://u:pw@a:4222,nats://u:pw@b:4222"),
            "nats://***@a:4222,nats://***@b:4222"
        );
    }
}
