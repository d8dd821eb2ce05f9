//! The NATS client, connected as [`NatsAccess`] says ([`connect`]), and how its failures are told at the default
//! level ([`ConnectionLog`]: by kind, rate-limited, naming the address and the login, never a secret).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::{ClientError, ConnectErrorKind, ConnectOptions, Event, ServerError};

use super::access::NatsAccess;
use super::settings::NatsSettings;

/// How often a connection failure of one kind is logged at most ([`ConnectionLog`]).
pub const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(30);

/// Connects to NATS as `access` says, with the settings' name, capacity and pings, retrying the first connect (a
/// NATS that comes up later is picked up; readiness reports it meanwhile). `on_event` gets every connection event.
///
/// # Errors
/// The client refuses its options (not expected: the addresses were checked).
pub async fn connect<F>(
    settings: &NatsSettings,
    access: &NatsAccess,
    on_event: F,
) -> Result<async_nats::Client, async_nats::ConnectError>
where
    F: Fn(Event) + Send + Sync + 'static,
{
    tracing::info!(
        nats_address = %access.display(),
        login = access.login_name(),
        tls = if access.requires_tls() { "required" } else { "as the URL or server asks" },
        "connecting to NATS"
    );
    let options = ConnectOptions::new()
        .name("chat-history-view")
        .retry_on_initial_connect()
        .subscription_capacity(settings.subscription_capacity)
        // The default (60 s) left a frozen server or a half-open link unnoticed for about three minutes.
        .ping_interval(settings.ping_interval)
        .event_callback(move |event| {
            on_event(event);
            std::future::ready(())
        });
    access.apply(options).connect(access.servers()).await
}

/// The kind of a connection failure, for its log line and its rate limit: one of a closed set (the client's
/// connect error kinds, and server errors); `None` for an event that is no failure.
pub fn failure_kind(event: &Event) -> Option<&'static str> {
    const CONNECT_ERRORS: [(ConnectErrorKind, &str); 8] = [
        (
            ConnectErrorKind::AuthorizationViolation,
            "authorization_violation",
        ),
        (ConnectErrorKind::Authentication, "authentication"),
        (ConnectErrorKind::Tls, "tls"),
        (ConnectErrorKind::Io, "io"),
        (ConnectErrorKind::TimedOut, "timed_out"),
        (ConnectErrorKind::Dns, "dns"),
        (ConnectErrorKind::ServerParse, "server_parse"),
        (ConnectErrorKind::MaxReconnects, "max_reconnects"),
    ];
    match event {
        Event::Disconnected => Some("disconnected"),
        // A failed connect attempt: the client sends its error as text, its kind's `Display` and, after `: `, its
        // cause (the vendored client's: vendor/async-nats/PATCH.md).
        Event::ClientError(ClientError::Other(text)) => Some(
            CONNECT_ERRORS
                .iter()
                .find(|(kind, _)| {
                    let kind = kind.to_string();
                    text.strip_prefix(kind.as_str())
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with(": "))
                })
                .map_or("client_error", |(_, name)| name),
        ),
        Event::ClientError(ClientError::MaxReconnects) => Some("max_reconnects"),
        Event::ClientError(_) => Some("client_error"),
        Event::ServerError(ServerError::AuthorizationViolation) => Some("authorization_violation"),
        Event::ServerError(_) => Some("server_error"),
        Event::Connected
        | Event::Closed
        | Event::LameDuckMode
        | Event::Draining
        | Event::SlowConsumer(_) => None,
    }
}

/// The connection events' log lines. A failure (a connect attempt that failed, a lost connection, a server error)
/// is a WARN with the server address (credentials redacted) and its kind ([`failure_kind`]); the client retries
/// without end (every few seconds), so each kind is logged at most once per [`FAILURE_LOG_INTERVAL`]: the first
/// at once, later ones with how many of that kind went unlogged since (`suppressed`).
/// `history_view_nats_connection_events_total` still counts every event. Other events are INFO lines.
#[derive(Debug)]
pub struct ConnectionLog {
    /// `--nats-url` with its credentials replaced by `***`.
    address: String,
    /// [`NatsAccess::login_identity`], named on an authorization violation.
    login: Option<String>,
    /// Per failure kind: when it was last logged, and how many of it went unlogged since.
    kinds: HashMap<&'static str, (Instant, u64)>,
}

impl ConnectionLog {
    pub fn new(address: String, login: Option<String>) -> Self {
        Self {
            address,
            login,
            kinds: HashMap::new(),
        }
    }

    /// Logs `event`, which happened at `now`; `possible_loss`: whether it means events may have been missed.
    pub fn log(&mut self, event: &Event, possible_loss: bool, now: Instant) {
        let Some(kind) = failure_kind(event) else {
            tracing::info!(nats_address = %self.address, event = %event, possible_loss, "NATS connection event");
            return;
        };
        if let Some(suppressed) = self.allow(kind, now) {
            let message = match event {
                Event::Disconnected => "the NATS connection was lost",
                Event::ServerError(_) => "NATS server error",
                _ => "cannot connect to NATS",
            };
            // The server gives no reason: a wrong login, a user revoked by its account, an account unknown to its
            // resolver or expired all read alike.
            let login = (kind == "authorization_violation")
                .then_some(self.login.as_deref())
                .flatten();
            tracing::warn!(
                nats_address = %self.address,
                kind,
                error = %event,
                login,
                possible_loss,
                suppressed,
                "{message}"
            );
        }
    }

    /// Whether a failure of `kind` at `now` is logged: `Some(n)` with the `n` of its kind not logged since the
    /// last one that was, `None` (and counted) within [`FAILURE_LOG_INTERVAL`] of that one.
    fn allow(&mut self, kind: &'static str, now: Instant) -> Option<u64> {
        match self.kinds.get_mut(kind) {
            Some((last, suppressed))
                if now.saturating_duration_since(*last) < FAILURE_LOG_INTERVAL =>
            {
                *suppressed += 1;
                None
            }
            Some((last, suppressed)) => {
                *last = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                self.kinds.insert(kind, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests;
