//! `Coverage`: from when on the worker has heard every live event of a thread, and so whether a view built from a
//! store read that started at a given moment may be marked complete (the persister-lag rule, [design 2.1.1]).
//!
//! An event reaches a view live or through the store. The live stream covers a thread from its *coverage start*
//! on, the latest of:
//! - the first confirmed round trip after the subscription was (re)established ([`Coverage::confirm_live`]);
//! - the handling of the last gap signal ([`Coverage::gap`], [`Coverage::disconnected`]);
//! - the removal of the thread's previous cache entry, recorded when it is dropped ([`Coverage::entry_dropped`]), or
//!   the creation of the current one while that previous entry may still be alive ([`Coverage::entry_created`]);
//! - the end of the last store outage ([`Coverage::store_failed`], [`Coverage::store_answered`]).
//!
//! An event published before the coverage start is in the store once aihub's persister wrote it, which it does
//! within `HISTORY_VIEW_PERSIST_LAG_MS` (the assumption the rule rests on, measured by the store path). So a store
//! read that started at least that bound after the coverage start, merged with the live events, holds every event
//! of the thread: [`Coverage::verdict`].
//!
//! Removals are remembered per bucket of thread ids (fixed arrays of a stamp and of the live entries' count and
//! tags, so the memory never fills up): a removal in a bucket counts for every thread of the bucket, which is
//! conservative, never wrong. An entry alive beside a new one delays the new one only if it may be the same
//! thread's: the bucket's tags tell one other thread's entry from the thread's own.
//!
//! Time is a [`Stamp`] on tokio's monotonic clock ([`tokio::time::Instant`]), the one clock of the read path: its
//! stamps, timers and deadlines. The rules take `now` from their caller, so they are tested with a hand-driven clock;
//! the `*_now` wrappers read tokio's, which tests of the cache pause and advance (`start_paused`).
//!
//! [design 2.1.1]: ../docs/design.md#2.1.1

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::catch_up::CatchUp;

/// A moment: nanoseconds on the monotonic clock since a day before the coverage's origin (process start), so that
/// a moment before the start (where a JetStream replay begins) is a stamp too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

impl Stamp {
    /// Never happened (a coverage start of `NEVER` covers nothing).
    const NEVER: u64 = u64::MAX;

    /// Nanoseconds since a day before the origin: never 0 for a moment of this process.
    pub fn nanos(self) -> u64 {
        self.0
    }

    pub fn plus(self, duration: Duration) -> Self {
        Self(self.0.saturating_add(nanos(duration)))
    }

    pub fn minus(self, duration: Duration) -> Self {
        Self(self.0.saturating_sub(nanos(duration)).max(1))
    }

    /// The stamp of [`Stamp::nanos`] (kept in an atomic).
    pub fn from_nanos(nanos: u64) -> Self {
        Self(nanos)
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// How far before the origin stamps reach: a day, more than any replay window.
const BEFORE_ORIGIN_NS: u64 = 86_400 * 1_000_000_000;

/// Buckets of thread ids for the removal memory: 64 Ki buckets (1 MiB: a stamp and a word of live entries each). A
/// removal delays completion for the threads that share its bucket, so more buckets mean fewer needless deferrals
/// under eviction churn.
const REMOVAL_BUCKETS: usize = 1 << 16;

/// The bits of a bucket's live-entry word that count its entries; the others hold the wrapping sum of their tags.
const COUNT_BITS: u32 = 16;

/// Which removal bucket a thread falls in.
pub fn bucket(thread_id: &str) -> usize {
    bucket_and_tag(thread_id).0
}

/// The thread's bucket (the low bits of its hash) and its tag within the bucket (the other 48 bits).
fn bucket_and_tag(thread_id: &str) -> (usize, u64) {
    let mut hasher = DefaultHasher::new();
    thread_id.hash(&mut hasher);
    let hash = hasher.finish();
    // Truncation is the point: the low bits pick the bucket.
    ((hash as usize) & (REMOVAL_BUCKETS - 1), hash >> COUNT_BITS)
}

/// What one live entry of a thread with `tag` adds to its bucket's live-entry word: one to the count, its tag to the
/// sum (a 16-bit count cannot carry into the sum: a bucket never holds 65,536 live entries).
fn live_entry(tag: u64) -> u64 {
    (tag << COUNT_BITS) | 1
}

/// What a complete view is complete against: the last gap, and the last removal in its thread's bucket. When
/// either moves on, the view is partial again (without visiting it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Epoch {
    gap: u64,
    removal: u64,
}

#[cfg(test)]
impl Epoch {
    /// An epoch with the given gap generation and no removal, for tests of code that only compares epochs.
    pub(crate) fn at_gap(gap: u64) -> Self {
        Self { gap, removal: 0 }
    }
}

/// Taken when a store read starts; judged by [`Coverage::verdict`] when it has finished.
#[derive(Debug, Clone, Copy)]
pub struct ReadStart {
    at: Stamp,
    bucket: usize,
    /// The entry's own floor of its coverage start ([`Coverage::entry_created`]).
    floor: Stamp,
}

/// Whether a view whose store read started at a [`ReadStart`] may be marked complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadVerdict {
    /// The read started at least the bound after the thread's coverage start: complete as of this epoch.
    Complete(Epoch),
    /// The read started too early; a read starting at this moment (or later) can be complete, unless the coverage
    /// start moves again meanwhile.
    Deferred(Stamp),
    /// The live stream is not confirmed, or the store is failing: no moment can be named yet.
    Uncovered,
}

