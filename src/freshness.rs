//! `Freshness`: the wall-clock instant up to which the live stream has delivered, and the ingest path applied,
//! every event that reached NATS (the `X-History-Covered-Through` of an answer from memory, [design 2.1.7]).
//!
//! - Core NATS: the worker's own round-trip probe (the one that confirms the subscription) is sent every
//!   [`PROBE_EVERY`]; the ingest loop takes its reply only once it has applied every display event the client
//!   received before it ([`crate::ingest::Ingest::run`]), and the probe's send time becomes the instant. A server
//!   forwards a connection's messages in order, so every event that reached it before the probe is applied.
//! - JetStream: per consumed stream, the moment a consumer was seen with nothing pending and everything delivered
//!   applied; the worker's instant is the oldest of its streams'.
//!
//! One mutex (the streams' instants), taken alone for a few steps by the writers; readers load one atomic.
//!
//! [design 2.1.7]: ../docs/design.md#2.1.7

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How often a Core NATS worker sends a freshness probe once its subscription is confirmed.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The instant shared by the ingest path (which moves it) and the readers (which report it). Cloning is cheap.
#[derive(Clone, Default)]
pub struct Freshness {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Milliseconds since the Unix epoch of the instant (0: none yet): the last probe applied (Core NATS), or the
    /// oldest of the streams' instants, kept as they change so that a read is one atomic load.
    covered: AtomicU64,
    /// Per consumed JetStream stream, milliseconds since the Unix epoch it is covered through (0: not yet).
    streams: Mutex<HashMap<String, u64>>,
}

/// Milliseconds since the Unix epoch (0 for a moment before it).
pub fn millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn moment(ms: u64) -> Option<SystemTime> {
    (ms > 0).then(|| UNIX_EPOCH + Duration::from_millis(ms))
}

impl Freshness {
    pub fn new() -> Self {
        Self::default()
    }

    /// A probe sent at `sent` came back after every event received before it was applied.
    pub fn probe_applied(&self, sent: SystemTime) {
        self.inner.covered.fetch_max(millis(sent), Ordering::AcqRel);
    }

    /// A JetStream stream is consumed from now on: it holds the instant back until it is covered.
    pub fn track_stream(&self, name: &str) {
        self.update_streams(|streams| {
            streams.entry(name.to_owned()).or_insert(0);
        });
    }

    /// Every message `name` held when asked at `at` has been applied.
    pub fn stream_covered(&self, name: &str, at: SystemTime) {
        let at = millis(at);
        self.update_streams(|streams| {
            let covered = streams.entry(name.to_owned()).or_insert(0);
            *covered = (*covered).max(at);
        });
    }

    /// The stream is no longer consumed (deleted).
    pub fn forget_stream(&self, name: &str) {
        self.update_streams(|streams| {
            streams.remove(name);
        });
    }

    /// The instant up to which every event that reached NATS is applied, if one is known.
    pub fn covered_through(&self) -> Option<SystemTime> {
        moment(self.inner.covered.load(Ordering::Acquire))
    }

    /// Changes the streams' instants and keeps the oldest as the instant (under the lock, so updates land in order).
    fn update_streams(&self, change: impl FnOnce(&mut HashMap<String, u64>)) {
        let mut streams = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        change(&mut streams);
        let oldest = streams.values().copied().min().unwrap_or(0);
        self.inner.covered.store(oldest, Ordering::Release);
    }
}

/// `at` as RFC 3339 in UTC with milliseconds (`2026-12-01T16:40:12.345Z`), the form of `X-History-Covered-Through`.
pub fn rfc3339_millis(at: SystemTime) -> String {
    let ms = millis(at);
    let (secs, ms) = (ms / 1000, ms % 1000);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(i64::try_from(days).unwrap_or(i64::MAX));
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    // In range by construction: day 1..=31, month 1..=12.
    (year, month as u32, day as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_rfc3339_with_milliseconds_in_utc() {
        assert_eq!(rfc3339_millis(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let at = UNIX_EPOCH + Duration::from_millis(1_796_143_212_345);
        assert_eq!(rfc3339_millis(at), "2026-12-01T16:40:12.345Z");
        // A leap day, and the last millisecond of a century's last day.
        let leap = UNIX_EPOCH + Duration::from_millis(951_782_400_000);
        assert_eq!(rfc3339_millis(leap), "2000-02-29T00:00:00.000Z");
        let last = UNIX_EPOCH + Duration::from_millis(4_102_444_799_999);
        assert_eq!(rfc3339_millis(last), "2099-12-31T23:59:59.999Z");
    }

    proptest::proptest! {
        /// Agrees with the `time` crate's calendar on any moment of four centuries.
        #[test]
        fn dates_agree_with_the_time_crate(ms in 0u64..12_000_000_000_000) {
            let at = UNIX_EPOCH + Duration::from_millis(ms);
            let expected = time::OffsetDateTime::from(at);
            let text = rfc3339_millis(at);
            let date = format!("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
                expected.year(), u8::from(expected.month()), expected.day(),
                expected.hour(), expected.minute(), expected.second(), expected.millisecond());
            proptest::prop_assert_eq!(text, date);
        }
    }

    #[test]
    fn the_instant_is_the_last_probe_or_the_oldest_stream() {
        let freshness = Freshness::new();
        assert_eq!(freshness.covered_through(), None);
        let t = |ms| UNIX_EPOCH + Duration::from_millis(ms);
        freshness.probe_applied(t(5_000));
        freshness.probe_applied(t(4_000));
        assert_eq!(freshness.covered_through(), Some(t(5_000)));

        let streams = Freshness::new();
        streams.track_stream("a");
        streams.stream_covered("b", t(9_000));
        assert_eq!(streams.covered_through(), None, "a holds it back");
        streams.stream_covered("a", t(7_000));
        assert_eq!(streams.covered_through(), Some(t(7_000)));
        streams.forget_stream("a");
        assert_eq!(streams.covered_through(), Some(t(9_000)));
    }
}
