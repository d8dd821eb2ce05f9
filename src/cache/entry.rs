//! `Entry`: one cached thread, and the protocol of its locks.
//!
//! **Lock order** (a lock may be taken while holding those before it, never the other way):
//! `view` → `waiting`, and `view` → `rendering`. The store side's state ([`StoreSide`], in [`super::work`]) is
//! taken alone. All are std mutexes held for a few steps of CPU work, never across an `.await`. The cache's two
//! semaphores, held across a store read, are taken outside all of them: a permit of the explain share before a
//! hydration slot, never the other way ([`super::scan`]).
//!
//! **Who holds what:**
//! - The **view** is held by a reader rendering it, a hydration or fill merging into it, or the live path
//!   applying one event. The live path never waits for it: an event for a locked view is pushed to `waiting`, and
//!   whoever holds the view applies the waiting events before using it ([`Entry::lock_view`]) and again as it lets
//!   go; a holder that lets go re-checks `waiting` and takes the view again if it is free, so no event is left
//!   behind (an event pushed after the holder's last check finds the view free, or a holder that checks again).
//! - **`rendering`** (the last answer and the warnings logged) is taken only while holding the view.
//! - The **store side** (hydrating, fill queued or filling, a re-read scheduled) is one explicit state: a store
//!   job's [`super::work::Ticket`] is held by the reader or background task that runs it, or waits in the fill
//!   queue; everyone else waits for the job's outcome ([`super::work`]).
//! - The byte counts are atomics, so weighing an entry never waits for its view.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use super::form::{Answer, AnswerSource, Form};
use super::metrics::ViewMetrics;
use super::render::Rendering;
use super::work::StoreSide;
use crate::coverage::{self, Coverage, Stamp};
use crate::decode::ViewEvent;
use crate::project::Identity;
use crate::view::{Inserted, PublisherContext, ThreadView};

/// An entry's bytes beyond its view's and renderings': the entry's allocation less the view's struct, its thread
/// id and store-side state, and moka's own entry for it (its key, node, deque slots), as P5's breakdown measures
/// them (about 330 and 330 bytes; docs/benchmark.md).
const ENTRY_BYTES: usize = 640;

/// The least growth that has an entry weighed again: a small view is not re-weighed for every event.
const REWEIGH_MIN_BYTES: usize = 512;

/// One cached thread.
pub struct Entry {
    /// The cache key, kept so that live inserts need not copy it from each event.
    pub thread_id: Box<str>,
    /// The thread's removal bucket in [`Coverage`].
    pub bucket: usize,
    /// The floor of this entry's coverage start ([`Coverage::entry_created`]).
    pub floor: Stamp,
    /// Where the entry records its removal when it is dropped.
    coverage: Coverage,
    /// The view. Lock it through [`Entry::lock_view`], which applies the waiting events first.
    view: Mutex<ThreadView>,
    /// Live events that arrived while the view was locked, with their publisher contexts (kept while tracing is
    /// on); applied by the view's holder.
    waiting: Mutex<Vec<(ViewEvent, Option<PublisherContext>)>>,
    /// Set (under `waiting`'s lock) when an event is pushed there, cleared when the events are taken: a holder
    /// skips locking `waiting` while it is clear, except for its last check as it lets go, which always locks (that
    /// check is what leaves no event behind).
    has_waiting: AtomicBool,
    /// Readers waiting for the view to change ([`Entry::listen`]): a holder that changed it notifies only when
    /// there are any (`Notify::notify_waiters` takes a lock).
    listeners: AtomicUsize,
    /// The view's bytes, updated by every holder as it lets go.
    pub view_bytes: AtomicUsize,
    /// The bytes of the renderings held.
    rendered_bytes: AtomicUsize,
    /// The bytes held when moka last weighed the entry ([`Entry::charge`]).
    weighed: AtomicUsize,
    /// The renderings of the view's version and the warnings logged for this view; taken while holding the view.
    /// Allocated by the first read (most views streamed in live are never read).
    rendering: Mutex<Option<Box<Rendering>>>,
    /// The view's version as its last holder let go of it.
    pub version: AtomicU64,
    /// Notified as a holder that changed the view lets go of it (reads waiting for a run and feeds listen).
    pub changed: tokio::sync::Notify,
    /// Names this entry among every entry of every process ([`next_generation`]): a view's version restarts in a
    /// new entry, so an answer is named by both.
    pub generation: u64,
    /// What the store side of the entry is doing.
    pub store: StoreSide,
    /// The thread outgrew `HISTORY_VIEW_MAX_THREAD_BYTES`: the entry left the cache with its view emptied, and its
    /// readers answer 507.
    pub too_large: AtomicBool,
    /// Whether stage 1's skipped markers were warned about for this entry.
    pub skipped_markers_warned: AtomicBool,
    /// Milliseconds since the Unix epoch up to which the last store read merged into the view covers the thread
    /// (its start less the persister-lag bound); 0: none yet.
    pub stored_through: AtomicU64,
    /// When the thread was last read ([`Coverage::now`]'s nanoseconds; a warm-up ranks below every read), 0: never:
    /// what the hot set is chosen by ([`super::warm`]). One relaxed store per read.
    pub last_read: AtomicU64,
}

