//! P6: publish-to-visible latency (target: p99 <= 5 ms).
//!
//! A stored thread (a marker and 10 chunks on one display) is read once, so its view is hydrated and complete.
//! Then, 1000 times: one chunk with a unique text is published live, and the thread is read in a tight loop until
//! the body holds that text. The time from just before the publish to the read that shows it is the latency.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::data::{self, Conversation, Message};
use crate::report::{Row, fmt_duration, progress, quantile};
use crate::setup::Setup;

const ITERATIONS: usize = 1000;
const THREAD: &str = "p6-thread";
const SHAPE: Conversation = Conversation {
    turns: 1,
    events_per_turn: 11,
    displays: 1,
};
/// An event not visible after this long counts as lost.
const GIVE_UP: Duration = Duration::from_secs(2);

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let store = setup.store("bench_p6").await;
    store.insert(&SHAPE.rows(THREAD)).await;
    let worker = setup.start_worker("bench_p6", &[]).await;
    let first = worker.history(THREAD).await;
    assert_eq!(
        (first.status, first.source.as_str()),
        (200, "store"),
        "the first read hydrates"
    );
    worker.read_until_cached(THREAD).await;
    let publisher = setup.nats_client().await;
    let display = data::display(THREAD, 0, SHAPE.displays);

    let mut latencies = Vec::with_capacity(ITERATIONS);
    let mut reads = 0usize;
    let mut not_from_cache = 0usize;
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
        loop {
            let reply = worker.history(THREAD).await;
            reads += 1;
            if reply.source != "cache" {
                not_from_cache += 1;
            }
            if reply.contains(text.as_bytes()) {
                latencies.push(started.elapsed());
                break;
            }
            if started.elapsed() > GIVE_UP {
                lost += 1;
                break;
            }
        }
    }
    latencies.sort();
    let (p50, p99) = (quantile(&latencies, 0.5), quantile(&latencies, 0.99));
    progress(
        "P6",
        &format!(
            "p50 {}, p99 {}, max {}",
            fmt_duration(p50),
            fmt_duration(p99),
            fmt_duration(quantile(&latencies, 1.0))
        ),
    );
    vec![Row::check(
        "P6",
        "publish-to-visible latency (complete view)",
        format!(
            "p50 {}, p99 {} over {ITERATIONS} events ({:.1} reads/event{}{})",
            fmt_duration(p50),
            fmt_duration(p99),
            reads as f64 / ITERATIONS as f64,
            if lost > 0 {
                format!("; {lost} never visible")
            } else {
                String::new()
            },
            if not_from_cache > 0 {
                format!("; {not_from_cache} reads not from cache")
            } else {
                String::new()
            },
        ),
        "p99 <= 5 ms",
        lost == 0 && p99 <= Duration::from_millis(5),
    )]
}
