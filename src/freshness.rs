//! `Freshness`: the instant up to which the live source has applied every event that reached NATS, and the one rule
//! that lets an answer come from memory ([design 2.1]): **only while that instant is within the window of the read**
//! ([`Freshness::serves`]), the window being the persister-lag bound (at least 1 s, the silence bound). The same
//! instant is the `X-History-Covered-Through` of an answer from memory ([design 2.1.7]), so the serving decision and
//! the header are one quantity and cannot disagree.
//!
//! The instant is the oldest of its parts' ([`Part`]), each moved forward only by what proves it:
//! - Core NATS ([`Part::Probe`]): the worker's own round-trip probe, sent every quarter of the window; the ingest
//!   loop hands its reply over only once it has applied every display event the client received before it, and
//!   the probe's send moment becomes the part's instant. A server forwards a connection's messages in order.
//! - JetStream ([`Part::Stream`]): per consumed stream, what its checks proved applied (`source/rule.rs`,
//!   [`crate::source`]): the moment a check found the consumer drained, or the moment an earlier check read a last
//!   sequence the consumer has since applied through, or a message's stream time less the clock-skew margin.
//! - Partitioned ([`Part::Upstream`]): per class stream, what its source is known to have copied.
//! - A lane that lasts until someone acts (no stream, a class stream not sourced, a refusing stream; [`Lane`]) holds
//!   the instant at none while it lasts ([`Part::Held`]).
//!
//! Moments are [`Stamp`]s on the coverage's clock (tokio's, so paused-clock tests drive it); the header converts to
//! the wall clock. One mutex (the parts), taken alone for a few steps by the writers; readers load one atomic.
//!
//! [design 2.1]: ../docs/design.md#2.1
//! [design 2.1.7]: ../docs/design.md#2.1.7

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::catch_up::Lane;
use crate::coverage::{Coverage, Stamp};

/// What the instant is the oldest of.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Part {
    /// Core NATS: the last round-trip probe applied.
    Probe,
    /// A consumed JetStream stream.
    Stream(String),
    /// Partitioned: a class stream upstream of the partitioned stream, as far as its source copied it.
    Upstream(String),
    /// A lane that lasts until someone acts: no instant while it lasts.
    Held(Lane),
}

/// The instant shared by the sources (which move it) and the readers (which judge and report it). Cloning is cheap.
#[derive(Clone)]
pub struct Freshness {
    inner: Arc<Inner>,
}

struct Inner {
    /// The clock of the stamps.
    coverage: Coverage,
    /// How old the instant may be for an answer from memory: the persister-lag bound, at least 1 s.
    window: Duration,
    /// The oldest part's stamp in nanoseconds (0: none, or a part without an instant), kept as the parts change so
    /// that a read is one atomic load.
    covered: AtomicU64,
    parts: Mutex<HashMap<Part, u64>>,
    /// Woken whenever the instant moves.
    changed: Notify,
}

