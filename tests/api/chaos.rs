//! The soak: overlapping faults under load, on the worker binary (`make soak`: the release build) with real servers (the Mongo-wire server on
//! disk, so a restart keeps the data). A publisher plays multi-turn conversations over many threads (nested
//! helpers, HITL reveals, duplicate deliveries); a persister like aihub's (its own NATS connection, not through
//! the faults) writes every event 0-500 ms after receiving it, sometimes twice as a second replica would; readers
//! read all the time, half with the primary identity; and a chaos loop cuts the worker's link to NATS, leaves it
//! half-open, freezes and restarts nats-server, and freezes and restarts the Mongo-wire server, some faults
//! overlapping. Once per cycle a quiet point (faults stopped, persister caught up, the worker's lag bound elapsed)
//! compares every thread's answer with a fresh worker's cold read and with the projector over the stored rows.
//!
//! `SOAK_SECS` (default 60: one cycle, what `make test` runs; `make soak` runs 300: five) sets the length, one
//! cycle per started minute; `SOAK_THREADS` (default 40; `make soak` 200) the number of threads. It prints a table
//! and writes `target/soak.json`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chat_history_view::decode::{Decoded, ViewEvent, decode_row};
use chat_history_view::project::{Identity, project};
use futures_util::StreamExt;
use futures_util::TryStreamExt;
use mongodb::bson::{RawDocumentBuf, doc};
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::fuzz_corpus::checks::stored_row;
use crate::helpers::{Api, BinaryApp, TestStore, metric, unique, worker_binary};
use crate::threads;
use test_support::memory::memory;
use test_support::proxy::Proxy;
use test_support::servers::{MongoServer, NatsServer};
use test_support::turns::{Conversation, PRIMARY};

/// The worker's persister-lag bound (its default) and the persister's largest delay.
const LAG: Duration = Duration::from_millis(2000);
const PERSIST_DELAY_MS: u64 = 500;
/// Readiness must be back this soon after a fault ends.
const RECOVERY: Duration = Duration::from_secs(15);
/// Long enough for the worker to notice a frozen server or a half-open link (about three 4 s pings).
const DEAD_LINK_HOLD: Duration = Duration::from_secs(14);
/// Reads after recovery and the lag bound, before the next fault: the window whose reads must mostly be served
/// from memory.
const CALM: Duration = Duration::from_secs(5);
/// The worker's default cache budget, and the RSS it may reach.
const RSS_LIMIT_KIB: u64 = (256 + 64) * 1024;
const READERS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    LinkCut,
    LinkHalfOpen,
    NatsFrozen,
    NatsRestarted,
    MongoFrozen,
    MongoRestarted,
}

/// A tiny xorshift generator: the soak needs variety, not quality, and no extra crate.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// What the readers saw, by phase.
#[derive(Default)]
struct Reads {
    /// (source, status) -> count, over the whole run.
    all: Mutex<BTreeMap<(String, u16), u64>>,
    calm_total: AtomicU64,
    calm_cache: AtomicU64,
}

