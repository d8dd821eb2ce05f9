//! The connection's failures: told by kind (the kinds [design 5](../../../docs/design.md#5) lists), and logged at most
//! once per interval.

use std::time::{Duration, Instant};

use async_nats::{ClientError, ConnectErrorKind, Event, ServerError};

use super::*;

#[test]
fn failures_are_told_by_kind() {
    let attempt = |kind: ConnectErrorKind| Event::ClientError(ClientError::Other(kind.to_string()));
    assert_eq!(
        failure_kind(&attempt(ConnectErrorKind::AuthorizationViolation)),
        Some("authorization_violation")
    );
    assert_eq!(failure_kind(&attempt(ConnectErrorKind::Tls)), Some("tls"));
    assert_eq!(failure_kind(&attempt(ConnectErrorKind::Io)), Some("io"));
    assert_eq!(
        failure_kind(&attempt(ConnectErrorKind::Authentication)),
        Some("authentication")
    );
    assert_eq!(
        failure_kind(&Event::ClientError(ClientError::Other(
            "something new".into()
        ))),
        Some("client_error")
    );
    // With its cause after the kind, as the vendored client sends it.
    let with_cause = |kind: ConnectErrorKind, cause: &str| {
        Event::ClientError(ClientError::Other(format!("{kind}: {cause}")))
    };
    assert_eq!(
        failure_kind(&with_cause(
            ConnectErrorKind::Tls,
            "invalid peer certificate: UnknownIssuer"
        )),
        Some("tls")
    );
    assert_eq!(
        failure_kind(&with_cause(
            ConnectErrorKind::Io,
            "Connection refused (os error 111)"
        )),
        Some("io")
    );
    assert_eq!(
        failure_kind(&Event::ServerError(ServerError::AuthorizationViolation)),
        Some("authorization_violation")
    );
    assert_eq!(failure_kind(&Event::Disconnected), Some("disconnected"));
    for event in [
        Event::Connected,
        Event::Closed,
        Event::LameDuckMode,
        Event::SlowConsumer(1),
    ] {
        assert_eq!(failure_kind(&event), None, "{event}");
    }
}

#[test]
fn each_kind_of_failure_is_logged_at_most_once_per_interval_with_the_count_it_skipped() {
    let mut log = ConnectionLog::new("nats://***@h:4222".to_owned(), None);
    let start = Instant::now();
    let at = |secs: u64| start + Duration::from_secs(secs);
    assert_eq!(log.allow("authorization_violation", at(0)), Some(0));
    // Retries every few seconds: counted, not logged.
    for secs in [2, 6, 10, 14, 18, 22, 26] {
        assert_eq!(log.allow("authorization_violation", at(secs)), None);
    }
    // Another kind has a limit of its own.
    assert_eq!(log.allow("tls", at(5)), Some(0));
    assert_eq!(log.allow("tls", at(6)), None);
    assert_eq!(log.allow("authorization_violation", at(30)), Some(7));
    assert_eq!(log.allow("authorization_violation", at(31)), None);
    assert_eq!(log.allow("authorization_violation", at(60)), Some(1));
    assert_eq!(log.allow("tls", at(35)), Some(1));
}

#[test]
fn the_kinds_given_are_the_kinds_design_5_lists() {
    // An event of every kind `failure_kind` can give.
    let attempt = |kind: ConnectErrorKind| Event::ClientError(ClientError::Other(kind.to_string()));
    let events = [
        attempt(ConnectErrorKind::AuthorizationViolation),
        attempt(ConnectErrorKind::Authentication),
        attempt(ConnectErrorKind::Tls),
        attempt(ConnectErrorKind::Io),
        attempt(ConnectErrorKind::TimedOut),
        attempt(ConnectErrorKind::Dns),
        attempt(ConnectErrorKind::ServerParse),
        attempt(ConnectErrorKind::MaxReconnects),
        Event::ClientError(ClientError::MaxReconnects),
        Event::ClientError(ClientError::Other("something new".into())),
        Event::Disconnected,
        Event::ServerError(ServerError::AuthorizationViolation),
        Event::ServerError(ServerError::Other("bad".into())),
    ];
    let given: std::collections::BTreeSet<&str> = events.iter().filter_map(failure_kind).collect();
    // The design's sentence: "`kind` (one of `a`, `b`, ...)".
    let design = include_str!("../../../docs/design.md");
    let start = design
        .find("`kind` (one of")
        .expect("design 5 lists the kinds")
        + "`kind` (one of".len();
    let list = design[start..].split(')').next().unwrap_or_default();
    let documented: std::collections::BTreeSet<&str> = list
        .split(',')
        .map(|item| item.trim().trim_matches('`'))
        .collect();
    assert_eq!(documented, given, "design 5's list of kinds");
}
