//! P13: a restart keeps the cache warm ([design 2.5](../../docs/design.md#2.5)). (Issue 38 names this target P12;
//! P12 already measured the Core witness, so the warm restart is P13.) Under P7's workload (50 threads, each turn a
//! read with the primary identity, then the turn's events published live and persisted), a worker is stopped with
//! SIGTERM after three turns of every thread and a new process started in its place, in Core mode, in JetStream mode
//! and as one of three partitioned workers, each with and without the warm set
//! (`HISTORY_VIEW_WARM_MAX_THREADS=0`). In the 30 s after the new worker turns ready, every thread goes on with its
//! turns, read through the new worker: the share of its reads answered from memory (of the threads it owns: in
//! partitioned mode the others are forwarded to owners that did not restart), every answer against the projector
//! over what was published, and the store queries the new worker made, off the read path (the warm-up's) and on it
//! (hydrations of reads), and the read latency. Each thread's first read after the restart is counted apart: it is
//! the read a cold cache sends to the store, while the share over 30 s is high even cold (every thread is read about
//! 30 times). Target with the warm set: at least 95% of reads from memory after ready, and of each thread's first
//! read; every answer correct. A read answered 503 (`store_unavailable`: the store did not answer within the store
//! timeout) is no wrong answer, and is counted apart: the client retries it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::future::join_all;

use test_support::class_streams::create_class_streams;
use test_support::turns::Conversation;

use crate::data::Message;
use crate::partitions::Partitions;
use crate::report::{Row, fmt_duration, progress, quantile};
use crate::setup::{BenchStore, Setup};
use crate::worker::{Scrape, Worker};

const THREADS: usize = 50;
/// Turns of every thread before the restart: the threads the old worker's readers made hot.
const TURNS_BEFORE: usize = 3;
/// How long after the new worker turned ready its reads are counted.
const AFTER_READY: Duration = Duration::from_secs(30);
const PERSIST_LAG_MS: &str = "500";
/// How long after a turn's events were persisted the next turn's read comes (as in P7).
const READ_AFTER_PERSIST: Duration = Duration::from_millis(200);
/// The classes of [`Conversation`]'s events: each has its class stream in the JetStream modes.
const CLASSES: [&str; 3] = ["TurnAgent", "HelperAgent", "UserAgent"];
const BUCKET: &str = "chv_bench_warm";
/// P12's stream over every agent subject: a class stream cannot overlap it.
const P12_STREAM: &str = "agent_bench_stream";
const PARTITIONED_STREAM: &str = "CHAT_HISTORY_VIEW";
const PARTITIONS: u32 = 3;
/// The longest a new worker's warm-up may hold `/readyz` (its `HISTORY_VIEW_WARM_MAX_SECS`).
const WARM_MAX_SECS: u64 = 60;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Core,
    JetStream,
    Partitioned,
}

impl Mode {
    fn key(self) -> &'static str {
        match self {
            Self::Core => "core",
            Self::JetStream => "jetstream",
            Self::Partitioned => "partitioned",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Core => "Core NATS",
            Self::JetStream => "JetStream",
            Self::Partitioned => "partitioned, 1 of 3 restarted",
        }
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let context = jetstream::new(setup.nats_client().await);
    let _ = context.delete_stream(P12_STREAM).await;
    create_class_streams(&setup.nats_url(), CLASSES.map(String::from)).await;
    let mut rows = Vec::new();
    // `BENCH_P13=partitioned-cold,core-warm`: only these runs (each `<mode>-<cold|warm>`), to repeat one.
    let only = std::env::var("BENCH_P13").ok();
    for mode in [Mode::Core, Mode::JetStream, Mode::Partitioned] {
        for warm in [false, true] {
            let run = format!("{}-{}", mode.key(), if warm { "warm" } else { "cold" });
            if only
                .as_ref()
                .is_some_and(|only| !only.split(',').any(|o| o == run))
            {
                continue;
            }
            // Each run starts from no snapshot and, partitioned, from no partitioned stream.
            let _ = context.delete_key_value(BUCKET).await;
            let _ = context.delete_stream(PARTITIONED_STREAM).await;
            rows.extend(run_one(&setup, mode, warm).await);
        }
    }
    let _ = context.delete_stream(PARTITIONED_STREAM).await;
    let _ = context.delete_key_value(BUCKET).await;
    for class in CLASSES {
        let _ = context.delete_stream(format!("agent_{class}_stream")).await;
    }
    rows
}

