//! P9(d): partitioned workers divide the work ([design 8](../../docs/design.md#8)), issue 40. Two shared cores cannot
//! show throughput growing with the workers, so P9(d) shows what each worker does: its share of the events, and its
//! CPU per event falling as 1/N.
//!
//! - **Ingest.** P1's messages (`BENCH_EVENTS_P1` over 1,000 threads, each with the `traceparent` aihub's publisher
//!   sends) are published on Core NATS into aihub's class streams, consumed by 1, 2 and 3 workers on fresh streams, in
//!   [`ROUNDS`] rounds (every other one in the other order), each count's runs pooled. One worker is the baseline: the
//!   binary takes `HISTORY_VIEW_PARTITIONS=1` as no partitioning, so it is one JetStream worker on the class streams,
//!   the deployment partitioning replaces; 2 and 3 are partitioned workers on the sourced stream. The publisher paces
//!   at [`PER_WORKER_RATE`] times N, a little every [`PACE_TICK`], so every worker of every run receives the same
//!   steady flow. Per worker: the events it received against its threads' share (each message's thread's owner,
//!   [`Partitions::owner`]), and its CPU (from the OS, from the first publish until it had received its share) per
//!   published and per received event; nats-server's CPU per event beside them, as the sourced stream copies every
//!   event once more. Target: each of N workers spends at most [`SHARE_MARGIN`] x 1/N of the single worker's CPU per
//!   published event, and every event is received by exactly one worker (each received its share exactly, and the
//!   shares add up to all).
//! - **A forwarded read.** P2's 200-message thread is stored and read through its owner among 2 partitioned workers
//!   until it is answered from memory; then one client reads it through the owner (local) and through the other
//!   worker (forwarded to the owner), [`READ_ROUNDS`] rounds of [`READS_PER_ROUND`] each, alternating: latency (p50,
//!   p99) and each worker's CPU per request, the routes from `history_view_read_routes_total`. Target: the
//!   forwarded p50 at most the local p50 plus [`HOP_BUDGET`]; every answer 200 from memory, every read through the
//!   other worker forwarded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::future::join_all;

use chat_history_view::subject::DeliveryKey;
use test_support::class_streams::create_class_streams;

use crate::data::Message;
use crate::p2_cache_reads::SHAPE;
use crate::partitions::Partitions;
use crate::report::{Row, fmt_count, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker::{self, Worker, cpu_time};

const ID: &str = "P9d";
const COUNTS: [u32; 3] = [1, 2, 3];
/// Rounds of a run for each count, pooled; every other round runs the counts in the other order, so that a slow
/// drift of the shared machine weighs on every count alike.
const ROUNDS: usize = 2;
/// The agent classes of P1's messages: each gets aihub's class stream.
const CLASSES: [&str; 2] = ["BenchAgent", "UserAgent"];
/// P12's stream over every agent subject: a class stream cannot overlap it.
const P12_STREAM: &str = "agent_bench_stream";
const PARTITIONED_STREAM: &str = "CHAT_HISTORY_VIEW";
/// Events per second each worker receives, in every run (the publisher paces at N times this). A JetStream
/// worker's CPU per event depends on how many messages each socket read and wake-up brings, so on how the events
/// arrive; at one total rate for every N, the workers of more partitions would each see a thinner flow. Low enough
/// for nats-server to carry three times over on two shared cores (it copies each event into the partitioned stream).
const PER_WORKER_RATE: f64 = 6_000.0;
/// The publisher sends what is due every tick: a steady flow, as aihub's many conversations stream their tokens. A
/// burst reaches a consumer of the class streams as a burst (measured: 9.7 µs of CPU per event in bursts of 100
/// against 17.4 µs trickling, at the same rate), but reaches a partitioned worker spread out by the sourcing:
/// bursts would favour the single worker.
const PACE_TICK: Duration = Duration::from_millis(1);
/// How often each worker's event counter is scraped (each scrape costs the worker CPU; no rate is timed here).
const POLL: Duration = Duration::from_millis(100);
/// A worker that receives nothing for this long has lost the rest of its share.
const STALL: Duration = Duration::from_secs(10);
/// How long each worker's CPU is read while nothing is published: its fixed cost, beside the stream's.
const IDLE: Duration = Duration::from_secs(2);
/// How much more than 1/N of the single worker's CPU per published event a worker of N may spend: its share
/// varies by a few percent with the thread ids, and each worker has fixed costs that do not divide.
const SHARE_MARGIN: f64 = 1.25;
const READ_THREAD: &str = "p9d-thread";
const READ_ROUNDS: usize = 10;
const READS_PER_ROUND: usize = 1000;
/// What a forwarded read may add to a local one's p50: the hop on loopback (a request and a 25 KiB answer relayed)
/// costs a fraction of it; a cluster network adds its round trip on top.
const HOP_BUDGET: Duration = Duration::from_millis(1);

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let messages = crate::p1_ingest::traced_messages(setup.settings.events_p1);
    let context = jetstream::new(setup.nats_client().await);
    // Deletes here and below start clean or clean up: a stream that is not there is what they want.
    let _ = context.delete_stream(P12_STREAM).await;
    let mut runs = Vec::new();
    for round in 0..ROUNDS {
        let mut order = COUNTS;
        if round % 2 == 1 {
            order.reverse();
        }
        for count in order {
            runs.push(ingest(&setup, &context, &messages, count).await);
        }
    }
    let pooled: Vec<Ingest> = COUNTS
        .iter()
        .map(|&count| Ingest::pooled(count, &runs))
        .collect();
    let mut rows = ingest_rows(&pooled);
    rows.extend(runs.iter().enumerate().map(|(i, run)| {
        Row::info(
            ID,
            format!("round {}: {} worker(s)", i / COUNTS.len() + 1, run.count),
            format!("{}; {}", describe(run), conditions(run)),
        )
    }));
    let _ = context.delete_stream(PARTITIONED_STREAM).await;
    rows.push(reads(&setup).await);
    let _ = context.delete_stream(PARTITIONED_STREAM).await;
    for class in CLASSES {
        let _ = context.delete_stream(format!("agent_{class}_stream")).await;
    }
    rows
}

