//! P1: live ingest throughput of the worker against a bare async-nats subscriber receiving the same messages
//! (target: >= 0.9 of bare and >= 100k events/s), the CPU cost of the worker's per-event path in-process, and what
//! tracing costs the worker per event, paired (target: at most 3% more CPU per event with tracing on).
//!
//! The same pre-serialized messages (a marker then chunks, round-robin over the threads, as concurrent
//! conversations stream), each with the `traceparent` header aihub's publisher sends (a fresh random trace and span
//! id per message, flags `01`), are published as fast as one publisher can, first to a bare subscriber (a process of
//! its own, counting messages, timed from the first publish to the last message received), then to a fresh worker
//! with tracing off (no endpoint) and one with tracing on (the default sampler, exporting to an OTLP sink in the
//! bench, [`crate::otlp_sink`]), each timed from the first publish to the scrape of `/metrics` that shows every
//! message received. The two workers of a round run back to back, the first of them alternating by round, so that
//! a slow drift of the shared machine weighs on both alike and cancels in their ratio. Six rounds
//! (`BENCH_ROUNDS_P1`); `BENCH_P1=tracing-off` or `tracing-on` runs one side only.
//!
//! The throughput and CPU targets take the worker with tracing off (the default), or the one side run: each side's
//! best rate among the rounds without dropped messages counts (the machine is shared, so the best round is the one
//! least disturbed), and every round is shown. Tracing's cost is the median over the rounds of each round's on/off
//! ratio of CPU per event, shown beside the off runs' round-to-round spread, the noise it is judged against.

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
use crate::otlp_sink::{Exported, OtlpSink};
use crate::report::{self, Row, fmt_count, progress};
use crate::setup::Setup;

const THREADS: usize = 1000;
/// `HISTORY_VIEW_SHADOW_SAMPLE` of the workers, by round (cycled): the checks sample reads only, so ingest should
/// not notice them; the rounds show it side by side.
const SAMPLES: [&str; 3] = ["0", "0.01", "1"];
/// How often the worker's event counter is scraped; its finishing time is known to within this (plus a scrape).
const POLL: Duration = Duration::from_millis(20);
/// A side that receives nothing for this long has lost the missing messages (a slow consumer drop).
const STALL: Duration = Duration::from_secs(3);
/// The most CPU per event tracing on (the default sampler) may add to tracing off.
const TRACING_BUDGET: f64 = 1.03;
/// The median of n normal samples varies about this (√(π/2)) times their standard deviation over √n.
const MEDIAN_SPREAD: f64 = 1.2533;

/// The OTEL_* variables P1 sets on every worker, tracing off or on.
const WORKER_TRACING_ENV: [&str; 4] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SDK_DISABLED",
];

/// The worker's tracing in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tracing {
    /// No OTLP endpoint: no exporter, no span.
    Off,
    /// An endpoint (the bench's sink) and the default sampler.
    On,
}

impl Tracing {
    const BOTH: [Tracing; 2] = [Tracing::Off, Tracing::On];

    /// Its name in `BENCH_P1`.
    fn key(self) -> &'static str {
        match self {
            Tracing::Off => "tracing-off",
            Tracing::On => "tracing-on",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Tracing::Off => "off",
            Tracing::On => "on",
        }
    }
}

/// The sides `BENCH_P1` selects (`tracing-off`, `tracing-on`, comma-separated), both when it is unset.
fn selected_sides() -> Vec<Tracing> {
    let only = std::env::var("BENCH_P1").ok();
    let sides: Vec<Tracing> = Tracing::BOTH
        .into_iter()
        .filter(|side| {
            only.as_ref()
                .is_none_or(|only| only.split(',').any(|o| o.trim() == side.key()))
        })
        .collect();
    assert!(
        !sides.is_empty(),
        "BENCH_P1={:?} selects no run: name tracing-off, tracing-on or both",
        only.unwrap_or_default()
    );
    sides
}

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
        report::rate(self.received, self.elapsed)
    }
}

