//! Shadow checks: what a read answered from memory held, compared with what the store holds once the persister
//! had its chance ([design 2.1], "The promise, measured"). This file is the pure part: the [`Snapshot`] a sampled
//! read records, the row-by-row [`compare`], and the [`Sampler`] that admits samples (a fraction, a rate limit, one
//! check per thread). The cache runs the checks and heals ([`crate::cache`]).
//!
//! One mutex (the sampler's bucket and the threads being checked), taken alone for a few steps.
//!
//! [design 2.1]: ../docs/design.md#2.1

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, DefaultHasher, Hash, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::time::Instant;

use crate::decode::ViewEvent;
use crate::freshness::millis;
use crate::subject::DeliveryKey;

/// What the shadow checks are configured with (help heading "Shadow checks"). A check runs the persister-lag bound
/// after its read and its store query is bounded by the store timeout ([`crate::bounds::Bounds`]).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Shadow checks")]
#[deny(missing_docs)]
pub struct ShadowSettings {
    /// The fraction of reads answered from memory (0 to 1; 0 turns it off) whose view is compared with the store
    /// once the persister-lag bound has passed since the read (a shadow check): a row the view lacks is
    /// counted, logged with metadata only, and healed (the view's next read hydrates).
    #[arg(id = "shadow_sample", value_name = "SHADOW_SAMPLE", long = "shadow-sample", env = "HISTORY_VIEW_SHADOW_SAMPLE", default_value = "0.01", value_parser = fraction)]
    pub sample: f64,

    /// Most shadow checks started per second, 1 to 10000; a sampled read beyond it is dropped and counted, never
    /// queued. Verify requests have a budget of their own at the same rate (beyond it 429, counted refused).
    #[arg(id = "shadow_max_per_sec", value_name = "SHADOW_MAX_PER_SEC", long = "shadow-max-per-sec", env = "HISTORY_VIEW_SHADOW_MAX_PER_SEC", default_value = "5", value_parser = rate)]
    pub max_per_sec: u32,

    /// Milliseconds (or a duration with a unit) a stored row's _id time (the persister host's clock, whole seconds)
    /// may be off the worker's clock: a row counts as surely stored before a read only if its _id time plus a second
    /// plus this margin is before the read; rows inside the band are uncertain, never a failure. 0 to 60000.
    #[arg(id = "shadow_clock_margin_ms", value_name = "SHADOW_CLOCK_MARGIN_MS", long = "shadow-clock-margin-ms", env = "HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS", default_value = "1000", value_parser = clock_margin)]
    pub clock_margin: Duration,
}

/// A fraction from 0 to 1 (a decimal number).
fn fraction(value: &str) -> Result<f64, String> {
    match value.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        Ok(_) => Err("must be between 0 and 1".into()),
        Err(e) => Err(format!("must be a decimal number from 0 to 1: {e}")),
    }
}

/// Checks per second: 1 to 10000.
fn rate(value: &str) -> Result<u32, String> {
    crate::setting::count(value, 10_000).map(|n| n as u32)
}

/// A clock margin: 0 to a minute.
fn clock_margin(value: &str) -> Result<Duration, String> {
    use crate::setting::{Unit, duration};
    duration(value, Unit::Millis, Duration::ZERO, Duration::from_secs(60))
}

impl ShadowSettings {
    pub fn enabled(&self) -> bool {
        self.sample > 0.0
    }
}

/// What one stored row or one held event was found to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finding {
    /// In the view and in the store, decoded alike.
    Match,
    /// In the view, not (yet) stored: normal.
    Ahead,
    /// Not in the view, stored about when the read happened (the clocks cannot tell before or after).
    Uncertain,
    /// In the view, arrived more than the bound (+ margin) before the read (or read from the store), and not
    /// stored: the store had it, as far as the bound goes, and no longer has it (the thread or the event was deleted), or the persister broke
    /// the bound. Not a broken promise (the view holds more, not less), but the view is made partial, so its next
    /// read hydrates and leaves it out ([design 2.1.8](../docs/design.md#2.1.8)).
    Orphaned,
    /// Not in the view, and persisted more than the bound after it was published (stored after the read, or before
    /// it but that late): the persister broke the bound and the live path did not deliver it.
    Late,
    /// The same delivery key decoded differently live and from the store.
    Differs,
    /// Not in the view, surely stored before the read, and persisted within the bound: a broken promise.
    Missing,
}