/// What the reads of one phase saw.
#[derive(Default)]
struct Reads {
    /// Reads of threads the restarted worker owns, and those answered from memory.
    owned: usize,
    owned_from_memory: usize,
    /// Every read, and those answered from memory.
    all: usize,
    all_from_memory: usize,
    wrong: usize,
    /// Each owned thread's first read of the phase, and those answered from memory: after a restart, the reads a
    /// cold cache sends to the store.
    first: usize,
    first_from_memory: usize,
    /// How long each read through the worker took, sorted.
    latencies: Vec<Duration>,
    /// Reads answered 503 (the store did not answer within the store timeout, or no slot was free): the client
    /// retries them (`Retry-After`); not a wrong answer, but a read the cache did not serve.
    unavailable: usize,
    /// The first wrong answers: the thread, the turn, the status, the source, and whether the body differed.
    wrong_examples: Vec<String>,
}

async fn run_one(setup: &Setup, mode: Mode, warm: bool) -> Vec<Row> {
    let side = if warm { "warm" } else { "cold" };
    let label = format!(
        "{}, {}",
        mode.label(),
        if warm { "warm set" } else { "no warm set" }
    );
    let database = format!("bench_p13_{}_{side}", mode.key());
    let store = setup.store(&database).await;
    store.create_display_index().await;
    let partitions = Partitions::new(if mode == Mode::Partitioned {
        PARTITIONS
    } else {
        1
    });
    let mut env = vec![
        ("HISTORY_VIEW_PERSIST_LAG_MS", PERSIST_LAG_MS.to_owned()),
        ("HISTORY_VIEW_WARM_BUCKET", BUCKET.to_owned()),
        ("HISTORY_VIEW_WARM_MAX_SECS", WARM_MAX_SECS.to_string()),
        (
            "HISTORY_VIEW_WARM_MAX_THREADS",
            if warm { "10000" } else { "0" }.to_owned(),
        ),
    ];
    if mode != Mode::Core {
        env.push(("HISTORY_VIEW_SOURCE", "jetstream".to_owned()));
    }
    let warm_max = Duration::from_secs(WARM_MAX_SECS);
    let mut workers = partitions.start_all(setup, &database, &env, warm_max).await;
    // As in P7: the first reads come more than the bound after the subscription was confirmed.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let publisher = setup.nats_client().await;
    let owned = |thread: &str| partitions.owner(thread) == 0;
    let conversations: Vec<Conversation> = (0..THREADS)
        .map(|t| Conversation::new(format!("p13-{}-{side}-{t:02}", mode.key())))
        .collect();
    progress(
        "P13",
        &format!("{label}: {THREADS} threads x {TURNS_BEFORE} turns, then a restart"),
    );
    let (conversations, before) = turns(
        &workers[0],
        &store,
        &publisher,
        conversations,
        Until::Turns(TURNS_BEFORE),
        owned,
    )
    .await;

    // The restart: SIGTERM (the old worker writes its hot set), then a new process on the same port.
    let old = workers.remove(0);
    old.stop().await;
    let started = Instant::now();
    let new = partitions.start(setup, 0, &database, &env).await;
    new.wait_ready_within(warm_max).await;
    let to_ready = started.elapsed();
    let at_ready = new.metrics().await;
    let (_, after) = turns(
        &new,
        &store,
        &publisher,
        conversations,
        Until::Instant(Instant::now() + AFTER_READY),
        owned,
    )
    .await;
    let scrape = new.metrics().await;
    drop(new);
    drop(workers);

    let queries = |scrape: &Scrape, kinds: &[&str]| -> f64 {
        kinds
            .iter()
            .map(|kind| {
                scrape.sample(&format!(
                    "history_view_store_queries_total{{kind=\"{kind}\"}}"
                ))
            })
            .sum()
    };
    let warm_queries = queries(&scrape, &["warm_markers", "warm_events"]);
    let warm_before_ready = queries(&at_ready, &["warm_markers", "warm_events"]);
    let read_path = queries(&scrape, &["hydration_markers", "hydration_events"]);
    let fills = queries(&scrape, &["fill"]);
    let rereads = queries(&scrape, &["reread_markers", "reread_events"]);
    let share = after.owned_from_memory as f64 / after.owned.max(1) as f64;
    let (median, p99) = (
        quantile(&after.latencies, 0.5),
        quantile(&after.latencies, 0.99),
    );
    progress(
        "P13",
        &format!(
            "{label}: ready {} after the start; first reads from memory {} of {}; owned reads from memory {} of {}, \
             all {} of {}; read latency median {}, p99 {}; wrong {} (before the restart {}), 503 {}; store queries: warm-up \
             {warm_queries} ({warm_before_ready} before ready), read-path hydrations {read_path}, fills {fills}, \
             re-reads {rereads}",
            fmt_duration(to_ready),
            after.first_from_memory,
            after.first,
            after.owned_from_memory,
            after.owned,
            after.all_from_memory,
            after.all,
            fmt_duration(median),
            fmt_duration(p99),
            after.wrong,
            before.wrong,
            after.unavailable + before.unavailable,
        ),
    );
    for example in before
        .wrong_examples
        .iter()
        .chain(&after.wrong_examples)
        .take(5)
    {
        progress("P13", &format!("{label}: wrong: {example}"));
    }
    let measured = format!(
        "{:.1}% of {} reads from memory ({} of {} through it in all), each thread's first {} of {}; read median {}, \
         p99 {}; {} wrong, {} answered 503; ready {} after the start; store queries: {warm_queries} by the warm-up, {read_path} \
         hydrations on the read path, {fills} fills",
        share * 100.0,
        after.owned,
        after.all_from_memory,
        after.all,
        after.first_from_memory,
        after.first,
        fmt_duration(median),
        fmt_duration(p99),
        after.wrong + before.wrong,
        after.unavailable + before.unavailable,
        fmt_duration(to_ready),
    );
    let what = format!("reads from memory in the 30 s after a restart turned ready, {label}");
    if warm {
        vec![Row::check(
            "P13",
            what,
            measured,
            ">= 95% from memory, and of each thread's first read (the store queries off the read path); every \
             answer correct",
            share >= 0.95
                && after.first_from_memory as f64 >= 0.95 * after.first as f64
                && after.wrong == 0
                && before.wrong == 0,
        )]
    } else {
        // The baseline: what a restart costs without the warm set. Its answers must be correct all the same.
        vec![Row::check(
            "P13",
            what,
            measured,
            "(baseline) every answer correct",
            after.wrong == 0 && before.wrong == 0,
        )]
    }
}

