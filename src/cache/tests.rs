//! The read path's orchestration without servers: the cache over an in-memory store whose queries a test can hold
//! at a gate (to race them against a read, a gap or a removal) or fail, on tokio's paused clock (the read path's one
//! clock), so re-reads and deadlines run when the test advances time. The black-box tests prove the same rules
//! against real servers.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::{Answer, CacheSettings, CacheSetup, HistoryBody, ReadError, Source, ViewCache};
use crate::coverage::{self, Coverage};
use crate::decode::{Decoded, ViewEvent, decode_payload};
use crate::freshness::Freshness;
use crate::metrics::Metrics;
use crate::shadow::{ShadowSettings, StoredRow};
use crate::store::{Bounds, Hydration, StoreBounds, StoreError, StoreReads, VisibleDisplays};
use crate::subject::DeliveryKey;
use crate::view::event_bytes;

const LAG: Duration = Duration::from_millis(2_000);
const THREAD: &str = "t";

/// The store's queries, each with its own gate and counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Query {
    Markers,
    Events,
    Fill,
}

impl Query {
    fn index(self) -> usize {
        self as usize
    }
}

/// Where a query waits while a test holds it, and how many queries have reached it.
struct Gate {
    open: watch::Sender<bool>,
    reached: watch::Sender<usize>,
    fail_next: AtomicBool,
    calls: AtomicUsize,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            open: watch::Sender::new(true),
            reached: watch::Sender::new(0),
            fail_next: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
        }
    }
}

/// aihub's event collection in memory: rows as the persister wrote them (decoded, as the store path yields them).
#[derive(Clone, Default)]
struct FakeStore {
    rows: Arc<Mutex<Vec<ViewEvent>>>,
    gates: Arc<[Gate; 3]>,
}

impl FakeStore {
    fn persist(&self, event: &ViewEvent) {
        self.rows.lock().unwrap().push(event.clone());
    }

    fn gate(&self, query: Query) -> &Gate {
        &self.gates[query.index()]
    }

    /// Queries of this kind wait at their gate until [`FakeStore::release`].
    fn hold(&self, query: Query) {
        self.gate(query).open.send_replace(false);
    }

    fn release(&self, query: Query) {
        self.gate(query).open.send_replace(true);
    }

    /// The next query of this kind fails as an outage would.
    fn fail_next(&self, query: Query) {
        self.gate(query).fail_next.store(true, Ordering::SeqCst);
    }

    fn calls(&self, query: Query) -> usize {
        self.gate(query).calls.load(Ordering::SeqCst)
    }

    /// Waits until `n` queries of this kind have reached their gate.
    async fn reached(&self, query: Query, n: usize) {
        let mut reached = self.gate(query).reached.subscribe();
        reached
            .wait_for(|&k| k >= n)
            .await
            .expect("the gate lives as long as the store");
    }

    /// Counts the query, waits at the gate while it is held, then fails if told to.
    async fn pass(&self, query: Query) -> Result<(), StoreError> {
        let gate = self.gate(query);
        gate.calls.fetch_add(1, Ordering::SeqCst);
        gate.reached.send_modify(|n| *n += 1);
        let mut open = gate.open.subscribe();
        open.wait_for(|&open| open)
            .await
            .expect("the gate lives as long as the store");
        if gate.fail_next.swap(false, Ordering::SeqCst) {
            return Err(StoreError::Timeout(Duration::from_millis(1)));
        }
        Ok(())
    }

    /// The rows `keep` selects, stopped at `budget` bytes as the real store's cursor is.
    fn select(
        &self,
        budget: usize,
        keep: impl Fn(&ViewEvent) -> bool,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        let mut events: Vec<ViewEvent> = self
            .rows
            .lock()
            .unwrap()
            .iter()
            .filter(|e| keep(e))
            .cloned()
            .collect();
        events.sort_by_key(|e| {
            (
                e.created_at.unwrap_or(i64::MIN),
                e.key.event_id().to_owned(),
            )
        });
        let bytes: usize = events.iter().map(event_bytes).sum();
        if bytes > budget {
            return Err(StoreError::TooLarge { limit: budget });
        }
        Ok(events)
    }
}

impl StoreReads for FakeStore {
    async fn visible_displays(
        &self,
        thread_id: &str,
        _hydration: Hydration,
        _bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        self.pass(Query::Markers).await?;
        let mut displays: Vec<String> = Vec::new();
        for event in self.rows.lock().unwrap().iter() {
            let display = event.key.display_id();
            if event.key.thread_id() == thread_id
                && event.is_marker()
                && !displays.iter().any(|d| d == display)
            {
                displays.push(display.to_owned());
            }
        }
        Ok(VisibleDisplays {
            displays,
            skipped_markers: 0,
        })
    }