impl Finding {
    pub const ALL: [Finding; 7] = [
        Finding::Match,
        Finding::Ahead,
        Finding::Uncertain,
        Finding::Orphaned,
        Finding::Late,
        Finding::Differs,
        Finding::Missing,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Finding::Match => "match",
            Finding::Ahead => "ahead",
            Finding::Uncertain => "uncertain",
            Finding::Orphaned => "orphaned",
            Finding::Late => "late",
            Finding::Differs => "differs",
            Finding::Missing => "missing",
        }
    }

    /// Whether it means the view answered without something it should have held (and is healed).
    pub fn is_failure(self) -> bool {
        matches!(self, Finding::Late | Finding::Differs | Finding::Missing)
    }
}

/// What a whole check came to (the `result` label of `history_view_shadow_checks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every event compared matched.
    Match,
    /// Nothing failed; some held events are not stored yet.
    Ahead,
    /// Nothing failed; some rows were stored about when the read happened.
    Uncertain,
    /// Nothing failed, but the view held events the store no longer has ([`Finding::Orphaned`]): healed.
    Orphaned,
    /// Something failed, but a gap was noticed within the window after the read: the persister-lag rule does not promise it ([design
    /// 2.1.6](../docs/design.md#2.1.6)).
    Window,
    Late,
    Differs,
    Missing,
    /// A sample beyond the rate limit, or for a thread already being checked: not checked.
    Dropped,
    /// The store did not answer the check's query.
    Error,
    /// `verify` of a view that is not complete: nothing it holds was promised, so it is not compared (no store
    /// query) and never a failure.
    NotComplete,
    /// `verify` beyond its own budget (`HISTORY_VIEW_SHADOW_MAX_PER_SEC` a second), or of a thread being verified:
    /// refused with 429, not compared.
    Refused,
}

impl Verdict {
    pub const ALL: [Verdict; 12] = [
        Verdict::Match,
        Verdict::Ahead,
        Verdict::Uncertain,
        Verdict::Orphaned,
        Verdict::Window,
        Verdict::Late,
        Verdict::Differs,
        Verdict::Missing,
        Verdict::Dropped,
        Verdict::Error,
        Verdict::NotComplete,
        Verdict::Refused,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Verdict::Match => "match",
            Verdict::Ahead => "ahead",
            Verdict::Uncertain => "uncertain",
            Verdict::Orphaned => "orphaned",
            Verdict::Window => "window",
            Verdict::Late => "late",
            Verdict::Differs => "differs",
            Verdict::Missing => "missing",
            Verdict::Dropped => "dropped",
            Verdict::Error => "error",
            Verdict::NotComplete => "not_complete",
            Verdict::Refused => "refused",
        }
    }

    pub fn is_failure(self) -> bool {
        matches!(self, Verdict::Late | Verdict::Differs | Verdict::Missing)
    }

    /// Whether the view is healed (made partial): a failure, or events the store no longer has.
    pub fn heals(self) -> bool {
        self.is_failure() || self == Verdict::Orphaned
    }
}

/// The key hasher of snapshots: keyed per process, like the view's index.
static KEY_HASHER: LazyLock<RandomState> = LazyLock::new(RandomState::new);

fn key_hash(key: &DeliveryKey) -> u64 {
    KEY_HASHER.hash_one(key)
}

/// A digest of what an event decoded to (its `created_at` and body, not its key).
pub fn digest(event: &ViewEvent) -> u64 {
    let mut hasher = DefaultHasher::new();
    event.created_at.hash(&mut hasher);
    event.body.hash(&mut hasher);
    hasher.finish()
}

/// What a read answered from: the displays it counted as visible, and the key and digest of every event the view
/// held on them (16 bytes an event).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub thread_id: Box<str>,
    /// The read's moment on the wall clock (compared with the rows' `_id` and `created_at`).
    pub read_at: SystemTime,
    /// The instant the answer said it covered (`X-History-Covered-Through`), if any: an event that reached NATS
    /// after it may rightly be missing from the answer (still queued for the ingest loop at the read).
    pub covered_through: Option<SystemTime>,
    /// The displays the read counted as visible.
    pub visible: HashSet<Box<str>>,
    /// `(key hash, digest, arrived)` of each held event on a visible display
    /// ([`crate::decode::ViewEvent::arrived`]), sorted.
    events: Vec<(u64, u64, u32)>,
}