/// One worker run of a round.
struct WorkerRun {
    tracing: Tracing,
    ingested: Ingested,
    /// How fast the publisher went while feeding the worker.
    publish_rate: f64,
    /// CPU time the worker process used in the run (every thread: NATS client, ingest, HTTP, cache upkeep,
    /// exporter).
    cpu: Duration,
    /// With tracing on: what the sink received from the worker by the time its CPU was read, and by its exit
    /// (the exporter sends what it still holds when the worker stops).
    exported: Option<(Exported, Exported)>,
}

impl WorkerRun {
    fn cpu_per_event(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.ingested.received.max(1) as f64
    }
}

/// One round: the bare subscriber, then the worker runs, on the same messages.
struct Round {
    /// The workers' `HISTORY_VIEW_SHADOW_SAMPLE`.
    sample: &'static str,
    bare: Ingested,
    /// CPU time the bare subscriber's process used receiving the round's messages.
    bare_cpu: Duration,
    /// The round's worker runs, in the order they ran.
    workers: Vec<WorkerRun>,
}

impl Round {
    fn worker(&self, tracing: Tracing) -> Option<&WorkerRun> {
        self.workers.iter().find(|run| run.tracing == tracing)
    }

    /// The worker with `tracing`'s rate over the bare subscriber's.
    fn ratio(&self, tracing: Tracing) -> f64 {
        self.worker(tracing)
            .map_or(0.0, |run| run.ingested.rate() / self.bare.rate())
    }

    /// CPU per event with tracing on over off, when the round ran both.
    fn tracing_cpu_ratio(&self) -> Option<f64> {
        let (off, on) = (self.worker(Tracing::Off)?, self.worker(Tracing::On)?);
        Some(on.cpu_per_event() / off.cpu_per_event())
    }

    fn bare_cpu_per_event(&self) -> f64 {
        self.bare_cpu.as_secs_f64() * 1e6 / self.bare.received.max(1) as f64
    }

    fn complete(&self, n: usize) -> bool {
        self.bare.received == n as u64
            && self
                .workers
                .iter()
                .all(|run| run.ingested.received == n as u64)
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
        let workers: Vec<String> = self
            .workers
            .iter()
            .map(|run| {
                let exported = match run.exported {
                    Some((measured, total)) => format!(
                        ", exported {} requests / {:.0} KiB by then ({} / {:.0} KiB by its exit)",
                        measured.requests,
                        measured.bytes as f64 / 1024.0,
                        total.requests,
                        total.bytes as f64 / 1024.0
                    ),
                    None => String::new(),
                };
                format!(
                    "worker tracing {} {}/s{} = {:.2}x, CPU {:.2} µs/event, publisher {}/s{exported}",
                    run.tracing.label(),
                    fmt_count(run.ingested.rate()),
                    dropped(&run.ingested),
                    run.ingested.rate() / self.bare.rate(),
                    run.cpu_per_event(),
                    fmt_count(run.publish_rate)
                )
            })
            .collect();
        let pair = self
            .tracing_cpu_ratio()
            .map_or(String::new(), |ratio| format!("; CPU on/off {ratio:.3}x"));
        format!(
            "shadow sample {}: bare {}/s{}, CPU {:.2} µs/event; {}{pair}",
            self.sample,
            fmt_count(self.bare.rate()),
            dropped(&self.bare),
            self.bare_cpu_per_event(),
            workers.join("; ")
        )
    }
}

