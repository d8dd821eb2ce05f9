//! `Config`: the command line, every component's settings flattened into it. Each component declares its settings
//! beside its code as a clap `Args` group with a help heading (NATS and JetStream: [`crate::source::settings`];
//! MongoDB and the shared bounds: [`crate::store::StoreSettings`], [`crate::bounds::StoreBounds`]; the cache, its
//! warm-up, the HTTP API, the shadow checks and logging beside theirs). This file only loads them: it adds the
//! environment variable to every error (clap names only the flag, and an operator sets the variable), checks the
//! secrets after parsing so that no error echoes one (and the NATS login and TLS files,
//! [`crate::source::connect`]), and checks the settings that depend on each other (the partitions).

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};

pub use crate::bounds::StoreBounds;
pub use crate::cache::{CacheSettings, DEFAULT_CACHE_MAX_BYTES};
pub use crate::http::{HttpSettings, Inspector};
pub use crate::setting::Secret;
pub use crate::shadow::ShadowSettings;
pub use crate::source::settings::{
    DEFAULT_REPLAY_MARGIN, DEFAULT_SUBJECT, JetStreamArgs, NatsSettings, Source,
};
pub use crate::store::{DEFAULT_FILL_INDEX_HINT, DEFAULT_INDEX_HINT, StoreSettings};
pub use crate::telemetry::trace::TraceSettings;
pub use crate::telemetry::{LogFormat, LogSettings};
pub use crate::warm_up::WarmSettings;

/// chat-history-view: serves aihub chat histories from a live view of NATS display events, falling back to the
/// `agent_events` collection in MongoDB. Every setting is a flag or its HISTORY_VIEW_* variable; durations take
/// a plain number in the unit their name ends with, or a unit of their own (30s, 5m, 2000ms).
#[derive(Debug, Clone, Parser)]
#[command(version)]
pub struct Config {
    #[command(flatten)]
    pub nats: NatsSettings,
    #[command(flatten)]
    pub jetstream: JetStreamArgs,
    #[command(flatten)]
    pub store: StoreSettings,
    #[command(flatten)]
    pub bounds: StoreBounds,
    #[command(flatten)]
    pub cache: CacheSettings,
    #[command(flatten)]
    pub warm: WarmSettings,
    #[command(flatten)]
    pub http: HttpSettings,
    #[command(flatten)]
    pub shadow: ShadowSettings,
    #[command(flatten)]
    pub log: LogSettings,
    #[command(flatten)]
    pub trace: TraceSettings,
}

impl Config {
    /// The configuration from the command line and the environment; a bad value exits as clap does (status 2),
    /// naming the setting.
    pub fn load() -> Self {
        Self::try_load_from(std::env::args_os()).unwrap_or_else(|error| error.exit())
    }