/// A locked view ([`Entry::lock_view`]). Letting go of it applies the events that waited meanwhile, records the
/// view's bytes, and re-checks for events that arrived in between (taking the view again if it is free).
pub struct ViewGuard<'a> {
    entry: &'a Entry,
    metrics: &'a ViewMetrics,
    /// `None` only while dropping.
    view: Option<MutexGuard<'a, ThreadView>>,
    /// The view's version when it was taken.
    taken_at: u64,
}

pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a view lock leaves a view that is still structurally valid (every mutation is a
    // single insert); serving it beats failing every later read of the thread.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<'a> ViewGuard<'a> {
    /// Takes over `view` (locked) and applies the waiting events to it.
    fn new(entry: &'a Entry, metrics: &'a ViewMetrics, view: MutexGuard<'a, ThreadView>) -> Self {
        let taken_at = view.version();
        let mut guard = ViewGuard {
            entry,
            metrics,
            view: Some(view),
            taken_at,
        };
        guard.apply_waiting();
        guard
    }

    /// [`ThreadView::insert_live`], counting an event it drops as orphaned: the one place both live paths (applied
    /// at once, or waiting beside the view) insert through.
    fn insert_live(&mut self, event: ViewEvent, publisher: Option<PublisherContext>) -> Inserted {
        let inserted = (**self).insert_live(event, publisher);
        if inserted == Inserted::Orphaned {
            self.metrics.cache.orphaned_events(1);
        }
        inserted
    }

    /// Inserts the waiting events, in arrival order, counting each as the live path would have.
    fn apply_waiting(&mut self) {
        if !self.entry.has_waiting.load(Ordering::Acquire) {
            return;
        }
        let waiting = {
            let mut waiting = lock(&self.entry.waiting);
            self.entry.has_waiting.store(false, Ordering::Relaxed);
            std::mem::take(&mut *waiting)
        };
        for (event, publisher) in waiting {
            // An orphan is counted as such by the insert.
            let inserted = self.insert_live(event, publisher);
            self.metrics.applied.count(inserted);
        }
    }
}

impl std::ops::Deref for ViewGuard<'_> {
    type Target = ThreadView;
    fn deref(&self) -> &ThreadView {
        self.view.as_deref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for ViewGuard<'_> {
    fn deref_mut(&mut self) -> &mut ThreadView {
        self.view.as_deref_mut().expect("held until dropped")
    }
}

impl Drop for ViewGuard<'_> {
    fn drop(&mut self) {
        loop {
            self.apply_waiting();
            self.entry.view_bytes.store(self.bytes(), Ordering::Relaxed);
            let version = self.version();
            if version != self.taken_at && self.entry.rendered_bytes.load(Ordering::Relaxed) > 0 {
                self.entry.drop_stale_renderings(version);
            }
            drop(self.view.take());
            if version != self.taken_at {
                // SeqCst with the listener count's load, as in `Entry::listen`: a listener that compared the
                // version before this store is counted by the load after it.
                self.entry.version.store(version, Ordering::SeqCst);
                if self.entry.listeners.load(Ordering::SeqCst) > 0 {
                    self.entry.changed.notify_waiters();
                }
                self.taken_at = version;
            }
            // An event pushed after the last check, while this guard still held the view, waits for a holder:
            // be that holder if the view is free (if it is not, its holder checks as it lets go).
            if lock(&self.entry.waiting).is_empty() {
                return;
            }
            match self.entry.try_lock_view() {
                Some(view) => {
                    self.taken_at = view.version();
                    self.view = Some(view);
                }
                None => return,
            }
        }
    }
}

/// A reader counted as waiting for an entry's view to change ([`Entry::listen`]).
pub struct Listening<'a>(&'a Entry);