/// Shared coverage state. Cloning is cheap.
#[derive(Clone)]
pub struct Coverage {
    inner: Arc<Inner>,
}

struct Inner {
    origin: Instant,
    /// `HISTORY_VIEW_PERSIST_LAG_MS`.
    lag: Duration,
    /// When the subscription was last confirmed live; `NEVER` while it is not (before the first confirmation, and
    /// from a disconnect until the next one).
    live_since: AtomicU64,
    /// Bumped by every disconnect, so that a confirmation probe sent before it does not count after it.
    connection: AtomicU64,
    /// Serialises the transitions of `live_since` and `connection` (rare; reads stay lock-free).
    transitions: Mutex<()>,
    /// The moment of the last gap signal; strictly increasing, so it is also the gap generation.
    last_gap: AtomicU64,
    /// When the store last recovered from an outage; `NEVER` during one. 0: no outage seen.
    store_ok_since: AtomicU64,
    /// Per bucket of thread ids, the moment the last cache entry was dropped; strictly increasing per bucket.
    removals: Box<[AtomicU64]>,
    /// Per bucket of thread ids, the cache entries alive now (created and not yet dropped): their count in the low
    /// [`COUNT_BITS`], the wrapping sum of their threads' tags above, so that one atomic add records both.
    alive: Box<[AtomicU64]>,
    catch_up: CatchUp,
}

/// Moves `cell` to `now`, or one past its value when `now` is not later, and returns the new value: a moment that
/// also serves as a generation (every call changes it).
fn advance(cell: &AtomicU64, now: Stamp) -> u64 {
    let previous = cell
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
            Some(now.0.max(old.saturating_add(1)))
        })
        // The closure always returns Some.
        .unwrap_or_else(|old| old);
    now.0.max(previous.saturating_add(1))
}

