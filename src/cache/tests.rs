//! The read path's orchestration without servers: the cache over an in-memory store whose queries a test can hold
//! at a gate (to race them against a read, a gap or a removal) or fail, on tokio's paused clock (the read path's one
//! clock), so re-reads and deadlines run when the test advances time. The black-box tests prove the same rules
//! against real servers.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use super::{
    Answer, AnswerSource, CacheSettings, CacheSetup, HistoryBody, ReadError, Verified,
    VerifyReport, ViewCache,
};
use crate::bounds::StoreBounds;
use crate::coverage::Coverage;
use crate::decode::{Decoded, STORED, ViewEvent, decode_payload};
use crate::explain::{RowMeta, ViewFates};
use crate::freshness::{Freshness, Part};
use crate::shadow::{ShadowSettings, StoredRow, Verdict};
use crate::startup::Metrics;
use crate::store::{Bounds, Hydration, StoreError, StoreReads, VisibleDisplays};
use crate::subject::DeliveryKey;
use crate::view::{PublisherContext, event_bytes};
use crate::warm_up::{WarmMetrics, WarmPlan, WarmReport};

const LAG: Duration = Duration::from_millis(2_000);
const THREAD: &str = "t";

/// The store's queries, each with its own gate and counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Query {
    Markers,
    Events,
    Fill,
    /// Explain's row scan.
    Explain,
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
    gates: Arc<[Gate; 4]>,
}

impl FakeStore {
    /// Stores `event` as the persister would (a row read back is [`STORED`], whenever it arrived).
    fn persist(&self, event: &ViewEvent) {
        let mut row = event.clone();
        row.arrived = STORED;
        self.rows.lock().unwrap().push(row);
    }