impl Snapshot {
    /// The snapshot of a view's events (all of them, any order) read at `read_at`: visibility by the projector's
    /// rule ([`crate::project::visible_displays`]).
    pub fn of<'a>(
        thread_id: &str,
        read_at: SystemTime,
        events: impl Iterator<Item = &'a ViewEvent> + Clone,
    ) -> Self {
        let visible: HashSet<Box<str>> = crate::project::visible_displays(events.clone())
            .into_iter()
            .map(Box::from)
            .collect();
        let mut held: Vec<(u64, u64, u32)> = events
            .filter(|e| visible.contains(e.key.display_id()))
            .map(|e| (key_hash(&e.key), digest(e), e.arrived))
            .collect();
        held.sort_unstable();
        Self {
            thread_id: thread_id.into(),
            read_at,
            covered_through: None,
            visible,
            events: held,
        }
    }

    fn held(&self, key: &DeliveryKey) -> Option<u64> {
        let hash = key_hash(key);
        let at = self.events.partition_point(|(h, _, _)| *h < hash);
        self.events
            .get(at)
            .filter(|(h, _, _)| *h == hash)
            .map(|(_, d, _)| *d)
    }
}

/// One stored row as a check reads it: the decoded event and its `_id` time (milliseconds since the Unix epoch,
/// whole seconds on the persister host's clock), if its `_id` is an ObjectId.
#[derive(Debug, Clone)]
pub struct StoredRow {
    pub event: ViewEvent,
    pub persisted_ms: Option<i64>,
}

/// A row found failing, by metadata only (never its payload).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Divergence {
    pub finding: Finding,
    pub event_id: String,
    pub display_id: String,
    pub run_id: String,
    pub event_name: String,
    pub agent_class: String,
}

/// What one comparison found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Comparison {
    pub counts: HashMap<Finding, u64>,
    /// The failing rows (missing, late, differs), in store order.
    pub divergent: Vec<Divergence>,
}

impl Comparison {
    pub fn count(&self, finding: Finding) -> u64 {
        self.counts.get(&finding).copied().unwrap_or(0)
    }

    /// The worst finding: a failure if any, else orphaned, uncertain, ahead, match.
    pub fn verdict(&self) -> Verdict {
        match Finding::ALL
            .iter()
            .rev()
            .find(|f| self.count(**f) > 0)
            .copied()
        {
            Some(Finding::Missing) => Verdict::Missing,
            Some(Finding::Differs) => Verdict::Differs,
            Some(Finding::Late) => Verdict::Late,
            Some(Finding::Orphaned) => Verdict::Orphaned,
            Some(Finding::Uncertain) => Verdict::Uncertain,
            Some(Finding::Ahead) => Verdict::Ahead,
            Some(Finding::Match) | None => Verdict::Match,
        }
    }
}