impl Drop for Listening<'_> {
    fn drop(&mut self) {
        self.0.listeners.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A generation no entry of this or an earlier process had: the process's start in microseconds since the Unix
/// epoch plus a count of the entries it made.
fn next_generation() -> u64 {
    static BASE: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |since| {
                u64::try_from(since.as_micros()).unwrap_or(u64::MAX / 2)
            })
    });
    static COUNT: AtomicU64 = AtomicU64::new(0);
    *BASE + COUNT.fetch_add(1, Ordering::Relaxed)
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.coverage
            .entry_dropped(&self.thread_id, self.coverage.now());
    }
}

impl Entry {
    pub fn new(thread_id: &str, coverage: &Coverage) -> Self {
        let bucket = coverage::bucket(thread_id);
        let view = ThreadView::new();
        Self {
            thread_id: thread_id.into(),
            bucket,
            floor: coverage.entry_created(thread_id, coverage.now()),
            coverage: coverage.clone(),
            view_bytes: AtomicUsize::new(view.bytes()),
            view: Mutex::new(view),
            waiting: Mutex::new(Vec::new()),
            has_waiting: AtomicBool::new(false),
            listeners: AtomicUsize::new(0),
            rendered_bytes: AtomicUsize::new(0),
            weighed: AtomicUsize::new(0),
            rendering: Mutex::new(None),
            version: AtomicU64::new(0),
            changed: tokio::sync::Notify::new(),
            generation: next_generation(),
            store: StoreSide::new(),
            too_large: AtomicBool::new(false),
            skipped_markers_warned: AtomicBool::new(false),
            stored_through: AtomicU64::new(0),
            last_read: AtomicU64::new(0),
        }
    }

    /// Records a read of the thread now, for the hot set.
    pub fn read_now(&self, coverage: &Coverage) {
        self.last_read
            .store(coverage.now().nanos(), Ordering::Relaxed);
    }

