//! P1: live ingest throughput of the worker against a bare async-nats subscriber receiving the same messages
//! (target: >= 0.8 of bare and >= 100k events/s), plus the CPU cost of the worker's per-event path in-process.
//!
//! The same pre-serialized messages (a marker then chunks, round-robin over the threads, as concurrent
//! conversations stream) are published as fast as one publisher can, first to a bare subscriber in the bench
//! process (counting messages, timed from the first publish to the last message received), then to a fresh worker
//! (timed from the first publish to the scrape of `/metrics` that shows every message received). Five rounds,
//! each side by side; each side's best rate among the rounds without dropped messages counts (the machine is
//! shared, so the best round is the one least disturbed), and every round is shown.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::{ConnectOptions, Event};
use chat_history_view::decode::{Decoded, decode_payload};
use chat_history_view::subject::DeliveryKey;
use chat_history_view::view::ThreadView;
use futures_util::StreamExt;

use crate::data::{self, Message};
use crate::report::{Row, fmt_count, progress};
use crate::setup::Setup;

const THREADS: usize = 1000;
const ROUNDS: usize = 6;
/// `HISTORY_VIEW_SHADOW_SAMPLE` of the worker, by round (cycled): the checks sample reads only, so ingest should
/// not notice them; the rounds show it side by side.
const SAMPLES: [&str; 3] = ["0", "0.01", "1"];
/// How often the worker's event counter is scraped; its finishing time is known to within this (plus a scrape).
const POLL: Duration = Duration::from_millis(20);
/// A side that receives nothing for this long has lost the missing messages (a slow consumer drop).
const STALL: Duration = Duration::from_secs(3);

/// One side's result.
#[derive(Debug, Clone, Copy)]
struct Ingested {
    received: u64,
    elapsed: Duration,
    /// Slow-consumer events the side's NATS client reported (each one is a batch of dropped messages).
    drops: u64,
}