/// Milliseconds since the Unix epoch (0 for a moment before it).
pub fn millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Freshness {
    /// `window`: the silence bound, `max(HISTORY_VIEW_PERSIST_LAG_MS, 1 s)` ([`crate::source::Timing::silence`]).
    pub fn new(coverage: Coverage, window: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                coverage,
                window,
                covered: AtomicU64::new(0),
                parts: Mutex::new(HashMap::new()),
                changed: Notify::new(),
            }),
        }
    }

    /// How old the instant may be for an answer from memory.
    pub fn window(&self) -> Duration {
        self.inner.window
    }

    /// How often a source must prove its part for answers to keep coming from memory: a quarter of the window, so
    /// that a proof that needs two of them (a check's reading applied through at the next) is still within it.
    pub fn prove_every(&self) -> Duration {
        self.inner.window / 4
    }

    /// **The rule** ([design 2.1](../docs/design.md#2.1)): an answer may come from memory only if every event that
    /// reached NATS before the read less the window has been applied (or its loss recorded as a gap), that is,
    /// while the covered-through instant is at most the window old.
    pub fn serves(&self) -> bool {
        self.serves_at(self.inner.coverage.now())
    }

    fn serves_at(&self, now: Stamp) -> bool {
        self.covered_stamp()
            .is_some_and(|covered| covered.plus(self.inner.window) >= now)
    }

    /// Waits until [`Freshness::serves`], or `deadline`; returns whether it does.
    pub async fn wait(&self, deadline: Instant) -> bool {
        loop {
            let changed = self.inner.changed.notified();
            if self.serves() {
                return true;
            }
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(deadline) => return self.serves(),
            }
        }
    }

    /// `part` counts from now on, without an instant until it is covered (a stream consumed, a lane held).
    pub fn track(&self, part: Part) {
        self.update(|parts| {
            parts.entry(part).or_insert(0);
        });
    }

    /// Every event `part` holds from before `at` is applied (its instant only moves forward).
    pub fn covered(&self, part: Part, at: Stamp) {
        self.update(|parts| {
            let covered = parts.entry(part).or_insert(0);
            *covered = (*covered).max(at.nanos());
        });
    }

    /// `part` no longer counts (a stream deleted, a lane cleared).
    pub fn forget(&self, part: &Part) {
        self.update(|parts| {
            parts.remove(part);
        });
    }

    /// The instant on the coverage's clock, if every part has one.
    pub fn covered_stamp(&self) -> Option<Stamp> {
        match self.inner.covered.load(Ordering::Acquire) {
            0 => None,
            nanos => Some(Stamp::from_nanos(nanos)),
        }
    }

    /// The instant on the wall clock: the `X-History-Covered-Through` of an answer from memory.
    pub fn covered_through(&self) -> Option<SystemTime> {
        self.covered_stamp()
            .map(|stamp| self.inner.coverage.wall_of(stamp))
    }

    /// Changes the parts and keeps the oldest as the instant (under the lock, so updates land in order).
    fn update(&self, change: impl FnOnce(&mut HashMap<Part, u64>)) {
        let mut parts = self
            .inner
            .parts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        change(&mut parts);
        let oldest = parts.values().copied().min().unwrap_or(0);
        drop(parts);
        if self.inner.covered.swap(oldest, Ordering::AcqRel) != oldest {
            self.inner.changed.notify_waiters();
        }
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

    #[tokio::test(start_paused = true)]
    async fn the_instant_is_the_oldest_part_and_serves_within_the_window() {
        let coverage = Coverage::new(Duration::from_secs(2));
        let freshness = Freshness::new(coverage.clone(), Duration::from_secs(2));
        assert_eq!(freshness.covered_through(), None);
        assert!(!freshness.serves(), "nothing proved yet");
        let start = coverage.now();
        freshness.covered(Part::Probe, start);
        freshness.covered(Part::Probe, start.minus(Duration::from_secs(1)));
        assert_eq!(freshness.covered_stamp(), Some(start), "never moves back");
        assert!(freshness.serves());
        tokio::time::advance(Duration::from_millis(1_999)).await;
        assert!(freshness.serves());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!freshness.serves(), "older than the window");

        let streams = Freshness::new(coverage.clone(), Duration::from_secs(2));
        let now = coverage.now();
        streams.track(Part::Stream("a".into()));
        streams.covered(Part::Stream("b".into()), now);
        assert_eq!(streams.covered_stamp(), None, "a holds it back");
        streams.covered(Part::Stream("a".into()), now.minus(Duration::from_secs(1)));
        assert_eq!(
            streams.covered_stamp(),
            Some(now.minus(Duration::from_secs(1)))
        );
        streams.track(Part::Held(Lane::NoStream));
        assert!(!streams.serves(), "a held lane: nothing from memory");
        streams.forget(&Part::Held(Lane::NoStream));
        streams.forget(&Part::Stream("a".into()));
        assert_eq!(streams.covered_stamp(), Some(now));
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_waits_until_the_instant_enters_the_window() {
        let coverage = Coverage::new(Duration::from_secs(2));
        let freshness = Freshness::new(coverage.clone(), Duration::from_secs(2));
        let old = coverage.now();
        freshness.covered(Part::Probe, old);
        tokio::time::advance(Duration::from_secs(3)).await;
        let waiter = {
            let freshness = freshness.clone();
            tokio::spawn(async move {
                freshness
                    .wait(Instant::now() + Duration::from_secs(1))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        freshness.covered(Part::Probe, coverage.now());
        assert!(waiter.await.unwrap());
        let start = Instant::now();
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(
            !freshness
                .wait(Instant::now() + Duration::from_millis(500))
                .await
        );
        assert!(Instant::now() >= start + Duration::from_millis(3_500));
    }
}