    /// Up to when the last store read merged into the view covers the thread.
    pub fn stored_through(&self) -> Option<std::time::SystemTime> {
        let ms = self.stored_through.load(Ordering::Acquire);
        (ms > 0).then(|| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
    }

    /// Bytes held: the view and its last rendered answer (as of their last change).
    pub fn held_bytes(&self) -> usize {
        self.view_bytes.load(Ordering::Relaxed) + self.rendered_bytes.load(Ordering::Relaxed)
    }

    /// Locks the view, waiting for another holder, and applies the live events that waited beside it.
    pub fn lock_view<'a>(&'a self, metrics: &'a ViewMetrics) -> ViewGuard<'a> {
        ViewGuard::new(self, metrics, lock(&self.view))
    }

    /// The view if no one holds it (a poisoned lock is taken over, as [`lock`] does).
    fn try_lock_view(&self) -> Option<MutexGuard<'_, ThreadView>> {
        match self.view.try_lock() {
            Ok(view) => Some(view),
            Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Applies a live event (with its publisher's context, if kept) if the view is free; otherwise leaves it
    /// waiting for the view's holder, which applies it (and counts it) before letting go. Returns what the insert
    /// did and whether it made a display of a complete view uncovered (a fill is due), or `None` if the event waits.
    pub fn apply_live(
        &self,
        event: ViewEvent,
        publisher: Option<PublisherContext>,
        metrics: &ViewMetrics,
    ) -> Option<(Inserted, bool)> {
        let Some(view) = self.try_lock_view() else {
            {
                let mut waiting = lock(&self.waiting);
                waiting.push((event, publisher));
                self.has_waiting.store(true, Ordering::Release);
            }
            // The holder may have checked the waiting events just before this push and be letting go now: take
            // the view if it is free, so the event does not wait for the next holder.
            if let Some(view) = self.try_lock_view() {
                drop(ViewGuard::new(self, metrics, view));
            }
            return None;
        };
        let mut guard = ViewGuard::new(self, metrics, view);
        let inserted = guard.insert_live(event, publisher);
        Some((inserted, guard.take_fill_due()))
    }

    /// Renders the view (held by the caller) for `primary`, reusing the last rendering while the view has not
    /// changed, and records the rendering's bytes.
    pub fn render<F: Form>(
        &self,
        view: &mut ThreadView,
        primary: Option<&Identity>,
        source: AnswerSource,
        metrics: &ViewMetrics,
    ) -> Answer<F> {
        let mut rendering = lock(&self.rendering);
        let rendering = rendering.get_or_insert_with(Box::default);
        let mut answer = rendering.render(&self.thread_id, view, primary, source, metrics);
        answer.generation = self.generation;
        self.rendered_bytes
            .store(rendering.bytes(), Ordering::Relaxed);
        answer
    }

    /// The per-message digests of `version` of this entry's view as the feed rendered it for `primary`, if kept.
    pub fn recent_digests(
        &self,
        version: u64,
        primary: Option<&Identity>,
    ) -> Option<std::sync::Arc<[u64]>> {
        let _view = lock(&self.view);
        lock(&self.rendering)
            .as_ref()?
            .recent_digests(version, primary)
    }

    /// Counts a reader waiting for the view to change until the returned guard is dropped. Count first, then
    /// compare the view's version (SeqCst): a holder stores the new version, then loads the count (SeqCst), so
    /// either the reader sees the new version or the holder sees the reader and notifies.
    pub fn listen(&self) -> Listening<'_> {
        self.listeners.fetch_add(1, Ordering::SeqCst);
        Listening(self)
    }

    /// Drops the renderings of versions of the view before `version` (the view, held by the caller, changed: no
    /// read is answered from them again, and the next read renders the new version), keeping the warnings logged
    /// and the feed's recent digests.
    fn drop_stale_renderings(&self, version: u64) {
        if let Some(rendering) = lock(&self.rendering).as_mut() {
            rendering.keep_version(version);
            self.rendered_bytes
                .store(rendering.bytes(), Ordering::Relaxed);
        }
    }

    /// Forgets the last rendering (its memory is freed now, whoever still holds the entry).
    pub fn forget_rendering(&self) {
        if let Some(rendering) = lock(&self.rendering).as_mut() {
            rendering.forget();
        }
        self.rendered_bytes.store(0, Ordering::Relaxed);
    }

    /// The weight to charge now: the bytes held, an eighth more, and the entry's own bytes and moka's for it
    /// ([`ENTRY_BYTES`]). The entry is weighed again once it holds a quarter more than when last weighed (and at
    /// least [`REWEIGH_MIN_BYTES`] more: [`Entry::outgrew_charge`]), so its charge stays within an eighth of what
    /// it holds, either way, and a growing view is re-weighed only every so often (a re-weigh is a moka insert).
    pub fn charge(&self) -> u32 {
        let bytes = self.held_bytes();
        self.weighed.store(bytes, Ordering::Relaxed);
        u32::try_from(bytes + bytes / 8 + ENTRY_BYTES).unwrap_or(u32::MAX)
    }

    pub fn outgrew_charge(&self) -> bool {
        let weighed = self.weighed.load(Ordering::Relaxed);
        self.held_bytes() > weighed + (weighed / 4).max(REWEIGH_MIN_BYTES)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::decode::{Decoded, decode_payload};
    use crate::metrics::Exposition;
    use crate::subject::DeliveryKey;

    /// The cache's metrics with the exposition that renders them.
    #[derive(Clone)]
    struct Metrics {
        views: ViewMetrics,
        exposition: Exposition,
    }

    impl Metrics {
        fn new() -> Self {
            let (views, exposition) = ViewMetrics::registered();
            Self { views, exposition }
        }

        fn render(&self) -> String {
            self.exposition.render()
        }
    }

    impl std::ops::Deref for Metrics {
        type Target = ViewMetrics;
        fn deref(&self) -> &ViewMetrics {
            &self.views
        }
    }

    fn chunk(event_id: &str, created_at: i64) -> ViewEvent {
        let key = DeliveryKey::parse_subject(&format!(
            "agent.A.a.t.d.r.display_event.ChunkEvent.{event_id}"
        ))
        .unwrap();
        let payload = format!(
            r#"{{"_parent_event_names": ["ChunkEvent"], "created_at": {created_at}, "content": "c"}}"#
        );
        match decode_payload(key, payload.as_bytes()).unwrap() {
            Decoded::Event(event) => event,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    /// Events the holders counted as relevant.
    fn relevant(metrics: &Metrics) -> f64 {
        let sample = "history_view_events_total{outcome=\"relevant\"} ";
        metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(sample)?.parse().ok())
            .unwrap_or(0.0)
    }

    #[test]
    fn a_live_event_waits_beside_a_locked_view_and_its_holder_applies_it_in_order() {
        let metrics = Metrics::new();
        let entry = Entry::new("t", &Coverage::new(Duration::ZERO));
        // Weighed as the view it holds from the start (a lower first charge lets more entries in than they weigh).
        assert_eq!(entry.held_bytes(), ThreadView::new().bytes());
        let held = entry.lock_view(&metrics);
        // The live path does not wait for the holder.
        assert!(entry.apply_live(chunk("a", 2), None, &metrics).is_none());
        assert!(entry.apply_live(chunk("a", 1), None, &metrics).is_none());
        assert!(entry.apply_live(chunk("b", 3), None, &metrics).is_none());
        assert_eq!(held.len(), 0);
        drop(held);
        // Applied as the holder let go, in arrival order (the first delivery of `a` wins), and counted.
        assert!(lock(&entry.waiting).is_empty());
        let view = entry.lock_view(&metrics);
        assert_eq!(view.len(), 2);
        assert_eq!(relevant(&metrics), 2.0);
        assert_eq!(entry.view_bytes.load(Ordering::Relaxed), view.bytes());
        drop(view);
        assert_eq!(
            entry
                .apply_live(chunk("c", 4), None, &metrics)
                .map(|(i, _)| i),
            Some(Inserted::Added)
        );
    }

    #[test]
    fn an_event_that_waits_beside_a_held_view_keeps_its_publishers_context() {
        let metrics = Metrics::new();
        let entry = Entry::new("t", &Coverage::new(Duration::ZERO));
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        let publisher = PublisherContext::from_headers(&headers).expect("a traceparent");
        let held = entry.lock_view(&metrics);
        assert!(
            entry
                .apply_live(chunk("a", 1), Some(publisher), &metrics)
                .is_none()
        );
        drop(held);
        let view = entry.lock_view(&metrics);
        let kept: Vec<_> = view
            .publishers()
            .map(|(event, p)| (event.key.event_id().to_owned(), *p))
            .collect();
        assert_eq!(kept, [("a".to_owned(), publisher)]);
        // Its bytes are the view's, as the weigher sees them.
        assert_eq!(entry.view_bytes.load(Ordering::Relaxed), view.bytes());
    }

    #[test]
    fn a_change_to_the_view_drops_the_rendering_of_its_older_version() {
        use super::super::form::{AnswerSource, HistoryBody};
        let metrics = Metrics::new();
        let entry = Entry::new("t", &Coverage::new(Duration::ZERO));
        entry.apply_live(chunk("a", 1), None, &metrics);
        let render = || {
            let mut view = entry.lock_view(&metrics);
            let answer: Answer<HistoryBody> =
                entry.render(&mut view, None, AnswerSource::Cache, &metrics);
            answer
        };
        let first = render();
        let rendered = entry.rendered_bytes.load(Ordering::Relaxed);
        assert!(rendered >= first.body.body.len());
        // Read again unchanged: the rendering is reused and kept.
        assert!(Arc::ptr_eq(&render().body, &first.body));
        assert_eq!(entry.rendered_bytes.load(Ordering::Relaxed), rendered);
        // A live event changes the view: the old answer can never be served again, and is dropped at once.
        entry.apply_live(chunk("b", 2), None, &metrics);
        assert_eq!(entry.rendered_bytes.load(Ordering::Relaxed), 0);
        assert!(lock(&entry.rendering).as_ref().unwrap().bytes() == 0);
        let second = render();
        assert!(!Arc::ptr_eq(&second.body, &first.body));
        assert!(entry.rendered_bytes.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn an_event_pushed_while_the_holder_lets_go_is_not_left_behind() {
        // Many rounds of a holder letting go while another thread pushes: every event ends up in the view.
        let metrics = Metrics::new();
        let entry = Arc::new(Entry::new("t", &Coverage::new(Duration::ZERO)));
        let rounds = 2_000;
        let mut applied_live = 0u32;
        std::thread::scope(|scope| {
            let reader = Arc::clone(&entry);
            let metrics_reader = metrics.clone();
            scope.spawn(move || {
                for _ in 0..rounds {
                    let view = reader.lock_view(&metrics_reader);
                    std::hint::black_box(view.len());
                }
            });
            for i in 0..rounds {
                if entry
                    .apply_live(chunk(&format!("e{i}"), i), None, &metrics)
                    .is_some()
                {
                    applied_live += 1;
                }
            }
        });
        assert!(lock(&entry.waiting).is_empty());
        assert_eq!(entry.lock_view(&metrics).len(), rounds as usize);
        // Each event counted once: by the live path, or by the holder that applied it.
        assert_eq!(relevant(&metrics) + f64::from(applied_live), rounds as f64);
    }
}
