//! P11: the live feed ([design 3.2](../../docs/design.md#3.2)). (a) Publish-to-client latency over the feed, as P6
//! measures it for reads: a stored thread read from memory, its feed open; 500 times one chunk with a unique text
//! is published and the time until the feed's event holding it arrives is the latency (p50, p99; target p99 <=
//! 50 ms). The chunks come 20 ms apart, so each is the first change after a quiet period (changes within 5 ms of
//! the last event are coalesced and wait that long). (b) The cost of 1,000 open feeds on idle threads: 1,000 stored threads read from memory, then a feed
//! opened on each (each on its own connection, the connection cap raised for it); the worker's resident memory
//! before and after, and its CPU over 10 s with every feed open and nothing published, reported.

use std::sync::Arc;
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

use crate::data::{self, Conversation, Message};
use crate::report::{Row, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker::Worker;

const ITERATIONS: usize = 500;
const THREAD: &str = "p11-thread";
const IDLE_THREADS: usize = 1_000;
const SHAPE: Conversation = Conversation {
    turns: 1,
    events_per_turn: 11,
    displays: 1,
};
/// The pause between two chunks: longer than the feed's coalescing interval, so each chunk is sent at once.
const QUIET: Duration = Duration::from_millis(20);
/// An event not on the feed after this long counts as lost.
const GIVE_UP: Duration = Duration::from_secs(2);

type Events = BoxStream<'static, String>;

/// Opens the feed of `thread` on a connection of its own; its events' data as they come.
async fn open(worker: &Worker, thread: &str) -> Events {
    let http = reqwest::Client::new();
    let response = http
        .get(format!(
            "{}/v1/threads/{thread}/history/stream",
            worker.base_url()
        ))
        .send()
        .await
        .expect("the feed answers");
    assert_eq!(response.status(), 200, "the feed of {thread}");
    response
        .bytes_stream()
        .eventsource()
        .filter_map(|event| async move { event.ok().map(|e| e.data) })
        .boxed()
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let mut rows = latency(&setup).await;
    rows.extend(idle_feeds(&setup).await);
    rows
}

async fn latency(setup: &Setup) -> Vec<Row> {
    let store = setup.store("bench_p11").await;
    store.insert(&SHAPE.rows(THREAD)).await;
    let worker = setup.start_worker("bench_p11", &[]).await;
    worker.history(THREAD).await;
    worker.read_until_cached(THREAD).await;
    let publisher = setup.nats_client().await;
    let display = data::display(THREAD, 0, SHAPE.displays);
    let mut feed = open(&worker, THREAD).await;
    feed.next().await.expect("the snapshot");
    progress("P11", &format!("{ITERATIONS} chunks over one feed"));
    let mut latencies = Vec::with_capacity(ITERATIONS);
    let mut lost = 0usize;
    for i in 0..ITERATIONS {
        let text = format!("<live-{i}>");
        let message = Message::from_row(&data::chunk_with_text(
            THREAD,
            &display,
            SHAPE.events() + i,
            &text,
        ));
        let started = Instant::now();
        message.publish(&publisher).await;
        let arrived = tokio::time::timeout(GIVE_UP, async {
            while let Some(data) = feed.next().await {
                if data.contains(&text) {
                    return true;
                }
            }
            false
        })
        .await;
        match arrived {
            Ok(true) => latencies.push(started.elapsed()),
            _ => lost += 1,
        }
        // A quiet period: the next change is the first after it, sent at once (not coalesced).
        tokio::time::sleep(QUIET).await;
    }
    latencies.sort();
    let p99 = quantile(&latencies, 0.99);
    vec![Row::check(
        "P11",
        "publish-to-client latency over the live feed (one chunk every 20 ms)",
        format!(
            "p50 {}, p99 {}, {lost} of {ITERATIONS} lost",
            fmt_duration(quantile(&latencies, 0.5)),
            fmt_duration(p99)
        ),
        "p99 <= 50 ms, none lost",
        lost == 0 && p99 <= Duration::from_millis(50),
    )]
}

async fn idle_feeds(setup: &Setup) -> Vec<Row> {
    let store = setup.store("bench_p11_idle").await;
    let threads: Vec<String> = (0..IDLE_THREADS).map(|i| format!("p11-idle-{i}")).collect();
    let rows: Vec<_> = threads
        .iter()
        .flat_map(|thread| {
            Conversation {
                turns: 2,
                events_per_turn: 2,
                displays: 1,
            }
            .rows(thread)
        })
        .collect();
    store.insert(&rows).await;
    let worker = setup
        .start_worker(
            "bench_p11_idle",
            &[
                ("HISTORY_VIEW_HTTP_MAX_CONNECTIONS", "4096"),
                ("HISTORY_VIEW_HTTP_MAX_STREAMS", "2048"),
            ],
        )
        .await;
    for thread in &threads {
        worker.history(thread).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = worker.memory();
    progress("P11", &format!("opening {IDLE_THREADS} feeds"));
    let mut feeds = Vec::with_capacity(IDLE_THREADS);
    for thread in &threads {
        let mut feed = open(&worker, thread).await;
        feed.next().await.expect("the snapshot");
        feeds.push(feed);
    }
    let after = worker.memory();
    let cpu = worker.cpu_time();
    let idle = Duration::from_secs(10);
    tokio::time::sleep(idle).await;
    let cpu = worker.cpu_time().saturating_sub(cpu);
    let open = worker.metrics().await.sum("history_view_feed_streams");
    drop(feeds);
    let per_feed = (after.rss_kib.saturating_sub(before.rss_kib)) as f64 / IDLE_THREADS as f64;
    vec![Row::info(
        "P11",
        "1,000 open feeds on idle threads",
        format!(
            "{open:.0} open; resident {} KiB before, {} KiB after ({per_feed:.1} KiB per feed); worker CPU {:.2}% of a core while idle",
            before.rss_kib,
            after.rss_kib,
            cpu.as_secs_f64() / idle.as_secs_f64() * 100.0
        ),
    )]
}
