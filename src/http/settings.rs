//! The HTTP API's settings (help heading "HTTP"): where it listens, its connection and request limits, its
//! timeouts, the delay and the drain on shutdown, the API token and the inspector page.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::ConnectionLimits;
use crate::setting::{self, DAY, POSITIVE, Secret, Unit};

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

/// The HTTP API's listeners and limits.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "HTTP")]
#[deny(missing_docs)]
pub struct HttpSettings {
    /// Address the HTTP API listens on; port 0 picks a free port.
    #[arg(long, env = "HISTORY_VIEW_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,

    /// Address of a listener of its own for the orchestrator's probes, serving /healthz, /readyz and /metrics only:
    /// clients that fill the API's connection cap cannot starve it. Unset: the probes share the API's listener
    /// (and its reserve of 16 connections).
    #[arg(
        id = "probe_listen",
        value_name = "PROBE_LISTEN",
        long = "probe-listen",
        env = "HISTORY_VIEW_PROBE_LISTEN"
    )]
    pub probe_listen: Option<SocketAddr>,

    /// HTTP connections served at once; beyond them a few more are accepted for the probes and /metrics only, and the
    /// rest are closed.
    #[arg(id = "http_max_connections", value_name = "HTTP_MAX_CONNECTIONS", long = "http-max-connections", env = "HISTORY_VIEW_HTTP_MAX_CONNECTIONS", default_value = "1024", value_parser = limit)]
    pub max_connections: usize,

    /// History reads answered at once; a read beyond it answers 503 overloaded at once.
    #[arg(id = "http_max_in_flight", value_name = "HTTP_MAX_IN_FLIGHT", long = "http-max-in-flight", env = "HISTORY_VIEW_HTTP_MAX_IN_FLIGHT", default_value = "256", value_parser = limit)]
    pub max_in_flight: usize,

    /// Reads waiting for a run (wait_for_run) at once; they take no in-flight permit (this bounds them instead), and
    /// one beyond it answers 503 overloaded at once.
    #[arg(id = "http_max_waiting", value_name = "HTTP_MAX_WAITING", long = "http-max-waiting", env = "HISTORY_VIEW_HTTP_MAX_WAITING", default_value = "1024", value_parser = limit)]
    pub max_waiting: usize,

    /// Live feeds (history/stream) open at once; each holds a connection (within HISTORY_VIEW_HTTP_MAX_CONNECTIONS)
    /// and no read permit, and one beyond it answers 503 overloaded at once.
    #[arg(id = "http_max_streams", value_name = "HTTP_MAX_STREAMS", long = "http-max-streams", env = "HISTORY_VIEW_HTTP_MAX_STREAMS", default_value = "256", value_parser = limit)]
    pub max_streams: usize,

    /// Seconds (or a duration with a unit) from a request's first byte to the end of its headers before the
    /// connection is closed.
    #[arg(id = "http_header_timeout_secs", value_name = "HTTP_HEADER_TIMEOUT_SECS", long = "http-header-timeout-secs", alias = "http-header-timeout", env = "HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS", default_value = "10", value_parser = secs)]
    pub header_timeout: Duration,

    /// Seconds (or a duration with a unit) a connection may stay open without a request before it is closed.
    #[arg(id = "http_idle_timeout_secs", value_name = "HTTP_IDLE_TIMEOUT_SECS", long = "http-idle-timeout-secs", alias = "http-idle-timeout", env = "HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS", default_value = "60", value_parser = secs)]
    pub idle_timeout: Duration,

    /// Seconds (or a duration with a unit; 0 allowed) the worker goes on serving after SIGTERM or Ctrl-C, with
    /// /readyz answering 503, before it stops accepting connections and drains: the time the orchestrator takes to
    /// take it out of its Service's endpoints, so that no client is sent to a closed port. The pod's termination
    /// grace period must exceed this delay plus HISTORY_VIEW_SHUTDOWN_DRAIN_SECS.
    #[arg(id = "shutdown_delay_secs", value_name = "SHUTDOWN_DELAY_SECS", long = "shutdown-delay-secs", env = "HISTORY_VIEW_SHUTDOWN_DELAY_SECS", default_value = "5", value_parser = delay)]
    pub shutdown_delay: Duration,

    /// Seconds (or a duration with a unit) allowed for draining in-flight requests on shutdown.
    #[arg(id = "shutdown_drain_secs", value_name = "SHUTDOWN_DRAIN_SECS", long = "shutdown-drain-secs", env = "HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", default_value = "5", value_parser = secs)]
    pub shutdown_drain: Duration,

    /// Bearer token required on /v1/* when set; never logged.
    #[arg(id = "api_token", value_name = "API_TOKEN", long = "api-token", env = "HISTORY_VIEW_API_TOKEN", hide_env_values = true, value_parser = setting::secret)]
    pub api_token: Option<Secret>,

    /// File of bearer tokens /v1/* accepts instead, one a line (blank lines and surrounding whitespace ignored; all
    /// of them are valid at once, so a rotation adds the new token, moves the clients, then removes the old one).
    /// Read again every second, by its path (a mounted Secret's update is seen): a change takes effect within
    /// seconds without a restart; a file that becomes unreadable or empty keeps the tokens read last. Setting it and
    /// HISTORY_VIEW_API_TOKEN is an error.
    #[arg(id = "api_token_file", value_name = "API_TOKEN_FILE", long = "api-token-file", env = "HISTORY_VIEW_API_TOKEN_FILE", value_parser = setting::path)]
    pub api_token_file: Option<PathBuf>,

    /// The tokens HISTORY_VIEW_API_TOKEN_FILE held at start ([`HttpSettings::read_token_file`]): the set the API
    /// starts with, before the file's watcher reads it again.
    #[arg(skip)]
    pub file_tokens: Vec<Secret>,

    /// The thread inspector page (/inspect/threads/{id}; it shows message text): auto (served unless an API token
    /// is set, because a browser's page cannot send the token without it being typed in),
    /// on, or off.
    #[arg(
        long,
        env = "HISTORY_VIEW_INSPECTOR",
        default_value = "auto",
        value_enum
    )]
    pub inspector: Inspector,
}