/// What bounds the judgement of a row's times.
#[derive(Debug, Clone, Copy)]
pub struct Clocks {
    /// `HISTORY_VIEW_PERSIST_LAG_MS`.
    pub persist_lag: Duration,
    /// `HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS`.
    pub margin: Duration,
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Compares the store's `rows` (stage 2 over the read's visible displays and the store's, in store order) with what
/// the read held.
///
/// A row counts if its display was visible to the read, or if it is a marker (a marker stored before the read
/// made its display visible then). The first row of each key is compared (the store path keeps the first):
/// - held: `match`, or `differs` when it decoded otherwise;
/// - not held and surely stored before the read (`_id` time + 1 s + margin before it): `late` if it was persisted
///   more than the bound (+ 1 s + margin) after it was published (the assumption broke), `missing` otherwise (the
///   promise broke);
/// - not held, surely persisted after the read (`_id` time - margin after it) and published more than the bound
///   (+ margin) before it: `late`;
/// - not held, surely persisted after the read otherwise: not compared (the read could not have held it);
/// - not held, held by the view `now` (delivered live since the read), and published after the instant the answer
///   said it covered less the margin: not compared (it was still on its way to the view at the read, as the
///   answer's `X-History-Covered-Through` admits);
/// - not held, stored about when the read happened, and held by the view `now`: not compared;
/// - not held otherwise: `uncertain`.
///
/// Held events no row has are `orphaned` if they arrived more than the bound (+ margin) before the read, or were read
/// from the store (the store had them before the read, as far as the bound goes), `ahead` otherwise.
pub fn compare(
    snapshot: &Snapshot,
    rows: &[StoredRow],
    now: Option<&Snapshot>,
    clocks: Clocks,
) -> Comparison {
    let read = i64::try_from(millis(snapshot.read_at)).unwrap_or(i64::MAX);
    let covered = snapshot
        .covered_through
        .map_or(i64::MIN, |at| i64::try_from(millis(at)).unwrap_or(i64::MAX));
    let margin = ms(clocks.margin);
    let lag = ms(clocks.persist_lag);
    let mut comparison = Comparison::default();
    let mut seen: HashSet<&DeliveryKey> = HashSet::new();
    let mut matched: HashSet<u64> = HashSet::new();
    for row in rows {
        let event = &row.event;
        if !(snapshot.visible.contains(event.key.display_id()) || event.is_marker()) {
            continue;
        }
        if !seen.insert(&event.key) {
            continue;
        }
        let finding = match snapshot.held(&event.key) {
            Some(held) => {
                matched.insert(key_hash(&event.key));
                if held == digest(event) {
                    Finding::Match
                } else {
                    Finding::Differs
                }
            }
            None if now.is_some_and(|now| now.held(&event.key).is_some())
                && event
                    .created_at
                    .is_ok_and(|ns| (ns / 1_000_000).saturating_add(margin) >= covered) =>
            {
                continue;
            }
            None => match row.persisted_ms {
                // Stored before the read, but persisted more than the bound after it was published: the assumption
                // broke for this row (the view could not have it unless it arrived live), not the promise.
                Some(at)
                    if at.saturating_add(1000 + margin) < read
                        && event.created_at.is_ok_and(|ns| {
                            at.saturating_sub(ns / 1_000_000) > lag + margin + 1000
                        }) =>
                {
                    Finding::Late
                }
                Some(at) if at.saturating_add(1000 + margin) < read => Finding::Missing,
                Some(at) if at.saturating_sub(margin) > read => {
                    let published_long_before = event
                        .created_at
                        .is_ok_and(|ns| (ns / 1_000_000).saturating_add(lag + margin) < read);
                    if !published_long_before {
                        continue;
                    }
                    Finding::Late
                }
                _ if now.is_some_and(|now| now.held(&event.key).is_some()) => continue,
                _ => Finding::Uncertain,
            },
        };
        *comparison.counts.entry(finding).or_default() += 1;
        if finding.is_failure() {
            let key = &event.key;
            comparison.divergent.push(Divergence {
                finding,
                event_id: key.event_id().to_owned(),
                display_id: key.display_id().to_owned(),
                run_id: key.run_id().to_owned(),
                event_name: key.event_name().to_owned(),
                agent_class: key.agent_class().to_owned(),
            });
        }
    }
    for (hash, _, arrived) in &snapshot.events {
        if matched.contains(hash) {
            continue;
        }
        // The whole second it arrived in ended the bound and the margin before the read.
        let arrived_by = (i64::from(*arrived) + 1) * 1000;
        let finding = if arrived_by.saturating_add(lag + margin) <= read {
            Finding::Orphaned
        } else {
            Finding::Ahead
        };
        *comparison.counts.entry(finding).or_default() += 1;
    }
    comparison
}

/// Admits samples: a fraction of the reads, at most `max_per_sec` a second (a token bucket of one second's
/// worth; a sample beyond it is dropped, never queued), one check per thread at a time. `verify` has one of its own
/// that draws every request (`sample` 1): its budget.
pub struct Sampler {
    /// `sample` as a threshold over 64-bit draws (0: never, `u64::MAX`: always).
    threshold: u64,
    draws: AtomicU64,
    max_per_sec: f64,
    state: Mutex<SamplerState>,
}

struct SamplerState {
    tokens: f64,
    refilled: Instant,
    checking: HashSet<Box<str>>,
}

/// Whether a read is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Not drawn (the common case: nothing to count).
    Skipped,
    /// Drawn but over the rate limit, or its thread is being checked: counted as dropped.
    Dropped,
    /// Drawn and admitted: the caller records a snapshot and must [`Sampler::done`] the thread after its check.
    Admitted,
}

