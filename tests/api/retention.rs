//! JetStream retention and faults, read through (`HISTORY_VIEW_SOURCE=jetstream`, the built binary, real servers).
//! In each scenario a [`Reader`] keeps reading a thread every 50 ms during and after the fault and holds every
//! answer to the promise: no answer served from memory (`X-History-Source: cache`, 200) lacks an event stored in
//! the store more than the persister-lag bound before the read started (and no answer from the store lacks one
//! stored more than the store timeout before it started: a read shares a store read already in flight). Each ends with the answer equal to the reference (the projector over the stored rows)
//! and to a fresh worker's cold read. The faults: a chunk that aged out of a class stream (`max_age`) or was purged
//! while the worker was frozen; bursts past a class stream's `max_msgs` and past the partitioned stream's
//! `HISTORY_VIEW_JETSTREAM_MAX_BYTES`; the partitioned stream purged while the owner was frozen; the leader of an R3
//! class stream killed; no stream matching `HISTORY_VIEW_JETSTREAM_STREAMS`; a nats-server without JetStream; a
//! class stream created while workers run (class streams and partitioned); a worker behind its class stream under a
//! burst of other threads' events; a class stream full with `discard: new` that refuses a chunk (issue 47).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use chat_history_view::partition::owner;
use serde_json::Value;
use tokio::task::JoinSet;

use crate::helpers::{
    Api, BinaryApp, TestStore, chunk_row, metric, publish_rows, unique, user_row, worker_binary,
};
use crate::promise::target;
use crate::scene::{Scene, now_ns, read_until_cache, wait_metric};
use test_support::class_streams::{create_class_streams, create_replicated_class_streams};
use test_support::process::port_prefix;
use test_support::promise::{self, Kind, Ledger, Reader, Source, Target, read_history, token};
use test_support::rows::publish_stored;
use test_support::scrape::metric_sum;
use test_support::servers::{MongoServer, NatsCluster, NatsServer};
use test_support::wait::{eventually, eventually_within, scaled, when};

/// The persister-lag bound every worker here runs with (the default, set explicitly: the promise is stated in it).
const LAG: Duration = Duration::from_millis(2_000);
const LAG_SETTING: (&str, &str) = ("HISTORY_VIEW_PERSIST_LAG_MS", "2000");
/// The bound of the burst scenarios (see there).
const BURST_LAG: Duration = Duration::from_millis(5_000);
const JETSTREAM: (&str, &str) = ("HISTORY_VIEW_SOURCE", "jetstream");
// ---------------------------------------------------------------------------------------------------------------
// The scenarios' rows: each text starts with its token (`[c12]`), which the judge looks for.

/// A `created_at` (ns) that is now and later than every one handed out before, so rows sort as made.
fn stamp() -> i64 {
    static LAST: AtomicI64 = AtomicI64::new(0);
    let now = now_ns(0);
    let previous = LAST
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |last| {
            Some(now.max(last + 1))
        })
        .expect("always updates");
    now.max(previous + 1)
}

/// The user turn opening `thread` (visible: its display's marker).
fn question(thread: &str) -> Value {
    user_row(
        thread,
        "d1",
        &format!("q-{thread}"),
        stamp(),
        &format!("[q-{thread}]"),
    )
}

/// Chunk `n` of `thread`'s answer from an agent of `class`, its text padded with `pad` bytes.
fn chunk(thread: &str, class: &str, n: usize, pad: usize) -> Value {
    let text = format!("[c{n}]{}", "x".repeat(pad));
    chunk_row(thread, "d1", class, &format!("c{n}"), stamp(), &text)
}

// ---------------------------------------------------------------------------------------------------------------
// What a failure prints, and the scenarios' common ends.

/// The lines of `/metrics` that say what the source and the views went through (printed with a failure).
async fn diagnostics(api: &Api) -> String {
    const FAMILIES: [&str; 9] = [
        "history_view_jetstream_",
        "history_view_persister_lag_exceeded",
        "history_view_views_downgraded",
        "history_view_background_rereads",
        "history_view_hydrations_total",
        "history_view_ready",
        "history_view_store_errors",
        "history_view_hydration_slot_timeouts",
        "history_view_read_routes",
    ];
    let metrics = api
        .metrics()
        .await
        .lines()
        .filter(|l| !l.starts_with('#') && FAMILIES.iter().any(|f| l.starts_with(f)))
        .collect::<Vec<_>>()
        .join("\n");
    // Readiness names what holds the source behind (which lane, and why).
    let readiness = api.get("/readyz", &[]).await.body;
    format!("{metrics}\n/readyz: {readiness}")
}

/// Reads `thread` through `api` until it is served from memory equal to the reference, judging every answer on
/// the way (`test_support::promise::settle`, with what the worker went through on failure); returns the body.
async fn settle(api: &Api, thread: &str, ledger: &Ledger, limit: Duration) -> String {
    if let Err(failure) =
        promise::settle(&target(api), thread, &Kind::History(None), ledger, limit).await
    {
        panic!("{failure}\n{}", diagnostics(api).await);
    }
    ledger.reference_body(thread, None)
}

/// Readers' targets for `apis`.
fn targets(apis: Vec<Api>) -> Vec<Target> {
    apis.iter().map(target).collect()
}

/// A fresh Core worker's cold reads (from the store) of `threads` equal the reference.
async fn cold_reads_equal(
    nats_url: String,
    mongo_uri: String,
    database: String,
    threads: &[String],
    ledger: &Ledger,
) {
    let cold = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats_url),
        ("HISTORY_VIEW_MONGODB_URI", mongo_uri),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        // The reference, not what is tested: the test's Mongo-wire server may be busy with the other workers.
        ("HISTORY_VIEW_STORE_TIMEOUT_MS", "15000".to_owned()),
    ])
    .await;
    cold.wait_ready().await;
    for thread in threads {
        let reply = cold.api.history(thread, "").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.source(), Some("store"), "{thread}: a cold read");
        assert_eq!(
            reply.body,
            ledger.reference_body(thread, None),
            "{thread}: a cold read"
        );
    }
}

/// [`cold_reads_equal`] against a scene's servers and database.
async fn cold_reads_equal_in(scene: &Scene, threads: &[String], ledger: &Ledger) {
    cold_reads_equal(
        scene.nats.url(),
        scene.mongo.uri(),
        scene.database.clone(),
        threads,
        ledger,
    )
    .await;
}