enum Until {
    Turns(usize),
    Instant(Instant),
}

/// Every conversation's turns, concurrently, read through `worker`: a read, then the turn's events published and
/// persisted, then [`READ_AFTER_PERSIST`]; until each has had `Until::Turns` turns or the instant has come.
async fn turns(
    worker: &Worker,
    store: &BenchStore,
    publisher: &async_nats::Client,
    conversations: Vec<Conversation>,
    until: Until,
    owned: impl Fn(&str) -> bool + Copy,
) -> (Vec<Conversation>, Reads) {
    let until = &until;
    let runs = conversations
        .into_iter()
        .map(|mut conversation| async move {
            let mut reads = Reads::default();
            let mut turn = 0;
            loop {
                match until {
                    Until::Turns(turns) if turn >= *turns => break,
                    Until::Instant(deadline) if Instant::now() >= *deadline => break,
                    _ => {}
                }
                turn += 1;
                let asked = Instant::now();
                let reply = worker
                    .get(&format!(
                        "/v1/threads/{}/history?{}",
                        conversation.thread,
                        Conversation::query()
                    ))
                    .await;
                reads.latencies.push(asked.elapsed());
                let body: serde_json::Value =
                    serde_json::from_slice(&reply.body).unwrap_or_default();
                let from_memory = reply.source == "cache";
                reads.all += 1;
                reads.all_from_memory += usize::from(from_memory);
                if owned(&conversation.thread) {
                    reads.owned += 1;
                    reads.owned_from_memory += usize::from(from_memory);
                    if turn == 1 {
                        reads.first += 1;
                        reads.first_from_memory += usize::from(from_memory);
                    }
                }
                if reply.status == 503 {
                    reads.unavailable += 1;
                } else if reply.status != 200 || body != conversation.expected() {
                    reads.wrong += 1;
                    reads.wrong_examples.push(format!(
                        "{} turn {turn}: {} from {:?}{}",
                        conversation.thread,
                        reply.status,
                        reply.source,
                        if reply.status == 200 {
                            format!(
                                ", {} messages where {} were expected",
                                reply.message_count(),
                                conversation.expected()["messages"]
                                    .as_array()
                                    .map_or(0, Vec::len)
                            )
                        } else {
                            format!(", {}", String::from_utf8_lossy(&reply.body))
                        }
                    ));
                }
                let rows = conversation.next_turn();
                for row in &rows {
                    Message::from_row(row).publish(publisher).await;
                }
                publisher.flush().await.expect("flush the publisher");
                store.insert(&rows).await;
                tokio::time::sleep(READ_AFTER_PERSIST).await;
            }
            (conversation, reads)
        });
    let mut total = Reads::default();
    let mut conversations = Vec::new();
    for (conversation, reads) in join_all(runs).await {
        conversations.push(conversation);
        total.owned += reads.owned;
        total.owned_from_memory += reads.owned_from_memory;
        total.all += reads.all;
        total.all_from_memory += reads.all_from_memory;
        total.wrong += reads.wrong;
        total.unavailable += reads.unavailable;
        total.first += reads.first;
        total.first_from_memory += reads.first_from_memory;
        total.latencies.extend(reads.latencies);
        total.wrong_examples.extend(reads.wrong_examples);
    }
    total.latencies.sort();
    (conversations, total)
}