impl HttpSettings {
    /// The limits of the HTTP accept loop.
    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.max_connections,
            header_timeout: self.header_timeout,
            idle_timeout: self.idle_timeout,
        }
    }

    /// The tokens `/v1/*` accepts at start, or `None` when it requires none.
    pub fn tokens(&self) -> Option<Vec<Secret>> {
        match (&self.api_token, &self.api_token_file) {
            (Some(token), _) => Some(vec![token.clone()]),
            (None, Some(_)) => Some(self.file_tokens.clone()),
            (None, None) => None,
        }
    }

    /// Checks the token after parsing, so that an error never echoes it. A token with whitespace or control
    /// characters (a trailing newline from a file, say) could never be presented in an `Authorization` header as it
    /// is: refused at start rather than refusing every request. An empty one is refused too: set but empty is more
    /// likely a missing Secret than a wish to turn authentication off.
    pub(crate) fn check_token(&self) -> Result<(), String> {
        let Some(token) = &self.api_token else {
            return Ok(());
        };
        if token.expose().is_empty() {
            return Err("must not be empty when set (unset it to disable authentication)".into());
        }
        super::tokens::check(token.expose())
            .map_err(|reason| format!("{reason} (a trailing newline, for example)"))
    }

    /// Reads `HISTORY_VIEW_API_TOKEN_FILE` when it is set: its tokens become [`HttpSettings::file_tokens`].
    ///
    /// # Errors
    /// The file cannot be read, is not UTF-8, holds no token or a line that is no token; the message never shows
    /// the content.
    pub(crate) fn read_token_file(&mut self) -> Result<(), String> {
        let Some(path) = &self.api_token_file else {
            return Ok(());
        };
        let bytes = super::tokens::read_bounded(path)
            .map_err(|error| format!("cannot read {}: {error}", path.display()))?;
        self.file_tokens = super::tokens::tokens_of(&bytes)
            .map_err(|refused| format!("{}: {}", path.display(), refused.reason))?;
        Ok(())
    }
}

fn limit(value: &str) -> Result<usize, String> {
    setting::count(value, 1 << 20).map(|n| n as usize)
}

fn secs(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, POSITIVE, DAY)
}

/// The shutdown delay: 0 (stop at once, as where nothing routes by endpoints) to an hour (more is a typo: the
/// orchestrator's grace period has to cover it).
fn delay(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, Duration::ZERO, Duration::from_secs(3600))
}
