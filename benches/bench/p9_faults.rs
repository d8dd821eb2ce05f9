//! P9: how much of the read load stays in memory through a fault, Core NATS against the JetStream source, side by
//! side on the same scenario. Each scenario has its own nats-server (it is restarted) with aihub's class streams, a
//! worker reaching it through a TCP proxy (which is cut), 30 threads served from memory with one turn each, and then
//! the fault: (a) the nats-server restarted, (b) the worker's link cut for a second. An answer to each thread is
//! published and persisted during the fault, and for 10 s from the fault's start every thread is read in turn: the
//! share of those reads answered from memory is the figure. (c) After a worker restart, how long until every
//! thread is answered from memory.
//!
//! Both workers run with the default persister-lag bound (2 s), the JetStream one with its default replay window.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::report::{Row, progress};
use crate::setup::Setup;
use crate::worker::Worker;
use test_support::class_streams::create_class_streams;
use test_support::proxy::Proxy;
use test_support::rows::{self, CHUNK, Event, USER_MESSAGE};
use test_support::servers::NatsServer;

const THREADS: usize = 30;
const WINDOW: Duration = Duration::from_secs(10);
const FAULT: Duration = Duration::from_secs(1);
/// One round of reads (every thread once) starts this often.
const ROUND: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    NatsRestart,
    LinkCut,
    WorkerRestart,
}

impl Fault {
    fn label(self) -> &'static str {
        match self {
            Fault::NatsRestart => "nats-server restart",
            Fault::LinkCut => "worker-side link cut",
            Fault::WorkerRestart => "worker restart",
        }
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let mut rows = Vec::new();
    for fault in [Fault::LinkCut, Fault::NatsRestart] {
        let core = scenario(&setup, "core", fault).await;
        let jetstream = scenario(&setup, "jetstream", fault).await;
        let measured = format!(
            "from memory in the {} s from the fault: Core {:.0}%, JetStream {:.0}% (of {} and {} reads in rounds every \
             {} ms; stale from memory: {} and {})",
            WINDOW.as_secs(),
            core.share * 100.0,
            jetstream.share * 100.0,
            core.reads,
            jetstream.reads,
            ROUND.as_millis(),
            core.stale,
            jetstream.stale
        );
        let fresh = core.stale == 0 && jetstream.stale == 0;
        let what = format!("reads from memory after a {}", fault.label());
        rows.push(match fault {
            Fault::LinkCut => Row::check(
                "P9",
                what,
                measured,
                "JetStream >= 95%; none stale",
                jetstream.share >= 0.95 && fresh,
            ),
            _ => Row::check(
                "P9",
                what,
                measured,
                "JetStream above Core (a file-storage restart is no gap); none stale",
                jetstream.share > core.share && fresh,
            ),
        });
    }
    let core = scenario(&setup, "core", Fault::WorkerRestart).await;
    let jetstream = scenario(&setup, "jetstream", Fault::WorkerRestart).await;
    rows.push(Row::info(
        "P9",
        "worker restart: until every thread is answered from memory",
        format!(
            "Core {:.2} s, JetStream {:.2} s (its replay reaches back past the bound)",
            core.until_memory.as_secs_f64(),
            jetstream.until_memory.as_secs_f64()
        ),
    ));
    rows
}

struct Outcome {
    share: f64,
    reads: usize,
    /// Reads from memory that lacked the turn published during the fault.
    stale: usize,
    until_memory: Duration,
}

fn turn(thread: &str, i: usize, now: i64) -> [Value; 2] {
    let user = Event {
        agent: ("UserAgent", "user"),
        thread,
        display: &format!("d{i}"),
        run: "run",
        event_id: &format!("u{i}"),
        name: "UserMessageEvent",
        parents: USER_MESSAGE,
        created_at: now,
    }
    .row(rows::user_message("question"));
    let answer = Event {
        agent: ("A", "a"),
        thread,
        display: &format!("d{i}"),
        run: "run",
        event_id: &format!("c{i}"),
        name: "ChunkEvent",
        parents: CHUNK,
        created_at: now + 1,
    }
    .row(rows::chunk("answer"));
    [user, answer]
}

fn now_ns() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(now.as_nanos()).unwrap_or(i64::MAX)
}

fn running(worker: &Option<Worker>) -> &Worker {
    worker.as_ref().expect("a worker runs")
}

async fn scenario(setup: &Setup, source: &str, fault: Fault) -> Outcome {
    progress("P9", &format!("{source}: {}", fault.label()));
    let mut nats = tokio::task::block_in_place(NatsServer::start);
    create_class_streams(&nats.url(), ["UserAgent".to_owned(), "A".to_owned()]).await;
    let proxy = Proxy::start(nats.address()).await;
    let database = format!("bench_p9_{source}_{fault:?}");
    let store = setup.store(&database).await;
    let env = [
        ("HISTORY_VIEW_NATS_URL", proxy.nats_url()),
        ("HISTORY_VIEW_SOURCE", source.to_owned()),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut worker = Some(setup.start_worker(&database, &env).await);
    let mut publisher = async_nats::connect(nats.url()).await.expect("publisher");
    let threads: Vec<String> = (0..THREADS).map(|t| format!("p9-{t}")).collect();
    for thread in &threads {
        let rows = turn(thread, 0, now_ns());
        store.insert(&rows).await;
        rows::publish(&publisher, &rows).await;
    }
    for thread in &threads {
        running(&worker).read_until_cached(thread).await;
    }

    let started = Instant::now();
    match fault {
        Fault::LinkCut => proxy.cut(),
        Fault::NatsRestart => tokio::task::block_in_place(|| nats.stop()),
        Fault::WorkerRestart => drop(worker.take()),
    }
    if fault == Fault::NatsRestart {
        tokio::task::block_in_place(|| nats.restart());
        publisher = async_nats::connect(nats.url()).await.expect("publisher");
    }
    // The second turn: published (into the streams) and persisted during the fault.
    for thread in &threads {
        let rows = turn(thread, 1, now_ns());
        store.insert(&rows).await;
        rows::publish(&publisher, &rows).await;
    }
    match fault {
        Fault::LinkCut => {
            tokio::time::sleep(FAULT.saturating_sub(started.elapsed())).await;
            proxy.restore();
        }
        Fault::WorkerRestart => {
            worker = Some(setup.start_worker(&database, &env).await);
        }
        Fault::NatsRestart => {}
    }

    // Paced rounds, so that the share counts time slots, not how fast each kind of answer comes back (a read from
    // memory takes far less than one from the store).
    let (mut reads, mut from_memory, mut stale) = (0usize, 0usize, 0usize);
    let mut in_memory = [false; THREADS];
    let mut until_memory = WINDOW;
    let mut rounds = tokio::time::interval(ROUND);
    while started.elapsed() < WINDOW {
        rounds.tick().await;
        for (i, thread) in threads.iter().enumerate() {
            let reply = running(&worker).history(thread).await;
            reads += 1;
            if reply.source == "cache" {
                from_memory += 1;
                in_memory[i] = true;
                // Both turns were persisted before the first read: memory must hold the second.
                if reply.message_count() < 4 {
                    stale += 1;
                }
            }
        }
        if in_memory.iter().all(|&m| m) && until_memory == WINDOW {
            until_memory = started.elapsed();
            if fault == Fault::WorkerRestart {
                break;
            }
        }
    }
    drop(worker);
    Outcome {
        share: from_memory as f64 / reads.max(1) as f64,
        reads,
        stale,
        until_memory,
    }
}