impl Ingested {
    fn rate(&self) -> f64 {
        self.received as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// One round: the bare subscriber, then the worker, on the same messages.
struct Round {
    /// The worker's `HISTORY_VIEW_SHADOW_SAMPLE`.
    sample: &'static str,
    bare: Ingested,
    worker: Ingested,
    /// How fast the publisher went while feeding the worker.
    publish_rate: f64,
    /// CPU time the worker process used in the round (every thread: NATS client, ingest, HTTP, cache upkeep).
    worker_cpu: Duration,
    /// CPU time the bare subscriber's process used receiving the round's messages.
    bare_cpu: Duration,
}

impl Round {
    fn ratio(&self) -> f64 {
        self.worker.rate() / self.bare.rate()
    }

    fn worker_cpu_per_event(&self) -> f64 {
        self.worker_cpu.as_secs_f64() * 1e6 / self.worker.received.max(1) as f64
    }

    fn bare_cpu_per_event(&self) -> f64 {
        self.bare_cpu.as_secs_f64() * 1e6 / self.bare.received.max(1) as f64
    }

    fn complete(&self, n: usize) -> bool {
        self.bare.received == n as u64 && self.worker.received == n as u64
    }

    fn describe(&self, n: usize) -> String {
        let dropped = |side: &Ingested| {
            if side.received < n as u64 {
                format!(
                    " ({} DROPPED, {} slow-consumer events)",
                    n as u64 - side.received,
                    side.drops
                )
            } else {
                String::new()
            }
        };
        format!(
            "bare {}/s{}, worker (shadow sample {}) {}/s{} = {:.2}x; CPU per event: bare {:.2} µs, worker {:.2} µs; \
             publisher to worker {}/s",
            fmt_count(self.bare.rate()),
            dropped(&self.bare),
            self.sample,
            fmt_count(self.worker.rate()),
            dropped(&self.worker),
            self.ratio(),
            self.bare_cpu_per_event(),
            self.worker_cpu_per_event(),
            fmt_count(self.publish_rate)
        )
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let n = setup.settings.events_p1;
    let threads = THREADS.min(n).max(1);
    progress(
        "P1",
        &format!("serializing {n} events over {threads} threads"),
    );
    let messages = messages(n);
    let bytes: usize = messages
        .iter()
        .map(|m| m.subject.len() + m.payload.len())
        .sum();
    progress(
        "P1",
        &format!(
            "{:.0} MiB of subjects and payloads",
            bytes as f64 / (1 << 20) as f64
        ),
    );

    let mut rounds = Vec::new();
    for number in 1..=ROUNDS {
        let (bare, bare_cpu) = bare_subscriber(&setup, &messages).await;
        let sample = SAMPLES[(number - 1) % SAMPLES.len()];
        let (worker, published_in, worker_cpu) =
            worker_ingest(&setup, &messages, number, sample).await;
        let round = Round {
            sample,
            bare,
            worker,
            publish_rate: n as f64 / published_in.as_secs_f64(),
            worker_cpu,
            bare_cpu,
        };
        progress("P1", &format!("round {number}: {}", round.describe(n)));
        rounds.push(round);
    }

    progress(
        "P1",
        "in-process pipeline: parse_subject + decode_payload + ThreadView::insert",
    );
    let path = PathCost::measure(&messages);

    // Each side's best round is its capability with the least interference from the rest of the machine.
    let complete: Vec<&Round> = rounds.iter().filter(|r| r.complete(n)).collect();
    let best_rate =
        |side: fn(&Round) -> &Ingested| complete.iter().map(|r| side(r).rate()).fold(0.0, f64::max);
    let (bare, worker) = (best_rate(|r| &r.bare), best_rate(|r| &r.worker));
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let ratio = median(rounds.iter().map(Round::ratio).collect());
    let dropped = rounds.len() - complete.len();
    let verdict = Row::check(
        "P1",
        "live ingest vs bare async-nats subscriber",
        format!(
            "median per-round ratio {ratio:.2}x; {dropped} of {ROUNDS} rounds dropped messages; best rounds: worker \
             {}/s, bare {}/s",
            fmt_count(worker),
            fmt_count(bare),
        ),
        ">= 0.9x bare by the per-round median; drops in no round; >= 100k/s",
        ratio >= 0.9 && dropped == 0 && worker >= 100_000.0,
    );
    // Nothing but the client and the path should cost the worker CPU: the bare subscriber's CPU per event (the
    // client) plus the in-process path, with a quarter of headroom on the path.
    let worker_cpu = median(rounds.iter().map(Round::worker_cpu_per_event).collect());
    let bare_cpu = median(rounds.iter().map(Round::bare_cpu_per_event).collect());
    let limit = bare_cpu + 1.25 * path.total();
    let cpu_verdict = Row::check(
        "P1",
        "worker CPU per event (from the OS, per process)",
        format!(
            "median {worker_cpu:.2} µs against bare {bare_cpu:.2} µs + 1.25 x path {:.2} µs = {limit:.2} µs \
             (excess {:.2} µs)",
            path.total(),
            worker_cpu - bare_cpu - path.total(),
        ),
        "<= bare + 1.25 x the in-process path",
        worker_cpu <= limit,
    );
    let mut rows = vec![verdict, cpu_verdict];
    rows.push(Row::info(
        "P1",
        "by HISTORY_VIEW_SHADOW_SAMPLE (reads only: ingest unaffected)",
        SAMPLES
            .iter()
            .map(|sample| {
                let mut of: Vec<f64> = rounds
                    .iter()
                    .filter(|r| r.sample == *sample && r.complete(n))
                    .map(Round::ratio)
                    .collect();
                of.sort_by(f64::total_cmp);
                match of.last() {
                    Some(best) => format!(
                        "sample {sample}: best ratio {best:.2}x of {} rounds",
                        of.len()
                    ),
                    None => format!("sample {sample}: no round without drops"),
                }
            })
            .collect::<Vec<_>>()
            .join("; "),
    ));
    rows.extend(
        rounds
            .iter()
            .enumerate()
            .map(|(i, round)| Row::info("P1", format!("round {}", i + 1), round.describe(n))),
    );
    rows.push(Row::info(
        "P1",
        "how the worker's time is taken",
        format!(
            "first publish to the /metrics scrape showing all {n} (an upper bound: scraped every {} ms)",
            POLL.as_millis()
        ),
    ));
    rows.push(Row::info(
        "P1",
        "per-event CPU path, in-process, one core",
        format!(
            "{}/s = {:.2} µs/event: parse_subject {:.2} + decode_payload {:.2} + ThreadView::insert {:.2}",
            fmt_count(1e6 / path.total()),
            path.total(),
            path.parse,
            path.decode,
            path.insert
        ),
    ));
    rows
}

/// P1's `n` messages over its threads.
pub fn messages(n: usize) -> Arc<[Message]> {
    live_messages(n, THREADS.min(n).max(1)).into()
}

/// `n` messages, round-robin over `threads` threads: each thread's first event is its marker, the rest chunks.
fn live_messages(n: usize, threads: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let (t, seq) = (i % threads, i / threads);
            let thread = format!("p1-t{t:05}");
            let display = data::display(&thread, 0, 1);
            let row = if seq == 0 {
                data::marker(&thread, &display, seq)
            } else {
                data::chunk(&thread, &display, seq)
            };
            Message::from_row(&row)
        })
        .collect()
}

/// Publishes every message as fast as the client takes them, then flushes. Returns how long it took.
async fn publish_all(client: async_nats::Client, messages: Arc<[Message]>) -> Duration {
    let started = Instant::now();
    for message in messages.iter() {
        message.publish(&client).await;
    }
    client.flush().await.expect("flush the publisher");
    started.elapsed()
}

/// A client whose slow-consumer events are counted in the returned counter.
async fn counting_client(url: &str) -> (async_nats::Client, Arc<AtomicU64>) {
    let slow = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&slow);
    let client = ConnectOptions::new()
        .event_callback(move |event| {
            let counter = Arc::clone(&counter);
            async move {
                if matches!(event, Event::SlowConsumer(_)) {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .connect(url)
        .await
        .expect("the bare subscriber connects");
    (client, slow)
}

/// The environment variable that makes the benchmark binary the bare subscriber of P1: `<NATS URL> <messages>`.
pub const BARE_SUBSCRIBER_ENV: &str = "CHV_BENCH_BARE_SUBSCRIBER";

/// Phase A: a bare subscriber (a process of its own: this binary, as [`bare_subscriber_process`]; its own
/// connection, the worker's subject and default capacity) counts messages. Returns what it received and the CPU
/// its process spent receiving them (from the OS: user and system time).
async fn bare_subscriber(setup: &Setup, messages: &Arc<[Message]>) -> (Ingested, Duration) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child =
        tokio::process::Command::new(std::env::current_exe().expect("the bench binary"))
            .env(
                BARE_SUBSCRIBER_ENV,
                format!("{} {}", setup.nats_url(), messages.len()),
            )
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the bare subscriber starts");
    let mut lines = BufReader::new(child.stdout.take().expect("its stdout")).lines();
    let mut line = async || {
        lines
            .next_line()
            .await
            .expect("the bare subscriber's output")
            .expect("a line from the bare subscriber")
    };
    assert_eq!(line().await, "ready", "the bare subscriber subscribed");
    let publisher = setup.nats_client().await;
    let started = std::time::SystemTime::now();
    let publishing = tokio::spawn(publish_all(publisher, Arc::clone(messages)));
    let report = line().await;
    publishing.await.expect("the publisher task");
    child.wait().await.expect("the bare subscriber exits");
    let fields: Vec<u128> = report
        .split_whitespace()
        .map(|f| f.parse().expect("a number"))
        .collect();
    let [received, last_ns, drops, cpu_ns] = fields[..] else {
        panic!("the bare subscriber reported {report:?}");
    };
    let started_ns = started
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    let elapsed = if received == 0 {
        Duration::ZERO
    } else {
        Duration::from_nanos(u64::try_from(last_ns.saturating_sub(started_ns)).unwrap_or(u64::MAX))
    };
    let ingested = Ingested {
        received: received as u64,
        elapsed,
        drops: drops as u64,
    };
    (ingested, Duration::from_nanos(cpu_ns as u64))
}

/// The bare subscriber's process (`spec`: the NATS URL and how many messages to expect): subscribes, prints
/// `ready`, receives until every message came or none came for [`STALL`], then prints `<received> <wall-clock ns of
/// the last message> <slow-consumer events> <CPU ns spent since ready>` and exits.
pub fn bare_subscriber_process(spec: &str) {
    let (url, expected) = spec.split_once(' ').expect("<NATS URL> <messages>");
    let expected: u64 = expected.parse().expect("a message count");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let (client, slow) = counting_client(url).await;
        let mut subscriber = client
            .subscribe(chat_history_view::config::DEFAULT_SUBJECT)
            .await
            .expect("the bare subscriber subscribes");
        client
            .flush()
            .await
            .expect("the subscription is registered before publishing");
        let cpu_ready = crate::worker::cpu_time("self");
        println!("ready");
        let mut received = 0u64;
        let mut last = None;
        while received < expected {
            match tokio::time::timeout(STALL, subscriber.next()).await {
                Ok(Some(_message)) => {
                    received += 1;
                    last = Some(std::time::SystemTime::now());
                }
                _ => break,
            }
        }
        let cpu = crate::worker::cpu_time("self").saturating_sub(cpu_ready);
        let last_ns = last.map_or(0, |at| {
            at.duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_nanos()
        });
        println!(
            "{received} {last_ns} {} {}",
            slow.load(Ordering::Relaxed),
            cpu.as_nanos()
        );
    });
}

/// Phase B: the same publish to a fresh worker, finished when its events counter (every outcome) reaches `n`.
async fn worker_ingest(
    setup: &Setup,
    messages: &Arc<[Message]>,
    round: usize,
    sample: &str,
) -> (Ingested, Duration, Duration) {
    let worker = setup
        .start_worker(
            &format!("bench_p1_{round}"),
            &[("HISTORY_VIEW_SHADOW_SAMPLE", sample)],
        )
        .await;
    let expected = messages.len() as u64;
    let publisher = setup.nats_client().await;
    let cpu_before = worker.cpu_time();
    let started = Instant::now();
    let publishing = tokio::spawn(publish_all(publisher, Arc::clone(messages)));
    let finished = worker.wait_received(expected, POLL, STALL).await;
    let published_in = publishing.await.expect("the publisher task");
    let cpu = worker.cpu_time().saturating_sub(cpu_before);
    let scrape = worker.metrics().await;
    let ingested = Ingested {
        received: scrape.events_received(),
        elapsed: finished - started,
        drops: scrape.drops(),
    };
    (ingested, published_in, cpu)
}

/// The worker's per-event CPU work without NATS or the cache, in µs per event, step by step: subject → key,
/// payload → event, insert into the thread's view. Each step is the difference of two cumulative passes, best of
/// three.
struct PathCost {
    parse: f64,
    decode: f64,
    insert: f64,
}

impl PathCost {
    fn measure(messages: &[Message]) -> Self {
        let parse = best_of_three(messages, parse_pass);
        let decode = best_of_three(messages, decode_pass);
        let insert = best_of_three(messages, insert_pass);
        Self {
            parse,
            decode: decode - parse,
            insert: insert - decode,
        }
    }