/// One worker's part of a run.
struct Share {
    /// Events of its threads among those published.
    expected: u64,
    received: u64,
    /// CPU from the first publish until it had received its share.
    cpu: Duration,
    /// CPU while nothing was published, over [`IDLE`].
    idle: Duration,
}

/// The messages consumed by `count` workers.
struct Ingest {
    count: u32,
    published: u64,
    shares: Vec<Share>,
    /// nats-server's CPU over the same span (until the last worker had its share).
    nats_cpu: Duration,
    elapsed: Duration,
}

impl Ingest {
    /// The runs of `count` workers among `runs` taken together: events, CPU and time summed.
    fn pooled(count: u32, runs: &[Ingest]) -> Self {
        let of: Vec<&Ingest> = runs.iter().filter(|run| run.count == count).collect();
        let shares = (0..count as usize)
            .map(|k| Share {
                expected: of.iter().map(|run| run.shares[k].expected).sum(),
                received: of.iter().map(|run| run.shares[k].received).sum(),
                cpu: of.iter().map(|run| run.shares[k].cpu).sum(),
                idle: of.iter().map(|run| run.shares[k].idle).sum(),
            })
            .collect();
        Self {
            count,
            published: of.iter().map(|run| run.published).sum(),
            shares,
            nats_cpu: of.iter().map(|run| run.nats_cpu).sum(),
            elapsed: of.iter().map(|run| run.elapsed).sum(),
        }
    }

    fn per_published(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.published.max(1) as f64
    }

    /// Each worker received its share exactly, and the shares add up to every event published.
    fn each_once(&self) -> bool {
        self.shares.iter().all(|s| s.received == s.expected)
            && self.shares.iter().map(|s| s.received).sum::<u64>() == self.published
    }
}

