//! The soak's load: a persister like aihub's, a publisher of multi-turn conversations, readers whose every
//! answer is judged against what the persister committed (`test_support::promise`), and an RSS sampler.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;
use test_support::memory::memory;
use test_support::promise::{Ledger, Report, Target, read_history};
use test_support::turns::{Conversation, PRIMARY};
use test_support::wait::{eventually, when};
use tokio::sync::watch;

use super::{LAG, PERSIST_DELAY_MS, READERS, Rng};
use crate::fuzz_corpus::checks::stored_row;
use crate::helpers::TestStore;
use crate::threads;

/// The events the persister committed beyond the bound, and its largest commit lag.
#[derive(Default)]
pub struct LateCommits {
    pub events: HashSet<Arc<str>>,
    pub max: Duration,
    /// Every event's commit lag (the longest of its copies), to say what an unexplained `missing` event's was.
    pub lags: HashMap<Arc<str>, Duration>,
}

/// A row the persister will insert once `at` has come.
struct Due {
    at: Instant,
    /// The event's `created_at`, ns since the epoch.
    created_at_ns: i64,
    event_id: Arc<str>,
    row: Value,
    document: mongodb::bson::Document,
}

fn unix_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// The persister: its own connection to nats-server (never through the worker's proxy), each event written 0-500 ms
/// after it arrived, one in five written twice (a second replica). One writer inserts whatever is due in batches
/// and retries a batch until the store takes it (one insert per event, as aihub writes, overloads the Mongo-wire
/// server at the soak's rate and never catches up once a fault has piled them up).
///
/// Every batch goes into the `ledger` when its insert returned, the readers' judge. Every event committed more than
/// the bound after its `created_at` goes into `late_commits` (by event id) and is marked late in the ledger: the
/// driver sets a row's `_id` when the insert is sent, so a slow or frozen store commits rows whose `_id` says they
/// were stored in time, and on a loaded machine the persister itself may receive an event late. The worker cannot
/// tell such a row from one it lost; the soak can.
pub fn persister(
    client: async_nats::Client,
    store: TestStore,
    pending: Arc<AtomicUsize>,
    late_commits: Arc<Mutex<LateCommits>>,
    ledger: Ledger,
    sentinel: Sentinel,
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
            if let Some(n) = message.subject.strip_prefix(SENTINEL) {
                let n = n.trim_start_matches('.').parse().unwrap_or(0);
                sentinel.received.fetch_max(n, Ordering::SeqCst);
                continue;
            }
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
                    row: row.clone(),
                    document: document.clone(),
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
                let documents = batch.iter().map(|due| &due.document);
                loop {
                    let insert = events.insert_many(documents.clone());
                    match tokio::time::timeout(Duration::from_secs(30), insert).await {
                        Ok(Ok(_)) => break,
                        // The store is frozen or restarting: the next attempt, after a pause.
                        _ => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
                let at = Instant::now();
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
                    ledger.stored(std::slice::from_ref(&due.row), at, lag > LAG);
                }
                drop(late);
                pending.fetch_sub(batch.len(), Ordering::SeqCst);
            }
            // The pacing of the writer's batches.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// The subject of the sentinels the quiet point sends through to the persister: three tokens, so no worker's
/// subscription (nine tokens) matches it, and the persister's `agent.>` does.
const SENTINEL: &str = "agent.soak-sentinel";

/// How the choreography knows the load has settled: the publisher holds `turn` while it publishes a turn, and a
/// sentinel published after everything else reaches the persister after everything else (one connection's messages
/// reach a subscriber in order).
#[derive(Clone, Default)]
pub struct Sentinel {
    turn: Arc<tokio::sync::Mutex<()>>,
    sent: Arc<AtomicU64>,
    received: Arc<AtomicU64>,
}

impl Sentinel {
    /// Returns once the publisher is between turns; with its gate closed, it publishes nothing more.
    pub async fn publisher_idle(&self) {
        drop(self.turn.lock().await);
    }

    /// Publishes a sentinel through `client` (the publisher's connection) and waits until the persister has it:
    /// by then it has received, and counted as pending, every event published before.
    pub async fn round_trip(&self, client: &async_nats::Client) {
        let n = self.sent.fetch_add(1, Ordering::SeqCst) + 1;
        client
            .publish(format!("{SENTINEL}.{n}"), bytes::Bytes::new())
            .await
            .expect("publish a sentinel");
        client.flush().await.expect("flush");
        eventually("the persister receives the sentinel", || async {
            let received = self.received.load(Ordering::SeqCst);
            when(received >= n, || format!("sentinel {received} of {n}"))
        })
        .await;
    }
}

/// Publishes the threads' turns while `open` says so: a random thread's next turn every 100 ms (about 80 events a
/// second, what the Mongo-wire server can store with room to catch up after a fault), one event in ten
/// delivered twice, each recorded in the `ledger` first. Every thread gets its first turn before this returns.
pub async fn publisher(
    client: async_nats::Client,
    names: Vec<String>,
    mut open: watch::Receiver<bool>,
    stop: Arc<AtomicBool>,
    ledger: Ledger,
    sentinel: Sentinel,
) -> tokio::task::JoinHandle<()> {
    let mut conversations: Vec<Conversation> = names.into_iter().map(Conversation::new).collect();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for conversation in &mut conversations {
        publish(&client, &ledger, &conversation.next_turn(), &mut rng).await;
    }
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            if open.wait_for(|open| *open).await.is_err() {
                return;
            }
            let turn = sentinel.turn.lock().await;
            if !*open.borrow() {
                // Held meanwhile.
                continue;
            }
            let n = rng.below(conversations.len() as u64) as usize;
            let rows = conversations[n].next_turn();
            publish(&client, &ledger, &rows, &mut rng).await;
            drop(turn);
            // The publisher's pace.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

async fn publish(client: &async_nats::Client, ledger: &Ledger, rows: &[Value], rng: &mut Rng) {
    ledger.published(rows);
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

/// What the readers saw: every answer judged, and counts by source and status.
#[derive(Default)]
pub struct Reads {
    /// (source, status) -> count, over the whole run.
    pub all: Mutex<BTreeMap<(String, u16), u64>>,
    pub calm_total: AtomicU64,
    pub calm_cache: AtomicU64,
    /// Every answer held to the promise against the persister's commits.
    pub judged: Mutex<Report>,
}

/// Readers: random threads, half of the reads with the primary identity, each answer judged, counted by source
/// and status; reads while `calm` is set are counted apart.
pub fn readers(
    target: &Target,
    names: &[String],
    ledger: &Ledger,
    reads: &Arc<Reads>,
    calm: &Arc<AtomicBool>,
    stop: &Arc<AtomicBool>,
) {
    for reader in 0..READERS {
        let (target, names, ledger, reads, calm, stop) = (
            target.clone(),
            names.to_vec(),
            ledger.clone(),
            reads.clone(),
            calm.clone(),
            stop.clone(),
        );
        tokio::spawn(async move {
            let mut rng = Rng(0x1234_5678 + reader as u64);
            while !stop.load(Ordering::SeqCst) {
                let thread = &names[rng.below(names.len() as u64) as usize];
                let identity = (rng.below(2) == 0).then_some(PRIMARY);
                let was_calm = calm.load(Ordering::SeqCst);
                let read = read_history(&target, thread, identity, &ledger).await;
                let source = match read.source {
                    Some(test_support::promise::Source::Memory) => "cache",
                    Some(_) => "store",
                    None => "-",
                };
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
                    .entry((source.to_owned(), read.status))
                    .or_default() += 1;
                reads.judged.lock().unwrap().add(read.report);
            }
        });
    }
}

/// Samples the worker's RSS every second: (seconds since start, KiB).
pub fn rss_sampler(
    pid: u32,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(u64, u64)>> {
    tokio::spawn(async move {
        let mut samples = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            samples.push((started.elapsed().as_secs(), memory(pid).rss_kib));
            // The sampling interval.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        samples
    })
}
