//! P5: resident memory while 1M events over 100k threads stream in (target: <= cache budget + 64 MiB).
//!
//! The worker runs with a 64 MiB cache budget. Each thread gets 10 events (a marker and 9 chunks of about 100
//! bytes), thread after thread, published as fast as one publisher can, serialized on the fly. An OS thread
//! of the bench samples the worker's VmRSS every 100 ms during the stream and for 1 s after the worker has gone idle;
//! VmHWM (the kernel's exact peak) is the measured value. `/metrics` is scraped only at the end: a scrape runs the
//! cache's pending maintenance, and frequent scrapes would help the bound hold.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::data::{self, Message};
use crate::p5_breakdown::CHARGE_TOLERANCE;
use crate::report::{Row, fmt_count, fmt_duration, mib, progress};
use crate::setup::Setup;
use crate::worker::{self, Worker};

const BUDGET_MIB: u64 = 64;
pub const EVENTS_PER_THREAD: usize = 10;
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
const AFTER: Duration = Duration::from_secs(1);
/// The worker counts as idle once it uses less than this share of a core over [`IDLE_WINDOW`].
const IDLE_SHARE: f64 = 0.05;
const IDLE_WINDOW: Duration = Duration::from_millis(300);
const IDLE_DEADLINE: Duration = Duration::from_secs(120);

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let uri = setup.mongo_uri();
    let mut rows = tokio::task::spawn_blocking(move || crate::p5_breakdown::rows(&uri))
        .await
        .expect("P5's breakdown");
    rows.extend(run_process(setup).await);
    rows
}

async fn run_process(setup: Arc<Setup>) -> Vec<Row> {
    let n = setup.settings.events_p5;
    let threads = n.div_ceil(EVENTS_PER_THREAD);
    let budget = format!("{BUDGET_MIB}MiB");
    let worker = setup
        .start_worker("bench_p5", &[("HISTORY_VIEW_CACHE_MAX_BYTES", &budget)])
        .await;
    let idle = worker.memory();
    progress(
        "P5",
        &format!(
            "worker ready, RSS {:.1} MiB; streaming {n} events over {threads} threads",
            mib(idle.rss_kib)
        ),
    );

    let sampler = Sampler::start(worker.pid());
    let publisher = setup.nats_client().await;
    let started = Instant::now();
    for i in 0..n {
        message(i).publish(&publisher).await;
        if (i + 1) % 200_000 == 0 {
            progress("P5", &format!("published {}", i + 1));
        }
    }
    publisher.flush().await.expect("flush the publisher");
    let published_in = started.elapsed();
    progress(
        "P5",
        &format!(
            "published in {}; waiting for the worker to go idle",
            fmt_duration(published_in)
        ),
    );
    wait_idle(&worker).await;
    progress(
        "P5",
        &format!("idle after {}", fmt_duration(started.elapsed())),
    );
    tokio::time::sleep(AFTER).await;
    let max_sampled = sampler.stop();

    let memory = worker.memory();
    let scrape = worker.metrics().await;
    let received = scrape.events_received();
    let weighted = scrape.sample("history_view_cache_weighted_bytes");
    let entries = scrape.sample("history_view_cache_entries");
    let drops = scrape.drops();
    let disconnects = scrape.connection_events("disconnected");
    let limit_kib = (BUDGET_MIB + 64) * 1024;
    // Every thread holds its 10 events: the steady growth above idle per event held, against the payload's bytes
    // and against what the cache charged for them.
    let grown = (memory.rss_kib.saturating_sub(idle.rss_kib) * 1024) as f64;
    let held_events = entries * EVENTS_PER_THREAD as f64;
    let payload = payload_per_event(n.min(10_000));
    let over_charge = grown / weighted;
    vec![
        Row::check(
            "P5",
            "resident growth against the charge",
            format!(
                "{:.1} MiB above idle after the stream for {:.1} MiB charged = {over_charge:.2}x (at the peak {:.2}x); \
                 {:.0} B resident per event held, {:.2}x its {payload:.0} B published",
                grown / (1 << 20) as f64,
                weighted / (1 << 20) as f64,
                (memory.hwm_kib.saturating_sub(idle.rss_kib) * 1024) as f64 / weighted,
                grown / held_events,
                grown / held_events / payload
            ),
            format!("within {:.0}%", CHARGE_TOLERANCE * 100.0),
            (over_charge - 1.0).abs() <= CHARGE_TOLERANCE,
        ),
        Row::check(
            "P5",
            format!(
                "peak RSS, {} events over {} threads, 64 MiB budget",
                fmt_count(n as f64),
                fmt_count(threads as f64)
            ),
            format!(
                "VmHWM {:.1} MiB (max sampled VmRSS {:.1}, after {:.1}, at start {:.1})",
                mib(memory.hwm_kib),
                mib(max_sampled),
                mib(memory.rss_kib),
                mib(idle.rss_kib)
            ),
            format!("<= {} MiB (budget + 64 MiB)", BUDGET_MIB + 64),
            memory.hwm_kib <= limit_kib && received == n as u64,
        ),
        Row::info(
            "P5",
            "cache and intake at the end",
            format!(
                "weighted {:.1} MiB, {} entries; received {received}/{n}{}; slow-consumer events {drops}, \
                 disconnects {disconnects}; published in {}",
                weighted / (1 << 20) as f64,
                entries,
                if received < n as u64 {
                    format!(" (DROPPED {})", n as u64 - received)
                } else {
                    String::new()
                },
                fmt_duration(published_in)
            ),
        ),
    ]
}

/// The bytes of P5's first `n` events as published (subject + JSON payload), per event.
fn payload_per_event(n: usize) -> f64 {
    let bytes: usize = (0..n)
        .map(|i| {
            let message = message(i);
            message.subject.len() + message.payload.len()
        })
        .sum();
    bytes as f64 / n.max(1) as f64
}

/// P5's `i`th event: thread after thread, a marker and 9 chunks each.
pub fn message(i: usize) -> Message {
    let (t, seq) = (i / EVENTS_PER_THREAD, i % EVENTS_PER_THREAD);
    data::thread_event(&format!("p5-t{t:06}"), seq)
}

/// Waits until the worker's CPU use falls below [`IDLE_SHARE`] of a core (it has applied what it received).
async fn wait_idle(worker: &Worker) {
    let deadline = Instant::now() + IDLE_DEADLINE;
    let mut before = worker.cpu_time();
    while Instant::now() < deadline {
        tokio::time::sleep(IDLE_WINDOW).await;
        let now = worker.cpu_time();
        if now.saturating_sub(before).as_secs_f64() < IDLE_SHARE * IDLE_WINDOW.as_secs_f64() {
            return;
        }
        before = now;
    }
    progress("P5", "the worker did not go idle before the deadline");
}

/// Samples a process's VmRSS on its own OS thread, independent of the bench's async runtime.
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Sampler {
    fn start(pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut max_kib = 0;
            while !flag.load(Ordering::Relaxed) {
                max_kib = max_kib.max(worker::memory(pid).rss_kib);
                std::thread::sleep(SAMPLE_EVERY);
            }
            max_kib
        });
        Self { stop, thread }
    }

    /// Stops sampling; returns the largest VmRSS seen, in KiB.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the RSS sampler thread")
    }
}