/// One step of splitmix64: a well-mixed 64-bit draw from a counter.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Sampler {
    pub fn new(sample: f64, max_per_sec: u32, now: Instant) -> Self {
        let threshold = if sample >= 1.0 {
            u64::MAX
        } else {
            // Truncation is intended: the fraction of the draw space below the threshold.
            (sample.max(0.0) * u64::MAX as f64) as u64
        };
        let seed = RandomState::new().hash_one(0u8);
        Self {
            threshold,
            draws: AtomicU64::new(seed),
            max_per_sec: f64::from(max_per_sec),
            state: Mutex::new(SamplerState {
                tokens: f64::from(max_per_sec),
                refilled: now,
                checking: HashSet::new(),
            }),
        }
    }

    /// Whether the read of `thread_id` at `now` is checked. Costs one atomic add when not drawn.
    pub fn admit(&self, thread_id: &str, now: Instant) -> Admission {
        if self.threshold == 0 {
            return Admission::Skipped;
        }
        let draw = mix(self.draws.fetch_add(1, Ordering::Relaxed));
        if self.threshold != u64::MAX && draw >= self.threshold {
            return Admission::Skipped;
        }
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let elapsed = now.saturating_duration_since(state.refilled).as_secs_f64();
        state.tokens = (state.tokens + elapsed * self.max_per_sec).min(self.max_per_sec);
        state.refilled = now;
        if state.tokens < 1.0 || state.checking.contains(thread_id) {
            return Admission::Dropped;
        }
        state.tokens -= 1.0;
        state.checking.insert(thread_id.into());
        Admission::Admitted
    }

    /// The check of `thread_id` has finished (or was abandoned): its next sample may be admitted.
    pub fn done(&self, thread_id: &str) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .checking
            .remove(thread_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Decoded, decode_payload};
    use std::time::UNIX_EPOCH;

    /// `event` as received live at `second`.
    fn arrived(mut event: ViewEvent, second: u32) -> ViewEvent {
        event.arrived = second;
        event
    }

    fn event(display: &str, event_id: &str, name: &str, created_ms: i64, text: &str) -> ViewEvent {
        let (class, payload) = match name {
            "UserMessageEvent" => (
                "UserAgent",
                serde_json::json!({"_parent_event_names": ["UserMessageEvent"], "created_at": created_ms * 1_000_000,
                    "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": text}]}]}),
            ),
            _ => (
                "A",
                serde_json::json!({"_parent_event_names": ["ChunkEvent"], "created_at": created_ms * 1_000_000,
                    "content": text}),
            ),
        };
        let key = DeliveryKey::parse_subject(&format!(
            "agent.{class}.a.t.{display}.r.display_event.{name}.{event_id}"
        ))
        .unwrap();
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(e) => e,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    fn row(event: ViewEvent, persisted_ms: i64) -> StoredRow {
        StoredRow {
            event,
            persisted_ms: Some(persisted_ms),
        }
    }

    const CLOCKS: Clocks = Clocks {
        persist_lag: Duration::from_millis(2000),
        margin: Duration::from_millis(1000),
    };
    /// The read, on the wall clock (ms since the epoch).
    const READ: i64 = 100_000;

    fn snapshot(events: &[ViewEvent]) -> Snapshot {
        Snapshot::of(
            "t",
            UNIX_EPOCH + Duration::from_millis(READ as u64),
            events.iter(),
        )
    }

    #[test]
    fn rows_are_judged_by_whether_the_view_held_them_and_when_they_were_stored() {
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let answer = event("d", "c1", "ChunkEvent", 91_000, "a");
        let ahead = arrived(event("d", "c2", "ChunkEvent", 99_900, "b"), 99);
        let held = [marker.clone(), answer.clone(), ahead];
        let snap = snapshot(&held);
        let rows = [
            row(marker, 90_000),
            row(answer, 91_000),
            // Stored 3 s before the read, not held: missing.
            row(event("d", "x1", "ChunkEvent", 96_000, "m"), 97_000),
            // Stored 4 s before the read, but 12 s after it was published: the persister broke the bound.
            row(event("d", "x6", "ChunkEvent", 84_000, "p"), 96_000),
            // Inside the band: uncertain.
            row(event("d", "x2", "ChunkEvent", 98_500, "u"), 98_000),
            // Persisted after the read, published 5 s before it: late.
            row(event("d", "x3", "ChunkEvent", 95_000, "l"), 102_000),
            // Persisted after the read, published just before it: not compared.
            row(event("d", "x4", "ChunkEvent", 99_950, "n"), 102_000),
            // On a display the read did not count as visible: not compared.
            row(event("hidden", "x5", "ChunkEvent", 50_000, "h"), 51_000),
        ];
        let comparison = compare(&snap, &rows, None, CLOCKS);
        assert_eq!(comparison.count(Finding::Match), 2);
        assert_eq!(comparison.count(Finding::Missing), 1);
        assert_eq!(comparison.count(Finding::Uncertain), 1);
        assert_eq!(comparison.count(Finding::Late), 2);
        assert_eq!(comparison.count(Finding::Ahead), 1);
        assert_eq!(comparison.verdict(), Verdict::Missing);
        let ids: Vec<&str> = comparison
            .divergent
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        assert_eq!(ids, ["x1", "x6", "x3"]);
    }

    #[test]
    fn held_events_no_row_has_are_orphaned_once_the_store_should_have_had_them() {
        // A deleted thread: the view holds a turn read from the store, one that arrived 10 s before the read, and
        // one that arrived a moment before it.
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let answer = arrived(event("d", "c1", "ChunkEvent", 90_100, "a"), 90);
        let recent = arrived(event("d", "c2", "ChunkEvent", 97_500, "b"), 97);
        let comparison = compare(&snapshot(&[marker, answer, recent]), &[], None, CLOCKS);
        assert_eq!(comparison.count(Finding::Orphaned), 2);
        assert_eq!(comparison.count(Finding::Ahead), 1);
        assert_eq!(comparison.verdict(), Verdict::Orphaned);
        assert!(Verdict::Orphaned.heals());
        assert!(!Verdict::Orphaned.is_failure());
        assert!(comparison.divergent.is_empty());
        // A failure outranks it.
        let missing = row(event("d", "x", "ChunkEvent", 95_000, "m"), 95_000);
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let orphan = event("d", "c1", "ChunkEvent", 90_100, "a");
        let comparison = compare(
            &snapshot(&[marker.clone(), orphan]),
            &[row(marker, 90_000), missing],
            None,
            CLOCKS,
        );
        assert_eq!(comparison.count(Finding::Orphaned), 1);
        assert_eq!(comparison.verdict(), Verdict::Missing);
    }

    #[test]
    fn a_key_decoded_otherwise_differs_and_a_stored_marker_on_a_hidden_display_is_missing() {
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let chunk = event("d", "c", "ChunkEvent", 91_000, "live text");
        let snap = snapshot(&[marker.clone(), chunk]);
        let stored_otherwise = event("d", "c", "ChunkEvent", 91_000, "stored text");
        let other_marker = event("e", "m2", "UserMessageEvent", 92_000, "again");
        let comparison = compare(
            &snap,
            &[
                row(marker, 90_000),
                row(stored_otherwise.clone(), 91_000),
                // A duplicate row of the same key: only the first is compared.
                row(stored_otherwise, 91_000),
                row(other_marker, 92_000),
            ],
            None,
            CLOCKS,
        );
        assert_eq!(comparison.count(Finding::Differs), 1);
        assert_eq!(comparison.count(Finding::Missing), 1);
        assert_eq!(comparison.count(Finding::Match), 1);
        assert_eq!(comparison.verdict(), Verdict::Missing);
    }

    #[test]
    fn a_row_stored_about_the_read_and_delivered_live_since_is_not_compared() {
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let snap = snapshot(std::slice::from_ref(&marker));
        let next = event("d", "c", "ChunkEvent", 100_010, "next turn");
        let rows = [row(marker.clone(), 90_000), row(next.clone(), 100_000)];
        let uncertain = compare(&snap, &rows, None, CLOCKS);
        assert_eq!(uncertain.verdict(), Verdict::Uncertain);
        let now = snapshot(&[marker, next]);
        let after = compare(&snap, &rows, Some(&now), CLOCKS);
        assert_eq!(after.verdict(), Verdict::Match);
    }

    #[test]
    fn a_row_published_after_the_answers_instant_and_delivered_since_is_not_missing() {
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let mut snap = snapshot(std::slice::from_ref(&marker));
        // The answer covered up to 95 s; the chunk, published at 96 s and stored at 97 s, was still queued.
        snap.covered_through = Some(UNIX_EPOCH + Duration::from_millis(95_000));
        let queued = event("d", "c", "ChunkEvent", 96_000, "queued");
        let rows = [row(marker.clone(), 90_000), row(queued.clone(), 97_000)];
        let now = snapshot(&[marker.clone(), queued.clone()]);
        assert_eq!(
            compare(&snap, &rows, Some(&now), CLOCKS).verdict(),
            Verdict::Match
        );
        // Published well before the instant the answer covered, delivered only later: the answer broke its word.
        let early = event("d", "c", "ChunkEvent", 90_500, "queued");
        let rows = [row(marker.clone(), 90_000), row(early.clone(), 91_000)];
        let now = snapshot(&[marker, early]);
        assert_eq!(
            compare(&snap, &rows, Some(&now), CLOCKS).verdict(),
            Verdict::Missing
        );
    }

    #[test]
    fn a_view_that_holds_everything_stored_matches() {
        let marker = event("d", "m", "UserMessageEvent", 90_000, "hi");
        let snap = snapshot(std::slice::from_ref(&marker));
        let comparison = compare(&snap, &[row(marker, 90_000)], None, CLOCKS);
        assert_eq!(comparison.verdict(), Verdict::Match);
        assert!(comparison.divergent.is_empty());
        let empty = compare(&snapshot(&[]), &[], None, CLOCKS);
        assert_eq!(empty.verdict(), Verdict::Match);
    }

    proptest::proptest! {
        /// A row the view held with the same decoding is never a failure, whatever its times; a row not held is
        /// `missing` exactly when its `_id` time is more than a second plus the margin before the read.
        #[test]
        fn findings_follow_the_clock_rules(persisted in 80_000i64..120_000, created in 80_000i64..120_000, held: bool) {
            let marker = event("d", "m", "UserMessageEvent", 80_000, "hi");
            let chunk = event("d", "c", "ChunkEvent", created, "x");
            let held_events = if held { vec![marker.clone(), chunk.clone()] } else { vec![marker.clone()] };
            let snap = snapshot(&held_events);
            let comparison = compare(&snap, &[row(marker, 80_000), row(chunk.clone(), persisted)], None, CLOCKS);
            if held {
                proptest::prop_assert_eq!(comparison.verdict(), Verdict::Match);
            } else {
                let slow = persisted - created > 4000;
                let missing = persisted + 2000 < READ && !slow;
                proptest::prop_assert_eq!(comparison.count(Finding::Missing) == 1, missing);
                let late = (persisted - 1000 > READ && created + 3000 < READ) || (persisted + 2000 < READ && slow);
                proptest::prop_assert_eq!(comparison.count(Finding::Late) == 1, late);
            }
        }
    }

    #[test]
    fn the_sampler_admits_a_fraction_within_the_rate_and_one_check_per_thread() {
        let start = Instant::now();
        let never = Sampler::new(0.0, 5, start);
        assert_eq!(never.admit("t", start), Admission::Skipped);

        let always = Sampler::new(1.0, 2, start);
        assert_eq!(always.admit("a", start), Admission::Admitted);
        assert_eq!(
            always.admit("a", start),
            Admission::Dropped,
            "a is being checked"
        );
        assert_eq!(always.admit("b", start), Admission::Admitted);
        assert_eq!(always.admit("c", start), Admission::Dropped, "two a second");
        always.done("a");
        assert_eq!(
            always.admit("a", start + Duration::from_millis(400)),
            Admission::Dropped
        );
        assert_eq!(
            always.admit("a", start + Duration::from_millis(500)),
            Admission::Admitted
        );

        let some = Sampler::new(0.25, 10_000, start);
        let admitted = (0..4000)
            .filter(|i| {
                let thread = format!("t{i}");
                let admitted = some.admit(&thread, start) == Admission::Admitted;
                some.done(&thread);
                admitted
            })
            .count();
        assert!(
            (800..1200).contains(&admitted),
            "{admitted} of 4000 at 0.25"
        );
    }
}
