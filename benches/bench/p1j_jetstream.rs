//! P1j: the JetStream source against async-nats alone, side by side on one class stream. A bare pull consumer (a
//! process of its own: this binary, as [`bare_consumer_process`]) configured as the worker's consumer (ephemeral,
//! `AckPolicy::None`, memory storage, the display-event filter, heartbeat 2 s, expiry 10 s, each message's info
//! read) and a fresh release worker (`HISTORY_VIEW_SOURCE=jetstream`) consume the same messages at the same time:
//!
//! - **live**: P1's messages (with aihub's `traceparent`) published as fast as one publisher goes;
//! - **paced**: at 6,000 events/s, the rate partitioned workers were measured at, where wake-ups dominate;
//! - **replay**: a prefilled stream consumed from its start by a worker just started (replay window 1 h).
//!
//! Each run reports both processes' CPU per event (from the OS), their ratio, the throughput, how long after the
//! publisher's last message each was done, and the worker's resumes. Targets, per mode, by the median over the
//! rounds: CPU per event at most the bare consumer's + 1.25 x the in-process path (P1's, measured here on the
//! same messages) + 0.5 µs; no consumer resume in any run; live, the worker done within 1 s of the last publish
//! (of the bare consumer's last message, when JetStream itself stored the messages later than that); replay, at
//! least 0.5x the bare consumer's rate.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use futures_util::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::data::Message;
use crate::p1_ingest::{PathCost, median};
use crate::report::{self, Row, fmt_count, progress};
use crate::setup::Setup;
use crate::worker::{Worker, cpu_time};

const STREAM: &str = "agent_p1j_stream";
/// Rounds of each mode.
const ROUNDS: usize = 3;
/// The paced rate, and the events a paced run publishes (10 s of them).
const PACED_RATE: f64 = 6_000.0;
const PACED_EVENTS: usize = 60_000;
const POLL: Duration = Duration::from_millis(20);
/// A side that receives nothing for this long stopped (a stalled consumer is resumed after 4 s).
const STALL: Duration = Duration::from_secs(8);
/// The environment variable that makes the benchmark binary P1j's bare consumer: `<NATS URL> <stream> <messages>`.
pub const BARE_CONSUMER_ENV: &str = "CHV_BENCH_BARE_JETSTREAM";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Live,
    Paced,
    Replay,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::Live, Mode::Paced, Mode::Replay];

    fn label(self) -> &'static str {
        match self {
            Mode::Live => "live",
            Mode::Paced => "paced 6,000/s",
            Mode::Replay => "replay",
        }
    }
}

/// One side of a run.
#[derive(Debug, Clone, Copy)]
struct Side {
    received: u64,
    cpu: Duration,
    /// From the side's start (live and paced: the first publish; replay: its consumer's creation, or the worker's
    /// spawn) to its last message.
    elapsed: Duration,
    /// Live and paced: its last message after the publisher's last publish (zero if before).
    after_publisher: Duration,
}

impl Side {
    fn cpu_per_event(&self) -> f64 {
        report::cpu_per_event(self.cpu, self.received)
    }

    fn rate(&self) -> f64 {
        report::rate(self.received, self.elapsed)
    }
}

struct Run {
    mode: Mode,
    expected: u64,
    worker: Side,
    bare: Side,
    resumes: f64,
}

