//! P8: one hot thread in reverse `created_at` order must neither drop events nor delay other threads (targets: no
//! drop, probe publish-to-visible p99 <= 50 ms, reverse order ingested at >= 0.5x the in-order rate).
//!
//! Three fresh workers with default settings (the default subscription capacity), each fed 100k chunks of one
//! thread:
//! 1. in `created_at` order, as fast as the publisher goes: the in-order rate (events over the time from the first
//!    publish to the scrape showing all of them);
//! 2. in reverse order, as fast as the publisher goes: the reverse-order rate, the same way;
//! 3. in reverse order, paced at half the in-order rate (for at least 3 s: more than 100k events on a host whose
//!    in-order rate passes 67k/s), while a probe chunk is published every 5 ms on another
//!    thread (complete in the worker) and that thread is read until each probe shows: the probes' latencies, and
//!    whether the hot thread kept up (the time from its last publish to the scrape showing all of it).
//!
//! Before the view kept its events in arrival order, 100k reverse chunks ingested at ~2k/s, dropped thousands
//! of events and delayed other threads by seconds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::data;
use crate::report::{Row, fmt_count, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker::Worker;
use test_support::hot_thread::{self, Published};

const EVENTS: usize = 100_000;
const PROBE_THREAD: &str = "p8-probe";
/// How often the worker's counters are scraped while it ingests.
const POLL: Duration = Duration::from_millis(10);
/// A worker that receives nothing for this long has lost the missing events.
const STALL: Duration = Duration::from_secs(3);
/// The paced hot thread streams at least this long (more than [`EVENTS`] on a fast host), so that the probes reach
/// their count (>= 200, one every 5 ms) whatever the in-order rate.
const PACED_FOR: Duration = Duration::from_secs(3);

/// How one worker took one thread's events.
struct Ingested {
    /// Events per second from the first publish to the scrape showing all of them (or the last progress).
    rate: f64,
    /// Events received (every event the worker read, probes included).
    received: u64,
    drops: u64,
    /// From the end of publishing to the scrape showing every event.
    tail: Duration,
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let publisher = setup.nats_client().await;

    let worker = setup.start_worker("bench_p8_in_order", &[]).await;
    let in_order = hot_thread::hot_chunks("p8-in-order", EVENTS, false);
    let ordered = ingest(&worker, &publisher, &in_order, None).await;
    drop(worker);
    progress("P8", &format!("in order: {}/s", fmt_count(ordered.rate)));

    let worker = setup.start_worker("bench_p8_reverse", &[]).await;
    let reverse = hot_thread::hot_chunks("p8-reverse", EVENTS, true);
    let reversed = ingest(&worker, &publisher, &reverse, None).await;
    drop(worker);
    progress(
        "P8",
        &format!("reverse order: {}/s", fmt_count(reversed.rate)),
    );

    let store = setup.store("bench_p8").await;
    let marker = data::marker(PROBE_THREAD, "d1", 0);
    let first_probe_at = marker["event_data"]["created_at"]
        .as_i64()
        .expect("created_at")
        + 1;
    store.insert(&[marker]).await;
    let worker = setup.start_worker("bench_p8", &[]).await;
    worker.read_until_cached(PROBE_THREAD).await;
    let paced_rate = ordered.rate / 2.0;
    let paced_events = EVENTS.max((paced_rate * PACED_FOR.as_secs_f64()) as usize);
    let hot = hot_thread::hot_chunks("p8-hot", paced_events, true);
    let done = AtomicBool::new(false);
    let started = Instant::now();
    let feeding = async {
        let published = hot_thread::publish_paced(&publisher, &hot, Some(paced_rate)).await;
        done.store(true, Ordering::Release);
        published
    };
    let events = store.events();
    let probing = hot_thread::probe(
        &publisher,
        &events,
        worker.base_url(),
        PROBE_THREAD,
        first_probe_at,
        &done,
    );
    let (published, probes) = tokio::join!(feeding, probing);
    // The probes are events too: the hot thread is all in once the worker holds both.
    let paced = wait_received(&worker, paced_events + probes.sent(), started, published).await;
    let drops = paced.drops;
    drop(worker);
    let p99 = quantile(&probes.latencies, 0.99);
    progress(
        "P8",
        &format!(
            "paced at {}/s: probe p99 {}, max {}",
            fmt_count(paced_rate),
            fmt_duration(p99),
            fmt_duration(probes.max())
        ),
    );

    let ratio = reversed.rate / ordered.rate;
    vec![
        Row::check(
            "P8",
            format!(
                "hot thread, {}k events in reverse order, vs in order",
                EVENTS / 1000
            ),
            format!(
                "reverse {}/s = {ratio:.2}x in order ({}/s); received {}/{EVENTS} and {}/{EVENTS}, drops {} and {}",
                fmt_count(reversed.rate),
                fmt_count(ordered.rate),
                reversed.received,
                ordered.received,
                reversed.drops,
                ordered.drops,
            ),
            ">= 0.5x in order; no drop",
            ratio >= 0.5 && reversed.drops == 0 && reversed.received == EVENTS as u64,
        ),
        Row::check(
            "P8",
            "probes on another thread while the hot one streams in reverse",
            format!(
                "p50 {}, p99 {}, max {} over {} probes every {} ms{}{}; hot thread of {} events paced at {}/s, \
                 all of it in {} after its last publish; drops {drops}",
                fmt_duration(quantile(&probes.latencies, 0.5)),
                fmt_duration(p99),
                fmt_duration(probes.max()),
                probes.sent(),
                hot_thread::PROBE_EVERY.as_millis(),
                if probes.lost > 0 {
                    format!(", {} never visible", probes.lost)
                } else {
                    String::new()
                },
                if probes.not_from_cache > 0 {
                    format!(", {} reads not from cache", probes.not_from_cache)
                } else {
                    String::new()
                },
                paced_events,
                fmt_count(paced_rate),
                fmt_duration(paced.tail),
            ),
            "p99 <= 50 ms; >= 200 probes; no drop",
            p99 <= Duration::from_millis(50)
                && probes.lost == 0
                && probes.sent() >= 200
                && drops == 0
                && paced.received == (paced_events + probes.sent()) as u64,
        ),
    ]
}

/// Publishes `messages` to `worker` (at `rate`, or as fast as the publisher goes) and waits until the worker has
/// received all of them.
async fn ingest(
    worker: &Worker,
    publisher: &async_nats::Client,
    messages: &[Published],
    rate: Option<f64>,
) -> Ingested {
    let started = Instant::now();
    let published = hot_thread::publish_paced(publisher, messages, rate).await;
    wait_received(worker, messages.len(), started, published).await
}

/// Waits until `worker` has received `expected` events (or stalls); the rate counts from `started`, the tail from
/// `published` after it.
async fn wait_received(
    worker: &Worker,
    expected: usize,
    started: Instant,
    published: Duration,
) -> Ingested {
    let finished = worker.wait_received(expected as u64, POLL, STALL).await;
    let scrape = worker.metrics().await;
    let elapsed = finished - started;
    Ingested {
        rate: scrape.events_received() as f64 / elapsed.as_secs_f64().max(1e-9),
        received: scrape.events_received(),
        drops: scrape.drops(),
        tail: elapsed.saturating_sub(published),
    }
}