/// The persister: its own connection to nats-server (never through the worker's proxy), each event written 0-500 ms
/// after it arrived, one in five written twice (a second replica). One writer inserts whatever is due in batches
/// and retries a batch until the store takes it (one insert per event, as aihub writes, overloads the Mongo-wire
/// server at the soak's rate and never catches up once a fault has piled them up).
///
/// Every event committed more than the bound after its `created_at` goes into `late_commits` (by event id): the
/// driver sets a row's `_id` when the insert is sent, so a slow or frozen store commits rows whose `_id` says they
/// were stored in time, and on a loaded machine the persister itself may receive an event late. The worker cannot
/// tell such a row from one it lost; the soak can.
fn persister(
    client: async_nats::Client,
    store: TestStore,
    pending: Arc<AtomicUsize>,
    late_commits: Arc<Mutex<LateCommits>>,
) {
    let (due_tx, mut due_rx) = tokio::sync::mpsc::unbounded_channel::<Due>();
    let counted = pending.clone();
    tokio::spawn(async move {
        let mut subscriber = client
            .subscribe("agent.>")
            .await
            .expect("persister subscribes");
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        while let Some(message) = subscriber.next().await {
            let data: Value = serde_json::from_slice(&message.payload).expect("a JSON payload");
            let created_at_ns = data["created_at"].as_i64().unwrap_or(0);
            let row = stored_row(&message.subject, data);
            let document = mongodb::bson::to_document(&row).expect("row converts to BSON");
            let received = Instant::now();
            let due = received + Duration::from_millis(rng.below(PERSIST_DELAY_MS + 1));
            let event_id: Arc<str> = message.subject.rsplit('.').next().unwrap_or("").into();
            let copies = if rng.below(5) == 0 { 2 } else { 1 };
            for _ in 0..copies {
                counted.fetch_add(1, Ordering::SeqCst);
                let _ = due_tx.send(Due {
                    at: due,
                    created_at_ns,
                    event_id: event_id.clone(),
                    row: document.clone(),
                });
            }
        }
    });
    tokio::spawn(async move {
        let events = store.events();
        let mut waiting: Vec<Due> = Vec::new();
        loop {
            while let Ok(row) = due_rx.try_recv() {
                waiting.push(row);
            }
            let now = Instant::now();
            let (due, later): (Vec<_>, Vec<_>) = waiting.drain(..).partition(|due| due.at <= now);
            waiting = later;
            // Batches of at most 100: the Mongo-wire server takes a few hundred rows a second.
            for batch in due.chunks(100) {
                let rows = batch.iter().map(|due| &due.row);
                loop {
                    let insert = events.insert_many(rows.clone());
                    match tokio::time::timeout(Duration::from_secs(30), insert).await {
                        Ok(Ok(_)) => break,
                        _ => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                // The bound is the worker's, counted from `created_at` (the publisher's clock, this host's): the
                // persister may itself receive an event late when the machine is loaded.
                let committed = unix_ns();
                let mut late = late_commits.lock().unwrap();
                for due in batch {
                    let lag = Duration::from_nanos(
                        u64::try_from(committed.saturating_sub(due.created_at_ns)).unwrap_or(0),
                    );
                    late.max = late.max.max(lag);
                    let longest = late.lags.entry(due.event_id.clone()).or_default();
                    *longest = (*longest).max(lag);
                    if lag > LAG {
                        late.events.insert(due.event_id.clone());
                    }
                }
                drop(late);
                pending.fetch_sub(batch.len(), Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// A row the persister will insert once `at` has come.
struct Due {
    at: Instant,
    /// The event's `created_at`, ns since the epoch.
    created_at_ns: i64,
    event_id: Arc<str>,
    row: mongodb::bson::Document,
}

fn unix_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// The events the persister committed beyond the bound, and its largest commit lag.
#[derive(Default)]
struct LateCommits {
    events: std::collections::HashSet<Arc<str>>,
    max: Duration,
    /// Every event's commit lag (the longest of its copies), to say what an unexplained `missing` event's was.
    lags: HashMap<Arc<str>, Duration>,
}

/// Publishes the threads' turns while `open` says so: a random thread's next turn every 100 ms (about 80 events a
/// second, what the Mongo-wire server can store with room to catch up after a fault), one event in ten
/// delivered twice. Every thread gets its first turn before this returns.
async fn publisher(
    client: async_nats::Client,
    names: Vec<String>,
    mut open: watch::Receiver<bool>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    let mut conversations: Vec<Conversation> = names.into_iter().map(Conversation::new).collect();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for conversation in &mut conversations {
        publish(&client, &conversation.next_turn(), &mut rng).await;
    }
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            if open.wait_for(|open| *open).await.is_err() {
                return;
            }
            let n = rng.below(conversations.len() as u64) as usize;
            let rows = conversations[n].next_turn();
            publish(&client, &rows, &mut rng).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

async fn publish(client: &async_nats::Client, rows: &[Value], rng: &mut Rng) {
    for row in rows {
        let payload: bytes::Bytes = serde_json::to_vec(&row["event_data"])
            .expect("payload")
            .into();
        let copies = if rng.below(10) == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let _ = client.publish(threads::subject(row), payload.clone()).await;
        }
    }
    let _ = client.flush().await;
}

/// The event ids a shadow-check warning names `missing` (its `events` field: `missing:<name>/<event id>`).
fn missing_events(line: &str) -> Vec<String> {
    let Ok(line) = serde_json::from_str::<Value>(line) else {
        return Vec::new();
    };
    let events: Vec<String> = line["events"]
        .as_str()
        .and_then(|events| serde_json::from_str(events).ok())
        .unwrap_or_default();
    events
        .iter()
        .filter_map(|event| event.strip_prefix("missing:"))
        .filter_map(|event| event.rsplit_once('/'))
        .map(|(_, id)| id.to_owned())
        .collect()
}

/// Readers: random threads, half of the reads with the primary identity, counted by source and status; reads
/// while `calm` is set are counted apart.
fn readers(
    api: &Api,
    names: &[String],
    reads: &Arc<Reads>,
    calm: &Arc<AtomicBool>,
    stop: &Arc<AtomicBool>,
) {
    for reader in 0..READERS {
        let (api, names, reads, calm, stop) = (
            api.clone(),
            names.to_vec(),
            reads.clone(),
            calm.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            let mut rng = Rng(0x1234_5678 + reader as u64);
            while !stop.load(Ordering::SeqCst) {
                let thread = &names[rng.below(names.len() as u64) as usize];
                let query = if rng.below(2) == 0 {
                    Conversation::query()
                } else {
                    String::new()
                };
                let was_calm = calm.load(Ordering::SeqCst);
                let reply = api.history(thread, &query).await;
                let source = reply.source().unwrap_or("-").to_owned();
                if was_calm && calm.load(Ordering::SeqCst) {
                    reads.calm_total.fetch_add(1, Ordering::Relaxed);
                    if source == "cache" {
                        reads.calm_cache.fetch_add(1, Ordering::Relaxed);
                    }
                }
                *reads
                    .all
                    .lock()
                    .unwrap()
                    .entry((source, reply.status))
                    .or_default() += 1;
            }
        });
    }
}

/// Samples the worker's RSS every second: (seconds since start, KiB).
fn rss_sampler(
    pid: u32,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(u64, u64)>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            samples.push((started.elapsed().as_secs(), memory(pid).rss_kib));
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        samples
    })
}

/// Lets the worker serve undisturbed: the lag bound first (reads within it cannot come from memory after a
/// reconnect, by design), then [`CALM`] during which reads count as between faults.
async fn calm_window(calm: &AtomicBool) {
    tokio::time::sleep(LAG).await;
    calm.store(true, Ordering::SeqCst);
    tokio::time::sleep(CALM).await;
    calm.store(false, Ordering::SeqCst);
}

/// Waits until `client` is connected again and the server has processed everything it sent (its subscriptions
/// included, which it re-sends on reconnecting).
async fn reconnected(client: &async_nats::Client) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while client.connection_state() != async_nats::connection::State::Connected
        || tokio::time::timeout(Duration::from_secs(1), client.flush())
            .await
            .map_or(true, |r| r.is_err())
    {
        assert!(Instant::now() < deadline, "a test client did not reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn progress(started: Instant, cycle: usize, what: &str) {
    eprintln!(
        "soak {:>5.1} s, cycle {cycle}: {what}",
        started.elapsed().as_secs_f64()
    );
}

/// A dead link held for [`DEAD_LINK_HOLD`] must have been noticed: readiness 503. The failure, if not.
async fn noticed(api: &Api, fault: Fault) -> Option<String> {
    let status = api.get("/readyz", &[]).await.status;
    (status != 503)
        .then(|| format!("{fault:?} not noticed within {DEAD_LINK_HOLD:?} (readiness {status})"))
}

/// Waits until the worker answers ready; how long that took, or `None` past [`RECOVERY`].
async fn recovery(api: &Api) -> Option<Duration> {
    let since = Instant::now();
    while since.elapsed() < RECOVERY {
        if api.get("/readyz", &[]).await.status == 200 {
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// Every stored row, decoded, by thread (one query: the Mongo-wire server scans for each).
async fn stored_events(store: &TestStore) -> HashMap<String, Vec<ViewEvent>> {
    let rows: Vec<RawDocumentBuf> = store
        .events()
        .clone_with_type::<RawDocumentBuf>()
        .find(doc! {})
        .await
        .expect("stored rows")
        .try_collect()
        .await
        .expect("stored rows");
    let mut events: HashMap<String, Vec<ViewEvent>> = HashMap::new();
    for row in &rows {
        if let Decoded::Event(event) = decode_row(row) {
            events
                .entry(event.key.thread_id().to_owned())
                .or_default()
                .push(event);
        }
    }
    events
}

/// The quiet point's comparison: every thread, with and without the primary identity, as the worker answers it,
/// as a fresh worker answers it cold, and as the projector makes it of the stored rows. Returns the divergences.
async fn compare(worker: &Api, fresh: &Api, store: &TestStore, names: &[String]) -> Vec<String> {
    let primary = Identity {
        agent_class: PRIMARY.0.into(),
        agent_id: PRIMARY.1.into(),
    };
    let stored = stored_events(store).await;
    let mut divergences = Vec::new();
    for thread in names {
        let events = stored.get(thread).map_or(&[][..], Vec::as_slice);
        for (query, identity) in [
            (String::new(), None),
            (Conversation::query(), Some(&primary)),
        ] {
            let served = worker.history(thread, &query).await;
            let cold = fresh.history(thread, &query).await;
            let expected = json!(project(events, identity).history.messages);
            let source = served.source().unwrap_or("-").to_owned();
            if served.status != 200 || cold.status != 200 {
                divergences.push(format!(
                    "{thread} ?{query}: status {} (cold {})",
                    served.status, cold.status
                ));
            } else if served.body != cold.body {
                divergences.push(format!(
                    "{thread} ?{query}: from {source}, differs from a cold read"
                ));
            } else if served.json()["messages"] != expected {
                divergences.push(format!(
                    "{thread} ?{query}: from {source}, differs from the stored rows"
                ));
            }
        }
    }
    divergences
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_faults_under_load_lose_nothing_and_recover() {
    let secs: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let thread_count: usize = std::env::var("SOAK_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let cycles = secs.div_ceil(60).max(1) as usize;
    let started = Instant::now();

    let mut nats = NatsServer::start();
    let mut mongo = MongoServer::start_on_disk();
    let database = unique("soak");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let proxy = Proxy::start(nats.address()).await;
    let mongo_uri = mongo.uri();
    let worker_env = |nats_url: String| {
        vec![
            ("HISTORY_VIEW_NATS_URL", nats_url),
            ("HISTORY_VIEW_MONGODB_URI", mongo_uri.clone()),
            ("HISTORY_VIEW_MONGODB_DATABASE", database.clone()),
            // The Mongo-wire server walks the whole collection in Python for any hinted query (see
            // docs/benchmark.md); unhinted, it uses the index.
            ("HISTORY_VIEW_MONGODB_INDEX_HINT", String::new()),
            ("HISTORY_VIEW_MONGODB_FILL_INDEX_HINT", String::new()),
            // Every read from memory is a candidate for a shadow check (5 a second): a missing, late or differing
            // row fails the soak; reads a gap followed within the window count as `window`.
            ("HISTORY_VIEW_SHADOW_SAMPLE", "1".to_owned()),
        ]
    };
    let worker = BinaryApp::start_binary(&worker_binary(), &worker_env(proxy.nats_url())).await;
    worker.wait_ready().await;

    let pending = Arc::new(AtomicUsize::new(0));
    let late_commits = Arc::new(Mutex::new(LateCommits::default()));
    let persister_client = async_nats::connect(nats.url())
        .await
        .expect("persister connects");
    persister(
        persister_client.clone(),
        TestStore::connect(&mongo.uri(), &database).await,
        pending.clone(),
        late_commits.clone(),
    );
    let names: Vec<String> = (0..thread_count).map(|i| format!("soak-{i:04}")).collect();
    let (gate, open) = watch::channel(true);
    let stop = Arc::new(AtomicBool::new(false));
    let publisher_client = async_nats::connect(nats.url())
        .await
        .expect("publisher connects");
    let publishing = publisher(publisher_client.clone(), names.clone(), open, stop.clone()).await;
    let reads = Arc::new(Reads::default());
    let calm = Arc::new(AtomicBool::new(false));
    readers(&worker.api, &names, &reads, &calm, &stop);
    let rss = rss_sampler(worker.pid(), started, stop.clone());

    let mut injected: BTreeMap<Fault, usize> = BTreeMap::new();
    let mut recoveries: Vec<(Fault, Option<Duration>)> = Vec::new();
    let mut quiet_points: Vec<Value> = Vec::new();
    let mut divergences: Vec<String> = Vec::new();
    let mut unnoticed: Vec<String> = Vec::new();

    for cycle in 0..cycles {
        // The worker's link cut and restored.
        progress(started, cycle, "link cut");
        proxy.cut();
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.restore();
        *injected.entry(Fault::LinkCut).or_default() += 1;
        recoveries.push((Fault::LinkCut, recovery(&worker.api).await));
        calm_window(&calm).await;

        // The link left half-open; the Mongo-wire server frozen for 5 s meanwhile.
        progress(started, cycle, "link half-open, Mongo frozen");
        proxy.half_open();
        let dead = Instant::now();
        tokio::time::sleep(Duration::from_secs(3)).await;
        mongo.pause();
        tokio::time::sleep(Duration::from_secs(5)).await;
        mongo.resume();
        *injected.entry(Fault::MongoFrozen).or_default() += 1;
        tokio::time::sleep(DEAD_LINK_HOLD.saturating_sub(dead.elapsed())).await;
        unnoticed.extend(noticed(&worker.api, Fault::LinkHalfOpen).await);
        proxy.restore();
        *injected.entry(Fault::LinkHalfOpen).or_default() += 1;
        recoveries.push((Fault::LinkHalfOpen, recovery(&worker.api).await));
        calm_window(&calm).await;

        // nats-server frozen (nothing can be published: the publisher waits); the Mongo-wire server restarted
        // meanwhile.
        progress(started, cycle, "NATS frozen, Mongo restarted");
        gate.send_replace(false);
        tokio::time::sleep(Duration::from_millis(300)).await;
        nats.pause();
        let dead = Instant::now();
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| mongo.restart());
        *injected.entry(Fault::MongoRestarted).or_default() += 1;
        tokio::time::sleep(DEAD_LINK_HOLD.saturating_sub(dead.elapsed())).await;
        unnoticed.extend(noticed(&worker.api, Fault::NatsFrozen).await);
        nats.resume();
        *injected.entry(Fault::NatsFrozen).or_default() += 1;
        recoveries.push((Fault::NatsFrozen, recovery(&worker.api).await));
        reconnected(&persister_client).await;
        gate.send_replace(true);
        calm_window(&calm).await;

        // nats-server restarted.
        progress(started, cycle, "NATS restarted");
        gate.send_replace(false);
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::task::block_in_place(|| nats.restart());
        *injected.entry(Fault::NatsRestarted).or_default() += 1;
        recoveries.push((Fault::NatsRestarted, recovery(&worker.api).await));
        // Nothing is published before the persister is subscribed again (aihub's persister would have missed it
        // as well, and the comparison would find an event only the worker heard).
        reconnected(&persister_client).await;
        reconnected(&publisher_client).await;
        gate.send_replace(true);
        calm_window(&calm).await;

        // Quiet point: nothing published, the persister caught up, the lag bound elapsed.
        progress(started, cycle, "quiet point");
        gate.send_replace(false);
        let quiet = Instant::now();
        tokio::time::sleep(Duration::from_millis(300)).await;
        while pending.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        progress(started, cycle, "persister caught up");
        tokio::time::sleep(LAG + Duration::from_millis(500)).await;
        worker.wait_ready().await;
        let fresh = BinaryApp::start_binary(&worker_binary(), &worker_env(nats.url())).await;
        fresh.wait_ready().await;
        progress(started, cycle, "comparing");
        let found = compare(&worker.api, &fresh.api, &store, &names).await;
        quiet_points.push(json!({
            "cycle": cycle, "at_secs": started.elapsed().as_secs(), "divergences": found.len(),
            "took_ms": quiet.elapsed().as_millis() as u64,
        }));
        divergences.extend(
            found
                .into_iter()
                .map(|d| format!("quiet point {cycle}: {d}")),
        );
        drop(fresh);
        gate.send_replace(true);
    }

    stop.store(true, Ordering::SeqCst);
    gate.send_replace(true);
    let _ = publishing.await;
    let rss = rss.await.expect("RSS samples");

    // The verdict and its table.
    let mut failures = divergences.clone();
    let metrics = worker.api.metrics().await;
    let shadow = |result: &str| {
        metric(
            &metrics,
            &format!("history_view_shadow_checks_total{{result=\"{result}\"}}"),
        )
    };
    // `missing` and `differs` are the worker's failures. `late` says the persister broke the bound for an event the
    // live path missed: this soak's own persister does when its faults pile events up (a frozen NATS hands them
    // over 20 s late, a frozen store makes it catch up in batches), which the worker measures on the rows it reads
    // (`history_view_persister_lag_exceeded_total`). A `late` without such a measured row is unexplained: a failure.
    let lag_exceeded = metric(&metrics, "history_view_persister_lag_exceeded_total");
    // A `missing` row is a stored row whose `_id` says it was stored before the read. The driver sets `_id` when
    // the insert is sent, so a row this soak's persister committed beyond the bound (a frozen or overloaded store)
    // looks in time although the hydration before the read could not see it: the assumption broke, invisibly to
    // the worker. Such rows are explained when every missing event is named in the checks' warnings (one a second,
    // 20 events each) and each is one the persister committed beyond the bound.
    let warnings = worker.log_lines("A shadow check found");
    let named_missing: Vec<String> = warnings
        .iter()
        .flat_map(|line| missing_events(line))
        .collect();
    let missing_events_total = metric(
        &metrics,
        "history_view_shadow_events_total{result=\"missing\"}",
    );
    let (late_committed, commit_lag_max) = {
        let late = late_commits.lock().unwrap();
        let unexplained = named_missing
            .iter()
            .filter(|id| !late.events.contains(id.as_str()))
            .count();
        let explained = if named_missing.len() as f64 == missing_events_total {
            named_missing.len() - unexplained
        } else {
            0
        };
        for id in &named_missing {
            let lag = late.lags.get(id.as_str());
            eprintln!("missing event {id}: committed {lag:?} after its created_at");
        }
        ((explained, late.events.len()), late.max)
    };
    let missing_explained = late_committed.0 as f64 == missing_events_total;
    for result in ["missing", "late", "differs"] {
        let explained =
            (result == "late" && lag_exceeded > 0.0) || (result == "missing" && missing_explained);
        if shadow(result) > 0.0 && !explained {
            failures.push(format!(
                "{} shadow checks found {result} rows",
                shadow(result)
            ));
        }
    }
    if failures.len() > divergences.len() {
        // What the failed checks logged (metadata only).
        failures.extend(warnings.into_iter().take(10));
    }
    eprintln!("rows read beyond the persister-lag bound: {lag_exceeded}");
    eprintln!(
        "events committed beyond the bound: {} (largest commit lag {:.1} s); missing events explained by them: {} of {missing_events_total}",
        late_committed.1,
        commit_lag_max.as_secs_f64(),
        late_committed.0,
    );
    let shadow_results: Vec<String> = [
        "match",
        "ahead",
        "uncertain",
        "window",
        "missing",
        "late",
        "differs",
        "dropped",
        "error",
    ]
    .iter()
    .map(|r| format!("{r}={}", shadow(r)))
    .collect();
    failures.extend(unnoticed);
    for (fault, count) in &injected {
        if *count < cycles {
            failures.push(format!(
                "{fault:?} injected {count} times, fewer than {cycles}"
            ));
        }
    }
    for (fault, took) in &recoveries {
        if took.is_none() {
            failures.push(format!(
                "readiness not back within {RECOVERY:?} after {fault:?}"
            ));
        }
    }
    let (calm_total, calm_cache) = (
        reads.calm_total.load(Ordering::Relaxed),
        reads.calm_cache.load(Ordering::Relaxed),
    );
    let calm_share = calm_cache as f64 / calm_total.max(1) as f64;
    if calm_share < 0.5 {
        failures.push(format!(
            "{calm_cache} of {calm_total} reads between faults served from memory (< 50%)"
        ));
    }
    let peak_kib = rss.iter().map(|(_, kib)| *kib).max().unwrap_or(0);
    if peak_kib > RSS_LIMIT_KIB {
        failures.push(format!(
            "RSS peaked at {} MiB, above {} MiB",
            peak_kib / 1024,
            RSS_LIMIT_KIB / 1024
        ));
    }

    let all = reads.all.lock().unwrap().clone();
    eprintln!(
        "soak: {cycles} cycles, {thread_count} threads, {:.0} s",
        started.elapsed().as_secs_f64()
    );
    eprintln!("{:<16} {:>6}", "fault", "count");
    for (fault, count) in &injected {
        eprintln!("{:<16} {count:>6}", format!("{fault:?}"));
    }
    eprintln!("{:<16} {:>12}", "recovery", "readiness");
    for (fault, took) in &recoveries {
        eprintln!(
            "{:<16} {:>12}",
            format!("{fault:?}"),
            took.map_or("none".into(), |d| format!("{:.2} s", d.as_secs_f64()))
        );
    }
    eprintln!("{:<16} {:>6} {:>10}", "reads: source", "status", "count");
    for ((source, status), count) in &all {
        eprintln!("{source:<16} {status:>6} {count:>10}");
    }
    eprintln!(
        "between faults: {calm_cache} of {calm_total} reads from memory ({:.0}%)",
        calm_share * 100.0
    );
    eprintln!("shadow checks: {}", shadow_results.join(" "));
    eprintln!(
        "quiet points: {}",
        quiet_points
            .iter()
            .map(|q| format!("{}", q["divergences"]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    eprintln!(
        "RSS MiB over time: {}",
        rss.iter()
            .step_by(10)
            .map(|(t, kib)| format!("{t}s:{}", kib / 1024))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let report = json!({
        "secs": started.elapsed().as_secs(), "cycles": cycles, "threads": thread_count,
        "faults": injected.iter().map(|(f, n)| (format!("{f:?}"), json!(n))).collect::<serde_json::Map<_, _>>(),
        "recoveries_ms": recoveries.iter().map(|(f, d)| json!({"fault": format!("{f:?}"), "ms": d.map(|d| d.as_millis() as u64)})).collect::<Vec<_>>(),
        "reads": all.iter().map(|((s, st), n)| json!({"source": s, "status": st, "count": n})).collect::<Vec<_>>(),
        "between_faults": {"total": calm_total, "cache": calm_cache},
        "quiet_points": quiet_points,
        "rss_kib": rss,
        "shadow_checks": shadow_results,
        "late_commits": {"events": late_committed.1, "max_ms": commit_lag_max.as_millis() as u64,
            "missing_explained": late_committed.0},
        "failures": failures,
    });
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/soak.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("JSON"))
        .expect("target/soak.json");
    assert!(failures.is_empty(), "soak failed:\n{}", failures.join("\n"));
}
