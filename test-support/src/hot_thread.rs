//! A hot thread and a probe, shared by the tests and the benchmark's P8: one thread's chunks are published (in
//! reverse `created_at` order, or in order for the baseline) at a set rate, while a probe chunk is published on
//! another thread, already complete in the worker, every 5 ms, and that thread is read until each probe shows.
//! The probes' publish-to-visible latencies measure how much the hot thread delays the others.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chat_history_view::http::SOURCE_HEADER;

use crate::rows::{self, Event};

/// How often a probe is published.
pub const PROBE_EVERY: Duration = Duration::from_millis(5);
/// How often the probe thread is read.
const READ_EVERY: Duration = Duration::from_millis(1);
/// A probe not visible this long after the hot thread's last publish counts as lost.
const GIVE_UP: Duration = Duration::from_secs(2);

/// The wall clock in nanoseconds since the Unix epoch.
fn wall_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_nanos()).unwrap_or(i64::MAX)
        })
}

/// A message as published: subject and payload.
pub type Published = (String, Bytes);

/// A chunk of `thread`'s answer on display `d1`, created at `created_at`, with `text`.
pub fn chunk(thread: &str, event_id: &str, created_at: i64, text: &str) -> Published {
    let row = chunk_row(thread, event_id, created_at, text);
    (rows::subject(&row), Bytes::from(rows::payload(&row)))
}

/// [`chunk`] as aihub's persister stores it.
fn chunk_row(thread: &str, event_id: &str, created_at: i64, text: &str) -> serde_json::Value {
    Event {
        agent: ("Hot", "a"),
        thread,
        display: "d1",
        run: "r1",
        event_id,
        name: "ChunkEvent",
        parents: rows::CHUNK,
        created_at,
    }
    .row(rows::chunk(text))
}

/// `n` chunks of `thread`, with falling `created_at` if `reverse` (each one sorts before every earlier one).
pub fn hot_chunks(thread: &str, n: usize, reverse: bool) -> Vec<Published> {
    (0..n)
        .map(|i| {
            let at = if reverse { n - i } else { i } as i64;
            chunk(thread, &format!("h{i}"), 1_000 + at, "x")
        })
        .collect()
}

/// Publishes `messages` at `rate` per second (as fast as the client goes with `None`) and flushes; returns the
/// time taken.
pub async fn publish_paced(
    client: &async_nats::Client,
    messages: &[Published],
    rate: Option<f64>,
) -> Duration {
    let started = Instant::now();
    let mut sent = 0;
    while sent < messages.len() {
        let due = rate.map_or(messages.len(), |rate| {
            ((started.elapsed().as_secs_f64() * rate) as usize + 1).min(messages.len())
        });
        for (subject, payload) in &messages[sent..due] {
            client
                .publish(subject.clone(), payload.clone())
                .await
                .expect("publish to NATS");
        }
        sent = due.max(sent);
        if sent < messages.len() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    client.flush().await.expect("flush to NATS");
    started.elapsed()
}

/// What the probe saw.
#[derive(Debug, Default)]
pub struct Probes {
    /// Publish-to-visible latency of every probe that showed, sorted.
    pub latencies: Vec<Duration>,
    /// Probes that never showed.
    pub lost: usize,
    /// Reads that did not come from memory.
    pub not_from_cache: usize,
}

impl Probes {
    pub fn sent(&self) -> usize {
        self.latencies.len() + self.lost
    }

    pub fn max(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }
}

/// Publishes a probe chunk on `thread` (served by the worker at `base_url`) every [`PROBE_EVERY`] until `done` is
/// set, and stores it in `events` right after, as aihub's persister would (a probe never stored would leave the
/// worker's view once the persister-lag bound passed: [design 2.1.8](../../docs/design.md#2.1.8)); reads the
/// thread every millisecond in between until each probe shows; then waits for the probes still missing.
pub async fn probe(
    client: &async_nats::Client,
    events: &mongodb::Collection<mongodb::bson::Document>,
    base_url: &str,
    thread: &str,
    first_created_at: i64,
    done: &AtomicBool,
) -> Probes {
    let http = reqwest::Client::new();
    let url = format!("{base_url}/v1/threads/{thread}/history");
    let mut sent: Vec<(String, Instant)> = Vec::new();
    let mut seen: Vec<Option<Duration>> = Vec::new();
    let mut not_from_cache = 0;
    let mut next = Instant::now();
    let mut stopped: Option<Instant> = None;
    loop {
        if stopped.is_none() && done.load(Ordering::Acquire) {
            stopped = Some(Instant::now());
        }
        if stopped.is_none() && Instant::now() >= next {
            let i = sent.len();
            let text = format!("<probe-{i}>");
            // Created as it is published, as aihub's events are (the shadow checks read `created_at` as the publish
            // time: a row stored after a read whose `created_at` is older than the bound is judged late), and after
            // the probes before it.
            let created_at = wall_ns().max(first_created_at + i as i64);
            let row = chunk_row(thread, &format!("p{i}"), created_at, &text);
            let at = Instant::now();
            client
                .publish(rows::subject(&row), Bytes::from(rows::payload(&row)))
                .await
                .expect("publish a probe");
            events
                .insert_one(rows::document(&row))
                .await
                .expect("store a probe");
            sent.push((text, at));
            seen.push(None);
            next += PROBE_EVERY;
        }
        let reply = http.get(&url).send().await.expect("read the probe thread");
        if reply
            .headers()
            .get(SOURCE_HEADER)
            .is_none_or(|source| source != "cache")
        {
            not_from_cache += 1;
        }
        let body = reply.text().await.expect("the probe thread's body");
        let read_at = Instant::now();
        for ((text, at), seen) in sent.iter().zip(seen.iter_mut()) {
            if seen.is_none() && body.contains(text.as_str()) {
                *seen = Some(read_at - *at);
            }
        }
        let missing = seen.iter().filter(|s| s.is_none()).count();
        if missing > 0 || stopped.is_none() {
            // Read every millisecond, not in a tight loop: on a small machine the reader would take CPU from the
            // worker it measures.
            tokio::time::sleep(READ_EVERY).await;
        }
        if let Some(stopped) = stopped
            && (missing == 0 || stopped.elapsed() > GIVE_UP)
        {
            let mut latencies: Vec<Duration> = seen.iter().flatten().copied().collect();
            latencies.sort();
            return Probes {
                latencies,
                lost: missing,
                not_from_cache,
            };
        }
    }
}
