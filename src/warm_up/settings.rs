//! The warm-up's settings (help heading "Warm-up"): the hot set's bucket, how often it is written, how many threads
//! it names, and how fast and for how long a starting worker hydrates them before it turns ready.

use std::time::Duration;

use crate::setting::{self, DAY, POSITIVE, Unit};

/// The warm-up and the hot set it reads, written by the worker before it.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Warm-up")]
#[deny(missing_docs)]
pub struct WarmSettings {
    /// Seconds (or a duration with a unit) between two writes of the hot set (the worker also writes it when it
    /// stops). A crash loses the threads first read since the last write; each write is one NATS key-value put of
    /// at most the server's max_payload.
    #[arg(id = "warm_snapshot_secs", value_name = "WARM_SNAPSHOT_SECS", long = "warm-snapshot-secs", env = "HISTORY_VIEW_WARM_SNAPSHOT_SECS", default_value = "60", value_parser = snapshot_period)]
    pub snapshot: Duration,

    /// Most thread ids in the hot set, the most recently read first (fewer when they do not fit the NATS server's
    /// max_payload); 0 turns the hand-over and the warm-up off.
    #[arg(id = "warm_max_threads", value_name = "WARM_MAX_THREADS", long = "warm-max-threads", env = "HISTORY_VIEW_WARM_MAX_THREADS", default_value = "10000", value_parser = max_threads)]
    pub max_threads: usize,

    /// The NATS key-value bucket of the hot set (created if missing and allowed); letters, digits, '_' and '-'.
    /// Without the permissions it needs the warm-up is off, with one warning.
    #[arg(id = "warm_bucket", value_name = "WARM_BUCKET", long = "warm-bucket", env = "HISTORY_VIEW_WARM_BUCKET", default_value = "chat_history_view_warm", value_parser = bucket)]
    pub bucket: String,

    /// Hydrations a second of the warm-up, 1 to 100000 (each is the two store queries of a read's hydration, run
    /// only while a hydration slot stays free for reads).
    #[arg(id = "warm_rate", value_name = "WARM_RATE", long = "warm-rate", env = "HISTORY_VIEW_WARM_RATE", default_value = "200", value_parser = rate)]
    pub rate: u32,

    /// Seconds (or a duration with a unit) /readyz waits at most for the warm-up; the warm-up stops then. The
    /// orchestrator's readiness timing must allow it.
    #[arg(id = "warm_max_secs", value_name = "WARM_MAX_SECS", long = "warm-max-secs", env = "HISTORY_VIEW_WARM_MAX_SECS", default_value = "60", value_parser = max_secs)]
    pub max_wait: Duration,
}

impl WarmSettings {
    /// Whether the hot set is handed over at all.
    pub fn enabled(&self) -> bool {
        self.max_threads > 0
    }
}

fn snapshot_period(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, Duration::from_secs(1), DAY)
}

fn max_secs(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, POSITIVE, Duration::from_secs(3_600))
}

/// 0 (off) to a million: a value holds at most the server's max_payload anyway (about 25,000 ids in 1 MiB).
fn max_threads(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(n) if n > 1_000_000 => Err("must be at most 1000000".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("must be a whole number: {e}")),
    }
}

fn rate(value: &str) -> Result<u32, String> {
    setting::count(value, 100_000).map(|n| n as u32)
}

/// A key-value bucket name as NATS accepts it.
fn bucket(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err("must hold only letters, digits, '_' and '-'".into());
    }
    Ok(value.to_owned())
}
