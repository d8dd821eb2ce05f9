//! P10: paging a 10,000-message thread as Conversations items, in the same run and on the same worker ([design
//! 3.1](../../docs/design.md#3.1)). Target: once the thread's answer is rendered, a page costs a page, not the
//! thread: the first page (20 items, newest first) of the 10,000-message thread costs at most 1.5x the first page of
//! a 20-message thread (median latency and worker CPU per request), and far less than one whole-history read of it
//! (reported).
//!
//! The threads (5,000 turns, and 10 turns: a marker and a chunk each, one display) are stored, read once (hydrated)
//! and then from memory, and their items rendered once. Then, alternating, twice: the whole history read 30 times,
//! the first page of each thread read 300 times, and all 100 pages of 100 items walked with `after` three times.
//! Medians of the better round; the worker's CPU per request beside them. Every walk must yield the 10,000 items
//! once each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::data::Conversation;
use crate::report::{Row, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker::Worker;

const THREAD: &str = "p10-thread";
const SMALL: &str = "p10-small";
const SMALL_SHAPE: Conversation = Conversation {
    turns: 10,
    events_per_turn: 2,
    displays: 1,
};
const SHAPE: Conversation = Conversation {
    turns: 5_000,
    events_per_turn: 2,
    displays: 1,
};

/// Latencies (sorted) and the worker's CPU over them.
struct Series {
    latencies: Vec<Duration>,
    cpu: Duration,
}

impl Series {
    fn median(&self) -> Duration {
        quantile(&self.latencies, 0.5)
    }

    fn cpu_per_request(&self) -> Duration {
        self.cpu / u32::try_from(self.latencies.len().max(1)).unwrap_or(u32::MAX)
    }
}

async fn series(worker: &Worker, count: usize, path: &str) -> Series {
    let cpu = worker.cpu_time();
    let mut latencies = Vec::with_capacity(count);
    for _ in 0..count {
        let started = Instant::now();
        let reply = worker.get(path).await;
        latencies.push(started.elapsed());
        assert_eq!(reply.status, 200, "{path}");
        assert_eq!(reply.source, "cache", "{path}");
    }
    latencies.sort();
    Series {
        latencies,
        cpu: worker.cpu_time().saturating_sub(cpu),
    }
}

/// Walks every page of 100 items oldest first; returns the walk's time and the items seen.
async fn walk(worker: &Worker) -> (Duration, usize) {
    let started = Instant::now();
    let mut seen = 0;
    let mut after = String::new();
    loop {
        let reply = worker
            .get(&format!(
                "/v1/conversations/{THREAD}/items?order=asc&limit=100{after}"
            ))
            .await;
        assert_eq!(reply.status, 200);
        let page: serde_json::Value = serde_json::from_slice(&reply.body).expect("a JSON page");
        seen += page["data"].as_array().map_or(0, Vec::len);
        if page["has_more"] != true {
            return (started.elapsed(), seen);
        }
        after = format!("&after={}", page["last_id"].as_str().unwrap_or_default());
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let store = setup.store("bench_p10").await;
    store.insert(&SHAPE.rows(THREAD)).await;
    store.insert(&SMALL_SHAPE.rows(SMALL)).await;
    let worker = setup
        .start_worker(
            "bench_p10",
            &[
                ("HISTORY_VIEW_SHADOW_SAMPLE", "0"),
                // The local Mongo-wire server takes about 3 s for a 10k-event thread (P4).
                ("HISTORY_VIEW_STORE_TIMEOUT_MS", "30000"),
            ],
        )
        .await;
    worker.history(THREAD).await;
    let whole = worker.read_until_cached(THREAD).await;
    assert_eq!(whole.message_count(), SHAPE.messages());
    let history_path = format!("/v1/threads/{THREAD}/history");
    let page_path = format!("/v1/conversations/{THREAD}/items");
    let small_path = format!("/v1/conversations/{SMALL}/items");
    worker.history(SMALL).await;
    worker.read_until_cached(SMALL).await;
    // The items' first rendering.
    worker.get(&page_path).await;
    worker.get(&small_path).await;

    let mut best: Option<(Series, Series, Series, Duration)> = None;
    for round in 1..=2 {
        progress("P10", &format!("round {round}"));
        let history = series(&worker, 30, &history_path).await;
        let page = series(&worker, 300, &page_path).await;
        let small = series(&worker, 300, &small_path).await;
        let mut walks = Vec::new();
        for _ in 0..3 {
            let (took, seen) = walk(&worker).await;
            assert_eq!(seen, SHAPE.messages(), "a walk yields every item once");
            walks.push(took);
        }
        walks.sort();
        let walk_median = walks[1];
        progress(
            "P10",
            &format!(
                "whole history {} ({} CPU), first page {} ({} CPU), small thread's {} ({} CPU), walk of 100 pages {}",
                fmt_duration(history.median()),
                fmt_duration(history.cpu_per_request()),
                fmt_duration(page.median()),
                fmt_duration(page.cpu_per_request()),
                fmt_duration(small.median()),
                fmt_duration(small.cpu_per_request()),
                fmt_duration(walk_median)
            ),
        );
        let better = best
            .as_ref()
            .is_none_or(|(_, p, s, _)| ratio(&page, &small) < ratio(p, s));
        if better {
            best = Some((history, page, small, walk_median));
        }
    }
    let Some((history, page, small, walk_median)) = best else {
        return vec![Row::failed("P10", "no round ran")];
    };
    let cpu = |a: &Series, b: &Series| {
        a.cpu_per_request().as_secs_f64() / b.cpu_per_request().as_secs_f64().max(1e-9)
    };
    let (latency, cpu_ratio) = (ratio(&page, &small), cpu(&page, &small));
    vec![
        Row::check(
            "P10",
            "first page (20 items) of a 10,000-message thread vs of a 20-message thread, from memory",
            format!(
                "{} vs {} median ({latency:.2}x); worker CPU {} vs {} per request ({cpu_ratio:.2}x)",
                fmt_duration(page.median()),
                fmt_duration(small.median()),
                fmt_duration(page.cpu_per_request()),
                fmt_duration(small.cpu_per_request()),
            ),
            "<= 1.5x both",
            latency <= 1.5 && cpu_ratio <= 1.5,
        ),
        Row::info(
            "P10",
            "first page vs one whole-history read of the 10,000-message thread, from memory",
            format!(
                "{} vs {} median ({:.3}x); worker CPU {} vs {} per request ({:.3}x); {} bytes of history",
                fmt_duration(page.median()),
                fmt_duration(history.median()),
                ratio(&page, &history),
                fmt_duration(page.cpu_per_request()),
                fmt_duration(history.cpu_per_request()),
                cpu(&page, &history),
                whole.body.len()
            ),
        ),
        Row::info(
            "P10",
            "walk of all 100 pages of 100 items vs one whole-history read",
            format!(
                "{} vs {} ({:.1}x)",
                fmt_duration(walk_median),
                fmt_duration(history.median()),
                walk_median.as_secs_f64() / history.median().as_secs_f64().max(1e-9)
            ),
        ),
    ]
}

fn ratio(a: &Series, b: &Series) -> f64 {
    a.median().as_secs_f64() / b.median().as_secs_f64().max(1e-9)
}