/// Prints how long a test took, passed or failed.
struct Timed(&'static str, Instant);

impl Timed {
    fn new(name: &'static str) -> Self {
        Self(name, Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        eprintln!("TIMING {}: {:?}", self.0, self.1.elapsed());
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Streams and waits.

/// aihub's class stream of `class`, with `limits` applied to its configuration.
async fn create_limited_class_stream(
    nats_url: &str,
    class: &str,
    limits: impl FnOnce(&mut stream::Config),
) {
    let client = async_nats::connect(nats_url).await.expect("nats client");
    let mut config = stream::Config {
        name: format!("agent_{class}_stream"),
        subjects: vec![format!("agent.{class}.*.*.*.*.*.*.*")],
        storage: stream::StorageType::File,
        ..Default::default()
    };
    limits(&mut config);
    jetstream::new(client)
        .create_stream(config)
        .await
        .expect("a class stream with limits");
}

async fn stream_state(context: &jetstream::Context, name: &str) -> stream::State {
    context
        .get_stream(name)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .state
        .clone()
}

/// Waits until `name`'s state satisfies `done` (it says what it waits for).
async fn wait_stream(
    context: &jetstream::Context,
    name: &str,
    what: &str,
    done: impl Fn(&stream::State) -> bool,
) -> stream::State {
    let done = &done;
    eventually(&format!("{name}: {what}"), || async move {
        let state = stream_state(context, name).await;
        if done(&state) {
            Ok(state)
        } else {
            Err(format!("{state:?}"))
        }
    })
    .await
}

fn gaps(metrics: &str) -> String {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("history_view_jetstream_gaps_total{")
                || l.starts_with("history_view_jetstream_resumes_total{")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

const GAP: &str = "history_view_jetstream_resumes_total{outcome=\"gap\"}";

fn gap_cause(cause: &str) -> String {
    format!("history_view_jetstream_gaps_total{{cause=\"{cause}\"}}")
}

/// Stores `rows` (the ledger) and publishes them, each acknowledged by its stream.
async fn store_and_publish(
    ledger: &Ledger,
    store: &TestStore,
    context: &jetstream::Context,
    rows: &[Value],
) {
    ledger.store(&store.events(), rows).await;
    ledger.published(rows);
    publish_stored(context, rows).await;
}

/// A JetStream worker on `scene` (class streams), ready.
async fn class_worker(scene: &Scene) -> BinaryApp {
    scene
        .worker(scene.nats.url(), &[JETSTREAM, LAG_SETTING])
        .await
}

/// A thread opened by a stored and published question, served from memory.
async fn opened(scene: &Scene, ledger: &Ledger, api: &Api, thread: &str) {
    let context = jetstream::new(scene.publisher.clone());
    store_and_publish(ledger, &scene.store, &context, &[question(thread)]).await;
    read_until_cache(api, thread, "").await;
}

/// The scenario of a class stream losing a chunk while the worker is frozen: `lose` makes the stream lose it.
async fn frozen_worker_misses_a_chunk<F, Fut>(thread: &str, max_age: Option<Duration>, lose: F)
where
    F: FnOnce(jetstream::Context) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into()]).await;
    create_limited_class_stream(&scene.nats.url(), "A", |config| {
        if let Some(max_age) = max_age {
            config.max_age = max_age;
        }
    })
    .await;
    let app = class_worker(&scene).await;
    let ledger = Ledger::new(LAG);
    opened(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    let context = jetstream::new(scene.publisher.clone());

    let frozen = Instant::now();
    tokio::task::block_in_place(|| app.pause());
    // Stored and published while the worker is frozen: it reaches the stream, then the stream loses it.
    let lost = chunk(thread, "A", 1, 0);
    store_and_publish(&ledger, &scene.store, &context, &[lost]).await;
    let stored = Instant::now();
    wait_stream(&context, "agent_A_stream", "holds the chunk", |s| {
        s.last_sequence >= 1
    })
    .await;
    lose(context.clone()).await;
    wait_stream(&context, "agent_A_stream", "lost the chunk", |s| {
        s.messages == 0
    })
    .await;
    // Reads waiting on the frozen worker that started past the bound after the chunk was stored: the first
    // answers it gives on waking must have it.
    reader
        .wait_started_after(stored + LAG + Duration::from_millis(200))
        .await;
    // Frozen at least 11 s: the pull request expired and its heartbeats were missed too.
    let thawed = frozen + Duration::from_secs(11);
    tokio::time::sleep_until(thawed.max(Instant::now()).into()).await;
    app.resume();
    eprintln!("{thread}: frozen {:?}", frozen.elapsed());

    wait_metric(&app.api, GAP, 1.0).await;
    settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    // Read on for a while after the fault: still complete.
    reader.read_on_then_finish().await;
    let metrics = app.api.metrics().await;
    eprintln!("{thread}: {}", gaps(&metrics));
    assert!(
        metric(&metrics, &gap_cause("removed")) >= 1.0,
        "{}",
        gaps(&metrics)
    );
    cold_reads_equal_in(&scene, &[thread.to_owned()], &ledger).await;
}

// ---------------------------------------------------------------------------------------------------------------
// 1, 2: a chunk lost while the worker is frozen.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_aged_out_of_a_class_stream_while_the_worker_was_frozen_is_never_missing_from_memory()
 {
    let _timed = Timed::new(
        "a_chunk_aged_out_of_a_class_stream_while_the_worker_was_frozen_is_never_missing_from_memory",
    );
    frozen_worker_misses_a_chunk("t-ret-age", Some(Duration::from_secs(5)), |_| async {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_purged_from_a_class_stream_while_the_worker_was_frozen_is_never_missing_from_memory()
 {
    let _timed = Timed::new(
        "a_chunk_purged_from_a_class_stream_while_the_worker_was_frozen_is_never_missing_from_memory",
    );
    frozen_worker_misses_a_chunk("t-ret-purge", None, |context| async move {
        context
            .get_stream("agent_A_stream")
            .await
            .expect("the stream")
            .purge()
            .await
            .expect("a purge");
    })
    .await;
}

// ---------------------------------------------------------------------------------------------------------------
// 3: a burst past a class stream's max_msgs.

/// `threads` threads' questions, then `chunks` chunks each (round by round), published quickly and stored after
/// (as aihub's persister does), while a reader reads each of the first `read` threads through `apis`.
async fn burst(
    store: &TestStore,
    publisher: &async_nats::Client,
    ledger: &Ledger,
    threads: &[String],
    chunks: usize,
    pad: usize,
    readers: &[Reader],
) -> Duration {
    let context = jetstream::new(publisher.clone());
    let questions: Vec<Value> = threads.iter().map(|t| question(t)).collect();
    store_and_publish(ledger, store, &context, &questions).await;
    let rows: Vec<Value> = (1..=chunks)
        .flat_map(|n| threads.iter().map(move |t| chunk(t, "A", n, pad)))
        .collect();
    // Bursts of 110 (more than the class stream's 100), each published at once and then stored: every row is
    // stored within the bound after it was published (the persister's side of the bound: a row stored later may
    // be missed for good, by design).
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for burst in rows.chunks(110) {
        let published = Instant::now();
        ledger.published(burst);
        publish_rows(publisher, burst).await;
        ledger.store(&store.events(), burst).await;
        slowest = slowest.max(published.elapsed());
    }
    eprintln!(
        "burst: {} chunks published and stored in {:?}, each within {slowest:?} ({} readers)",
        rows.len(),
        started.elapsed(),
        readers.len()
    );
    slowest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_a_class_streams_max_msgs_leaves_no_answer_from_memory_without_a_stored_chunk()
{
    let _timed = Timed::new(
        "a_burst_past_a_class_streams_max_msgs_leaves_no_answer_from_memory_without_a_stored_chunk",
    );
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into()]).await;
    create_limited_class_stream(&scene.nats.url(), "A", |config| config.max_messages = 100).await;
    // A bound of 5 s: the Mongo-wire server of the tests takes up to 2 s to store a burst while the workers
    // hydrate, and aihub's persister stores within the bound.
    let ledger = Ledger::new(BURST_LAG);
    let app = scene
        .worker(
            scene.nats.url(),
            &[JETSTREAM, (LAG_SETTING.0, &ledger.lag_setting())],
        )
        .await;
    let threads: Vec<String> = (0..50).map(|i| format!("t-ret-msgs-{i}")).collect();
    let readers: Vec<Reader> = threads[..3]
        .iter()
        .map(|t| Reader::start(vec![target(&app.api)], t, Kind::History(None), &ledger))
        .collect();
    let slowest = burst(
        &scene.store,
        &scene.publisher,
        &ledger,
        &threads,
        25,
        0,
        &readers,
    )
    .await;
    let settling = Instant::now();
    for thread in &threads[..20] {
        settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    }
    eprintln!("20 threads settled in {:?}", settling.elapsed());
    for reader in readers {
        reader.finish().await;
    }
    let metrics = app.api.metrics().await;
    eprintln!("max_msgs burst: {}", gaps(&metrics));
    assert!(
        slowest < ledger.lag,
        "the store took longer than the bound after a publish: {slowest:?}"
    );
    cold_reads_equal_in(&scene, &threads[..10], &ledger).await;
}

// ---------------------------------------------------------------------------------------------------------------
// 4, 8b: partitioned workers on one nats-server.

/// Two partitioned workers (`HISTORY_VIEW_PARTITIONS=2`) on one nats-server, each on its port `<prefix>k`.
struct Partitioned {
    scene: Scene,
    workers: Vec<BinaryApp>,
}

impl Partitioned {
    async fn start(classes: &[&str], extra: &[(&'static str, &str)]) -> Self {
        let scene = Scene::new().await;
        create_class_streams(&scene.nats.url(), classes.iter().map(|c| (*c).to_owned())).await;
        let prefix = port_prefix(2);
        let mut workers = Vec::new();
        for k in 0..2u16 {
            let mut env = vec![
                ("HISTORY_VIEW_NATS_URL", scene.nats.url()),
                ("HISTORY_VIEW_MONGODB_URI", scene.mongo.uri()),
                ("HISTORY_VIEW_MONGODB_DATABASE", scene.database.clone()),
                (JETSTREAM.0, JETSTREAM.1.to_owned()),
                (LAG_SETTING.0, LAG_SETTING.1.to_owned()),
                ("HISTORY_VIEW_PARTITIONS", "2".into()),
                ("HISTORY_VIEW_PARTITION", k.to_string()),
                ("HISTORY_VIEW_JETSTREAM_REPLICAS", "1".into()),
                (
                    "HISTORY_VIEW_PEER_URL",
                    format!("http://127.0.0.1:{prefix}{{partition}}"),
                ),
            ];
            env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
            let app = BinaryApp::start_on(prefix * 10 + k, &env).await;
            app.wait_ready().await;
            workers.push(app);
        }
        Self { scene, workers }
    }

    /// The owner's API first, then the other's.
    fn apis(&self, thread: &str) -> Vec<Api> {
        let k = owner(thread, 2) as usize;
        vec![self.workers[k].api.clone(), self.workers[1 - k].api.clone()]
    }

    fn owner(&self, thread: &str) -> &BinaryApp {
        &self.workers[owner(thread, 2) as usize]
    }

    async fn cold_reads_equal(&self, threads: &[String], ledger: &Ledger) {
        cold_reads_equal_in(&self.scene, threads, ledger).await;
    }
}

/// A thread named after `prefix` that partition `k` of 2 owns.
fn owned_by(prefix: &str, k: u32) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| owner(t, 2) == k)
        .expect("a thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_stream_past_its_max_bytes_in_a_burst_leaves_no_answer_from_memory_without_a_stored_chunk()
 {
    let _timed = Timed::new(
        "the_partitioned_stream_past_its_max_bytes_in_a_burst_leaves_no_answer_from_memory_without_a_stored_chunk",
    );
    let deployment = Partitioned::start(
        &["UserAgent", "A"],
        &[
            ("HISTORY_VIEW_JETSTREAM_MAX_BYTES", "512KiB"),
            (LAG_SETTING.0, "5000"),
        ],
    )
    .await;
    // The bound of the burst scenarios: see the class stream's.
    let ledger = Ledger::new(BURST_LAG);
    let threads: Vec<String> = (0..50).map(|i| format!("t-ret-bytes-{i}")).collect();
    let readers: Vec<Reader> = threads[..3]
        .iter()
        .map(|t| Reader::start(targets(deployment.apis(t)), t, Kind::History(None), &ledger))
        .collect();
    let scene = &deployment.scene;
    // 1,250 chunks of some 600 bytes each: about one and a half times the partitioned stream's 512 KiB.
    let slowest = burst(
        &scene.store,
        &scene.publisher,
        &ledger,
        &threads,
        25,
        400,
        &readers,
    )
    .await;
    let settling = Instant::now();
    for thread in &threads[..20] {
        for api in deployment.apis(thread) {
            settle(&api, thread, &ledger, Duration::from_secs(20)).await;
        }
    }
    eprintln!("20 threads settled in {:?}", settling.elapsed());
    for reader in readers {
        reader.finish().await;
    }
    let context = jetstream::new(scene.publisher.clone());
    let state = stream_state(&context, "CHAT_HISTORY_VIEW").await;
    eprintln!("CHAT_HISTORY_VIEW after the burst: {state:?}");
    assert!(state.bytes <= 512 * 1024, "{state:?}");
    assert!(
        state.first_sequence > 1,
        "the limit removed nothing: {state:?}"
    );
    for (k, worker) in deployment.workers.iter().enumerate() {
        eprintln!("worker {k}: {}", gaps(&worker.api.metrics().await));
    }
    assert!(
        slowest < ledger.lag,
        "the store took longer than the bound after a publish: {slowest:?}"
    );
    deployment.cold_reads_equal(&threads[..10], &ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partitioned_stream_purged_while_the_owner_was_frozen_is_never_missing_from_memory() {
    let _timed = Timed::new(
        "the_partitioned_stream_purged_while_the_owner_was_frozen_is_never_missing_from_memory",
    );
    let deployment = Partitioned::start(&["UserAgent", "A"], &[]).await;
    let scene = &deployment.scene;
    let ledger = Ledger::new(LAG);
    let thread = owned_by("t-ret-ppurge", 0);
    let owner_app = deployment.owner(&thread);
    opened(scene, &ledger, &owner_app.api, &thread).await;
    let reader = Reader::start(
        targets(deployment.apis(&thread)),
        &thread,
        Kind::History(None),
        &ledger,
    );
    let context = jetstream::new(scene.publisher.clone());
    let before = stream_state(&context, "CHAT_HISTORY_VIEW").await;

    let frozen = Instant::now();
    tokio::task::block_in_place(|| owner_app.pause());
    store_and_publish(
        &ledger,
        &scene.store,
        &context,
        &[chunk(&thread, "A", 1, 0)],
    )
    .await;
    let stored = Instant::now();
    wait_stream(&context, "CHAT_HISTORY_VIEW", "sourced the chunk", |s| {
        s.last_sequence > before.last_sequence
    })
    .await;
    context
        .get_stream("CHAT_HISTORY_VIEW")
        .await
        .expect("the partitioned stream")
        .purge()
        .await
        .expect("a purge");
    wait_stream(&context, "CHAT_HISTORY_VIEW", "purged", |s| s.messages == 0).await;
    reader
        .wait_started_after(stored + LAG + Duration::from_millis(200))
        .await;
    owner_app.resume();
    eprintln!("{thread}: frozen {:?}", frozen.elapsed());

    wait_metric(&owner_app.api, GAP, 1.0).await;
    for api in deployment.apis(&thread) {
        settle(&api, &thread, &ledger, Duration::from_secs(20)).await;
    }
    reader.read_on_then_finish().await;
    let metrics = owner_app.api.metrics().await;
    eprintln!("owner: {}", gaps(&metrics));
    assert!(
        metric(&metrics, &gap_cause("removed")) >= 1.0,
        "{}",
        gaps(&metrics)
    );
    deployment.cold_reads_equal(&[thread], &ledger).await;
}

// ---------------------------------------------------------------------------------------------------------------
// 5: the leader of an R3 class stream killed.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_of_an_r3_class_stream_killed_mid_answer_leaves_no_answer_from_memory_without_a_stored_chunk()
 {
    let _timed = Timed::new(
        "the_leader_of_an_r3_class_stream_killed_mid_answer_leaves_no_answer_from_memory_without_a_stored_chunk",
    );
    leader_killed_mid_answer(false).await;
}

/// The same through a partitioned worker (partition 0 of 2, the owner of the thread read; its partitioned stream has
/// three replicas, so it outlives the killed server): the class stream upstream of it loses its leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_of_an_r3_class_stream_killed_upstream_of_a_partitioned_worker_leaves_no_answer_from_memory_without_a_stored_chunk()
 {
    let _timed = Timed::new(
        "the_leader_of_an_r3_class_stream_killed_upstream_of_a_partitioned_worker_leaves_no_answer_from_memory_without_a_stored_chunk",
    );
    leader_killed_mid_answer(true).await;
}

/// A chunk every 100 ms to one thread of an R3 class stream while its leader server is killed, read all along
/// through a class-stream worker, or a partitioned worker that owns the thread.
async fn leader_killed_mid_answer(partitioned: bool) {
    let began = Instant::now();
    let mut cluster = tokio::task::block_in_place(|| NatsCluster::start(3));
    create_replicated_class_streams(
        &cluster.servers[0].url(),
        ["UserAgent".into(), "A".into()],
        3,
    )
    .await;
    let admin = async_nats::connect(cluster.servers[0].url())
        .await
        .expect("admin");
    let context = jetstream::new(admin);
    let leader = context
        .get_stream("agent_A_stream")
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .cluster
        .clone()
        .and_then(|c| c.leader)
        .expect("a leader");
    let killed: usize = leader
        .trim_start_matches('n')
        .parse()
        .expect("a server n<i>");
    // The worker and the publisher reach a server that stays.
    let kept = (killed + 1) % 3;
    let nats_url = cluster.servers[kept].url();
    let mongo = MongoServer::start();
    let database = unique("ret");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let mut env = vec![
        ("HISTORY_VIEW_NATS_URL", nats_url.clone()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database.clone()),
        (JETSTREAM.0, JETSTREAM.1.to_owned()),
        (LAG_SETTING.0, LAG_SETTING.1.to_owned()),
    ];
    let (app, thread) = if partitioned {
        let prefix = port_prefix(2);
        env.extend([
            ("HISTORY_VIEW_PARTITIONS", "2".to_owned()),
            ("HISTORY_VIEW_PARTITION", "0".to_owned()),
            ("HISTORY_VIEW_JETSTREAM_REPLICAS", "3".to_owned()),
            (
                "HISTORY_VIEW_PEER_URL",
                format!("http://127.0.0.1:{prefix}{{partition}}"),
            ),
        ]);
        (
            BinaryApp::start_on(prefix * 10, &env).await,
            owned_by("t-ret-leader-part", 0),
        )
    } else {
        (BinaryApp::start(&env).await, "t-ret-leader".to_owned())
    };
    let thread = thread.as_str();
    app.wait_ready().await;
    let publisher = async_nats::connect(&nats_url).await.expect("publisher");
    let ledger = Ledger::new(LAG);
    let opening = question(thread);
    ledger
        .store(&store.events(), std::slice::from_ref(&opening))
        .await;
    ledger.published(std::slice::from_ref(&opening));
    publish_rows(&publisher, &[opening]).await;
    read_until_cache(&app.api, thread, "").await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);

    // A chunk every 100 ms for 8 s, published as aihub does (Core NATS: one made during the election may reach no
    // replica) and stored; the leader is killed 2 s in.
    let mut next = Instant::now();
    for n in 1..=80 {
        if n == 20 {
            tokio::task::block_in_place(|| cluster.servers[killed].kill());
            eprintln!("killed {leader} at {:?}", began.elapsed());
        }
        let row = chunk(thread, "A", n, 0);
        ledger.published(std::slice::from_ref(&row));
        publish_rows(&publisher, std::slice::from_ref(&row)).await;
        ledger.store(&store.events(), &[row]).await;
        next += Duration::from_millis(100);
        tokio::time::sleep_until(next.into()).await;
    }
    let new_leader = context.get_stream("agent_A_stream").await.ok();
    eprintln!(
        "published until {:?}; stream reachable after: {}",
        began.elapsed(),
        new_leader.is_some()
    );
    // Upstream of a partitioned worker, nats-server itself resumes sourcing the class stream, and retries a source
    // whose upstream has no leader after 10 s, then 20 s, 30 s... (5 s x 2 x failures, at most 2 minutes): a loaded
    // machine's slow election costs a failure or two more. That is NATS's time, not the worker's (which answers from
    // the store meanwhile, as the reader checks): the worker is held to settling after NATS reports the source
    // caught up, and the budget leaves NATS's wait out.
    let nats_wait = if partitioned {
        source_caught_up(&nats_url, "CHAT_HISTORY_VIEW", "agent_A_stream").await
    } else {
        Duration::ZERO
    };
    // Reads go to the store while a class stream or a source upstream is not confirmed (a loaded machine stretches
    // the election and the sources' recovery), so settling may take longer here than elsewhere.
    settle(&app.api, thread, &ledger, Duration::from_secs(40)).await;
    reader.read_on_then_finish().await;
    let metrics = app.api.metrics().await;
    eprintln!("leader killed: {}", gaps(&metrics));
    cold_reads_equal(
        nats_url,
        mongo.uri(),
        database,
        &[thread.to_owned()],
        &ledger,
    )
    .await;
    eprintln!(
        "took {:?}, of which {nats_wait:?} waiting for NATS's source",
        began.elapsed()
    );
    assert!(
        began.elapsed() - nats_wait < Duration::from_secs(90),
        "over budget: {:?} ({nats_wait:?} of it waiting for NATS's source)",
        began.elapsed()
    );
}

/// Waits until `stream`'s source `source` has caught up (no lag, active within the last 2 s), as nats-server reports
/// it, and returns how long that took; at most 150 s (nats-server's longest retry of a source is 2 minutes).
async fn source_caught_up(nats_url: &str, stream: &str, source: &str) -> Duration {
    let begun = Instant::now();
    let context = &jetstream::new(async_nats::connect(nats_url).await.expect("admin"));
    eventually_within(
        &format!("{stream}'s source {source} caught up"),
        scaled(Duration::from_secs(150)),
        || async move {
            let mut handle = context
                .get_stream(stream)
                .await
                .map_err(|e| e.to_string())?;
            let info = handle.info().await.map_err(|e| e.to_string())?;
            let found = info.sources.iter().find(|s| s.name == source);
            let caught_up = found.is_some_and(|s| {
                s.lag == 0 && s.active.is_some_and(|a| a < Duration::from_secs(2))
            });
            when(caught_up, || format!("{found:?}"))
        },
    )
    .await;
    eprintln!(
        "{stream}'s source {source} caught up after {:?}",
        begun.elapsed()
    );
    begun.elapsed()
}

// ---------------------------------------------------------------------------------------------------------------
// 6, 7: failing closed.

/// A JetStream worker on `scene` reaching `nats_url`, started but not waited ready.
async fn unready_worker(scene: &Scene, nats_url: String) -> BinaryApp {
    BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats_url),
        ("HISTORY_VIEW_MONGODB_URI", scene.mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", scene.database.clone()),
        (JETSTREAM.0, JETSTREAM.1.to_owned()),
        (LAG_SETTING.0, LAG_SETTING.1.to_owned()),
    ])
    .await
}

/// Waits until the worker fails closed: `/readyz` 503 naming `needle`, an ERROR log naming
/// HISTORY_VIEW_JETSTREAM_STREAMS, no stream consumed; then it stays unready for 3 s.
async fn failed_closed(app: &BinaryApp, needle: &str) {
    // The streams are listed every second (half of the 2 s bound): ten listings.
    eventually_within(
        "failed closed",
        scaled(Duration::from_secs(10)),
        || async move {
            let ready = app.api.get("/readyz", &[]).await;
            let logged = app
                .log_lines("HISTORY_VIEW_JETSTREAM_STREAMS")
                .into_iter()
                .any(|l| l.contains("ERROR"));
            if ready.status == 503 && ready.body.contains(needle) && logged {
                eprintln!("/readyz: {}", ready.body);
                return Ok(());
            }
            let lines = app.log_lines("");
            Err(format!(
                "/readyz {} {}; ERROR logged: {logged}; the worker's log:\n{}",
                ready.status,
                ready.body,
                lines[lines.len().saturating_sub(30)..].join("\n")
            ))
        },
    )
    .await;
    for line in app.log_lines("HISTORY_VIEW_JETSTREAM_STREAMS") {
        eprintln!("log: {line}");
    }
    // It stays unready: an absence over three listings, sampled (not a wait for anything).
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let ready = app.api.get("/readyz", &[]).await;
        assert_eq!(ready.status, 503, "ready without a stream: {}", ready.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        metric(&app.api.metrics().await, "history_view_jetstream_streams "),
        0.0
    );
    let metrics = app.api.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l == "history_view_jetstream_streams 0"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("jetstream_streams"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Stores a turn of `thread` and reads until the answer has it: from the store, never from memory.
async fn read_from_the_store(scene: &Scene, ledger: &Ledger, api: &Api, thread: &str, n: usize) {
    let row = if n == 0 {
        question(thread)
    } else {
        chunk(thread, "A", n, 0)
    };
    ledger
        .store(&scene.store.events(), std::slice::from_ref(&row))
        .await;
    let read = read_history(&target(api), thread, None, ledger).await;
    read.report.assert_kept("a read while failed closed");
    let body = read.body;
    assert_eq!(read.source, Some(Source::Store), "{body}");
    assert!(body.contains(&token(&row).expect("a token")), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stream_matching_fails_closed_reads_from_the_store_and_a_stream_created_later_is_consumed()
 {
    let _timed = Timed::new(
        "no_stream_matching_fails_closed_reads_from_the_store_and_a_stream_created_later_is_consumed",
    );
    let scene = Scene::new().await;
    let app = unready_worker(&scene, scene.nats.url()).await;
    let ledger = Ledger::new(LAG);
    let thread = "t-ret-nostream";
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    failed_closed(&app, "HISTORY_VIEW_JETSTREAM_STREAMS").await;
    // Stored after the start: every read answers from the store, with it.
    read_from_the_store(&scene, &ledger, &app.api, thread, 0).await;
    read_from_the_store(&scene, &ledger, &app.api, thread, 1).await;

    create_class_streams(&scene.nats.url(), ["UserAgent".into(), "A".into()]).await;
    app.wait_ready().await;
    wait_metric(&app.api, "history_view_jetstream_streams", 2.0).await;
    let context = jetstream::new(scene.publisher.clone());
    store_and_publish(&ledger, &scene.store, &context, &[chunk(thread, "A", 2, 0)]).await;
    settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    reader.finish().await;
    cold_reads_equal_in(&scene, &[thread.to_owned()], &ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_without_jetstream_fails_closed_and_reads_come_from_the_store() {
    let _timed =
        Timed::new("a_nats_server_without_jetstream_fails_closed_and_reads_come_from_the_store");
    let scene = Scene::new().await;
    let core_only = tokio::task::block_in_place(NatsServer::start_without_jetstream);
    let app = unready_worker(&scene, core_only.url()).await;
    let ledger = Ledger::new(LAG);
    let thread = "t-ret-nojs";
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    failed_closed(&app, "JetStream").await;
    read_from_the_store(&scene, &ledger, &app.api, thread, 0).await;
    read_from_the_store(&scene, &ledger, &app.api, thread, 1).await;
    let report = reader.finish().await;
    assert_eq!(report.cache, 0, "served from memory without JetStream");
}

// ---------------------------------------------------------------------------------------------------------------
// 8: a class stream created while workers run.

/// Creates `agent_Late_stream` and at once publishes (acknowledged) and stores five chunks of `thread` from a
/// `Late` agent; returns when they are in the stream.
async fn late_class_stream(scene: &Scene, ledger: &Ledger, thread: &str) {
    create_class_streams(&scene.nats.url(), ["Late".into()]).await;
    let context = jetstream::new(scene.publisher.clone());
    let rows: Vec<Value> = (1..=5).map(|n| chunk(thread, "Late", n, 0)).collect();
    ledger.published(&rows);
    publish_stored(&context, &rows).await;
    ledger.store(&scene.store.events(), &rows).await;
}

async fn events(api: &Api) -> f64 {
    metric_sum(&api.metrics().await, "history_view_events_total")
}

async fn wait_events(api: &Api, at_least: f64) {
    eventually(&format!("{at_least} events received"), || async move {
        let received = events(api).await;
        when(received >= at_least, || format!("received {received}"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_stream_created_while_the_worker_runs_is_consumed_from_its_first_message_after_a_gap()
 {
    let _timed = Timed::new(
        "a_class_stream_created_while_the_worker_runs_is_consumed_from_its_first_message_after_a_gap",
    );
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into(), "A".into()]).await;
    let app = class_worker(&scene).await;
    let ledger = Ledger::new(LAG);
    let thread = "t-ret-late";
    opened(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    let before = events(&app.api).await;

    late_class_stream(&scene, &ledger, thread).await;
    wait_events(&app.api, before + 5.0).await;
    wait_metric(&app.api, &gap_cause("new_stream"), 1.0).await;
    wait_metric(&app.api, "history_view_jetstream_streams", 3.0).await;
    settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    reader.read_on_then_finish().await;
    assert_eq!(
        events(&app.api).await,
        before + 5.0,
        "each of its first 5 messages once"
    );
    cold_reads_equal_in(&scene, &[thread.to_owned()], &ledger).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_stream_created_while_partitioned_workers_run_is_sourced_from_its_first_message_after_a_gap()
 {
    let _timed = Timed::new(
        "a_class_stream_created_while_partitioned_workers_run_is_sourced_from_its_first_message_after_a_gap",
    );
    let deployment = Partitioned::start(&["UserAgent", "A"], &[]).await;
    let scene = &deployment.scene;
    let ledger = Ledger::new(LAG);
    let thread = owned_by("t-ret-plate", 1);
    let owner_app = deployment.owner(&thread);
    opened(scene, &ledger, &owner_app.api, &thread).await;
    let reader = Reader::start(
        targets(deployment.apis(&thread)),
        &thread,
        Kind::History(None),
        &ledger,
    );
    let before = events(&owner_app.api).await;

    late_class_stream(scene, &ledger, &thread).await;
    wait_events(&owner_app.api, before + 5.0).await;
    wait_metric(&owner_app.api, &gap_cause("upstream"), 1.0).await;
    for api in deployment.apis(&thread) {
        settle(&api, &thread, &ledger, Duration::from_secs(20)).await;
    }
    reader.read_on_then_finish().await;
    assert_eq!(
        events(&owner_app.api).await,
        before + 5.0,
        "each of its first 5 messages once"
    );
    deployment.cold_reads_equal(&[thread], &ledger).await;
}

// ---------------------------------------------------------------------------------------------------------------
// 9, 10: the serving rule (issue 47): a worker behind its stream under a burst, and a class stream that refuses
// display events, never answer from memory without what the store has held longer than the bound.

/// A JetStream worker on `scene` with the default settings: the test build, or the one `CHV_WORKER_BINARY` names
/// (to hold another build to the same scenario).
async fn default_class_worker(scene: &Scene) -> BinaryApp {
    scene
        .worker_binary(
            &worker_binary(),
            scene.nats.url(),
            &[JETSTREAM, LAG_SETTING],
        )
        .await
}

/// How far behind its stream the burst must put the worker: a chunk of the read thread applied only this long after
/// its stream stored it, past the bound (so an answer from memory could have lacked it for a second).
const BEHIND: Duration = Duration::from_millis(3_000);
/// The burst's events: at least this many; then, while no chunk has waited [`BEHIND`] and the worker catches up,
/// as many again, for at most [`BURST_FOR_AT_MOST`]; after that a worker that still keeps up is frozen for
/// [`BEHIND`] and half a second while the burst goes on.
const BURST_MIN: usize = 150_000;
const BURST_FOR_AT_MOST: Duration = Duration::from_secs(8);
const PUBLISHERS: usize = 3;

/// A display event aihub's agents publish in a burst, as `(subject, payload)`: chunk `n` of publisher `p`, on one
/// of 1,000 threads of its own that no worker has a view of (decoded by the worker, then dropped for want of a view),
/// from an agent of class `A`. Formatted directly (the subject and payload [`chunk_row`] makes: checked by
/// [`burst_event_is_a_chunk_row`]), so that publishing it costs the test next to nothing.
fn burst_event(p: usize, n: usize) -> (String, String) {
    let thread = format!("t-ret-flood-{p}-{}", n % 1_000);
    let id = format!("f{p}-{n}");
    let subject = format!("agent.A.a1.{thread}.d1.run-1.display_event.ChunkEvent.{id}");
    let payload = format!(
        r#"{{"content":"[{id}]","model_name":"m","event_id":"{id}","created_at":{},"_event_name":"ChunkEvent","_parent_event_names":["ChunkEvent","DisplayEvent"]}}"#,
        now_ns(0)
    );
    (subject, payload)
}

fn burst_event_is_a_chunk_row() {
    let (subject, payload) = burst_event(2, 1_007);
    let payload: Value = serde_json::from_str(&payload).expect("JSON");
    let row = chunk_row(
        "t-ret-flood-2-7",
        "d1",
        "A",
        "f2-1007",
        payload["created_at"].as_i64().expect("created_at"),
        "[f2-1007]",
    );
    assert_eq!(subject, test_support::rows::subject(&row));
    assert_eq!(payload, row["event_data"]);
}

/// Publisher `p` floods `agent_A_stream` with [`burst_event`]s (Core publishes, as aihub's agents make them), 500
/// at a time, while the publishers together have published (`published`) less than `quota`, until `stop`.
async fn flood(
    client: async_nats::Client,
    p: usize,
    stop: Arc<AtomicBool>,
    published: Arc<AtomicUsize>,
    quota: Arc<AtomicUsize>,
) {
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        if published.load(Ordering::SeqCst) >= quota.load(Ordering::SeqCst) {
            client.flush().await.expect("flush");
            // The load generator's pacing: it looks at its quota again (a wait for nothing in the worker).
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        for _ in 0..500 {
            let (subject, payload) = burst_event(p, n);
            client
                .publish(subject, payload.into())
                .await
                .expect("publish");
            n += 1;
        }
        published.fetch_add(500, Ordering::SeqCst);
    }
    client.flush().await.expect("flush");
}

/// What `/metrics` said of a stream's last applied sequence, sampled all along: `(when the scrape was sent,
/// sequence)`. A sample says the sequences past it were not applied yet when it was sent.
#[derive(Clone, Default)]
struct Applied {
    samples: Arc<Mutex<Vec<(Instant, u64)>>>,
}

impl Applied {
    /// Samples `api`'s `history_view_jetstream_last_sequence` of `stream` every 100 ms until `running` is false (a
    /// scrape that fails or takes over 5 s is left out).
    fn watch(
        &self,
        api: Api,
        stream: &'static str,
        running: Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<()> {
        let samples = self.samples.clone();
        let sample = format!("history_view_jetstream_last_sequence{{stream=\"{stream}\"}}");
        tokio::spawn(async move {
            while running.load(Ordering::SeqCst) {
                let sent = Instant::now();
                let scraped = api
                    .http
                    .get(format!("{}/metrics", api.address))
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await;
                if let Ok(response) = scraped
                    && let Ok(metrics) = response.text().await
                {
                    let sequence = metric(&metrics, &sample) as u64;
                    samples.lock().unwrap().push((sent, sequence));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    }

    /// The last sequence seen applied.
    fn latest(&self) -> u64 {
        self.samples.lock().unwrap().last().map_or(0, |s| s.1)
    }

    /// How long the message of stream sequence `sequence`, stored at `stored`, is known to have waited unapplied:
    /// until the last scrape sent that did not show it applied.
    fn waited(&self, sequence: u64, stored: Instant) -> Duration {
        self.samples
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|(_, applied)| *applied < sequence)
            .map_or(Duration::ZERO, |(sent, _)| {
                sent.saturating_duration_since(stored)
            })
    }

    /// The longest any of `chunks` (stream sequence, when its stream acknowledged it) is known to have waited.
    fn longest_wait(&self, chunks: &[(u64, Instant)]) -> Duration {
        chunks
            .iter()
            .map(|(sequence, stored)| self.waited(*sequence, *stored))
            .max()
            .unwrap_or_default()
    }
}

/// Each chunk's stream sequence and when its stream acknowledged it.
type Acknowledged = Arc<Mutex<Vec<(u64, Instant)>>>;

/// Stores each chunk (the ledger) once its stream has acknowledged it, in the order published, and notes it in
/// `acknowledged`.
fn store_once_acknowledged(
    ledger: &Ledger,
    store: TestStore,
    acknowledged: Acknowledged,
) -> (
    tokio::sync::mpsc::UnboundedSender<(Value, jetstream::context::PublishAckFuture)>,
    tokio::task::JoinHandle<()>,
) {
    let (send, mut received) =
        tokio::sync::mpsc::unbounded_channel::<(Value, jetstream::context::PublishAckFuture)>();
    let ledger = ledger.clone();
    let task = tokio::spawn(async move {
        while let Some((row, ack)) = received.recv().await {
            let ack = ack.await.expect("stored by its stream");
            acknowledged
                .lock()
                .unwrap()
                .push((ack.sequence, Instant::now()));
            ledger.store(&store.events(), &[row]).await;
        }
    });
    (send, task)
}

/// Stops the publishers and returns `agent_A_stream`'s last sequence once they have flushed.
async fn end_burst(
    stop: &AtomicBool,
    publishers: &mut JoinSet<()>,
    context: &jetstream::Context,
) -> u64 {
    stop.store(true, Ordering::SeqCst);
    while let Some(done) = publishers.join_next().await {
        done.expect("a publisher");
    }
    stream_state(context, "agent_A_stream").await.last_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_its_class_stream_in_a_burst_never_answers_from_memory_without_a_chunk_stored_past_the_bound()
 {
    let _timed = Timed::new(
        "a_worker_behind_its_class_stream_in_a_burst_never_answers_from_memory_without_a_chunk_stored_past_the_bound",
    );
    burst_event_is_a_chunk_row();
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into(), "A".into()]).await;
    let app = default_class_worker(&scene).await;
    let ledger = Ledger::new(LAG);
    let thread = "t-ret-behind";
    opened(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    // A chunk's acknowledgement waits for the stream to store what was published before it.
    let mut context = jetstream::new(scene.publisher.clone());
    context.set_timeout(Duration::from_secs(60));
    let applied = Applied::default();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = applied.watch(app.api.clone(), "agent_A_stream", watching.clone());
    let store = TestStore::connect(&scene.mongo.uri(), &scene.database).await;
    let acknowledged = Acknowledged::default();
    let (storing, stored) = store_once_acknowledged(&ledger, store, acknowledged.clone());

    // The burst: publishers of their own (aihub's agents), into the class stream the thread's chunks go to.
    let began = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let published = Arc::new(AtomicUsize::new(0));
    let quota = Arc::new(AtomicUsize::new(BURST_MIN));
    let mut publishers = JoinSet::new();
    for p in 0..PUBLISHERS {
        let client = async_nats::connect(scene.nats.url())
            .await
            .expect("a publisher");
        publishers.spawn(flood(
            client,
            p,
            stop.clone(),
            published.clone(),
            quota.clone(),
        ));
    }
    // A chunk of the thread every 250 ms, published (stored by its stream once acknowledged) and then stored, as
    // aihub does, during the burst and until the worker has caught up. Once BURST_MIN events are published, the
    // burst ends when a chunk has waited BEHIND unapplied; a worker that catches up before that gets BURST_MIN
    // more, for at most BURST_FOR_AT_MOST, then is frozen for BEHIND and half a second while the burst goes on.
    enum Phase {
        Flooding,
        Watching,
        Frozen(Instant),
        Over(u64),
    }
    let mut phase = Phase::Flooding;
    // When the worker was frozen, and until when.
    let mut froze: Option<(Instant, Instant)> = None;
    let mut chunks = 0;
    // How many chunks had been published when the last round of the burst was complete.
    let mut before_watching = 0;
    let mut next = Instant::now();
    loop {
        assert!(
            began.elapsed() < Duration::from_secs(90),
            "the burst and the catch-up took over 90 s: {}",
            diagnostics(&app.api).await
        );
        chunks += 1;
        let row = chunk(thread, "A", chunks, 0);
        ledger.published(std::slice::from_ref(&row));
        let ack = context
            .publish(
                test_support::rows::subject(&row),
                test_support::rows::payload(&row).into(),
            )
            .await
            .expect("publish");
        storing.send((row, ack)).expect("the storing task");
        match phase {
            Phase::Flooding => {
                if published.load(Ordering::SeqCst) >= quota.load(Ordering::SeqCst) {
                    before_watching = chunks;
                    phase = Phase::Watching;
                }
            }
            Phase::Watching => {
                let acknowledged = acknowledged.lock().unwrap().clone();
                let through = acknowledged.last().map_or(0, |c| c.0);
                if applied.longest_wait(&acknowledged) >= BEHIND {
                    phase = Phase::Over(end_burst(&stop, &mut publishers, &context).await);
                } else if acknowledged.len() > before_watching && applied.latest() >= through {
                    if began.elapsed() < BURST_FOR_AT_MOST {
                        eprintln!("caught up with {through}: {BURST_MIN} events more");
                        quota.fetch_add(BURST_MIN, Ordering::SeqCst);
                        phase = Phase::Flooding;
                    } else {
                        // Frozen while the burst goes on: it has a backlog to apply when thawed.
                        eprintln!("the worker keeps up: frozen for {BEHIND:?}");
                        tokio::task::block_in_place(|| app.pause());
                        quota.fetch_add(BURST_MIN, Ordering::SeqCst);
                        phase = Phase::Frozen(Instant::now());
                    }
                }
            }
            Phase::Frozen(since) => {
                if since.elapsed() >= BEHIND + Duration::from_millis(500) {
                    app.resume();
                    froze = Some((since, Instant::now()));
                    phase = Phase::Over(end_burst(&stop, &mut publishers, &context).await);
                }
            }
            Phase::Over(last) => {
                if applied.latest() >= last {
                    break;
                }
            }
        }
        next += Duration::from_millis(250);
        tokio::time::sleep_until(next.into()).await;
    }
    let caught_up = began.elapsed();
    drop(storing);
    stored.await.expect("the storing task");
    // Read on for 2 s after.
    reader
        .wait_started_after(Instant::now() + Duration::from_secs(2))
        .await;
    watching.store(false, Ordering::SeqCst);
    watcher.await.expect("the watcher");
    // How long each chunk is known to have waited unapplied: by the scrapes, or (acknowledged while the worker was
    // frozen) until it was thawed.
    let acknowledged = acknowledged.lock().unwrap().clone();
    let waits: Vec<Duration> = acknowledged
        .iter()
        .map(|(sequence, stored)| {
            let thawed = froze
                .filter(|(from, to)| (*from..*to).contains(stored))
                .map_or(Duration::ZERO, |(_, to)| to - *stored);
            applied.waited(*sequence, *stored).max(thawed)
        })
        .collect();
    let longest = waits.iter().max().copied().unwrap_or_default();
    let past_the_bound = waits.iter().filter(|w| **w > LAG).count();
    let flooded = published.load(Ordering::SeqCst);
    let last = stream_state(&context, "agent_A_stream").await.last_sequence;
    eprintln!(
        "burst: {flooded} events by {PUBLISHERS} publishers ({last} messages in the stream in all); {} chunks of \
         {thread}, {past_the_bound} of them known to have waited unapplied more than the bound after their stream \
         stored them (the longest {longest:?}); caught up {caught_up:?} after the burst began",
        acknowledged.len(),
    );
    let report = reader.finish().await;
    eprintln!(
        "{} reads from memory, {} from the store",
        report.cache, report.store
    );
    assert!(flooded >= BURST_MIN, "{flooded} events");
    assert!(
        longest >= BEHIND,
        "the burst did not put the worker {BEHIND:?} behind (the longest wait {longest:?})"
    );
    settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    cold_reads_equal_in(&scene, &[thread.to_owned()], &ledger).await;
}

/// The sample of `history_view_jetstream_refusing` of agent_A_stream for `full` (the client library writes labels
/// sorted by name).
const REFUSING_FULL: &str =
    "history_view_jetstream_refusing{cause=\"full\",stream=\"agent_A_stream\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_stream_full_with_discard_new_refuses_a_chunk_and_nothing_is_answered_from_memory_without_it()
 {
    let _timed = Timed::new(
        "a_class_stream_full_with_discard_new_refuses_a_chunk_and_nothing_is_answered_from_memory_without_it",
    );
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into()]).await;
    create_limited_class_stream(&scene.nats.url(), "A", |config| {
        config.max_messages = 200;
        config.discard = stream::DiscardPolicy::New;
    })
    .await;
    let app = default_class_worker(&scene).await;
    let ledger = Ledger::new(LAG);
    let thread = "t-ret-refused";
    opened(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    let context = jetstream::new(scene.publisher.clone());

    // Other threads' chunks fill the stream to its limit: from then on it refuses what is published to it.
    let others: Vec<Value> = (1..=200)
        .map(|n| chunk(&format!("t-ret-refused-other-{}", n % 10), "A", n, 0))
        .collect();
    publish_stored(&context, &others).await;
    wait_stream(&context, "agent_A_stream", "full", |s| s.messages == 200).await;
    // A chunk of the thread: refused by its stream, stored by aihub's persister all the same.
    let refused = chunk(thread, "A", 1, 0);
    ledger.published(std::slice::from_ref(&refused));
    let answer = context
        .publish(
            test_support::rows::subject(&refused),
            test_support::rows::payload(&refused).into(),
        )
        .await
        .expect("publish")
        .await;
    assert!(answer.is_err(), "the full stream took it: {answer:?}");
    eprintln!("refused: {}", answer.expect_err("refused"));
    ledger
        .store(&scene.store.events(), std::slice::from_ref(&refused))
        .await;
    let stored = Instant::now();

    // The thread's answer has the chunk, from the store, by the bound after it was stored (the reader judges every
    // answer meanwhile); the worker says why.
    let mut with_it = None;
    while stored.elapsed() < LAG + Duration::from_secs(3) {
        let reply = app.api.history(thread, "").await;
        if reply.status == 200 && reply.body.contains(&token(&refused).expect("a token")) {
            with_it = Some((reply.source().map(str::to_owned), stored.elapsed()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Read on for the bound and 2 s more: never from memory without it.
    reader
        .wait_started_after(stored + LAG + Duration::from_secs(2))
        .await;
    let ready = app.api.get("/readyz", &[]).await;
    let metrics = app.api.metrics().await;
    let report = reader.finish().await;
    eprintln!(
        "refused chunk answered: {with_it:?}; /readyz {} {}; {} reads from memory, {} from the store",
        ready.status, ready.body, report.cache, report.store
    );
    assert!(
        with_it.is_some(),
        "never answered with the refused chunk:\n{}",
        diagnostics(&app.api).await
    );
    assert_eq!(ready.status, 503, "ready while refusing: {}", ready.body);
    assert!(ready.body.contains("agent_A_stream"), "{}", ready.body);
    assert_eq!(
        metric(&metrics, REFUSING_FULL),
        1.0,
        "{}",
        diagnostics(&app.api).await
    );

    // Room again (a purge): no longer refusing, a gap (what it refused reached no stream), and the thread served
    // from memory again, with the chunk.
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    context
        .get_stream("agent_A_stream")
        .await
        .expect("the stream")
        .purge()
        .await
        .expect("a purge");
    wait_metric(&app.api, &gap_cause("refused"), 1.0).await;
    app.wait_ready().await;
    settle(&app.api, thread, &ledger, Duration::from_secs(20)).await;
    reader.read_on_then_finish().await;
    assert_eq!(metric(&app.api.metrics().await, REFUSING_FULL), 0.0);
    cold_reads_equal_in(&scene, &[thread.to_owned()], &ledger).await;
}