    async fn display_events(
        &self,
        thread_id: &str,
        displays: &[String],
        _hydration: Hydration,
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        self.pass(Query::Events).await?;
        self.select(bounds.budget, |e| {
            e.key.thread_id() == thread_id && displays.iter().any(|d| d == e.key.display_id())
        })
    }

    async fn stored_rows(
        &self,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
    ) -> Result<Vec<StoredRow>, StoreError> {
        let events = self.display_events(thread_id, displays, Hydration::Shadow, bounds);
        // Every row of the fake was persisted long before any read.
        Ok(events
            .await?
            .into_iter()
            .map(|event| StoredRow {
                event,
                persisted_ms: Some(0),
            })
            .collect())
    }

    async fn fill_events(
        &self,
        wanted: &[(&str, &[Box<str>])],
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        self.pass(Query::Fill).await?;
        self.select(bounds.budget, |e| {
            wanted.iter().any(|(thread, displays)| {
                *thread == e.key.thread_id() && displays.iter().any(|d| **d == *e.key.display_id())
            })
        })
    }
}

fn event(family: &str, agent: &str, display: &str, id: &str, at: i64, data: &str) -> ViewEvent {
    let key = DeliveryKey::parse_subject(&format!(
        "agent.{agent}.{agent}-1.{THREAD}.{display}.run.display_event.{family}.{id}"
    ))
    .expect("a display-event subject");
    let payload = format!(r#"{{"_parent_event_names": ["{family}"], "created_at": {at}, {data}}}"#);
    match decode_payload(key, payload.as_bytes()) {
        Ok(Decoded::Event(event)) => event,
        other => panic!("a relevant event expected, got {other:?}"),
    }
}

/// A user turn: a visibility marker of `display`.
fn user(display: &str, id: &str, at: i64) -> ViewEvent {
    event(
        "UserMessageEvent",
        "UserAgent",
        display,
        id,
        at,
        r#""messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "question"}]}]"#,
    )
}

fn chunk(display: &str, id: &str, at: i64, text: &str) -> ViewEvent {
    event(
        "ChunkEvent",
        "Primary",
        display,
        id,
        at,
        &format!(r#""content": "{text}""#),
    )
}

/// The cache over a fake store, NATS confirmed live at the start of (paused) time.
struct Scene {
    views: ViewCache<FakeStore>,
    store: FakeStore,
    coverage: Coverage,
}

impl Scene {
    fn new() -> Self {
        Self::with_thread_limit(64 << 20)
    }

    fn with_thread_limit(max_thread_bytes: usize) -> Self {
        Self::build(max_thread_bytes, 0.0)
    }

    /// Every read answered from memory is shadow-checked.
    fn shadowed() -> Self {
        Self::build(64 << 20, 1.0)
    }

    fn build(max_thread_bytes: usize, sample: f64) -> Self {
        let store = FakeStore::default();
        let coverage = Coverage::new(LAG);
        assert!(coverage.confirm_live(coverage.connection(), coverage.now()));
        let setup = CacheSetup {
            settings: CacheSettings {
                max_bytes: 64 << 20,
                idle: Duration::from_secs(3_600),
                concurrent_hydrations: 4,
                max_thread_bytes,
            },
            shadow: ShadowSettings {
                sample,
                max_per_sec: 1_000,
                clock_margin: Duration::from_secs(1),
            },
            bounds: StoreBounds {
                store_timeout: Duration::from_secs(2),
                persist_lag: LAG,
            },
            gap_window: Duration::from_secs(12),
        };
        let views = ViewCache::new(
            store.clone(),
            Metrics::new(),
            coverage.clone(),
            Freshness::new(),
            setup,
        );
        Self {
            views,
            store,
            coverage,
        }
    }

    /// A thread persisted before the worker heard of it: one visible turn on `d1` with an answer.
    fn stored_turn(&self) {
        self.store.persist(&user("d1", "u1", 1));
        self.store.persist(&chunk("d1", "c1", 2, "answer-one"));
    }

    /// Past the persister-lag bound since coverage started: a store read now may complete a view.
    async fn past_the_bound(&self) {
        tokio::time::sleep(LAG).await;
    }

    async fn read(&self) -> Result<Answer<HistoryBody>, ReadError> {
        self.views.read::<HistoryBody>(THREAD, None).await
    }

    fn spawn_read(&self) -> tokio::task::JoinHandle<Result<Answer<HistoryBody>, ReadError>> {
        let views = self.views.clone();
        tokio::spawn(async move { views.read::<HistoryBody>(THREAD, None).await })
    }

    /// A cold read of a stored thread past the bound, held at `query`'s gate until the test releases it.
    async fn read_held_at(
        &self,
        query: Query,
    ) -> tokio::task::JoinHandle<Result<Answer<HistoryBody>, ReadError>> {
        self.stored_turn();
        self.past_the_bound().await;
        self.store.hold(query);
        let reader = self.spawn_read();
        self.store.reached(query, 1).await;
        reader
    }

    /// A complete thread whose new turn's fill is held at its gate (told to fail if `fails`), with a read that
    /// arrived meanwhile and waits.
    async fn read_during_held_fill(
        &self,
        fails: bool,
    ) -> tokio::task::JoinHandle<Result<Answer<HistoryBody>, ReadError>> {
        self.complete_thread().await;
        self.store.hold(Query::Fill);
        if fails {
            self.store.fail_next(Query::Fill);
        }
        self.new_turn_revealing_a_stored_event().await;
        self.store.reached(Query::Fill, 1).await;
        let reader = self.spawn_read();
        settle().await;
        reader
    }

    /// A thread complete in memory: stored, read past the bound, then answered from the cache.
    async fn complete_thread(&self) {
        self.stored_turn();
        self.past_the_bound().await;
        assert_eq!(self.read().await.unwrap().source, Source::Store);
        assert_eq!(self.read().await.unwrap().source, Source::Cache);
    }

    /// A new turn on `d2`: an answer persisted before the worker saw it live, then its marker live and stored.
    async fn new_turn_revealing_a_stored_event(&self) {
        self.store.persist(&chunk("d2", "c2", 3, "answer-two"));
        let marker = user("d2", "u2", 4);
        self.store.persist(&marker);
        self.views.apply(marker).await;
    }
}

/// Lets every spawned task run until it waits on something only the test can release: paused time advances only
/// when every task is idle.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

fn body(answer: &Answer<HistoryBody>) -> String {
    String::from_utf8(answer.body.body.to_vec()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn concurrent_readers_of_a_cold_thread_share_one_hydration() {
    let scene = Scene::new();
    scene.stored_turn();
    scene.past_the_bound().await;
    scene.store.hold(Query::Markers);
    let readers: Vec<_> = (0..8).map(|_| scene.spawn_read()).collect();
    scene.store.reached(Query::Markers, 1).await;
    settle().await;
    scene.store.release(Query::Markers);
    let mut bodies = Vec::new();
    for reader in readers {
        let answer = reader.await.unwrap().unwrap();
        assert_eq!(answer.source, Source::Store);
        bodies.push(body(&answer));
    }
    assert!(
        bodies
            .iter()
            .all(|b| *b == bodies[0] && b.contains("answer-one"))
    );
    assert_eq!(scene.store.calls(Query::Markers), 1);
    assert_eq!(scene.store.calls(Query::Events), 1);
    // The hydration completed the view: the next read needs no store.
    assert_eq!(scene.read().await.unwrap().source, Source::Cache);
    assert_eq!(scene.store.calls(Query::Markers), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_hydration_fails_its_waiters_at_once_and_the_next_read_tries_again() {
    let scene = Scene::new();
    scene.store.fail_next(Query::Markers);
    let first = scene.read_held_at(Query::Markers).await;
    let waiters: Vec<_> = (0..3).map(|_| scene.spawn_read()).collect();
    settle().await;
    scene.store.release(Query::Markers);
    assert!(matches!(
        first.await.unwrap(),
        Err(ReadError::Store(StoreError::Timeout(_)))
    ));
    for waiter in waiters {
        assert!(matches!(
            waiter.await.unwrap(),
            Err(ReadError::ConcurrentReadFailed)
        ));
    }
    assert_eq!(
        scene.store.calls(Query::Markers),
        1,
        "waiters do not queue store reads"
    );
    let answer = scene.read().await.unwrap();
    assert!(body(&answer).contains("answer-one"));
    assert_eq!(scene.store.calls(Query::Markers), 2);
}

#[tokio::test(start_paused = true)]
async fn a_view_held_partial_by_the_bound_is_completed_by_one_background_reread() {
    let scene = Scene::new();
    scene.stored_turn();
    // Within the bound after coverage started: answered from the store, but not complete.
    assert_eq!(scene.read().await.unwrap().source, Source::Store);
    assert_eq!(scene.read().await.unwrap().source, Source::Store);
    assert_eq!(scene.store.calls(Query::Markers), 2);
    scene.past_the_bound().await;
    settle().await;
    // One re-read for the entry, however many reads were held partial.
    assert_eq!(scene.store.calls(Query::Markers), 3);
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, Source::Cache);
    assert!(body(&answer).contains("answer-one"));
    assert_eq!(scene.store.calls(Query::Markers), 3);
}

#[tokio::test(start_paused = true)]
async fn a_gap_during_a_hydration_leaves_the_view_partial() {
    let scene = Scene::new();
    let reader = scene.read_held_at(Query::Events).await;
    scene.coverage.gap(scene.coverage.now());
    scene.store.release(Query::Events);
    let answer = reader.await.unwrap().unwrap();
    assert!(
        body(&answer).contains("answer-one"),
        "answered from the store"
    );
    // The read started before the gap: it cannot complete the view.
    assert_eq!(scene.read().await.unwrap().source, Source::Store);
    scene.past_the_bound().await;
    settle().await;
    assert_eq!(scene.read().await.unwrap().source, Source::Cache);
}

#[tokio::test(start_paused = true)]
async fn a_removal_in_the_bucket_during_a_hydration_leaves_the_view_partial() {
    let scene = Scene::new();
    let reader = scene.read_held_at(Query::Markers).await;
    // Another entry of the thread's bucket (say its predecessor) is dropped while the read runs.
    let bucket = coverage::bucket(THREAD);
    scene.coverage.entry_created(bucket, scene.coverage.now());
    scene.coverage.entry_dropped(bucket, scene.coverage.now());
    scene.store.release(Query::Markers);
    assert!(body(&reader.await.unwrap().unwrap()).contains("answer-one"));
    assert_eq!(scene.read().await.unwrap().source, Source::Store);
}

#[tokio::test(start_paused = true)]
async fn a_read_during_a_fill_waits_for_it_and_the_view_is_complete_after() {
    let scene = Scene::new();
    let reader = scene.read_during_held_fill(false).await;
    assert!(!reader.is_finished(), "the read waits for the fill");
    scene.store.release(Query::Fill);
    let answer = reader.await.unwrap().unwrap();
    assert_eq!(answer.source, Source::Store);
    assert!(
        body(&answer).contains("answer-two"),
        "the filled event is in"
    );
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, Source::Cache);
    assert!(body(&answer).contains("answer-two"));
    assert_eq!(scene.store.calls(Query::Fill), 1);
    assert_eq!(scene.store.calls(Query::Markers), 1, "no hydration");
}

#[tokio::test(start_paused = true)]
async fn a_failed_fill_fails_its_waiting_reader_and_the_next_read_hydrates() {
    let scene = Scene::new();
    let reader = scene.read_during_held_fill(true).await;
    scene.store.release(Query::Fill);
    assert!(matches!(
        reader.await.unwrap(),
        Err(ReadError::ConcurrentReadFailed)
    ));
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, Source::Store);
    assert!(body(&answer).contains("answer-two"));
    assert_eq!(scene.store.calls(Query::Markers), 2, "the read hydrated");
}

#[tokio::test(start_paused = true)]
async fn a_gap_during_a_fill_leaves_the_view_partial_and_its_reader_hydrates() {
    let scene = Scene::new();
    let reader = scene.read_during_held_fill(false).await;
    scene.coverage.gap(scene.coverage.now());
    scene.store.release(Query::Fill);
    let answer = reader.await.unwrap().unwrap();
    assert_eq!(answer.source, Source::Store);
    assert!(body(&answer).contains("answer-two"));
    assert_eq!(
        scene.store.calls(Query::Markers),
        2,
        "partial after the gap: hydrated"
    );
    assert_eq!(scene.read().await.unwrap().source, Source::Store);
}

#[tokio::test(start_paused = true)]
async fn a_thread_past_the_limit_answers_too_large_from_the_store_and_from_a_live_view() {
    let limit = 64 << 10;
    let scene = Scene::with_thread_limit(limit);
    scene.stored_turn();
    scene
        .store
        .persist(&chunk("d1", "big", 3, &"x".repeat(limit)));
    scene.past_the_bound().await;
    assert!(matches!(
        scene.read().await,
        Err(ReadError::TooLarge { limit: l }) if l == limit
    ));

    // A complete view that outgrows the limit live leaves the cache; the store answers the same.
    let scene = Scene::with_thread_limit(limit);
    scene.complete_thread().await;
    let big = chunk("d1", "big", 3, &"x".repeat(limit));
    scene.store.persist(&big);
    scene.views.apply(big).await;
    assert!(matches!(
        scene.read().await,
        Err(ReadError::TooLarge { limit: l }) if l == limit
    ));
}

/// Issue 36: an event that arrives while a reader holds the view is applied by that reader, after the live path
/// checked the limit; the view it takes past the limit must not be answered from memory (a feed's reads made this
/// common: the thread stayed cached past the limit and its history answered 200).
#[tokio::test(start_paused = true)]
async fn a_view_taken_past_the_limit_by_its_holder_is_not_answered_from_memory() {
    let limit = 64 << 10;
    let scene = Scene::with_thread_limit(limit);
    scene.complete_thread().await;
    let big = chunk("d1", "big", 3, &"x".repeat(limit));
    scene.store.persist(&big);
    let entry = scene.views.entry(THREAD).await;
    let held = entry.lock_view(&scene.views.metrics);
    // The view is held: the event waits beside it, and the live path's check sees the view as it was.
    assert!(scene.views.apply(big).await.is_none());
    // Letting go applies it.
    drop(held);
    assert!(matches!(
        scene.read().await,
        Err(ReadError::TooLarge { limit: l }) if l == limit
    ));
}

#[tokio::test(start_paused = true)]
async fn a_reader_that_goes_away_mid_hydration_hands_the_store_job_to_the_next() {
    let scene = Scene::new();
    let first = scene.read_held_at(Query::Markers).await;
    let second = scene.spawn_read();
    settle().await;
    // The first reader's request is cancelled (its client hung up) while its hydration waits on the store.
    first.abort();
    scene.store.reached(Query::Markers, 2).await;
    scene.store.release(Query::Markers);
    let answer = second.await.unwrap().unwrap();
    assert!(body(&answer).contains("answer-one"));
    assert_eq!(scene.read().await.unwrap().source, Source::Cache);
}

/// The count of one `history_view_shadow_checks_total` result.
fn shadow_checks(views: &ViewCache<FakeStore>, result: &str) -> f64 {
    let sample = format!("history_view_shadow_checks_total{{result=\"{result}\"}} ");
    views
        .metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(&sample)?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(start_paused = true)]
async fn a_shadow_check_finds_a_stored_row_the_view_lacks_and_heals_the_view() {
    let scene = Scene::shadowed();
    scene.complete_thread().await;
    // The read from memory above was sampled; its view held everything stored.
    tokio::time::sleep(LAG * 8).await;
    assert_eq!(shadow_checks(&scene.views, "match"), 1.0);

    // A row reaches the store by another path than NATS (a backfill): the complete view answers without it.
    scene
        .store
        .persist(&chunk("d1", "backfilled", 3, "from-a-backfill"));
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, Source::Cache);
    assert!(!body(&answer).contains("from-a-backfill"));
    // A second read while its check waits is not checked again.
    scene.read().await.unwrap();
    assert_eq!(shadow_checks(&scene.views, "dropped"), 1.0);

    // Past the bound (and, with no probe to prove the link alive, the gap window) the check finds it missing and
    // makes the view partial: the next read hydrates and holds it.
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert_eq!(shadow_checks(&scene.views, "missing"), 1.0);
    let healed = scene.read().await.unwrap();
    assert_eq!(healed.source, Source::Store);
    assert!(body(&healed).contains("from-a-backfill"));
}

#[tokio::test(start_paused = true)]
async fn a_failure_followed_by_a_gap_counts_as_a_window_and_verify_reports_it_on_demand() {
    let scene = Scene::shadowed();
    scene.complete_thread().await;
    tokio::time::sleep(LAG * 8).await;
    scene
        .store
        .persist(&chunk("d1", "unseen", 3, "missed-live"));
    assert_eq!(scene.read().await.unwrap().source, Source::Cache);
    // A dead link noticed after the read: what the read lacked is not a promise broken.
    tokio::time::sleep(LAG + Duration::from_secs(1)).await;
    scene.coverage.gap(scene.coverage.now());
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert_eq!(shadow_checks(&scene.views, "window"), 1.0);
    assert_eq!(shadow_checks(&scene.views, "missing"), 0.0);

    // On demand: the view (hydrated again) holds the row now.
    scene.past_the_bound().await;
    scene.read().await.unwrap();
    let report = scene.views.verify(THREAD).await.unwrap().unwrap();
    assert_eq!(report.result, crate::shadow::Verdict::Match);
    assert_eq!(report.counts["match"], 3);
    assert!(!report.healed);
    assert!(scene.views.verify("not-cached").await.unwrap().is_none());
}