    /// Deletes every row of `thread`, as aihub deletes a thread.
    fn delete_thread(&self, thread: &str) {
        self.rows
            .lock()
            .unwrap()
            .retain(|row| row.key.thread_id() != thread);
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

    async fn row_metadata(
        &self,
        thread_id: &str,
        bounds: Bounds,
    ) -> Result<Vec<RowMeta>, StoreError> {
        self.pass(Query::Explain).await?;
        let rows = self.select(bounds.budget, |e| e.key.thread_id() == thread_id)?;
        Ok(rows
            .into_iter()
            .map(|e| RowMeta {
                created_at: e.created_at.as_ref().ok().copied(),
                relevant: true,
                marker: e.is_marker(),
                key: e.key,
            })
            .collect())
    }
}

fn event(family: &str, agent: &str, display: &str, id: &str, at: i64, data: &str) -> ViewEvent {
    event_on(THREAD, family, agent, display, id, at, data)
}

fn event_on(
    thread: &str,
    family: &str,
    agent: &str,
    display: &str,
    id: &str,
    at: i64,
    data: &str,
) -> ViewEvent {
    let key = DeliveryKey::parse_subject(&format!(
        "agent.{agent}.{agent}-1.{thread}.{display}.run.display_event.{family}.{id}"
    ))
    .expect("a display-event subject");
    let payload = format!(r#"{{"_parent_event_names": ["{family}"], "created_at": {at}, {data}}}"#);
    match decode_payload(key, payload.as_bytes()) {
        // As received live now (a stored copy is made by `FakeStore::persist`).
        Ok(Decoded::Event(event)) => ViewEvent {
            arrived: crate::decode::arrival(std::time::SystemTime::now()),
            ..event
        },
        other => panic!("a relevant event expected, got {other:?}"),
    }
}

/// A user turn: a visibility marker of `display`.
fn user(display: &str, id: &str, at: i64) -> ViewEvent {
    user_on(THREAD, display, id, at)
}

/// [`user`] on `thread`.
fn user_on(thread: &str, display: &str, id: &str, at: i64) -> ViewEvent {
    event_on(
        thread,
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

/// The wall clock's now in nanoseconds since the Unix epoch, as a `created_at` (the paused clock does not move it).
fn wall_ns() -> i64 {
    i64::try_from(crate::freshness::millis(std::time::SystemTime::now())).unwrap() * 1_000_000
}

/// The cache over a fake store, NATS confirmed live at the start of (paused) time.
struct Scene {
    views: ViewCache<FakeStore>,
    store: FakeStore,
    coverage: Coverage,
    freshness: Freshness,
    /// Every wing's metrics, the cache's among them.
    metrics: Metrics,
    /// Whether the live source keeps proving what it applied ([`probes`]).
    probing: Arc<AtomicBool>,
}

/// The live source as Core NATS is: a round-trip probe applied every quarter of the window, while `probing`.
async fn probes(coverage: Coverage, freshness: Freshness, probing: Arc<AtomicBool>) {
    loop {
        if probing.load(Ordering::Acquire) {
            freshness.covered(Part::Probe, coverage.now());
        }
        tokio::time::sleep(freshness.prove_every()).await;
    }
}

impl Scene {
    fn new() -> Self {
        Self::with_thread_limit(64 << 20)
    }

    fn with_thread_limit(max_thread_bytes: usize) -> Self {
        Self::build(max_thread_bytes, 0.0, 1_000)
    }

    /// Every read answered from memory is shadow-checked.
    fn shadowed() -> Self {
        Self::build(64 << 20, 1.0, 1_000)
    }

    /// No sampled checks; `verify` within `max_per_sec` a second.
    fn verify_budget(max_per_sec: u32) -> Self {
        Self::build(64 << 20, 0.0, max_per_sec)
    }

    fn build(max_thread_bytes: usize, sample: f64, max_per_sec: u32) -> Self {
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
                max_per_sec,
                clock_margin: Duration::from_secs(1),
            },
            bounds: StoreBounds {
                store_timeout: Duration::from_secs(2),
                persist_lag: LAG,
            },
            gap_window: Duration::from_secs(12),
        };
        let freshness = Freshness::new(coverage.clone(), LAG);
        let metrics = Metrics::new();
        crate::telemetry::testing::undecided_default();
        let views = ViewCache::new(
            store.clone(),
            metrics.views(),
            coverage.clone(),
            freshness.clone(),
            setup,
        );
        let probing = Arc::new(AtomicBool::new(true));
        tokio::spawn(probes(
            coverage.clone(),
            freshness.clone(),
            Arc::clone(&probing),
        ));
        Self {
            views,
            store,
            coverage,
            freshness,
            metrics,
            probing,
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
        assert_eq!(self.read().await.unwrap().source, AnswerSource::Store);
        assert_eq!(self.read().await.unwrap().source, AnswerSource::Cache);
    }

    /// A new turn on `d2`: an answer persisted before the worker saw it live, then its marker live and stored.
    async fn new_turn_revealing_a_stored_event(&self) {
        self.store.persist(&chunk("d2", "c2", 3, "answer-two"));
        let marker = user("d2", "u2", 4);
        self.store.persist(&marker);
        self.views.apply(marker, None).await;
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
        assert_eq!(answer.source, AnswerSource::Store);
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
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
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
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
    assert_eq!(scene.store.calls(Query::Markers), 2);
    scene.past_the_bound().await;
    settle().await;
    // One re-read for the entry, however many reads were held partial.
    assert_eq!(scene.store.calls(Query::Markers), 3);
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
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
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
    scene.past_the_bound().await;
    settle().await;
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
}

#[tokio::test(start_paused = true)]
async fn a_removal_in_the_bucket_during_a_hydration_leaves_the_view_partial() {
    let scene = Scene::new();
    let reader = scene.read_held_at(Query::Markers).await;
    // Another entry of the thread's bucket (say its predecessor) is dropped while the read runs.
    scene.coverage.entry_created(THREAD, scene.coverage.now());
    scene.coverage.entry_dropped(THREAD, scene.coverage.now());
    scene.store.release(Query::Markers);
    assert!(body(&reader.await.unwrap().unwrap()).contains("answer-one"));
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
}

#[tokio::test(start_paused = true)]
async fn a_read_during_a_fill_waits_for_it_and_the_view_is_complete_after() {
    let scene = Scene::new();
    let reader = scene.read_during_held_fill(false).await;
    assert!(!reader.is_finished(), "the read waits for the fill");
    scene.store.release(Query::Fill);
    let answer = reader.await.unwrap().unwrap();
    assert_eq!(answer.source, AnswerSource::Store);
    assert!(
        body(&answer).contains("answer-two"),
        "the filled event is in"
    );
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
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
    assert_eq!(answer.source, AnswerSource::Store);
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
    assert_eq!(answer.source, AnswerSource::Store);
    assert!(body(&answer).contains("answer-two"));
    assert_eq!(
        scene.store.calls(Query::Markers),
        2,
        "partial after the gap: hydrated"
    );
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
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
    scene.views.apply(big, None).await;
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
    assert!(scene.views.apply(big, None).await.is_none());
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
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
}

/// The count of one `history_view_shadow_checks_total` result.
fn shadow_checks(scene: &Scene, result: &str) -> f64 {
    let sample = format!("history_view_shadow_checks_total{{result=\"{result}\"}} ");
    scene
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
    assert_eq!(shadow_checks(&scene, "match"), 1.0);

    // A row reaches the store by another path than NATS (a backfill): the complete view answers without it.
    scene
        .store
        .persist(&chunk("d1", "backfilled", 3, "from-a-backfill"));
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
    assert!(!body(&answer).contains("from-a-backfill"));
    // A second read while its check waits is not checked again.
    scene.read().await.unwrap();
    assert_eq!(shadow_checks(&scene, "dropped"), 1.0);

    // Past the bound (and, with no probe to prove the link alive, the gap window) the check finds it missing and
    // makes the view partial: the next read hydrates and holds it.
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert_eq!(shadow_checks(&scene, "missing"), 1.0);
    let healed = scene.read().await.unwrap();
    assert_eq!(healed.source, AnswerSource::Store);
    assert!(body(&healed).contains("from-a-backfill"));
}

fn orphaned_events(scene: &Scene) -> f64 {
    crate::metrics::sample(
        &scene.metrics.render(),
        "history_view_orphaned_events_total",
    )
    .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_deleted_thread_leaves_memory_by_a_shadow_check_and_its_next_hydration() {
    let scene = Scene::shadowed();
    scene.complete_thread().await;
    // The turn (created long ago) arrives again live, as a replay or a late delivery would bring it.
    scene.views.apply(user("d1", "u1", 1), None).await;
    scene.store.delete_thread(THREAD);
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
    assert!(body(&answer).contains("answer-one"));
    // The check, the bound after the read, finds the held turn orphaned and makes the view partial.
    tokio::time::sleep(LAG + Duration::from_millis(100)).await;
    settle().await;
    assert_eq!(shadow_checks(&scene, "orphaned"), 1.0);
    assert_eq!(shadow_checks(&scene, "missing"), 0.0);
    // The next read hydrates and leaves the turn out, as aihub's own read does.
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Store);
    assert!(!body(&answer).contains("answer-one"), "{}", body(&answer));
    // Its marker: the answer stays, on a display no longer visible, as the store's rows of it would be (stage 2
    // reads only visible displays, so nothing says whether the store still has it).
    assert_eq!(orphaned_events(&scene), 1.0);
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
}

#[tokio::test(start_paused = true)]
async fn a_hydration_drops_replayed_events_of_a_deleted_thread_and_keeps_those_the_store_may_not_have_yet()
 {
    let scene = Scene::new();
    // A replay brings a deleted thread's old turn (the stream stored it ten seconds ago), and a new turn that is
    // not stored yet.
    let now = wall_ns();
    let replayed = |mut event: ViewEvent| {
        event.arrived -= 10;
        event
    };
    scene.views.apply(replayed(user("d1", "u1", 1)), None).await;
    scene
        .views
        .apply(replayed(chunk("d1", "c1", 2, "answer-one")), None)
        .await;
    scene.views.apply(user("d2", "u2", now), None).await;
    scene
        .views
        .apply(chunk("d2", "c2", now + 1, "answer-two"), None)
        .await;
    scene.past_the_bound().await;
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Store);
    let text = body(&answer);
    assert!(!text.contains("answer-one"), "{text}");
    assert!(text.contains("answer-two"), "{text}");
    // The old turn's marker; its answer stays held, on a display no longer visible.
    assert_eq!(orphaned_events(&scene), 1.0);
    // The replay goes on after the hydration: an old event of the deleted turn is judged by its cut too.
    scene
        .views
        .apply(replayed(user("d2", "u-old", 1)), None)
        .await;
    assert_eq!(body(&scene.read().await.unwrap()), text);
    assert_eq!(orphaned_events(&scene), 2.0);
}

#[tokio::test(start_paused = true)]
async fn a_failure_followed_by_a_gap_counts_as_a_window_and_verify_reports_it_on_demand() {
    let scene = Scene::shadowed();
    scene.complete_thread().await;
    tokio::time::sleep(LAG * 8).await;
    scene
        .store
        .persist(&chunk("d1", "unseen", 3, "missed-live"));
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
    // A dead link noticed after the read (its probes stop coming back): what the read lacked is not a promise
    // broken.
    scene.probing.store(false, Ordering::Release);
    tokio::time::sleep(LAG + Duration::from_secs(1)).await;
    scene.coverage.gap(scene.coverage.now());
    tokio::time::sleep(Duration::from_secs(13)).await;
    assert_eq!(shadow_checks(&scene, "window"), 1.0);
    assert_eq!(shadow_checks(&scene, "missing"), 0.0);

    // On demand: the view (hydrated again) holds the row now.
    scene.probing.store(true, Ordering::Release);
    scene.past_the_bound().await;
    scene.read().await.unwrap();
    let report = verified(&scene.views).await;
    assert_eq!(report.result, Verdict::Match);
    assert_eq!(report.counts["match"], 3);
    assert!(!report.healed);
    assert!(matches!(
        scene.views.verify("not-cached").await,
        Ok(Verified::NotCached)
    ));
}

/// A verify of the thread that answered a report.
async fn verified(views: &ViewCache<FakeStore>) -> VerifyReport {
    match views.verify(THREAD).await {
        Ok(Verified::Report(report)) => report,
        other => panic!("a report expected, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn verify_has_a_budget_of_its_own_and_beyond_it_is_refused_without_a_store_query() {
    let scene = Scene::verify_budget(2);
    scene.complete_thread().await;
    let queries = scene.store.calls(Query::Markers);
    // The bucket holds one second's worth: two verifies, each one stage-1 query.
    for _ in 0..2 {
        assert_eq!(verified(&scene.views).await.result, Verdict::Match);
    }
    assert_eq!(scene.store.calls(Query::Markers), queries + 2);
    for _ in 0..50 {
        assert!(matches!(
            scene.views.verify(THREAD).await,
            Ok(Verified::Refused)
        ));
    }
    assert_eq!(
        scene.store.calls(Query::Markers),
        queries + 2,
        "refused: no query"
    );
    assert_eq!(shadow_checks(&scene, "refused"), 50.0);
    assert_eq!(shadow_checks(&scene, "match"), 2.0);

    // Half a second refills one token.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(verified(&scene.views).await.result, Verdict::Match);
    assert!(matches!(
        scene.views.verify(THREAD).await,
        Ok(Verified::Refused)
    ));

    // One verify of a thread at a time: a second while the first waits on the store is refused, even with tokens.
    tokio::time::sleep(Duration::from_secs(1)).await;
    scene.store.hold(Query::Markers);
    let views = scene.views.clone();
    let first = tokio::spawn(async move { views.verify(THREAD).await });
    scene.store.reached(Query::Markers, queries + 4).await;
    assert!(matches!(
        scene.views.verify(THREAD).await,
        Ok(Verified::Refused)
    ));
    // Its client hangs up: the thread may be verified again.
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    scene.store.release(Query::Markers);
    assert_eq!(verified(&scene.views).await.result, Verdict::Match);
    // A thread not cached costs no token.
    assert!(matches!(
        scene.views.verify("not-cached").await,
        Ok(Verified::NotCached)
    ));
}

#[tokio::test(start_paused = true)]
async fn verify_of_a_view_not_complete_answers_not_complete_and_counts_no_failure() {
    let scene = Scene::verify_budget(5);
    scene.stored_turn();
    // Within the bound after coverage started: the view is partial, never served as complete.
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
    // A row the view lacks, surely stored long before (the fake's rows are all that old).
    scene.store.persist(&chunk("d1", "unseen", 3, "backfilled"));
    let queries = scene.store.calls(Query::Markers);
    let report = verified(&scene.views).await;
    assert_eq!(report.result, Verdict::NotComplete);
    assert_eq!(report.view, "partial");
    assert!(!report.healed);
    assert!(report.divergent.is_empty());
    assert_eq!(report.counts["missing"], 0);
    assert_eq!(scene.store.calls(Query::Markers), queries, "not compared");
    assert_eq!(shadow_checks(&scene, "not_complete"), 1.0);
    for failure in ["missing", "late", "differs"] {
        assert_eq!(shadow_checks(&scene, failure), 0.0, "{failure}");
    }

    // Completed by its re-read past the bound, it holds the row: compared now, it matches.
    scene.past_the_bound().await;
    settle().await;
    let report = verified(&scene.views).await;
    assert_eq!(report.view, "complete");
    assert_eq!(report.result, Verdict::Match);
    assert_eq!(report.counts["match"], 3);
}

/// An explain as the handler runs it: the thread's fates through the read path, then the stored rows' metadata.
async fn explain(
    views: &ViewCache<FakeStore>,
    thread_id: &str,
) -> Result<(AnswerSource, usize), ReadError> {
    let answer = views.read::<ViewFates>(thread_id, None).await?;
    let scan = views.row_metadata(thread_id).await?;
    Ok((answer.source, scan.rows.len()))
}

#[tokio::test(start_paused = true)]
async fn concurrent_explains_of_a_complete_thread_share_one_row_scan_and_no_hydration() {
    let scene = Scene::new();
    scene.complete_thread().await;
    let hydrations = scene.store.calls(Query::Markers);
    scene.store.hold(Query::Explain);
    let explains: Vec<_> = (0..16)
        .map(|_| {
            let views = scene.views.clone();
            tokio::spawn(async move { explain(&views, THREAD).await })
        })
        .collect();
    scene.store.reached(Query::Explain, 1).await;
    settle().await;
    // Every explain waits for the one scan in flight.
    assert_eq!(scene.store.calls(Query::Explain), 1);
    scene.store.release(Query::Explain);
    for explain in explains {
        // The fates from memory, the two stored rows from the shared scan.
        assert_eq!(explain.await.unwrap().unwrap(), (AnswerSource::Cache, 2));
    }
    assert_eq!(scene.store.calls(Query::Explain), 1);
    assert_eq!(
        scene.store.calls(Query::Markers),
        hydrations,
        "no hydration"
    );
    // A later explain is not answered from the finished scan: it scans again.
    scene.store.persist(&chunk("d1", "c2", 3, "later"));
    assert_eq!(
        explain(&scene.views, THREAD).await.unwrap(),
        (AnswerSource::Cache, 3)
    );
    assert_eq!(scene.store.calls(Query::Explain), 2);
}

/// The context of a message whose `traceparent` has trace and span ids of `n` repeated, as the view keeps it.
fn publisher(n: u8) -> PublisherContext {
    let mut headers = async_nats::HeaderMap::new();
    let value = format!(
        "00-{}-{}-01",
        format!("{n:02x}").repeat(16),
        format!("{n:02x}").repeat(8)
    );
    headers.insert("traceparent", value.as_str());
    PublisherContext::from_headers(&headers).expect("a traceparent")
}

/// Each listed event's id with its `publisher_trace_id` (absent: `-`), from an explain of the thread as the handler
/// joins it.
async fn publisher_trace_ids(views: &ViewCache<FakeStore>) -> Vec<(String, String)> {
    let answer = views.read::<ViewFates>(THREAD, None).await.unwrap();
    let scan = views.row_metadata(THREAD).await.unwrap();
    let explanation =
        serde_json::to_value(crate::explain::explain(THREAD, &answer.body, &scan.rows)).unwrap();
    explanation["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| {
            let id = event["event_id"].as_str().unwrap().to_owned();
            let trace = event
                .get("publisher_trace_id")
                .map_or("-".to_owned(), |t| t.as_str().unwrap()[..2].to_owned());
            (id, trace)
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn the_publishers_contexts_of_live_events_survive_hydration_and_fill_and_explain_lists_their_trace_ids()
 {
    let scene = Scene::new();
    scene.stored_turn();
    // Live: the stored marker again (its row gets the context), an answer not stored yet (created now), and one
    // that waits beside the view while a holder has it; then a repeat of the answer with another context (the
    // first stays).
    let now = wall_ns();
    scene
        .views
        .apply(user("d1", "u1", 1), Some(publisher(1)))
        .await;
    scene
        .views
        .apply(chunk("d1", "live", now, "later"), Some(publisher(2)))
        .await;
    let entry = scene.views.entry(THREAD).await;
    let held = entry.lock_view(&scene.views.metrics);
    assert!(
        scene
            .views
            .apply(
                chunk("d1", "waited", now + 1, "later still"),
                Some(publisher(3))
            )
            .await
            .is_none()
    );
    drop(held);
    scene
        .views
        .apply(chunk("d1", "live", now, "later"), Some(publisher(9)))
        .await;
    scene.past_the_bound().await;
    let ids = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    };
    // The explain's read hydrates: the store's rows merged with the live events, each keeping its context; `c1`
    // came from the store only.
    assert_eq!(
        publisher_trace_ids(&scene.views).await,
        ids(&[("u1", "01"), ("c1", "-"), ("live", "02"), ("waited", "03")])
    );
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
    // A new turn's marker, live with a context, is filled: the fill keeps every context.
    scene
        .store
        .persist(&chunk("d2", "c2", now + 2, "answer-two"));
    let marker = user("d2", "u2", now + 3);
    scene.store.persist(&marker);
    scene.views.apply(marker, Some(publisher(4))).await;
    settle().await;
    assert_eq!(scene.store.calls(Query::Fill), 1);
    assert_eq!(
        publisher_trace_ids(&scene.views).await,
        ids(&[
            ("u1", "01"),
            ("c1", "-"),
            ("live", "02"),
            ("waited", "03"),
            ("c2", "-"),
            ("u2", "04")
        ])
    );
    assert_eq!(scene.store.calls(Query::Markers), 1, "one hydration");
}

#[tokio::test(start_paused = true)]
async fn a_failed_row_scan_fails_the_explains_that_shared_it_and_the_next_scans_again() {
    let scene = Scene::new();
    scene.complete_thread().await;
    scene.store.hold(Query::Explain);
    scene.store.fail_next(Query::Explain);
    let explains: Vec<_> = (0..4)
        .map(|_| {
            let views = scene.views.clone();
            tokio::spawn(async move { views.row_metadata(THREAD).await })
        })
        .collect();
    scene.store.reached(Query::Explain, 1).await;
    settle().await;
    scene.store.release(Query::Explain);
    for explain in explains {
        assert!(matches!(explain.await.unwrap(), Err(ReadError::Store(_))));
    }
    assert_eq!(scene.store.calls(Query::Explain), 1);
    assert_eq!(
        scene.views.row_metadata(THREAD).await.unwrap().rows.len(),
        2
    );
}

#[tokio::test(start_paused = true)]
async fn a_storm_of_explains_leaves_a_cold_read_its_slots() {
    // Four hydration slots: the explain share is two.
    let scene = Scene::new();
    scene.stored_turn();
    scene.past_the_bound().await;
    scene.store.hold(Query::Explain);
    let explains: Vec<_> = (0..12)
        .map(|i| {
            let views = scene.views.clone();
            tokio::spawn(async move { views.row_metadata(&format!("other-{i}")).await })
        })
        .collect();
    scene.store.reached(Query::Explain, 2).await;
    settle().await;
    // Two scans hold their slots at the gate; the other explains wait for the share, not for a slot.
    assert_eq!(scene.store.calls(Query::Explain), 2);
    // A cold read finds a slot while every explain still waits.
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Store);
    assert!(body(&answer).contains("answer-one"));
    assert!(explains.iter().all(|explain| !explain.is_finished()));
    assert_eq!(scene.store.calls(Query::Explain), 2);
    // Once the gate opens, the waiting explains run in turn within the share.
    scene.store.release(Query::Explain);
    for explain in explains {
        assert!(explain.await.unwrap().unwrap().rows.is_empty());
    }
    assert_eq!(scene.store.calls(Query::Explain), 12);
}

#[tokio::test(start_paused = true)]
async fn an_explain_of_a_cold_thread_hydrates_within_the_share() {
    // Both permits of the share held by scans at the gate: an explain of a cold thread waits for one, and gives up
    // after the store timeout without having taken a slot; a history read of that thread is answered meanwhile.
    let scene = Scene::new();
    scene.store.hold(Query::Explain);
    let scans: Vec<_> = (0..2)
        .map(|i| {
            let views = scene.views.clone();
            tokio::spawn(async move { views.row_metadata(&format!("other-{i}")).await })
        })
        .collect();
    scene.store.reached(Query::Explain, 2).await;
    scene.stored_turn();
    scene.past_the_bound().await;
    let views = scene.views.clone();
    let cold_explain = tokio::spawn(async move { views.read::<ViewFates>(THREAD, None).await });
    settle().await;
    assert_eq!(
        scene.store.calls(Query::Markers),
        0,
        "no hydration beyond the share"
    );
    assert_eq!(scene.read().await.unwrap().source, AnswerSource::Store);
    assert!(matches!(cold_explain.await.unwrap(), Err(ReadError::Busy)));
    scene.store.release(Query::Explain);
    for scan in scans {
        scan.await.unwrap().unwrap();
    }
    // The share free again, an explain reads its thread (complete now: from memory).
    assert_eq!(
        explain(&scene.views, THREAD).await.unwrap(),
        (AnswerSource::Cache, 2)
    );
}

/// The warm-up's plan: `rate` a second, for `secs` from now.
fn warm_plan(rate: u32, secs: u64) -> WarmPlan {
    WarmPlan {
        rate,
        deadline: tokio::time::Instant::now() + Duration::from_secs(secs),
    }
}

/// The warm-up ([`crate::warm_up::warm_up`]) of a test cache, counted on a registry of its own.
trait WarmUp {
    async fn warm_up(&self, threads: Vec<String>, plan: WarmPlan) -> WarmReport;
}

impl WarmUp for ViewCache<FakeStore> {
    async fn warm_up(&self, threads: Vec<String>, plan: WarmPlan) -> WarmReport {
        let metrics = Arc::new(WarmMetrics::register(&mut crate::metrics::Registrar::new()));
        crate::warm_up::warm_up(self, threads, plan, &metrics).await
    }
}

fn warm_threads(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("w{i}")).collect()
}

#[tokio::test(start_paused = true)]
async fn the_warm_up_waits_for_the_bound_then_builds_complete_views_a_read_answers_from_memory() {
    let scene = Scene::new();
    scene.stored_turn();
    let views = scene.views.clone();
    let warming = tokio::spawn(async move {
        views
            .warm_up(vec![THREAD.to_owned()], warm_plan(10, 60))
            .await
    });
    // Within the bound after the confirmation a store read could not complete a view: the warm-up waits.
    tokio::time::sleep(LAG - Duration::from_millis(10)).await;
    assert_eq!(scene.store.calls(Query::Markers), 0);
    let report = warming.await.unwrap();
    assert_eq!((report.listed, report.hydrated, report.pending), (1, 1, 0));
    assert!(!report.hit_deadline);
    assert_eq!(scene.store.calls(Query::Markers), 1);
    assert_eq!(scene.store.calls(Query::Events), 1);
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
    assert!(body(&answer).contains("answer-one"));
    // Complete at once: no background re-read follows.
    tokio::time::sleep(LAG * 2).await;
    assert_eq!(scene.store.calls(Query::Markers), 1);
}

#[tokio::test(start_paused = true)]
async fn the_warm_up_goes_newest_first_at_most_its_rate_and_a_gone_thread_costs_one_query() {
    let scene = Scene::new();
    scene.past_the_bound().await;
    let views = scene.views.clone();
    let start = tokio::time::Instant::now();
    let warming =
        tokio::spawn(async move { views.warm_up(warm_threads(4), warm_plan(2, 60)).await });
    settle().await;
    // The first starts at once; one more every half second.
    assert_eq!(scene.store.calls(Query::Markers), 1);
    assert!(scene.views.cache.contains_key("w0"));
    assert!(!scene.views.cache.contains_key("w1"));
    tokio::time::sleep_until(start + Duration::from_millis(490)).await;
    assert_eq!(scene.store.calls(Query::Markers), 1);
    tokio::time::sleep_until(start + Duration::from_millis(510)).await;
    assert_eq!(scene.store.calls(Query::Markers), 2);
    assert!(scene.views.cache.contains_key("w1"));
    assert!(!scene.views.cache.contains_key("w2"));
    let report = warming.await.unwrap();
    assert_eq!(report.hydrated, 4);
    assert!(tokio::time::Instant::now() >= start + Duration::from_millis(1_500));
    // Threads that do not exist: stage 1 each, nothing else; and they are not handed on, the set they came in
    // included (their one query was spent in this generation).
    assert_eq!(scene.store.calls(Query::Markers), 4);
    assert_eq!(scene.store.calls(Query::Events), 0);
    scene.stored_turn();
    scene.read().await.unwrap();
    assert_eq!(scene.views.hot_set(3, &warm_threads(4)), [THREAD]);
}

#[tokio::test(start_paused = true)]
async fn a_warm_up_stopped_midway_hands_on_what_was_read_then_the_set_it_was_handed() {
    let scene = Scene::new();
    // `g` does not exist; the others do.
    let inherited: Vec<String> = ["w0", "g", "w1", "w2", "w3", "w4"]
        .map(String::from)
        .to_vec();
    for (i, thread) in inherited.iter().enumerate().filter(|(_, t)| *t != "g") {
        scene.store.persist(&user_on(thread, "d1", "u1", i as i64));
    }
    scene.stored_turn();
    scene.past_the_bound().await;
    let views = scene.views.clone();
    let handed = inherited.clone();
    // Two a second: w0, g, w1 and w2 start by 1.5 s.
    let warming = tokio::spawn(async move { views.warm_up(handed, warm_plan(2, 60)).await });
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(scene.store.calls(Query::Markers), 4);
    scene.read().await.unwrap();
    warming.abort();
    let _ = warming.await;
    assert!(!scene.views.cache.contains_key("w3"));
    // Read here first, then the handed set in its order, reached or not, without the thread that does not exist.
    assert_eq!(
        scene.views.hot_set(10, &inherited),
        [THREAD, "w0", "w1", "w2", "w3", "w4"]
    );
    assert_eq!(scene.views.hot_set(3, &inherited), [THREAD, "w0", "w1"]);
    // Without the handed set (after the idle time), only what this worker holds.
    assert_eq!(scene.views.hot_set(10, &[]), [THREAD, "w0", "w1", "w2"]);
}

#[tokio::test(start_paused = true)]
async fn a_warm_hydration_never_takes_the_last_free_slot_and_never_queues_before_reads() {
    // Four slots: three reads held at the store leave one free, which the warm-up must not take.
    let scene = Scene::new();
    scene.past_the_bound().await;
    scene.store.hold(Query::Markers);
    let readers: Vec<_> = ["r1", "r2", "r3"]
        .into_iter()
        .map(|thread| {
            let views = scene.views.clone();
            tokio::spawn(async move { views.read::<HistoryBody>(thread, None).await })
        })
        .collect();
    scene.store.reached(Query::Markers, 3).await;
    let views = scene.views.clone();
    let warming =
        tokio::spawn(async move { views.warm_up(warm_threads(2), warm_plan(100, 60)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(scene.store.calls(Query::Markers), 3);
    // A read that comes now gets the free slot at once.
    let late = {
        let views = scene.views.clone();
        tokio::spawn(async move { views.read::<HistoryBody>("r4", None).await })
    };
    scene.store.reached(Query::Markers, 4).await;
    scene.store.release(Query::Markers);
    for reader in readers {
        reader.await.unwrap().unwrap();
    }
    late.await.unwrap().unwrap();
    let report = warming.await.unwrap();
    assert_eq!(report.hydrated, 2);
    assert_eq!(scene.store.calls(Query::Markers), 6);
}

#[tokio::test(start_paused = true)]
async fn the_warm_up_holds_at_most_half_the_slots() {
    let scene = Scene::new();
    scene.past_the_bound().await;
    scene.store.hold(Query::Markers);
    let views = scene.views.clone();
    let warming =
        tokio::spawn(async move { views.warm_up(warm_threads(6), warm_plan(1_000, 60)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Four slots: two warm hydrations at once.
    assert_eq!(scene.store.calls(Query::Markers), 2);
    scene.store.release(Query::Markers);
    assert_eq!(warming.await.unwrap().hydrated, 6);
}

#[tokio::test(start_paused = true)]
async fn the_warm_up_stops_at_its_deadline_and_leaves_the_rest_pending() {
    let scene = Scene::new();
    scene.past_the_bound().await;
    let metrics = scene.metrics.clone();
    let report = crate::warm_up::warm_up(
        &scene.views,
        warm_threads(10),
        warm_plan(1, 3),
        &metrics.warm,
    )
    .await;
    assert!(report.hit_deadline);
    assert_eq!(report.listed, 10);
    assert_eq!(report.hydrated, 3);
    assert_eq!(report.pending, 7);
    let rendered = metrics.render();
    let state = |s: &str| {
        crate::metrics::sample(
            &rendered,
            &format!("history_view_warm_threads{{state=\"{s}\"}}"),
        )
    };
    assert_eq!(state("listed"), Some(10.0));
    assert_eq!(state("hydrated"), Some(3.0));
    assert_eq!(state("pending"), Some(7.0));
}

#[tokio::test(start_paused = true)]
async fn a_thread_read_first_is_skipped_by_the_warm_up() {
    let scene = Scene::new();
    scene.complete_thread().await;
    let report = scene
        .views
        .warm_up(vec![THREAD.to_owned()], warm_plan(10, 60))
        .await;
    assert_eq!((report.hydrated, report.skipped), (0, 1));
    assert_eq!(scene.store.calls(Query::Markers), 1);
}

#[tokio::test(start_paused = true)]
async fn the_hot_set_is_the_most_recently_read_newest_first() {
    let scene = Scene::new();
    for thread in ["a", "b", "c", "d"] {
        scene.store.persist(&user_on(thread, "d1", "u1", 1));
    }
    scene.past_the_bound().await;
    for thread in ["a", "b", "c", "d"] {
        scene.views.read::<HistoryBody>(thread, None).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    scene.views.read::<HistoryBody>("b", None).await.unwrap();
    // A thread only written to live is no read.
    scene.views.apply(user("d9", "u9", 1), None).await;
    assert_eq!(scene.views.hot_set(10, &[]), ["b", "d", "c", "a"]);
    assert_eq!(scene.views.hot_set(2, &[]), ["b", "d"]);
    assert!(scene.views.hot_set(0, &[]).is_empty());
}

/// The spans of the cache's part of a read ([design 5](../../docs/design.md#5), "Traces").
mod spans {
    use opentelemetry::trace::SpanId;
    use opentelemetry_sdk::trace::SpanData;
    use tracing::Instrument;

    use super::*;
    use crate::telemetry::testing::{attribute, is_child_of, record};

    fn source(span: &SpanData) -> Option<String> {
        attribute(span, "chat_history_view.source").map(|v| v.to_string())
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_readers_each_have_a_cache_span_and_the_one_hydration_is_a_child_of_the_reader_running_it()
     {
        let spans = record();
        let scene = Scene::new();
        scene.stored_turn();
        scene.past_the_bound().await;
        scene.store.hold(Query::Markers);
        let readers: Vec<_> = (0..4).map(|_| scene.spawn_read()).collect();
        scene.store.reached(Query::Markers, 1).await;
        settle().await;
        scene.store.release(Query::Markers);
        for reader in readers {
            reader.await.unwrap().unwrap();
        }
        let reads = spans.named("cache");
        assert_eq!(reads.len(), 4);
        assert!(
            reads
                .iter()
                .all(|read| source(read).as_deref() == Some("store"))
        );
        assert!(
            reads
                .iter()
                .all(|read| read.parent_span_id == SpanId::INVALID),
            "no span was current around the reads"
        );
        let hydration = spans.one("hydrate");
        assert_eq!(
            reads
                .iter()
                .filter(|read| is_child_of(&hydration, read))
                .count(),
            1
        );
        // From memory now: a cache span without a hydration.
        assert_eq!(scene.read().await.unwrap().source, AnswerSource::Cache);
        assert_eq!(spans.named("cache").len(), 5);
        let last = spans.named("cache").pop().unwrap();
        assert_eq!(source(&last).as_deref(), Some("cache"));
        assert_eq!(spans.named("hydrate").len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_inside_a_span_is_its_child_and_the_background_reread_it_leads_to_is_a_root() {
        let spans = record();
        let scene = Scene::new();
        scene.stored_turn();
        // Before the bound: the view stays partial, and a re-read is due once the bound has passed.
        let request = tracing::info_span!("request");
        let answer = scene.read().instrument(request.clone()).await.unwrap();
        drop(request);
        assert_eq!(answer.source, AnswerSource::Store);
        scene.past_the_bound().await;
        settle().await;
        assert_eq!(scene.store.calls(Query::Markers), 2, "the re-read ran");
        let request = spans.one("request");
        let read = spans.one("cache");
        assert!(is_child_of(&read, &request));
        let hydrations = spans.named("hydrate");
        assert_eq!(hydrations.len(), 2);
        assert!(is_child_of(&hydrations[0], &read));
        assert_eq!(hydrations[1].parent_span_id, SpanId::INVALID);
        assert_ne!(
            hydrations[1].span_context.trace_id(),
            request.span_context.trace_id()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_fill_joins_the_span_that_asked_for_it_and_is_a_root_when_none_did() {
        let spans = record();
        let scene = Scene::new();
        scene.complete_thread().await;
        let asker = tracing::info_span!("asker");
        scene
            .new_turn_revealing_a_stored_event()
            .instrument(asker.clone())
            .await;
        drop(asker);
        settle().await;
        // A second new turn, its marker applied with no span current.
        scene.store.persist(&chunk("d3", "c3", 5, "answer-three"));
        let marker = user("d3", "u3", 6);
        scene.store.persist(&marker);
        scene.views.apply(marker, None).await;
        settle().await;
        assert_eq!(scene.store.calls(Query::Fill), 2);
        let answer = scene.read().await.unwrap();
        assert_eq!(answer.source, AnswerSource::Cache);
        assert!(body(&answer).contains("answer-three"));
        let fills = spans.named("fill");
        assert_eq!(fills.len(), 2);
        assert!(is_child_of(&fills[0], &spans.one("asker")));
        assert_eq!(fills[1].parent_span_id, SpanId::INVALID);
    }
}

#[tokio::test(start_paused = true)]
async fn a_complete_view_is_answered_from_memory_only_while_the_source_proves_the_window() {
    let scene = Scene::new();
    scene.complete_thread().await;
    // The source stops proving what it applied (a consumer behind its stream, a frozen link).
    scene.probing.store(false, Ordering::Release);
    tokio::time::sleep(scene.freshness.window()).await;
    let asked = tokio::time::Instant::now();
    let answer = scene.read().await.unwrap();
    assert_eq!(
        answer.source,
        AnswerSource::Store,
        "the view may lack what was stored a window ago"
    );
    assert!(
        tokio::time::Instant::now() >= asked + Duration::from_secs(1),
        "it waited half the store timeout for the source first"
    );
    // A read that waits is answered from memory as soon as the source proves it again.
    let reader = scene.spawn_read();
    settle().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!reader.is_finished(), "waiting for the source");
    scene.probing.store(true, Ordering::Release);
    let answer = reader.await.unwrap().unwrap();
    assert_eq!(answer.source, AnswerSource::Cache);
    // Its covered-through instant is the one the rule judged: within the window.
    let covered = answer.covered_through.unwrap();
    let age = std::time::SystemTime::now()
        .duration_since(covered)
        .unwrap_or_default();
    assert!(age <= scene.freshness.window(), "{age:?}");
}

#[tokio::test(start_paused = true)]
async fn a_read_of_a_view_that_needs_the_store_anyway_does_not_wait_for_the_source() {
    let scene = Scene::new();
    scene.stored_turn();
    scene.past_the_bound().await;
    scene.probing.store(false, Ordering::Release);
    tokio::time::sleep(scene.freshness.window()).await;
    let asked = tokio::time::Instant::now();
    let answer = scene.read().await.unwrap();
    assert_eq!(answer.source, AnswerSource::Store);
    assert_eq!(
        tokio::time::Instant::now(),
        asked,
        "a cold view reads the store at once"
    );
}

mod model;
