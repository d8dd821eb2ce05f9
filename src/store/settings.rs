//! The store client's settings (help heading "MongoDB"): where aihub's events are and which indexes the queries
//! name ([`StoreSettings`]). The two bounds every wing shares, the store timeout and the persister-lag bound, have a
//! home of their own (`src/bounds.rs`).

use std::path::PathBuf;

use crate::setting::{self, Secret};

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