    /// Parses `args` (the program name first) and the environment, then checks the secret settings, whose
    /// errors name the setting but never the value, and the partitions.
    ///
    /// # Errors
    /// A value clap or a check refuses; its message names the flag and the variable.
    pub fn try_load_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Self::command()
            .try_get_matches_from(args)
            .map_err(name_the_variable)?;
        let mut config = Self::from_arg_matches(&matches)
            .map_err(|error| name_the_variable(error.format(&mut Self::command())))?;
        config.read_secret_files(&matches)?;
        if let Err((flag, reason)) = config.resolve_partition(std::env::var("HOSTNAME").ok()) {
            return Err(invalid(flag, reason));
        }
        let secrets = [
            ("nats-url", config.nats.check_url()),
            ("mongodb-uri", config.store.check_uri()),
            ("api-token", config.http.check_token()),
        ];
        for (flag, check) in secrets {
            if let Err(reason) = check {
                return Err(invalid(
                    flag,
                    format!("{reason} (the value is not shown: it may hold credentials)"),
                ));
            }
        }
        // The NATS login and TLS files, read and checked now so that a bad one stops the start (the client would
        // retry it forever); the worker reads them again when it connects.
        if let Err(error) = config.nats.check_access() {
            return Err(invalid(error.flag, error.reason));
        }
        Ok(config)
    }

    /// Takes the secrets given as files (`HISTORY_VIEW_MONGODB_URI_FILE`, `HISTORY_VIEW_API_TOKEN_FILE`) from their
    /// files. A setting and its `_FILE` twin both set is an error naming both; an empty value counts as unset (a
    /// chart renders a variable it has no value for as `""`, and clap keeps it as an empty value).
    fn read_secret_files(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        crate::setting::unset_if_empty(&mut self.store.uri_file);
        crate::setting::unset_if_empty(&mut self.http.api_token_file);
        // The URI has a default, which is no choice of the operator's.
        let uri_given = matches.value_source("mongodb_uri") != Some(ValueSource::DefaultValue)
            && !self.store.uri.expose().is_empty();
        let token_given = self
            .http
            .api_token
            .as_ref()
            .is_some_and(|token| !token.expose().is_empty());
        let twins = [
            ("mongodb-uri", uri_given, self.store.uri_file.is_some()),
            ("api-token", token_given, self.http.api_token_file.is_some()),
        ];
        for (flag, given, file_given) in twins {
            if given && file_given {
                return Err(Self::command().error(
                    ErrorKind::ArgumentConflict,
                    format!(
                        "{} and {} are both set: set one of them",
                        setting(flag),
                        setting(&format!("{flag}-file"))
                    ),
                ));
            }
        }
        if self.http.api_token_file.is_some() {
            // Empty beside its file: unset.
            self.http.api_token = None;
        }
        let files = [
            ("mongodb-uri-file", self.store.read_uri_file()),
            ("api-token-file", self.http.read_token_file()),
        ];
        for (flag, read) in files {
            if let Err(reason) = read {
                return Err(invalid(
                    flag,
                    format!("{reason} (the content is not shown: it holds credentials)"),
                ));
            }
        }
        Ok(())
    }

    /// Checks the partition settings together and takes this worker's partition from `host` (the host name) when
    /// it is not set. An error names the flag (its long name) it is about.
    fn resolve_partition(&mut self, host: Option<String>) -> Result<(), (&'static str, String)> {
        let js = &mut self.jetstream;
        if js.partitions == 1 {
            return match js.given_partition() {
                Some(p) if p > 0 => Err((
                    "partition",
                    format!("is {p}, but HISTORY_VIEW_PARTITIONS is 1"),
                )),
                _ => Ok(()),
            };
        }
        if self.nats.source != Source::JetStream {
            return Err((
                "partitions",
                "needs HISTORY_VIEW_SOURCE=jetstream (the partitions are a JetStream subject transform)".into(),
            ));
        }
        if js.peer_url.is_none() {
            return Err((
                "peer-url",
                "must be set when HISTORY_VIEW_PARTITIONS > 1 (reads of other workers' threads go there)".into(),
            ));
        }
        let partition = match js.given_partition() {
            Some(p) => p,
            None => host.as_deref().and_then(ordinal).ok_or((
                "partition",
                "is not set and the host name ends in no ordinal (-<n>, as a StatefulSet pod's)"
                    .into(),
            ))?,
        };
        if partition >= js.partitions {
            return Err((
                "partition",
                format!(
                    "is {partition}, not below HISTORY_VIEW_PARTITIONS ({})",
                    js.partitions
                ),
            ));
        }
        js.partition = Some(crate::source::settings::PartitionArg(Some(partition)));
        Ok(())
    }

    /// Whether the JetStream source keeps a Core witness.
    pub fn witness(&self) -> bool {
        self.nats.source == Source::JetStream && self.jetstream.witness
    }
}

/// A value of the setting whose long flag is `flag` that a check after parsing refused, for `reason`.
fn invalid(flag: &str, reason: impl std::fmt::Display) -> clap::Error {
    Config::command().error(
        ErrorKind::ValueValidation,
        format!("invalid value for {}: {reason}", setting(flag)),
    )
}

/// `--flag (HISTORY_VIEW_…)` for the setting whose long flag is `flag`: how every error names a setting.
fn setting(flag: &str) -> String {
    let command = Config::command();
    let env = command
        .get_arguments()
        .find(|arg| arg.get_long() == Some(flag))
        .and_then(|arg| arg.get_env())
        .map(|env| format!(" ({})", env.to_string_lossy()))
        .unwrap_or_default();
    format!("--{flag}{env}")
}

/// Adds the variable to a clap error about a value: clap names the flag (`--store-timeout-ms <STORE_TIMEOUT>`) even
/// when the value came from the environment.
fn name_the_variable(mut error: clap::Error) -> clap::Error {
    let Some(ContextValue::String(arg)) = error.get(ContextKind::InvalidArg) else {
        return error;
    };
    let Some(flag) = arg
        .split_whitespace()
        .next()
        .and_then(|flag| flag.strip_prefix("--"))
    else {
        return error;
    };
    let named = setting(flag);
    error.insert(ContextKind::InvalidArg, ContextValue::String(named));
    error
}

/// The ordinal ending a StatefulSet pod's host name (`chv-2` is 2).
fn ordinal(host: &str) -> Option<u32> {
    let (_, number) = host.rsplit_once('-')?;
    number.parse().ok()
}

#[cfg(test)]
mod tests;
