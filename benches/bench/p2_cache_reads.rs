//! P2: cache-hit reads of a 200-message thread (100 user and 100 assistant turns: markers and chunks alternating on
//! one display) by 32 concurrent clients, against a ceiling measured in the same run: the same HTTP stack answering
//! the same pre-serialized body without the cache ([`crate::p2_ceiling`]). Target: the worker's throughput at 32
//! clients >= 0.8x the ceiling's.
//!
//! The thread is stored, read once (hydrated from the store), then read by 32 tasks, each with its own HTTP
//! client and connection, as fast as they can: 1 s of warm-up, 5 s measured; worker and ceiling alternate, twice,
//! and the better round of each counts. The load generator runs on the same two cores as the server, so the
//! worker's CPU time per request is reported too; one client alone gives the latency without contention.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::data::Conversation;
use crate::p2_ceiling::Ceiling;
use crate::report::{Row, fmt_count, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker;

const CLIENTS: usize = 32;
const WARM_UP: Duration = Duration::from_secs(1);
const MEASURED: Duration = Duration::from_secs(5);
const THREAD: &str = "p2-thread";
/// The thread P2 reads (P9(d) reads it too).
pub const SHAPE: Conversation = Conversation {
    turns: 100,
    events_per_turn: 2,
    displays: 1,
};

/// The result of one load run.
struct Load {
    /// Latency of every request started in the measured window, sorted.
    latencies: Vec<Duration>,
    /// Answers that were not a 200 from the cache.
    unexpected: usize,
    worker_cpu: Duration,
    bench_cpu: Duration,
}

impl Load {
    fn rate(&self) -> f64 {
        self.latencies.len() as f64 / MEASURED.as_secs_f64()
    }

    fn summary(&self) -> String {
        format!(
            "p50 {}, p99 {}, {} req/s",
            fmt_duration(quantile(&self.latencies, 0.5)),
            fmt_duration(quantile(&self.latencies, 0.99)),
            fmt_count(self.rate())
        )
    }

    /// CPU per request of the worker and of the bench, and their share of the machine's cores.
    fn cpu_split(&self) -> String {
        let requests = self.latencies.len().max(1) as f64;
        let cores = MEASURED.as_secs_f64();
        format!(
            "worker {:.0} µs CPU/req ({:.2} cores), load generator {:.0} µs CPU/req ({:.2} cores)",
            self.worker_cpu.as_secs_f64() * 1e6 / requests,
            self.worker_cpu.as_secs_f64() / cores,
            self.bench_cpu.as_secs_f64() * 1e6 / requests,
            self.bench_cpu.as_secs_f64() / cores,
        )
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let store = setup.store("bench_p2").await;
    store.insert(&SHAPE.rows(THREAD)).await;
    // Shadow checks off for the comparison with the ceiling; two more workers sample 1% and every read.
    let worker = setup
        .start_worker("bench_p2", &[("HISTORY_VIEW_SHADOW_SAMPLE", "0")])
        .await;
    let first = worker.history(THREAD).await;
    assert_eq!(
        (first.status, first.source.as_str()),
        (200, "store"),
        "the first read hydrates from the store"
    );
    assert_eq!(
        first.message_count(),
        SHAPE.messages(),
        "the thread has 200 messages"
    );
    let body_bytes = first.body.len();
    worker.read_until_cached(THREAD).await;
    let mut sampled = Vec::new();
    for sample in ["0.01", "1"] {
        let shadowed = setup
            .start_worker("bench_p2", &[("HISTORY_VIEW_SHADOW_SAMPLE", sample)])
            .await;
        shadowed.history(THREAD).await;
        shadowed.read_until_cached(THREAD).await;
        sampled.push((sample, shadowed));
    }

    // An ETag of the worker's length: its value does not matter to the clients.
    let ceiling = Ceiling::start(
        &setup.mongo_uri(),
        first.body.clone(),
        "\"0123456789abcdef\"".to_owned(),
    );
    let worker_url = format!("{}/v1/threads/{THREAD}/history", worker.base_url());
    let ceiling_url = format!("{}/v1/threads/{THREAD}/history", ceiling.base_url);
    let worker_cpu = || worker.cpu_time();

    progress("P2", "1 client");
    let single = load(&worker_url, 1, &worker_cpu).await;
    let single_ceiling = load(&ceiling_url, 1, &|| Duration::ZERO).await;
    progress("P2", &format!("1 client: {}", single.summary()));
    let mut rounds = Vec::new();
    let mut shadow_rounds: Vec<Vec<Load>> = sampled.iter().map(|_| Vec::new()).collect();
    for round in 1..=2 {
        progress("P2", &format!("{CLIENTS} clients, round {round}"));
        for ((sample, shadowed), loads) in sampled.iter().zip(&mut shadow_rounds) {
            let url = format!("{}/v1/threads/{THREAD}/history", shadowed.base_url());
            let shadowed_load = load(&url, CLIENTS, &|| shadowed.cpu_time()).await;
            progress(
                "P2",
                &format!("sample {sample}: {}", shadowed_load.summary()),
            );
            loads.push(shadowed_load);
        }
        let worker_round = load(&worker_url, CLIENTS, &worker_cpu).await;
        let ceiling_round = load(&ceiling_url, CLIENTS, &|| Duration::ZERO).await;
        progress(
            "P2",
            &format!(
                "worker {}; ceiling {}",
                worker_round.summary(),
                ceiling_round.summary()
            ),
        );
        rounds.push((worker_round, ceiling_round));
    }
    drop(ceiling);
    let unexpected: usize = rounds
        .iter()
        .map(|(w, c)| w.unexpected + c.unexpected)
        .sum();
    let (mut workers, mut ceilings): (Vec<Load>, Vec<Load>) = rounds.into_iter().unzip();
    workers.sort_by(|a, b| b.rate().total_cmp(&a.rate()));
    ceilings.sort_by(|a, b| b.rate().total_cmp(&a.rate()));
    let (loaded, ceiling) = (&workers[0], &ceilings[0]);
    let ratio = loaded.rate() / ceiling.rate().max(1.0);
    // Each sampled worker's best round against the unsampled worker's best (rounds interleaved).
    let shadow_ratios: Vec<(&str, f64, f64)> = sampled
        .iter()
        .zip(&shadow_rounds)
        .map(|((sample, _), loads)| {
            let best = loads.iter().map(Load::rate).fold(0.0, f64::max);
            let requests: usize = loads.iter().map(|l| l.latencies.len()).sum();
            let cpu: Duration = loads.iter().map(|l| l.worker_cpu).sum();
            let cpu_per_request = cpu.as_secs_f64() * 1e6 / requests.max(1) as f64;
            (*sample, best / loaded.rate().max(1.0), cpu_per_request)
        })
        .collect();
    drop(sampled);
    let unsampled_cpu = workers
        .iter()
        .map(|l| l.worker_cpu.as_secs_f64() * 1e6 / l.latencies.len().max(1) as f64)
        .sum::<f64>()
        / workers.len() as f64;
    let at_one_percent = shadow_ratios.first().map_or(0.0, |(_, r, _)| *r);

    vec![
        Row::check(
            "P2",
            format!(
                "cache-hit read, 200 messages ({} KiB), {CLIENTS} clients, vs the HTTP ceiling",
                body_bytes / 1024
            ),
            format!(
                "worker {} = {ratio:.2}x the ceiling ({}); best of 2 rounds each{}",
                loaded.summary(),
                ceiling.summary(),
                if unexpected > 0 {
                    format!("; {unexpected} answers not 200/cache")
                } else {
                    String::new()
                }
            ),
            ">= 0.8x the ceiling",
            unexpected == 0 && ratio >= 0.8,
        ),
        Row::check(
            "P2",
            "shadow checks' cost on cache-hit reads (HISTORY_VIEW_SHADOW_SAMPLE vs 0)",
            shadow_ratios
                .iter()
                .map(|(sample, ratio, cpu)| {
                    format!("sample {sample}: {ratio:.2}x ({cpu:.0} µs CPU/req)")
                })
                .chain([format!("sample 0: {unsampled_cpu:.0} µs CPU/req")])
                .collect::<Vec<_>>()
                .join("; ")
                + "; best of 2 interleaved rounds each",
            ">= 0.95x at 0.01",
            at_one_percent >= 0.95,
        ),
        Row::info(
            "P2",
            "the other rounds",
            format!(
                "worker {}; ceiling {}",
                workers[1].summary(),
                ceilings[1].summary()
            ),
        ),
        Row::info(
            "P2",
            "CPU split at 32 clients (2 shared cores)",
            loaded.cpu_split(),
        ),
        Row::info(
            "P2",
            "closed loop: mean latency = clients / rate",
            format!(
                "{CLIENTS} / {}/s = {}: a p99 <= 1 ms needs well over {}k req/s",
                fmt_count(loaded.rate()),
                fmt_duration(Duration::from_secs_f64(
                    CLIENTS as f64 / loaded.rate().max(1.0)
                )),
                CLIENTS
            ),
        ),
        Row::info(
            "P2",
            "same read, 1 client",
            format!(
                "worker {}; ceiling {}",
                single.summary(),
                single_ceiling.summary()
            ),
        ),
    ]
}

/// `clients` tasks read `url` in a loop; requests started in the measured window are recorded. `server_cpu` is
/// the server's CPU time so far (zero for the in-process ceiling).
async fn load(url: &str, clients: usize, server_cpu: &(dyn Fn() -> Duration + Sync)) -> Load {
    let measure_from = Instant::now() + WARM_UP;
    let until = measure_from + MEASURED;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut latencies = Vec::new();
                let mut unexpected = 0;
                loop {
                    let started = Instant::now();
                    if started >= until {
                        break;
                    }
                    let reply = worker::get(&http, &url).await;
                    let latency = started.elapsed();
                    if started >= measure_from {
                        latencies.push(latency);
                        if reply.status != 200 || reply.source != "cache" {
                            unexpected += 1;
                        }
                    }
                }
                (latencies, unexpected)
            })
        })
        .collect();
    tokio::time::sleep_until(measure_from.into()).await;
    let (worker_cpu, bench_cpu) = (server_cpu(), worker::cpu_time("self"));
    tokio::time::sleep_until(until.into()).await;
    let (worker_cpu, bench_cpu) = (
        server_cpu().saturating_sub(worker_cpu),
        worker::cpu_time("self").saturating_sub(bench_cpu),
    );
    let mut result = Load {
        latencies: Vec::new(),
        unexpected: 0,
        worker_cpu,
        bench_cpu,
    };
    for task in tasks {
        let (latencies, unexpected) = task.await.expect("a load client task");
        result.latencies.extend(latencies);
        result.unexpected += unexpected;
    }
    result.latencies.sort();
    result
}