async fn ingest(
    setup: &Setup,
    context: &jetstream::Context,
    messages: &[Message],
    count: u32,
) -> Ingest {
    // Fresh streams: no replay of the previous run's events, and the partitioned stream made for `count`.
    let _ = context.delete_stream(PARTITIONED_STREAM).await;
    for class in CLASSES {
        let _ = context.delete_stream(format!("agent_{class}_stream")).await;
    }
    create_class_streams(&setup.nats_url(), CLASSES.map(String::from)).await;
    let partitions = Partitions::new(count);
    let env = [("HISTORY_VIEW_SOURCE", "jetstream".to_owned())];
    let database = format!("bench_p9d_{count}");
    let workers = partitions
        .start_all(setup, &database, &env, Duration::ZERO)
        .await;
    let mut expected = vec![0; count as usize];
    for message in messages {
        let key =
            DeliveryKey::parse_subject(message.subject.as_str()).expect("bench subjects parse");
        expected[partitions.owner(key.thread_id()) as usize] += 1;
    }
    let cpu = |workers: &[Worker]| workers.iter().map(Worker::cpu_time).collect::<Vec<_>>();
    let before_idle = cpu(&workers);
    tokio::time::sleep(IDLE).await;
    let before = cpu(&workers);
    let nats_pid = setup.nats_pid().to_string();
    let nats_before = cpu_time(&nats_pid);
    progress(
        ID,
        &format!("{count} worker(s): publishing {}", messages.len()),
    );
    let publisher = setup.nats_client().await;
    let started = Instant::now();
    let rate = f64::from(count) * PER_WORKER_RATE;
    let batch = (rate * PACE_TICK.as_secs_f64()).ceil() as usize;
    for (i, due_now) in messages.chunks(batch).enumerate() {
        for message in due_now {
            message.publish(&publisher).await;
        }
        let due = started + Duration::from_secs_f64(((i + 1) * batch) as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
    }
    publisher.flush().await.expect("flush the publisher");
    let after = join_all(
        workers
            .iter()
            .zip(&expected)
            .map(|(worker, &expected)| async move {
                worker.wait_received(expected, POLL, STALL).await;
                worker.cpu_time()
            }),
    )
    .await;
    let nats_cpu = cpu_time(&nats_pid).saturating_sub(nats_before);
    let elapsed = started.elapsed();
    let scrapes = join_all(workers.iter().map(Worker::metrics)).await;
    let shares = (0..workers.len())
        .map(|k| Share {
            expected: expected[k],
            received: scrapes[k].events_received(),
            cpu: after[k].saturating_sub(before[k]),
            idle: before[k].saturating_sub(before_idle[k]),
        })
        .collect();
    let run = Ingest {
        count,
        published: messages.len() as u64,
        shares,
        nats_cpu,
        elapsed,
    };
    progress(ID, &format!("{}; {}", describe(&run), conditions(&run)));
    run
}

/// Every worker's share and CPU, and nats-server's CPU, per published event.
fn describe(run: &Ingest) -> String {
    let workers: Vec<String> = run
        .shares
        .iter()
        .enumerate()
        .map(|(k, s)| {
            format!(
                "worker {k}: {} events ({:.1}%, its threads' {:.1}%), {:.2} s CPU = {:.2} µs per published event \
                 ({:.2} per received)",
                s.received,
                s.received as f64 * 100.0 / run.published as f64,
                s.expected as f64 * 100.0 / run.published as f64,
                s.cpu.as_secs_f64(),
                run.per_published(s.cpu),
                s.cpu.as_secs_f64() * 1e6 / s.received.max(1) as f64,
            )
        })
        .collect();
    format!(
        "{}; nats-server {:.2} µs per event",
        workers.join("; "),
        run.per_published(run.nats_cpu)
    )
}

/// The target rows, from each count's runs pooled.
fn ingest_rows(pooled: &[Ingest]) -> Vec<Row> {
    let single = pooled
        .iter()
        .find(|run| run.count == 1)
        .map_or(0.0, |run| run.per_published(run.shares[0].cpu));
    pooled
        .iter()
        .map(|run| {
            if run.count == 1 {
                return Row::check(
                    ID,
                    format!("1 worker (JetStream source, the baseline): events and CPU per event, {ROUNDS} rounds"),
                    describe(run),
                    "every event received",
                    run.each_once(),
                );
            }
            let limit = single / f64::from(run.count) * SHARE_MARGIN;
            let divided = run
                .shares
                .iter()
                .all(|s| run.per_published(s.cpu) <= limit);
            Row::check(
                ID,
                format!(
                    "{} partitioned workers: each one's share and CPU per event, {ROUNDS} rounds",
                    run.count
                ),
                describe(run),
                format!(
                    "each <= 1/{} x {single:.2} x {SHARE_MARGIN} = {limit:.2} µs per published event; every event \
                     received by exactly one worker",
                    run.count
                ),
                divided && run.each_once(),
            )
        })
        .collect()
}

/// A run's pace and the workers' CPU while idle (their fixed cost, not taken off the stream's).
fn conditions(run: &Ingest) -> String {
    let idle: Vec<String> = run
        .shares
        .iter()
        .map(|s| format!("{:.0}", s.idle.as_secs_f64() * 1e3 / IDLE.as_secs_f64()))
        .collect();
    format!(
        "published to the last share received in {} ({}/s); idle CPU {} ms per s",
        fmt_duration(run.elapsed),
        fmt_count(run.published as f64 / run.elapsed.as_secs_f64()),
        idle.join(", ")
    )
}

/// One side of the read comparison: its latencies and each worker's CPU while it ran.
#[derive(Default)]
struct Reads {
    latencies: Vec<Duration>,
    /// Answers that were not a 200 from memory.
    unexpected: usize,
    /// CPU of the owner and of the other worker.
    owner_cpu: Duration,
    other_cpu: Duration,
}

impl Reads {
    fn per_request(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.latencies.len().max(1) as f64
    }

    fn summary(&self) -> String {
        format!(
            "p50 {}, p99 {}, CPU per request owner {:.0} µs + other {:.0} µs",
            fmt_duration(quantile(&self.latencies, 0.5)),
            fmt_duration(quantile(&self.latencies, 0.99)),
            self.per_request(self.owner_cpu),
            self.per_request(self.other_cpu),
        )
    }
}

/// P2's thread read by one client through its owner and through the other of 2 partitioned workers.
async fn reads(setup: &Setup) -> Row {
    let database = "bench_p9d_reads";
    setup
        .store(database)
        .await
        .insert(&SHAPE.rows(READ_THREAD))
        .await;
    let partitions = Partitions::new(2);
    let env = [("HISTORY_VIEW_SOURCE", "jetstream".to_owned())];
    let workers = partitions
        .start_all(setup, database, &env, Duration::ZERO)
        .await;
    let owner = partitions.owner(READ_THREAD) as usize;
    let (local, other) = (&workers[owner], &workers[1 - owner]);
    let first = local.history(READ_THREAD).await;
    assert_eq!(
        (first.status, first.message_count()),
        (200, SHAPE.messages()),
        "the first read answers the stored thread"
    );
    local.read_until_cached(READ_THREAD).await;
    let url = |worker: &Worker| format!("{}/v1/threads/{READ_THREAD}/history", worker.base_url());
    let urls = [url(local), url(other)];
    let http = reqwest::Client::new();
    let routes = || async {
        let (owner, other) = (local.metrics().await, other.metrics().await);
        (
            owner.sample("history_view_read_routes_total{route=\"local\"}"),
            other.sample("history_view_read_routes_total{route=\"forwarded\"}"),
        )
    };
    let routes_before = routes().await;
    progress(
        ID,
        &format!(
            "reads: {READ_ROUNDS} rounds of {READS_PER_ROUND} through the owner and through the other worker"
        ),
    );
    let mut sides = [Reads::default(), Reads::default()];
    for round in 0..READ_ROUNDS {
        // The side that goes first alternates, so neither always follows the other.
        for side in [round % 2, 1 - round % 2] {
            let reads = &mut sides[side];
            let (owner_before, other_before) = (local.cpu_time(), other.cpu_time());
            for _ in 0..READS_PER_ROUND {
                let asked = Instant::now();
                let reply = worker::get(&http, &urls[side]).await;
                reads.latencies.push(asked.elapsed());
                if reply.status != 200 || reply.source != "cache" {
                    reads.unexpected += 1;
                }
            }
            reads.owner_cpu += local.cpu_time().saturating_sub(owner_before);
            reads.other_cpu += other.cpu_time().saturating_sub(other_before);
        }
    }
    let routes_after = routes().await;
    let [mut at_owner, mut forwarded] = sides;
    at_owner.latencies.sort();
    forwarded.latencies.sort();
    let (local_p50, forwarded_p50) = (
        quantile(&at_owner.latencies, 0.5),
        quantile(&forwarded.latencies, 0.5),
    );
    let requests = READ_ROUNDS * READS_PER_ROUND;
    let counted = (
        routes_after.0 - routes_before.0,
        routes_after.1 - routes_before.1,
    );
    let unexpected = at_owner.unexpected + forwarded.unexpected;
    let cpu_ratio = forwarded.per_request(forwarded.owner_cpu + forwarded.other_cpu)
        / at_owner
            .per_request(at_owner.owner_cpu + at_owner.other_cpu)
            .max(1e-9);
    Row::check(
        ID,
        format!(
            "forwarded vs local read, 200 messages, 1 client, 2 partitioned workers ({requests} reads each)"
        ),
        format!(
            "local {}; forwarded {}; p50 {:.2}x, CPU (both workers) {cpu_ratio:.2}x; routes: the other worker \
             forwarded {}, the owner answered {} locally{}",
            at_owner.summary(),
            forwarded.summary(),
            forwarded_p50.as_secs_f64() / local_p50.as_secs_f64().max(1e-9),
            counted.1,
            counted.0,
            if unexpected > 0 {
                format!("; {unexpected} answers not 200 from memory")
            } else {
                String::new()
            }
        ),
        format!(
            "forwarded p50 <= local p50 + {}; every answer 200 from memory; every read through the other worker \
             forwarded",
            fmt_duration(HOP_BUDGET)
        ),
        forwarded_p50 <= local_p50 + HOP_BUDGET
            && unexpected == 0
            && counted.1 == requests as f64
            && counted.0 == 2.0 * requests as f64,
    )
}