impl Coverage {
    pub fn new(lag: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                lag,
                live_since: AtomicU64::new(Stamp::NEVER),
                connection: AtomicU64::new(0),
                transitions: Mutex::new(()),
                last_gap: AtomicU64::new(0),
                store_ok_since: AtomicU64::new(0),
                removals: (0..REMOVAL_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
                alive: (0..REMOVAL_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
                catch_up: CatchUp::new(),
            }),
        }
    }

    /// The current moment.
    pub fn now(&self) -> Stamp {
        let elapsed = u64::try_from(self.inner.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Stamp(elapsed.saturating_add(BEFORE_ORIGIN_NS).min(u64::MAX - 1))
    }

    /// The stamp of a moment on the wall clock (a JetStream server's timestamp), as far as the wall clock and the
    /// monotonic clock agree now.
    pub fn stamp_of(&self, at: SystemTime) -> Stamp {
        let now = self.now();
        match SystemTime::now().duration_since(at) {
            Ok(ago) => Stamp(now.0.saturating_sub(nanos(ago))),
            Err(ahead) => now.plus(ahead.duration()),
        }
    }

    /// The wall-clock moment of `stamp`, as far as the wall clock and the monotonic clock agree now.
    pub fn wall_of(&self, stamp: Stamp) -> SystemTime {
        let now = self.now();
        let wall = SystemTime::now();
        if stamp <= now {
            wall.checked_sub(Duration::from_nanos(now.0 - stamp.0))
                .unwrap_or(SystemTime::UNIX_EPOCH)
        } else {
            wall + Duration::from_nanos(stamp.0 - now.0)
        }
    }

    /// Whether the live source has delivered what it held when it was last resumed ([`CatchUp`]).
    pub fn catch_up(&self) -> &CatchUp {
        &self.inner.catch_up
    }

    /// The instant of `stamp`, for timers.
    pub fn instant(&self, stamp: Stamp) -> Instant {
        self.inner.origin + Duration::from_nanos(stamp.0.saturating_sub(BEFORE_ORIGIN_NS))
    }

    /// Whether the subscription is confirmed live now.
    pub fn is_live(&self) -> bool {
        self.inner.live_since.load(Ordering::Acquire) != Stamp::NEVER
    }

    /// The connection's epoch, to be handed back to [`Coverage::confirm_live`] with the answer to a probe sent now.
    pub fn connection(&self) -> u64 {
        self.inner.connection.load(Ordering::Acquire)
    }

    /// A probe sent during `connection` came back at `now`: the server has processed the subscription, so every
    /// event published from now on is delivered. Returns whether this made the stream live (it was not yet, and no
    /// disconnect happened since the probe was sent).
    pub fn confirm_live(&self, connection: u64, now: Stamp) -> bool {
        let _transition = self
            .inner
            .transitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        connection == self.inner.connection.load(Ordering::Acquire)
            && self
                .inner
                .live_since
                .compare_exchange(Stamp::NEVER, now.0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The connection to NATS is lost: nothing is covered until the next confirmation, and it is a gap.
    pub fn disconnected(&self, now: Stamp) {
        {
            let _transition = self
                .inner
                .transitions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.inner.connection.fetch_add(1, Ordering::AcqRel);
            self.inner.live_since.store(Stamp::NEVER, Ordering::Release);
        }
        self.gap(now);
    }

    /// A possible gap in the live stream (a slow-consumer drop, a client or server error, a dropped connection
    /// event, a full internal queue): every complete view becomes partial, and coverage starts again at `now`.
    pub fn gap(&self, now: Stamp) {
        advance(&self.inner.last_gap, now);
    }

    /// Time since the coverage was made (the process start).
    pub fn uptime(&self) -> Duration {
        self.inner.origin.elapsed()
    }

    /// The gap generation: it changes with every gap signal (a shadow check compares it before and after a read).
    pub fn gaps(&self) -> u64 {
        self.inner.last_gap.load(Ordering::Acquire)
    }

    /// A cache entry of `thread_id` is created at `now`. Returns the floor of its coverage start: `now` if the
    /// thread's previous entry may be alive (removed from the cache but not dropped yet, holding events the new one
    /// never sees), otherwise nothing (the previous entry, if any, was dropped and recorded already). It may be
    /// alive unless the bucket holds no other live entry, or one whose tag is not the thread's: a bucket shared with
    /// another thread's entry (one in 65,536 for each entry held) costs no deferral.
    pub fn entry_created(&self, thread_id: &str, now: Stamp) -> Stamp {
        let (bucket, tag) = bucket_and_tag(thread_id);
        let before = self.inner.alive[bucket].fetch_add(live_entry(tag), Ordering::AcqRel);
        let (count, tags) = (before & ((1 << COUNT_BITS) - 1), before >> COUNT_BITS);
        if count == 0 || (count == 1 && tags != tag) {
            Stamp(0)
        } else {
            now
        }
    }

    /// A cache entry of a thread in `bucket` is dropped at `now` (the cache let go of it and nothing holds it any
    /// more): its events are gone with it, so the thread's next entry covers it from `now` only. Every event
    /// applied to it was applied before this moment.
    pub fn entry_dropped(&self, thread_id: &str, now: Stamp) {
        let (bucket, tag) = bucket_and_tag(thread_id);
        self.removed(bucket, now);
        self.inner.alive[bucket].fetch_sub(live_entry(tag), Ordering::AcqRel);
    }

    /// An event of a thread in `bucket` may have been missed (the Core witness saw it, no stream delivered it): its
    /// views are partial from `now`, and complete again only from a store read started the bound after it.
    pub fn thread_gap(&self, bucket: usize, now: Stamp) {
        self.removed(bucket, now);
    }

    fn removed(&self, bucket: usize, now: Stamp) {
        advance(&self.inner.removals[bucket], now);
    }

    /// A store query or ping failed as an outage: aihub's persister most likely could not write either.
    pub fn store_failed(&self) {
        self.inner
            .store_ok_since
            .store(Stamp::NEVER, Ordering::Release);
    }

    /// The store answered at `now`; if it was failing, the outage ends now.
    pub fn store_answered(&self, now: Stamp) {
        // Err: it was not failing; nothing to record.
        let _ = self.inner.store_ok_since.compare_exchange(
            Stamp::NEVER,
            now.0,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// The epoch a view of a thread in `bucket` is complete against now.
    pub fn epoch(&self, bucket: usize) -> Epoch {
        Epoch {
            gap: self.inner.last_gap.load(Ordering::Acquire),
            removal: self.inner.removals[bucket].load(Ordering::Acquire),
        }
    }

    /// Taken immediately before the first store query of a read of a thread in `bucket`, for an entry whose own
    /// coverage floor is `floor`.
    pub fn read_start(&self, bucket: usize, floor: Stamp, now: Stamp) -> ReadStart {
        ReadStart {
            at: now,
            bucket,
            floor,
        }
    }

    /// Judges, once the read has finished, whether the view it built may be complete: only if the read started at
    /// least the bound after the thread's coverage start as it stands now (a gap, disconnect or removal during the
    /// read moves the coverage start past the read's start, so the read cannot count).
    pub fn verdict(&self, start: &ReadStart) -> ReadVerdict {
        // The epoch is read first: if anything moves after this, the recorded epoch is already stale and the view
        // is partial at its next read.
        let epoch = self.epoch(start.bucket);
        let live_since = self.inner.live_since.load(Ordering::Acquire);
        let store_ok_since = self.inner.store_ok_since.load(Ordering::Acquire);
        if live_since == Stamp::NEVER || store_ok_since == Stamp::NEVER {
            return ReadVerdict::Uncovered;
        }
        let coverage_start = Stamp(
            live_since
                .max(epoch.gap)
                .max(epoch.removal)
                .max(store_ok_since)
                .max(start.floor.0),
        );
        let earliest = coverage_start.plus(self.inner.lag);
        if start.at >= earliest {
            ReadVerdict::Complete(epoch)
        } else {
            ReadVerdict::Deferred(earliest)
        }
    }

    /// The earliest moment a store read may start to complete a view, as far as the whole stream goes (a thread's
    /// own removals and its entry's floor may push it later): the bound after the later of the confirmation, the
    /// last gap and the end of the last store outage. `None` while the stream is not confirmed or the store fails.
    pub fn complete_from(&self) -> Option<Stamp> {
        let live_since = self.inner.live_since.load(Ordering::Acquire);
        let store_ok_since = self.inner.store_ok_since.load(Ordering::Acquire);
        if live_since == Stamp::NEVER || store_ok_since == Stamp::NEVER {
            return None;
        }
        let gap = self.inner.last_gap.load(Ordering::Acquire);
        Some(Stamp(live_since.max(gap).max(store_ok_since)).plus(self.inner.lag))
    }

    /// [`Coverage::read_start`] at the current moment.
    pub fn read_start_now(&self, bucket: usize, floor: Stamp) -> ReadStart {
        self.read_start(bucket, floor, self.now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAG: Duration = Duration::from_millis(2000);

    fn ms(ms: u64) -> Stamp {
        Stamp(ms * 1_000_000)
    }

    /// A coverage whose stream was confirmed live at 0 ms (connection 0).
    fn live_at(at: Stamp) -> Coverage {
        let coverage = Coverage::new(LAG);
        assert!(coverage.confirm_live(0, at));
        coverage
    }

    fn verdict_of_read_at(coverage: &Coverage, bucket: usize, at: Stamp) -> ReadVerdict {
        coverage.verdict(&coverage.read_start(bucket, Stamp(0), at))
    }

    #[test]
    fn nothing_is_complete_before_the_subscription_is_confirmed() {
        let coverage = Coverage::new(LAG);
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(10_000)),
            ReadVerdict::Uncovered
        );
        assert!(!coverage.is_live());
    }

    #[test]
    fn a_read_is_complete_only_once_the_bound_has_passed_since_confirmation() {
        let coverage = live_at(ms(1_000));
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(2_999)),
            ReadVerdict::Deferred(ms(3_000))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, 0, ms(3_000)),
            ReadVerdict::Complete(_)
        ));
    }

    #[test]
    fn a_gap_moves_coverage_start_and_changes_the_epoch() {
        let coverage = live_at(ms(0));
        let before = coverage.epoch(7);
        coverage.gap(ms(5_000));
        assert_ne!(coverage.epoch(7), before, "complete views become partial");
        assert_eq!(
            verdict_of_read_at(&coverage, 7, ms(6_000)),
            ReadVerdict::Deferred(ms(7_000))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, 7, ms(7_000)),
            ReadVerdict::Complete(_)
        ));
    }

    #[test]
    fn a_gap_during_a_read_leaves_it_deferred() {
        let coverage = live_at(ms(0));
        let start = coverage.read_start(1, Stamp(0), ms(10_000));
        coverage.gap(ms(10_001));
        assert_eq!(coverage.verdict(&start), ReadVerdict::Deferred(ms(12_001)));
    }

    #[test]
    fn gaps_at_the_same_moment_still_change_the_epoch() {
        let coverage = live_at(ms(0));
        coverage.gap(ms(5));
        let first = coverage.epoch(0);
        coverage.gap(ms(5));
        assert_ne!(coverage.epoch(0), first);
    }

    #[test]
    fn a_disconnect_uncovers_until_a_probe_sent_after_it_returns() {
        let coverage = live_at(ms(0));
        let stale_probe = coverage.connection();
        coverage.disconnected(ms(4_000));
        assert!(!coverage.is_live());
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(9_000)),
            ReadVerdict::Uncovered
        );
        // A probe sent before the disconnect proves nothing about the new connection.
        assert!(!coverage.confirm_live(stale_probe, ms(5_000)));
        let probe = coverage.connection();
        assert!(coverage.confirm_live(probe, ms(6_000)));
        // A second answer does not move the start later.
        assert!(!coverage.confirm_live(probe, ms(7_000)));
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(7_000)),
            ReadVerdict::Deferred(ms(8_000))
        );
    }

    #[test]
    fn a_removal_defers_its_bucket_only_and_changes_its_epoch() {
        let coverage = live_at(ms(0));
        let (evicted, other) = (bucket("thread-a"), bucket("thread-b"));
        assert_ne!(evicted, other, "the two test threads share a bucket");
        let other_epoch = coverage.epoch(other);
        let evicted_epoch = coverage.epoch(evicted);
        assert_eq!(coverage.entry_created("thread-a", ms(1)), Stamp(0));
        coverage.entry_dropped("thread-a", ms(10_000));
        assert_eq!(coverage.epoch(other), other_epoch);
        assert_ne!(coverage.epoch(evicted), evicted_epoch);
        assert_eq!(
            verdict_of_read_at(&coverage, evicted, ms(11_000)),
            ReadVerdict::Deferred(ms(12_000))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, other, ms(11_000)),
            ReadVerdict::Complete(_)
        ));
    }

    #[test]
    fn a_removal_after_a_view_completed_makes_it_partial() {
        // The removal of an older entry may be recorded after the next entry was hydrated; the epoch catches it.
        let coverage = live_at(ms(0));
        let b = bucket("t");
        let ReadVerdict::Complete(epoch) = verdict_of_read_at(&coverage, b, ms(5_000)) else {
            panic!("complete expected");
        };
        coverage.entry_created("t", ms(1));
        coverage.entry_dropped("t", ms(5_001));
        assert_ne!(coverage.epoch(b), epoch);
    }

    #[test]
    fn an_entry_created_while_another_of_its_bucket_is_alive_covers_from_its_creation() {
        let coverage = live_at(ms(0));
        let b = bucket("t");
        // The thread's previous entry: out of the cache, but still held (not dropped, not recorded yet).
        assert_eq!(coverage.entry_created("t", ms(100)), Stamp(0));
        let floor = coverage.entry_created("t", ms(9_000));
        assert_eq!(floor, ms(9_000));
        let start = coverage.read_start(b, floor, ms(9_500));
        assert_eq!(coverage.verdict(&start), ReadVerdict::Deferred(ms(11_000)));
        // Once both are gone, a new entry needs no floor of its own: the drops are recorded.
        coverage.entry_dropped("t", ms(9_600));
        coverage.entry_dropped("t", ms(9_700));
        assert_eq!(coverage.entry_created("t", ms(12_000)), Stamp(0));
        assert_eq!(
            verdict_of_read_at(&coverage, b, ms(11_000)),
            ReadVerdict::Deferred(ms(11_700))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, b, ms(12_000)),
            ReadVerdict::Complete(_)
        ));
    }

    /// A thread other than `thread` in its bucket.
    fn neighbour_of(thread: &str) -> String {
        (0..)
            .map(|i| format!("n{i}"))
            .find(|other| bucket(other) == bucket(thread))
            .expect("some id shares the bucket")
    }

    #[test]
    fn an_entry_beside_another_threads_entry_of_its_bucket_needs_no_floor() {
        let coverage = live_at(ms(0));
        let neighbour = neighbour_of("t");
        assert_eq!(coverage.entry_created(&neighbour, ms(100)), Stamp(0));
        // The one entry alive in the bucket is another thread's: no previous entry of "t" can be alive.
        assert_eq!(coverage.entry_created("t", ms(9_000)), Stamp(0));
        // The thread's own second entry, beside its first and the neighbour's: it may be its previous one.
        assert_eq!(coverage.entry_created("t", ms(9_500)), ms(9_500));
        // With the neighbour's gone, the thread's first entry alone is alive beside a new one: its own.
        coverage.entry_dropped(&neighbour, ms(9_600));
        coverage.entry_dropped("t", ms(9_700));
        assert_eq!(coverage.entry_created("t", ms(9_800)), ms(9_800));
        coverage.entry_dropped("t", ms(9_900));
        coverage.entry_dropped("t", ms(10_000));
        assert_eq!(coverage.entry_created(&neighbour, ms(10_100)), Stamp(0));
    }

    #[test]
    fn a_store_outage_uncovers_and_its_end_starts_coverage_again() {
        let coverage = live_at(ms(0));
        coverage.store_failed();
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(9_000)),
            ReadVerdict::Uncovered
        );
        coverage.store_answered(ms(9_500));
        // Answers while the store is healthy do not move the start.
        coverage.store_answered(ms(9_900));
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(10_000)),
            ReadVerdict::Deferred(ms(11_500))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, 0, ms(11_500)),
            ReadVerdict::Complete(_)
        ));
    }

    #[test]
    fn a_zero_bound_completes_any_read_started_after_coverage_start() {
        let coverage = Coverage::new(Duration::ZERO);
        assert!(coverage.confirm_live(0, ms(100)));
        assert_eq!(
            verdict_of_read_at(&coverage, 0, ms(99)),
            ReadVerdict::Deferred(ms(100))
        );
        assert!(matches!(
            verdict_of_read_at(&coverage, 0, ms(100)),
            ReadVerdict::Complete(_)
        ));
    }

    #[test]
    fn wall_clock_moments_before_the_start_have_stamps_before_now() {
        let coverage = Coverage::new(LAG);
        let now = coverage.now();
        let earlier = coverage.stamp_of(SystemTime::now() - Duration::from_secs(60));
        assert!(earlier < now);
        assert!(now.0 - earlier.0 >= 59_000_000_000);
    }
}
