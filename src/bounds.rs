//! The two bounds every wing shares, in a home of their own: how long a read may wait for the store, and how long
//! after publishing an event aihub's persister has stored it (the persister-lag bound the serving and completeness
//! rules rest on, [design 2.1](../docs/design.md#2.1)). Their settings sit under the "MongoDB" help heading.

use std::time::Duration;

use tokio::time::Instant;

use crate::setting::{self, DAY, POSITIVE, Unit};

/// The two bounds every component shares, defined once here and handed out as one `Copy` value: how long a read may
/// wait for the store (`HISTORY_VIEW_STORE_TIMEOUT_MS`), and how long after publishing an event aihub's persister has
/// stored it (`HISTORY_VIEW_PERSIST_LAG_MS`). The store client, the cache, the shadow checks, the JetStream source's
/// timing and the partition router read them from here; none keeps a copy under a name of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "MongoDB")]
#[deny(missing_docs)]
pub struct StoreBounds {
    /// Milliseconds (or a duration with a unit: 2s) a read may wait for the store, a store-read slot included,
    /// before it answers 503; each query's maxTimeMS is the time left.
    #[arg(id = "store_timeout_ms", value_name = "STORE_TIMEOUT_MS", long = "store-timeout-ms", env = "HISTORY_VIEW_STORE_TIMEOUT_MS", default_value = "2000", value_parser = store_timeout)]
    pub store_timeout: Duration,

    /// Bound, in milliseconds (or with a unit), on how long after publishing an event aihub's persister has stored
    /// it; 0 allowed, at most a day. A view is served from memory only if its store read started at least this long
    /// after the worker last could have missed one of the thread's events (start, reconnect, gap, eviction, store
    /// outage). Raise it when history_view_persister_lag_exceeded_total grows: a larger bound only delays when a
    /// view becomes complete.
    #[arg(id = "persist_lag_ms", value_name = "PERSIST_LAG_MS", long = "persist-lag-ms", env = "HISTORY_VIEW_PERSIST_LAG_MS", default_value = "2000", value_parser = persist_lag)]
    pub persist_lag: Duration,
}

impl StoreBounds {
    /// The instant a store read starting now must be answered by.
    pub fn store_deadline(&self) -> Instant {
        Instant::now() + self.store_timeout
    }
}

fn store_timeout(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Millis, POSITIVE, DAY)
}

fn persist_lag(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Millis, Duration::ZERO, DAY)
}