impl Run {
    fn describe(&self) -> String {
        format!(
            "worker {:.2} µs/event, {}/s, done {} ms after the publisher, {} resumes; bare {:.2} µs/event, {}/s, \
             done {} ms after; {:.2}x the CPU, {:.2}x the rate; {} and {} of {} received",
            self.worker.cpu_per_event(),
            fmt_count(self.worker.rate()),
            self.worker.after_publisher.as_millis(),
            self.resumes,
            self.bare.cpu_per_event(),
            fmt_count(self.bare.rate()),
            self.bare.after_publisher.as_millis(),
            self.worker.cpu_per_event() / self.bare.cpu_per_event(),
            self.worker.rate() / self.bare.rate(),
            self.worker.received,
            self.bare.received,
            self.expected,
        )
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let n = setup.settings.events_p1;
    progress(
        "P1j",
        &format!("serializing {n} events, a traceparent on each"),
    );
    let messages = crate::p1_ingest::traced_messages(n);
    let paced: Arc<[Message]> = messages[..PACED_EVENTS.min(n)].to_vec().into();
    let client = setup.nats_client().await;
    let context = jetstream::new(client.clone());
    let _ = context.delete_stream(STREAM).await;
    let stream = context
        .create_stream(jetstream::stream::Config {
            name: STREAM.into(),
            subjects: vec!["agent.>".into()],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("the bench's class stream");
    let mut runs = Vec::new();
    for round in 1..=ROUNDS {
        for mode in Mode::ALL {
            stream.purge().await.expect("an empty stream for each run");
            let of = match mode {
                Mode::Paced => &paced,
                Mode::Live | Mode::Replay => &messages,
            };
            let run = match mode {
                Mode::Replay => replay(&setup, &client, of, round).await,
                Mode::Live | Mode::Paced => live(&setup, &client, of, mode, round).await,
            };
            progress(
                "P1j",
                &format!("round {round}, {}: {}", mode.label(), run.describe()),
            );
            runs.push(run);
        }
    }
    let _ = context.delete_stream(STREAM).await;
    progress(
        "P1j",
        "in-process pipeline: parse_subject + decode_payload + ThreadView::insert",
    );
    let path = PathCost::measure(&messages);
    verdicts(&runs, &path)
}

/// The rows: per mode the CPU target, the targets of a resume, of the live finish and of the replay rate, then each
/// run.
fn verdicts(runs: &[Run], path: &PathCost) -> Vec<Row> {
    let mut rows = Vec::new();
    for mode in Mode::ALL {
        let of: Vec<&Run> = runs.iter().filter(|r| r.mode == mode).collect();
        let worker = median(of.iter().map(|r| r.worker.cpu_per_event()).collect());
        let bare = median(of.iter().map(|r| r.bare.cpu_per_event()).collect());
        let limit = bare + 1.25 * path.total() + 0.5;
        let complete = of
            .iter()
            .all(|r| r.worker.received == r.expected && r.bare.received == r.expected);
        rows.push(Row::check(
            "P1j",
            format!("{}: worker CPU per event", mode.label()),
            format!(
                "median {worker:.2} µs against bare {bare:.2} µs + 1.25 x path {:.2} µs + 0.5 = {limit:.2} µs \
                 ({:.2}x the bare consumer; spread {:.2}–{:.2} µs)",
                path.total(),
                worker / bare,
                of.iter().map(|r| r.worker.cpu_per_event()).fold(f64::INFINITY, f64::min),
                of.iter().map(|r| r.worker.cpu_per_event()).fold(0.0, f64::max),
            ),
            "<= bare + 1.25 x path + 0.5 µs; every event received by both",
            worker <= limit && complete,
        ));
    }
    let resumes: f64 = runs.iter().map(|r| r.resumes).sum();
    rows.push(Row::check(
        "P1j",
        "consumer resumes (a stall ends in one)",
        format!("{resumes} in {} runs", runs.len()),
        "0",
        resumes == 0.0,
    ));
    // JetStream itself may store the messages after the publisher's end (file storage on a loaded machine): the
    // bare consumer's last message bounds how soon any consumer can be done, and the worker is judged against it.
    let live: Vec<&Run> = runs.iter().filter(|r| r.mode == Mode::Live).collect();
    let late = |r: &&Run| {
        r.worker
            .after_publisher
            .saturating_sub(r.bare.after_publisher)
    };
    let latest = live.iter().map(late).max().unwrap_or_default();
    rows.push(Row::check(
        "P1j",
        "live: worker done after the publisher's last message",
        format!(
            "at most {} ms after the later of the publisher's end and the bare consumer's last message (runs: {})",
            latest.as_millis(),
            live.iter()
                .map(|r| format!(
                    "{} ms after the publisher, bare {} ms",
                    r.worker.after_publisher.as_millis(),
                    r.bare.after_publisher.as_millis()
                ))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        "<= 1 s in every run",
        latest <= Duration::from_secs(1),
    ));
    let replays: Vec<&Run> = runs.iter().filter(|r| r.mode == Mode::Replay).collect();
    let ratio = median(
        replays
            .iter()
            .map(|r| r.worker.rate() / r.bare.rate())
            .collect(),
    );
    rows.push(Row::check(
        "P1j",
        "replay: worker rate against the bare consumer's",
        format!(
            "median {ratio:.2}x (worker {}/s, bare {}/s by the medians)",
            fmt_count(median(replays.iter().map(|r| r.worker.rate()).collect())),
            fmt_count(median(replays.iter().map(|r| r.bare.rate()).collect())),
        ),
        ">= 0.5x",
        ratio >= 0.5,
    ));
    rows.push(Row::info(
        "P1j",
        "the worker's per-event path, in-process",
        format!(
            "{:.2} µs: parse_subject {:.2} + decode_payload {:.2} + ThreadView::insert {:.2}; the rest of its CPU \
             above the bare consumer's is the source's loop, the cache's locks and metrics (docs/benchmark.md)",
            path.total(),
            path.parse,
            path.decode,
            path.insert
        ),
    ));
    rows.extend(runs.iter().enumerate().map(|(i, run)| {
        Row::info(
            "P1j",
            format!("run {} ({})", i + 1, run.mode.label()),
            run.describe(),
        )
    }));
    rows
}

/// The worker's settings: the JetStream source on the bench's stream, replaying `replay_secs`.
fn worker_env(replay_secs: &str) -> [(&'static str, &str); 3] {
    [
        ("HISTORY_VIEW_SOURCE", "jetstream"),
        ("HISTORY_VIEW_JETSTREAM_STREAMS", STREAM),
        ("HISTORY_VIEW_JETSTREAM_REPLAY_SECS", replay_secs),
    ]
}

/// Live or paced: a ready worker and a ready bare consumer, then the publisher.
async fn live(
    setup: &Setup,
    client: &async_nats::Client,
    messages: &Arc<[Message]>,
    mode: Mode,
    round: usize,
) -> Run {
    let expected = messages.len() as u64;
    let worker = setup
        .start_worker(&format!("bench_p1j_{round}_{mode:?}"), &worker_env("0"))
        .await;
    let mut bare = BareConsumer::start(setup, expected).await;
    let cpu_before = worker.cpu_time();
    let started = Instant::now();
    let started_wall = SystemTime::now();
    let rate = (mode == Mode::Paced).then_some(PACED_RATE);
    publish(client, messages, rate).await;
    let published = Instant::now();
    let published_wall = SystemTime::now();
    let finished = worker.wait_received(expected, POLL, STALL).await;
    let cpu = worker.cpu_time().saturating_sub(cpu_before);
    let scrape = worker.metrics().await;
    let bare = bare.report(Some((started_wall, published_wall))).await;
    worker.stop().await;
    Run {
        mode,
        expected,
        worker: Side {
            received: scrape.events_received(),
            cpu,
            elapsed: finished - started,
            after_publisher: finished.saturating_duration_since(published),
        },
        bare,
        resumes: scrape.sum("history_view_jetstream_resumes_total"),
    }
}

/// Replay: the stream prefilled, then a bare consumer and a worker started at once, each consuming it from its
/// start.
async fn replay(
    setup: &Setup,
    client: &async_nats::Client,
    messages: &Arc<[Message]>,
    round: usize,
) -> Run {
    let expected = messages.len() as u64;
    publish(client, messages, None).await;
    test_support::class_streams::wait_until_stored(
        &jetstream::new(client.clone()),
        STREAM,
        expected,
    )
    .await;
    let mut bare = BareConsumer::start(setup, expected).await;
    let started = Instant::now();
    // Answering /healthz, not waited ready: it is ready once its replay caught up.
    let worker = Worker::start_on(
        setup,
        test_support::process::free_port(),
        &format!("bench_p1j_{round}_replay"),
        &worker_env("3600"),
    )
    .await;
    let finished = worker.wait_received(expected, POLL, STALL).await;
    let cpu = worker.cpu_time();
    let scrape = worker.metrics().await;
    let bare = bare.report(None).await;
    worker.stop().await;
    Run {
        mode: Mode::Replay,
        expected,
        worker: Side {
            received: scrape.events_received(),
            cpu,
            elapsed: finished - started,
            after_publisher: Duration::ZERO,
        },
        bare,
        resumes: scrape.sum("history_view_jetstream_resumes_total"),
    }
}

/// Publishes every message, at `rate` per second if given, then flushes.
async fn publish(client: &async_nats::Client, messages: &[Message], rate: Option<f64>) {
    let started = Instant::now();
    for (i, message) in messages.iter().enumerate() {
        if let Some(rate) = rate {
            let due = started + Duration::from_secs_f64(i as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
        message.publish(client).await;
    }
    client.flush().await.expect("flush the publisher");
}

/// The bare consumer's process, started and ready (its consumer created and pulling).
struct BareConsumer {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl BareConsumer {
    async fn start(setup: &Setup, expected: u64) -> Self {
        let mut child =
            tokio::process::Command::new(std::env::current_exe().expect("the bench binary"))
                .env(
                    BARE_CONSUMER_ENV,
                    format!("{} {STREAM} {expected}", setup.nats_url()),
                )
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("the bare consumer starts");
        let lines = BufReader::new(child.stdout.take().expect("its stdout")).lines();
        let mut bare = Self { child, lines };
        assert_eq!(bare.line().await, "ready", "the bare consumer pulls");
        bare
    }

    async fn line(&mut self) -> String {
        self.lines
            .next_line()
            .await
            .expect("the bare consumer's output")
            .expect("a line from the bare consumer")
    }

    /// Its report; `publisher`: when the run's publisher started and ended (wall clock), `None` in a replay.
    async fn report(&mut self, publisher: Option<(SystemTime, SystemTime)>) -> Side {
        let report = self.line().await;
        self.child.wait().await.expect("the bare consumer exits");
        let fields: Vec<u128> = report
            .split_whitespace()
            .map(|f| f.parse().expect("a number"))
            .collect();
        let [received, ready_ns, last_ns, cpu_ns] = fields[..] else {
            panic!("the bare consumer reported {report:?}");
        };
        let at =
            |ns: u128| UNIX_EPOCH + Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX));
        let last = at(last_ns);
        let (from, after_publisher) = match publisher {
            Some((started, published)) => {
                (started, last.duration_since(published).unwrap_or_default())
            }
            // Replay: from its consumer's creation, and no publisher to finish after.
            None => (at(ready_ns), Duration::ZERO),
        };
        Side {
            received: received as u64,
            cpu: Duration::from_nanos(cpu_ns as u64),
            elapsed: last.duration_since(from).unwrap_or_default(),
            after_publisher,
        }
    }
}

/// The bare consumer (`spec`: the NATS URL, the stream, how many messages to expect): creates its consumer as the
/// worker does, starts pulling, prints `ready`, receives until every message came or none came for [`STALL`], then
/// prints `<received> <wall-clock ns when ready> <wall-clock ns of the last message> <CPU ns since ready>`.
pub fn bare_consumer_process(spec: &str) {
    let mut fields = spec.split(' ');
    let (Some(url), Some(stream), Some(expected)) = (fields.next(), fields.next(), fields.next())
    else {
        panic!("<NATS URL> <stream> <messages>, not {spec:?}");
    };
    let expected: u64 = expected.parse().expect("a message count");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        let client = async_nats::connect(url)
            .await
            .expect("the bare consumer connects");
        let context = jetstream::new(client);
        let stream = context
            .get_stream_no_info(stream)
            .await
            .expect("the stream");
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                deliver_policy: jetstream::consumer::DeliverPolicy::All,
                ack_policy: jetstream::consumer::AckPolicy::None,
                filter_subjects: vec![chat_history_view::config::DEFAULT_SUBJECT.into()],
                inactive_threshold: Duration::from_secs(60),
                memory_storage: true,
                ..Default::default()
            })
            .await
            .expect("the bare consumer's consumer");
        let mut messages = consumer
            .stream()
            .heartbeat(Duration::from_secs(2))
            .expires(Duration::from_secs(10))
            .messages()
            .await
            .expect("its pull stream");
        let cpu_ready = cpu_time("self");
        let ready = SystemTime::now();
        println!("ready");
        let mut received = 0u64;
        let mut last = None;
        while received < expected {
            match tokio::time::timeout(STALL, messages.next()).await {
                Ok(Some(Ok(message))) => {
                    let info = message.info().expect("a JetStream message");
                    std::hint::black_box((info.stream_sequence, info.pending));
                    received += 1;
                    last = Some(SystemTime::now());
                }
                _ => break,
            }
        }
        let cpu = cpu_time("self").saturating_sub(cpu_ready);
        let ns = |at: SystemTime| {
            at.duration_since(UNIX_EPOCH)
                .expect("after 1970")
                .as_nanos()
        };
        println!(
            "{received} {} {} {}",
            ns(ready),
            last.map_or(0, ns),
            cpu.as_nanos()
        );
    });
}
