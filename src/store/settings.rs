//! The store client's settings (help heading "MongoDB"): where aihub's events are and which indexes the queries
//! name ([`StoreSettings`]), and the two bounds every component shares, the store timeout and the persister-lag
//! bound ([`StoreBounds`]).

use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::setting::{self, DAY, POSITIVE, Secret, Unit};

/// The index both store stages name by default (aihub's collection has it).
pub const DEFAULT_INDEX_HINT: &str = "thread_id_1_event_type_1_event_parents_1";
/// The index a fill names by default.
pub const DEFAULT_FILL_INDEX_HINT: &str = "display_id_1";

/// What the store client is configured with.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "MongoDB")]
#[deny(missing_docs)]
pub struct StoreSettings {
    /// MongoDB connection string; may hold credentials and is never logged.
    #[arg(id = "mongodb_uri", value_name = "MONGODB_URI", long = "mongodb-uri", env = "HISTORY_VIEW_MONGODB_URI", default_value = "mongodb://127.0.0.1:27017", hide_env_values = true, value_parser = setting::secret)]
    pub uri: Secret,

    /// File holding the MongoDB connection string instead (a mounted Secret's key, so the URI is in no environment);
    /// read once at start, surrounding whitespace ignored. Setting it and HISTORY_VIEW_MONGODB_URI is an error.
    #[arg(id = "mongodb_uri_file", value_name = "MONGODB_URI_FILE", long = "mongodb-uri-file", env = "HISTORY_VIEW_MONGODB_URI_FILE", value_parser = setting::path)]
    pub uri_file: Option<PathBuf>,

    /// Database holding aihub's event collection.
    #[arg(id = "mongodb_database", value_name = "MONGODB_DATABASE", long = "mongodb-database", env = "HISTORY_VIEW_MONGODB_DATABASE", default_value = "aihub", value_parser = setting::name)]
    pub database: String,

    /// Collection of persisted agent events.
    #[arg(id = "mongodb_collection", value_name = "MONGODB_COLLECTION", long = "mongodb-collection", env = "HISTORY_VIEW_MONGODB_COLLECTION", default_value = "agent_events", value_parser = setting::name)]
    pub collection: String,

    /// Index both store stages name as a hint; empty disables the hint. A missing index slows reads down, it does not
    /// break them.
    #[arg(id = "mongodb_index_hint", value_name = "MONGODB_INDEX_HINT", long = "mongodb-index-hint", env = "HISTORY_VIEW_MONGODB_INDEX_HINT", default_value = DEFAULT_INDEX_HINT)]
    pub index_hint: String,

    /// Index a fill names as its hint; a fill reads the stored events of a display a live marker just made visible;
    /// empty disables the hint.
    #[arg(id = "mongodb_fill_index_hint", value_name = "MONGODB_FILL_INDEX_HINT", long = "mongodb-fill-index-hint", env = "HISTORY_VIEW_MONGODB_FILL_INDEX_HINT", default_value = DEFAULT_FILL_INDEX_HINT)]
    pub fill_index_hint: String,
}

impl StoreSettings {
    /// The index both hydration stages name, or `None` when disabled.
    pub fn thread_hint(&self) -> Option<&str> {
        Some(self.index_hint.trim()).filter(|h| !h.is_empty())
    }

    /// The index a fill names, or `None` when disabled.
    pub fn display_hint(&self) -> Option<&str> {
        Some(self.fill_index_hint.trim()).filter(|h| !h.is_empty())
    }

    /// Takes the URI from `HISTORY_VIEW_MONGODB_URI_FILE` when it is set, and checks it as [`Self::check_uri`] does.
    ///
    /// # Errors
    /// The file cannot be read, is empty, or holds no MongoDB URI; the message never shows the content.
    pub(crate) fn read_uri_file(&mut self) -> Result<(), String> {
        let Some(path) = &self.uri_file else {
            return Ok(());
        };
        let text = setting::read_secret_file(path)?;
        let uri = text.trim();
        if uri.is_empty() {
            return Err(format!("{} is empty", path.display()));
        }
        self.uri = Secret::new(uri);
        self.check_uri()
            .map_err(|reason| format!("the URI in {} {reason}", path.display()))
    }

    /// A seed list (`mongodb://`) or an SRV name (`mongodb+srv://`, resolved by the driver when it first connects);
    /// the rest of the syntax is the driver's to check. Checked after parsing, so that an error never echoes it.
    pub(crate) fn check_uri(&self) -> Result<(), String> {
        let value = self.uri.expose();
        if value.starts_with("mongodb://") || value.starts_with("mongodb+srv://") {
            Ok(())
        } else {
            Err("must start with mongodb:// or mongodb+srv://".into())
        }
    }
}

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