/// The median of `values` (the upper one of an even count); 0 when empty.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The standard deviation of `values` over their mean (0 for fewer than two).
fn relative_spread(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let variance =
        values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (values.len() - 1) as f64;
    variance.sqrt() / mean
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let n = setup.settings.events_p1;
    let rounds_wanted = setup.settings.rounds_p1;
    let sides = selected_sides();
    // The bench's own OTEL_* variables reach the workers (only HISTORY_VIEW_* ones are scrubbed). P1 sets those
    // it can to what it measures ([`WORKER_TRACING_ENV`]); any other (a sampler, which the worker refuses empty, or
    // the exporter's batching) would change what is measured.
    let foreign: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| name.starts_with("OTEL_") && !WORKER_TRACING_ENV.contains(&name.as_str()))
        .collect();
    assert!(
        foreign.is_empty(),
        "{foreign:?} set in the bench's environment would reach P1's workers: P1 measures the worker's default \
         tracing; unset them"
    );
    let threads = THREADS.min(n).max(1);
    progress(
        "P1",
        &format!(
            "serializing {n} events over {threads} threads, a traceparent on each; {rounds_wanted} rounds, \
             workers with tracing {}",
            sides
                .iter()
                .map(|side| side.label())
                .collect::<Vec<_>>()
                .join(" and ")
        ),
    );
    let messages = traced_messages(n);
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
    let sink = OtlpSink::start().await;

    let mut rounds = Vec::new();
    for number in 1..=rounds_wanted {
        let (bare, bare_cpu) = bare_subscriber(&setup, &messages).await;
        let sample = SAMPLES[(number - 1) % SAMPLES.len()];
        // The first side alternates, so neither always runs on a machine the other has just warmed or loaded.
        let mut order = sides.clone();
        if number % 2 == 0 {
            order.reverse();
        }
        let mut workers = Vec::new();
        for tracing in order {
            let database = format!("bench_p1_{number}_{}", tracing.label());
            workers.push(worker_ingest(&setup, &messages, &database, sample, tracing, &sink).await);
        }
        let round = Round {
            sample,
            bare,
            bare_cpu,
            workers,
        };
        progress("P1", &format!("round {number}: {}", round.describe(n)));
        rounds.push(round);
    }

    progress(
        "P1",
        "in-process pipeline: parse_subject + decode_payload + ThreadView::insert",
    );
    let path = PathCost::measure(&messages);

    // The targets' worker: tracing off, the default, unless only the other side ran.
    let main = sides[0];
    // Each side's best round is its capability with the least interference from the rest of the machine.
    let complete: Vec<&Round> = rounds.iter().filter(|r| r.complete(n)).collect();
    let bare = complete.iter().map(|r| r.bare.rate()).fold(0.0, f64::max);
    let worker = complete
        .iter()
        .filter_map(|r| r.worker(main))
        .map(|run| run.ingested.rate())
        .fold(0.0, f64::max);
    let ratio = median(rounds.iter().map(|r| r.ratio(main)).collect());
    let dropped = rounds.len() - complete.len();
    let verdict = Row::check(
        "P1",
        "live ingest vs bare async-nats subscriber",
        format!(
            "worker with tracing {}: median per-round ratio {ratio:.2}x; {dropped} of {} rounds dropped messages; \
             best rounds: worker {}/s, bare {}/s",
            main.label(),
            rounds.len(),
            fmt_count(worker),
            fmt_count(bare),
        ),
        ">= 0.9x bare by the per-round median; drops in no round; >= 100k/s",
        ratio >= 0.9 && dropped == 0 && worker >= 100_000.0,
    );
    // Nothing but the client and the path should cost the worker CPU: the bare subscriber's CPU per event (the
    // client) plus the in-process path, with a quarter of headroom on the path.
    let cpu_of = |side: Tracing| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| r.worker(side))
            .map(WorkerRun::cpu_per_event)
            .collect()
    };
    let worker_cpu = median(cpu_of(main));
    let bare_cpu = median(rounds.iter().map(Round::bare_cpu_per_event).collect());
    let limit = bare_cpu + 1.25 * path.total();
    let cpu_verdict = Row::check(
        "P1",
        "worker CPU per event (from the OS, per process)",
        format!(
            "tracing {}: median {worker_cpu:.2} µs against bare {bare_cpu:.2} µs + 1.25 x path {:.2} µs = \
             {limit:.2} µs (excess {:.2} µs)",
            main.label(),
            path.total(),
            worker_cpu - bare_cpu - path.total(),
        ),
        "<= bare + 1.25 x the in-process path",
        worker_cpu <= limit,
    );
    let mut rows = vec![verdict, cpu_verdict];
    rows.extend(tracing_rows(&rounds));
    rows.push(Row::info(
        "P1",
        "by HISTORY_VIEW_SHADOW_SAMPLE (reads only: ingest unaffected)",
        SAMPLES
            .iter()
            .map(|sample| {
                let mut of: Vec<f64> = rounds
                    .iter()
                    .filter(|r| r.sample == *sample && r.complete(n))
                    .map(|r| r.ratio(main))
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
            "first publish to the /metrics scrape showing all {n} (an upper bound: scraped every {} ms); its CPU \
             read then",
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

/// Tracing's cost, when the rounds ran both sides: the median of the rounds' on/off ratios of CPU per event against
/// the budget, the noise it is judged against, and throughput both ways.
fn tracing_rows(rounds: &[Round]) -> Vec<Row> {
    let ratios: Vec<f64> = rounds.iter().filter_map(Round::tracing_cpu_ratio).collect();
    if ratios.is_empty() {
        return Vec::new();
    }
    let side = |tracing: Tracing, of: fn(&WorkerRun) -> f64| -> Vec<f64> {
        rounds
            .iter()
            .filter_map(|r| r.worker(tracing))
            .map(of)
            .collect()
    };
    let (off_cpu, on_cpu) = (
        side(Tracing::Off, WorkerRun::cpu_per_event),
        side(Tracing::On, WorkerRun::cpu_per_event),
    );
    let rate = |run: &WorkerRun| run.ingested.rate();
    let (off_rate, on_rate) = (side(Tracing::Off, rate), side(Tracing::On, rate));
    let cost = median(ratios.clone());
    // The noise the median ratio is judged against (docs/benchmark.md, "P1: tracing off and on"): from the off runs
    // alone, as if pairing took nothing away (a ratio of two runs then varies √2 times as much as one run), and from
    // the paired ratios themselves, which shows what the pairing took away. The median of n values varies about
    // MEDIAN_SPREAD / √n times as much as one.
    let spread = relative_spread(&off_cpu);
    let ratio_spread = relative_spread(&ratios);
    let of_median = MEDIAN_SPREAD / (ratios.len() as f64).sqrt();
    let min_max = |values: &[f64]| {
        values.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| {
            (lo.min(*v), hi.max(*v))
        })
    };
    let (low, high) = min_max(&ratios);
    let (off_low, off_high) = min_max(&off_cpu);
    vec![
        Row::check(
            "P1",
            "tracing on (default sampler) vs off: worker CPU per event",
            format!(
                "median of {} paired rounds {cost:.3}x (rounds {low:.3}x to {high:.3}x); medians on {:.2} µs, off \
                 {:.2} µs",
                ratios.len(),
                median(on_cpu),
                median(off_cpu.clone()),
            ),
            format!("<= {TRACING_BUDGET:.2}x, against the off runs' spread (next row)"),
            cost <= TRACING_BUDGET,
        ),
        Row::info(
            "P1",
            "tracing off: round-to-round spread of worker CPU per event",
            format!(
                "off runs {off_low:.2} to {off_high:.2} µs, standard deviation {:.1}% of their mean: the median ratio \
                 ±{:.1}% unpaired ({MEDIAN_SPREAD:.2} x √2 x {:.1}% / √{n}); the paired ratios' deviation {:.1}%: \
                 ±{:.1}% paired",
                spread * 100.0,
                of_median * std::f64::consts::SQRT_2 * spread * 100.0,
                spread * 100.0,
                ratio_spread * 100.0,
                of_median * ratio_spread * 100.0,
                n = ratios.len(),
            ),
        ),
        Row::info(
            "P1",
            "tracing on vs off: worker throughput",
            format!(
                "medians on {}/s, off {}/s; per-round on/off rate ratio median {:.2}x",
                fmt_count(median(on_rate)),
                fmt_count(median(off_rate)),
                median(
                    rounds
                        .iter()
                        .filter_map(|r| Some(
                            r.worker(Tracing::On)?.ingested.rate()
                                / r.worker(Tracing::Off)?.ingested.rate()
                        ))
                        .collect()
                ),
            ),
        ),
    ]
}

/// P1's `n` messages over its threads, without headers (P12 publishes them into a class stream).
pub fn messages(n: usize) -> Arc<[Message]> {
    live_messages(n, THREADS.min(n).max(1)).into()
}

/// P1's `n` messages, each with the `traceparent` aihub's publisher sends (P9d publishes them too).
pub fn traced_messages(n: usize) -> Arc<[Message]> {
    live_messages(n, THREADS.min(n).max(1))
        .into_iter()
        .map(Message::with_traceparent)
        .collect()
}

/// `n` messages, round-robin over `threads` threads: each thread's first event is its marker, the rest chunks.
fn live_messages(n: usize, threads: usize) -> Vec<Message> {
    (0..n)
        .map(|i| {
            let (t, seq) = (i % threads, i / threads);
            data::thread_event(&format!("p1-t{t:05}"), seq)
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

/// Phase B: the same publish to a fresh worker with `tracing`, finished when its events counter (every outcome)
/// reaches `n`. With tracing on the worker exports to `sink`; it is stopped with SIGTERM afterwards, so that its
/// exporter sends what it still holds.
async fn worker_ingest(
    setup: &Setup,
    messages: &Arc<[Message]>,
    database: &str,
    sample: &str,
    tracing: Tracing,
    sink: &OtlpSink,
) -> WorkerRun {
    // WORKER_TRACING_ENV, set either way, so that none of the bench's own variables decides: an empty endpoint is
    // tracing off, an empty ratio the default sampler's (parent-based, 1% of roots).
    let endpoint = match tracing {
        Tracing::Off => "",
        Tracing::On => sink.endpoint(),
    };
    let values = [endpoint, "", "", "false"];
    let mut env = vec![("HISTORY_VIEW_SHADOW_SAMPLE", sample)];
    env.extend(WORKER_TRACING_ENV.into_iter().zip(values));
    let worker = setup.start_worker(database, &env).await;
    let expected = messages.len() as u64;
    let publisher = setup.nats_client().await;
    let exported_before = sink.received();
    let cpu_before = worker.cpu_time();
    let started = Instant::now();
    let publishing = tokio::spawn(publish_all(publisher, Arc::clone(messages)));
    let finished = worker.wait_received(expected, POLL, STALL).await;
    let published_in = publishing.await.expect("the publisher task");
    let cpu = worker.cpu_time().saturating_sub(cpu_before);
    let exported_measured = sink.received().since(exported_before);
    let scrape = worker.metrics().await;
    worker.stop().await;
    let ingested = Ingested {
        received: scrape.events_received(),
        elapsed: finished - started,
        drops: scrape.drops(),
    };
    WorkerRun {
        tracing,
        ingested,
        publish_rate: messages.len() as f64 / published_in.as_secs_f64(),
        cpu,
        exported: (tracing == Tracing::On)
            .then(|| (exported_measured, sink.received().since(exported_before))),
    }
}

/// The worker's per-event CPU work without NATS or the cache, in µs per event, step by step: subject → key,
/// payload → event, insert into the thread's view. Each step is the difference of two cumulative passes, best of
/// three. P1j takes it as the worker's own work per event too.
pub struct PathCost {
    pub parse: f64,
    pub decode: f64,
    pub insert: f64,
}

impl PathCost {
    pub fn measure(messages: &[Message]) -> Self {
        let parse = best_of_three(messages, parse_pass);
        let decode = best_of_three(messages, decode_pass);
        let insert = best_of_three(messages, insert_pass);
        Self {
            parse,
            decode: decode - parse,
            insert: insert - decode,
        }
    }

    pub fn total(&self) -> f64 {
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