    fn total(&self) -> f64 {
        self.parse + self.decode + self.insert
    }
}

/// µs per message of the fastest of three runs of `pass`; what it returns is dropped outside the timing.
fn best_of_three<T>(messages: &[Message], pass: fn(&[Message]) -> T) -> f64 {
    (0..3)
        .map(|_| {
            let started = Instant::now();
            let output = std::hint::black_box(pass(messages));
            let elapsed = started.elapsed();
            drop(output);
            elapsed.as_secs_f64() * 1e6 / messages.len() as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn key(message: &Message) -> DeliveryKey {
    DeliveryKey::parse_subject(message.subject.as_str()).expect("bench subjects parse")
}

fn decode(message: &Message) -> Decoded {
    decode_payload(key(message), &message.payload).expect("bench payloads are JSON")
}

// The passes keep what they build, as the worker does, so freeing it is not timed.
fn parse_pass(messages: &[Message]) -> Vec<DeliveryKey> {
    messages.iter().map(key).collect()
}

fn decode_pass(messages: &[Message]) -> Vec<Decoded> {
    messages.iter().map(decode).collect()
}

fn insert_pass(messages: &[Message]) -> HashMap<String, ThreadView> {
    let mut views: HashMap<String, ThreadView> = HashMap::new();
    for message in messages {
        if let Decoded::Event(event) = decode(message) {
            // The worker's `ViewCache::apply` also owns the thread id per event.
            let thread = event.key.thread_id().to_owned();
            views.entry(thread).or_default().insert(event);
        }
    }
    let held: usize = views.values().map(ThreadView::len).sum();
    assert_eq!(
        held,
        messages.len(),
        "every bench event is relevant and distinct"
    );
    views
}
