//! P7: aihub's multi-turn read pattern. Threads run concurrently, each turn: a read of the thread's history (with
//! the primary identity, as aihub's assistant paths read), then the turn's events published live: a user marker
//! on a new display (or a HITL answer on the open question's display), the primary's chunks and its stop, every
//! third turn a nested helper on a hidden display asking a HITL question. A persister writes each turn's events a
//! fixed delay after publishing them; the next turn's read comes 200 ms after that. The worker runs with a 500 ms
//! persister-lag bound and starts more than a second before the workload.
//!
//! Every answer must equal the projector over all events published before the read, and at the end a fresh
//! worker's cold read; every read after a thread's first must come from memory; store queries per turn are
//! counted by kind from the worker's `/metrics` (aihub runs its two-stage query on every turn).

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;

use crate::data::Message;
use crate::report::{Row, progress};
use crate::setup::Setup;
use crate::worker::Worker;
use test_support::turns::Conversation;

const THREADS: usize = 50;
const TURNS: usize = 10;
const PERSIST_LAG_MS: &str = "500";
/// How long after a turn's events were persisted the next turn's read comes.
const READ_AFTER_PERSIST: Duration = Duration::from_millis(200);

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let mut rows = Vec::new();
    for persister_delay_ms in [0, 50] {
        rows.extend(run_with_persister_delay(&setup, persister_delay_ms).await);
    }
    rows
}

/// What one thread's turns saw.
struct ThreadResult {
    conversation: Conversation,
    reads: usize,
    wrong: usize,
    /// Reads after the thread's first that did not come from memory.
    later_not_from_memory: usize,
    /// The turns of those reads.
    missed_turns: Vec<usize>,
}

async fn run_with_persister_delay(setup: &Setup, persister_delay_ms: u64) -> Vec<Row> {
    let database = format!("bench_p7_{persister_delay_ms}");
    let store = setup.store(&database).await;
    store.create_display_index().await;
    let worker = setup
        .start_worker(
            &database,
            &[("HISTORY_VIEW_PERSIST_LAG_MS", PERSIST_LAG_MS)],
        )
        .await;
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let publisher = setup.nats_client().await;
    let delay = Duration::from_millis(persister_delay_ms);
    let label = format!("persister {persister_delay_ms} ms");
    progress("P7", &format!("{label}: {THREADS} threads x {TURNS} turns"));

    let runs = (0..THREADS).map(|t| {
        let (worker, store, publisher) = (&worker, &store, publisher.clone());
        async move {
            let mut result = ThreadResult {
                conversation: Conversation::new(format!("p7-{persister_delay_ms}-{t:03}")),
                reads: 0,
                wrong: 0,
                later_not_from_memory: 0,
                missed_turns: Vec::new(),
            };
            for turn in 0..TURNS {
                let reply = read(worker, &result.conversation.thread).await;
                result.reads += 1;
                let body: serde_json::Value =
                    serde_json::from_slice(&reply.body).unwrap_or_default();
                if reply.status != 200 || body != result.conversation.expected() {
                    result.wrong += 1;
                }
                if turn > 0 && reply.source != "cache" {
                    result.later_not_from_memory += 1;
                    result.missed_turns.push(turn);
                }
                let rows = result.conversation.next_turn();
                for row in &rows {
                    Message::from_row(row).publish(&publisher).await;
                }
                publisher.flush().await.expect("flush the publisher");
                tokio::time::sleep(delay).await;
                store.insert(&rows).await;
                tokio::time::sleep(READ_AFTER_PERSIST).await;
            }
            result
        }
    });
    let results = join_all(runs).await;
    let scrape = worker.metrics().await;
    let queries = |kind: &str| {
        scrape.sample(&format!(
            "history_view_store_queries_total{{kind=\"{kind}\"}}"
        ))
    };
    let turns = (THREADS * TURNS) as f64;
    let fills = queries("fill");
    let hydrations = queries("hydration_markers") + queries("hydration_events");
    let rereads = queries("reread_markers") + queries("reread_events");
    let reads: usize = results.iter().map(|r| r.reads).sum();
    let wrong: usize = results.iter().map(|r| r.wrong).sum();
    let later = reads - THREADS;
    let later_not_from_memory: usize = results.iter().map(|r| r.later_not_from_memory).sum();
    let from_memory = scrape.sample("history_view_read_duration_seconds_count{source=\"cache\"}");
    let mut missed_by_turn = [0usize; TURNS];
    for turn in results.iter().flat_map(|r| &r.missed_turns) {
        missed_by_turn[*turn] += 1;
    }
    drop(worker);

    // Once the persister has caught up, a fresh worker's cold read of every thread gives the same answers.
    let fresh = setup
        .start_worker(
            &database,
            &[("HISTORY_VIEW_PERSIST_LAG_MS", PERSIST_LAG_MS)],
        )
        .await;
    let mut cold_mismatches = 0;
    for result in &results {
        let reply = read(&fresh, &result.conversation.thread).await;
        let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap_or_default();
        if reply.status != 200 || reply.source != "store" || body != result.conversation.expected()
        {
            cold_mismatches += 1;
        }
    }
    progress(
        "P7",
        &format!(
            "{label}: {wrong} wrong of {reads}; later reads not from memory {later_not_from_memory} of {later}; \
             fill queries {fills}, hydration queries {hydrations}, re-read queries {rereads}; not from memory by turn \
             {missed_by_turn:?}"
        ),
    );
    let pass = wrong == 0
        && cold_mismatches == 0
        && later_not_from_memory == 0
        && fills <= turns
        && rereads == 0.0;
    vec![
        Row::check(
            "P7",
            format!("multi-turn reads, {THREADS} threads x {TURNS} turns, {label}"),
            format!(
                "{} of {reads} answers correct, {} of {THREADS} cold reads equal; later reads from memory {} of {later} \
                 ({from_memory} reads from memory in all)",
                reads - wrong,
                THREADS - cold_mismatches,
                later - later_not_from_memory,
            ),
            "every answer correct; every read after a thread's first from memory",
            pass,
        ),
        Row::check(
            "P7",
            format!("store queries per turn, {label}"),
            format!(
                "fill {:.2} (off the read path), hydration {:.2} (each thread's first read: 2 queries), \
                 background re-read {:.2}; aihub: 2 full two-stage queries per turn",
                fills / turns,
                hydrations / turns,
                rereads / turns,
            ),
            "<= 1 small indexed query per turn, none on the read path",
            fills <= turns && later_not_from_memory == 0,
        ),
    ]
}

async fn read(worker: &Worker, thread: &str) -> crate::worker::Reply {
    worker
        .get(&format!(
            "/v1/threads/{thread}/history?{}",
            Conversation::query()
        ))
        .await
}
