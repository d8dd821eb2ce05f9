//! Value types of settings that [`crate::config`] parses and the components that use them share: a [`Secret`], the
//! [`LogFormat`] and the live [`Source`]. A leaf: it depends on nothing in the crate, so no component imports `config`.

use std::fmt;

/// How log lines are written (`HISTORY_VIEW_LOG_FORMAT`, used by [`crate::telemetry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
    Auto,
}

/// Whether the thread inspector page is served (`HISTORY_VIEW_INSPECTOR`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Inspector {
    /// Served unless an API token is set (a page behind a token needs the token typed into it).
    Auto,
    On,
    Off,
}

impl Inspector {
    /// Whether the page is served, given whether an API token is set.
    pub fn enabled(self, api_token: bool) -> bool {
        match self {
            Inspector::Auto => !api_token,
            Inspector::On => true,
            Inspector::Off => false,
        }
    }
}

/// Where live events come from (`HISTORY_VIEW_SOURCE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Source {
    /// A Core NATS subscription: nothing new to run; every disconnect is a gap.
    Core,
    /// aihub's JetStream class streams, resumed by sequence ([`crate::source`]).
    #[value(name = "jetstream")]
    JetStream,
}

/// A setting that must not appear in logs or `Debug` output (the Mongo URI, the API token, the NATS URL).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret([redacted])")
    }
}
