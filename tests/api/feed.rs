//! The live feed (`history/stream`) through the binary with a real SSE client (eventsource-stream over reqwest):
//! live events arrive as updates and the client's transcript equals a read; a resume with `Last-Event-ID` while
//! events keep arriving misses and doubles nothing; a gap and an eviction bring a fresh snapshot and the feed goes
//! on; a stream outlives the idle timeout and ends within the drain on shutdown, with an `end` event saying so; a
//! thread that grows past the thread limit ends its feed with the history's 507 body, and a resume answers 507.
//! Every live conformance case also streams to its expected history (`conformance::live_case`).

use std::time::{Duration, Instant};

use eventsource_stream::{Event, Eventsource};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::Value;
use test_support::proxy::Proxy;

use crate::helpers::{
    Api, chunk_row, encode, metric, publish_rows, spawn_app_with, turns, user_row,
};
use crate::scene::{Scene, now_ns, read_until_cache};

/// An open feed and the transcript its events build.
pub struct FeedClient {
    events: BoxStream<'static, Result<Event, String>>,
    /// The messages as the events so far make them.
    pub messages: Vec<Value>,
    /// The id of the last event.
    pub last_id: String,
    /// The kinds of the events received, in order.
    pub kinds: Vec<String>,
    /// The data of the feed's `end` event, once it came (the history's error body).
    pub ended: Option<Value>,
}

impl FeedClient {
    /// Opens the feed of `thread` with `query`, resuming after `last_id` when given; panics unless it answers 200
    /// `text/event-stream` with `Cache-Control: no-store`.
    pub async fn open(api: &Api, thread: &str, query: &str, last_id: Option<&str>) -> Self {
        let mut request = api.http.get(format!(
            "{}/v1/threads/{}/history/stream?{query}",
            api.address,
            encode(thread)
        ));
        if let Some(id) = last_id {
            request = request.header("last-event-id", id);
        }
        let response = request.send().await.expect("the feed answers");
        assert_eq!(response.status(), 200, "the feed of {thread}");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        assert_eq!(response.headers()["cache-control"], "no-store");
        let events = response
            .bytes_stream()
            .eventsource()
            .map(|event| event.map_err(|e| e.to_string()))
            .boxed();
        Self {
            events,
            messages: Vec::new(),
            last_id: last_id.unwrap_or_default().to_owned(),
            kinds: Vec::new(),
            ended: None,
        }
    }

    /// Applies the next event (within `limit`); `false` when none came or the feed ended.
    pub async fn apply_next(&mut self, limit: Duration) -> bool {
        let Ok(Some(Ok(event))) = tokio::time::timeout(limit, self.events.next()).await else {
            return false;
        };
        self.apply(event);
        true
    }

    /// Applies `event` to the transcript (an `end` to [`FeedClient::ended`]); panics on an event after the `end`.
    fn apply(&mut self, event: Event) {
        assert_eq!(self.ended, None, "an event after the end: {event:?}");
        let data: Value = serde_json::from_str(&event.data).expect("an event's data is JSON");
        match event.event.as_str() {
            "end" => {
                // The end names no answer: the client resumes after the last one it applied.
                assert_eq!(event.id, self.last_id, "the end carries no id of its own");
                self.ended = Some(data);
                self.kinds.push(event.event);
                return;
            }
            "snapshot" => self.messages = data["messages"].as_array().expect("messages").clone(),
            "update" => {
                let from = data["from"].as_u64().expect("from") as usize;
                assert!(from <= self.messages.len(), "an update from past the end");
                self.messages.truncate(from);
                self.messages.extend(
                    data["messages"]
                        .as_array()
                        .expect("messages")
                        .iter()
                        .cloned(),
                );
            }
            other => panic!("unexpected event {other}"),
        }
        self.last_id = event.id;
        self.kinds.push(event.event);
    }

    /// Applies events until the transcript equals `expected` (within `limit`); the transcript either way.
    pub async fn until(&mut self, expected: &Value, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        while Value::Array(self.messages.clone()) != *expected {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.apply_next(left).await {
                break;
            }
        }
        Value::Array(self.messages.clone())
    }

    /// Whether the feed ends (the body closes) within `limit`, applying what comes before.
    pub async fn ends_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline.into(), self.events.next()).await {
                Err(_) => return false,
                Ok(None) | Ok(Some(Err(_))) => return true,
                Ok(Some(Ok(event))) => self.apply(event),
            }
        }
    }

    /// The code of the feed's `end` event, if it came.
    pub fn end_code(&self) -> Option<&str> {
        self.ended.as_ref()?["error"]["code"].as_str()
    }
}

/// The history of `thread` as the worker answers it now.
async fn history(api: &Api, thread: &str) -> Value {
    api.history(thread, "").await.json()["messages"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_events_arrive_as_updates_and_a_resume_misses_and_doubles_nothing() {
    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let thread = "feed-live";
    // A stored turn, served from memory (past the persister-lag bound, so live events keep the view complete).
    scene.warm(&app.api, thread).await;
    let mut feed = FeedClient::open(&app.api, thread, "", None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);
    assert_eq!(feed.kinds, ["snapshot"]);
    assert_eq!(Value::Array(feed.messages.clone()), turns(&[("user", "Q")]));

    // Events one by one: each arrives as an update, the transcript equals the worker's read after each.
    let mut rows = Vec::new();
    for i in 0..8 {
        rows.push(chunk_row(
            thread,
            "d1",
            "A",
            &format!("c{i}"),
            now_ns(1 + i),
            &format!("{i} "),
        ));
    }
    for (n, row) in rows.iter().enumerate() {
        publish_rows(&scene.publisher, std::slice::from_ref(row)).await;
        app.api.wait_for_events(n as u64 + 1).await;
        let expected = history(&app.api, thread).await;
        assert_eq!(
            feed.until(&expected, Duration::from_secs(5)).await,
            expected,
            "after event {n}"
        );
    }
    assert!(
        feed.kinds[1..].iter().all(|k| k == "update"),
        "{:?}",
        feed.kinds
    );
    assert!(feed.kinds.len() >= 2, "{:?}", feed.kinds);

    // Disconnected while events keep coming; resumed with Last-Event-ID while more arrive.
    let (last, held) = (feed.last_id.clone(), feed.messages.clone());
    drop(feed);
    let publisher = scene.publisher.clone();
    let more: Vec<Value> = (8..40)
        .map(|i| {
            chunk_row(
                thread,
                "d1",
                "A",
                &format!("c{i}"),
                now_ns(1 + i),
                &format!("{i} "),
            )
        })
        .collect();
    let (before, during) = more.split_at(10);
    publish_rows(&publisher, before).await;
    app.api.wait_for_events(rows.len() as u64 + 10).await;
    let during = during.to_vec();
    let publishing = tokio::spawn(async move {
        for row in &during {
            publish_rows(&publisher, std::slice::from_ref(row)).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let mut resumed = FeedClient::open(&app.api, thread, "", Some(&last)).await;
    // The resumed client goes on from what it held: the rest comes from updates alone.
    resumed.messages = held;
    publishing.await.unwrap();
    app.api
        .wait_for_events(rows.len() as u64 + more.len() as u64)
        .await;
    let expected = history(&app.api, thread).await;
    assert_eq!(
        resumed.until(&expected, Duration::from_secs(5)).await,
        expected
    );
    assert_eq!(resumed.kinds[0], "update", "{:?}", resumed.kinds);
    assert!(
        resumed.kinds.iter().all(|k| k == "update"),
        "{:?}",
        resumed.kinds
    );
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "history_view_feed_resumes_total{outcome=\"update\"}"
        ),
        1.0
    );
    assert_eq!(metric(&metrics, "history_view_feed_streams"), 1.0);

    // An id the worker does not know: a snapshot.
    let mut unknown = FeedClient::open(&app.api, thread, "", Some("1.1")).await;
    assert!(unknown.apply_next(Duration::from_secs(5)).await);
    assert_eq!(unknown.kinds, ["snapshot"]);
    assert_eq!(Value::Array(unknown.messages.clone()), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_during_the_stream_brings_a_fresh_snapshot_and_nothing_stale() {
    let scene = Scene::new().await;
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = scene.worker(proxy.nats_url(), &[]).await;
    let thread = "feed-gap";
    scene.warm(&app.api, thread).await;
    let mut feed = FeedClient::open(&app.api, thread, "", None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);
    assert_eq!(Value::Array(feed.messages.clone()), turns(&[("user", "Q")]));

    // Missed live during the cut, persisted: the view is partial, and the feed must not miss the event.
    proxy.cut();
    app.api.wait_readiness(false).await;
    let missed = chunk_row(thread, "d1", "A", "e2", now_ns(1), "missed");
    publish_rows(&scene.publisher, std::slice::from_ref(&missed)).await;
    scene.store.insert_rows(std::slice::from_ref(&missed)).await;
    proxy.restore();
    app.wait_ready().await;
    // A live event after the gap: the feed reads again, and with the view partial, sends a snapshot.
    let after = chunk_row(thread, "d1", "A", "e3", now_ns(2), " then");
    scene.store.insert_rows(std::slice::from_ref(&after)).await;
    publish_rows(&scene.publisher, std::slice::from_ref(&after)).await;
    let expected = turns(&[("user", "Q"), ("assistant", "missed then")]);
    let before = feed.kinds.len();
    assert_eq!(
        feed.until(&expected, Duration::from_secs(10)).await,
        expected
    );
    // Whatever came after the gap came as a snapshot, and no transcript between lacked the missed event but held
    // the later one (an update from a partial view).
    assert!(
        feed.kinds[before..].iter().any(|k| k == "snapshot"),
        "{:?}",
        feed.kinds
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_goes_on_through_evictions_and_idle_timeouts_and_ends_on_shutdown() {
    let scene = Scene::new().await;
    let mut app = scene
        .worker(
            scene.nats.url(),
            &[
                ("HISTORY_VIEW_CACHE_MAX_BYTES", "256KiB"),
                ("HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS", "1"),
                ("HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", "3"),
            ],
        )
        .await;
    let thread = "feed-evicted";
    scene.warm(&app.api, thread).await;
    let mut feed = FeedClient::open(&app.api, thread, "", None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);

    // Other threads stream in until the budget has pushed the thread out (the eviction policy decides when); each
    // round the thread gets a stored and published event, which the feed delivers whatever happened to its entry.
    let mut text = String::new();
    let mut evicted = false;
    for round in 0..5 {
        let part = format!("{round} ");
        let event = chunk_row(
            thread,
            "d1",
            "A",
            &format!("r{round}"),
            now_ns(1 + round),
            &part,
        );
        scene.store.insert_rows(std::slice::from_ref(&event)).await;
        let flood: Vec<Value> = (0..1_500)
            .map(|t| {
                chunk_row(
                    &format!("other-{round}-{t}"),
                    "d1",
                    "A",
                    "c",
                    1,
                    &"x".repeat(600),
                )
            })
            .collect();
        publish_rows(&scene.publisher, &flood).await;
        publish_rows(&scene.publisher, std::slice::from_ref(&event)).await;
        text.push_str(&part);
        let expected = turns(&[("user", "Q"), ("assistant", &text)]);
        let kinds = feed.kinds.len();
        assert_eq!(
            feed.until(&expected, Duration::from_secs(10)).await,
            expected,
            "round {round}"
        );
        evicted |= feed.kinds[kinds..].iter().any(|k| k == "snapshot");
        if evicted {
            break;
        }
    }
    assert!(evicted, "the thread was never evicted: {:?}", feed.kinds);

    // Longer than the idle timeout without an event: the stream is not closed, and the next event arrives.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = chunk_row(thread, "d1", "A", "late", now_ns(100), "!");
    scene.store.insert_rows(std::slice::from_ref(&later)).await;
    publish_rows(&scene.publisher, std::slice::from_ref(&later)).await;
    text.push('!');
    let expected = turns(&[("user", "Q"), ("assistant", &text)]);
    assert_eq!(
        feed.until(&expected, Duration::from_secs(10)).await,
        expected
    );

    // SIGTERM: the feed says so in its `end` event and ends, and the worker exits within the drain.
    let started = Instant::now();
    app.terminate();
    assert!(
        feed.ends_within(Duration::from_secs(3)).await,
        "the feed did not end"
    );
    assert_eq!(feed.end_code(), Some("shutting_down"), "{:?}", feed.ended);
    let status = app
        .wait_exit(Duration::from_secs(5))
        .await
        .expect("the worker exits");
    assert!(status.success(), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

/// Issue 36: a feed whose thread grew past `HISTORY_VIEW_MAX_THREAD_BYTES` went silent for good (one last update,
/// then nothing) while the history answered 507. It now ends with an `end` event carrying the history's error body,
/// the stream closes, and a resume answers the history's 507.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_feed_whose_thread_passes_the_limit_ends_with_the_history_error_and_a_resume_answers_507()
{
    let app = spawn_app_with(|c| c.cache.max_thread_bytes = 1 << 20).await;
    let thread = "feed-outgrown";
    let start = [
        user_row(thread, "d1", "u1", 1, "Q"),
        chunk_row(thread, "d1", "A", "c0", 2, &"x".repeat(10_000)),
    ];
    app.store.insert_rows(&start).await;
    read_until_cache(&app.api, thread, "").await;
    let mut feed = FeedClient::open(&app.api, thread, "", None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);
    assert_eq!(feed.kinds, ["snapshot"]);

    // The answer grows past 1 MiB live (100 kB chunks, persisted and published as aihub does).
    for i in 0..12 {
        let row = chunk_row(
            thread,
            "d1",
            "A",
            &format!("more{i}"),
            100 + i,
            &"y".repeat(100_000),
        );
        app.store.insert_rows(std::slice::from_ref(&row)).await;
        publish_rows(&app.publisher, std::slice::from_ref(&row)).await;
    }
    let ended = feed.ends_within(Duration::from_secs(20)).await;
    assert!(ended, "the feed went silent: {:?}", feed.kinds);
    let history = app.api.history(thread, "").await;
    assert_eq!(history.status, 507, "{:.300}", history.body);
    assert_eq!(
        feed.end_code(),
        Some("thread_too_large"),
        "{:?}",
        feed.kinds
    );
    assert_eq!(
        feed.ended,
        Some(history.json()),
        "the end carries the history's body"
    );
    assert_eq!(feed.kinds.last().map(String::as_str), Some("end"));
    // The feed gave its slot back when it ended.
    assert_eq!(
        metric(&app.api.metrics().await, "history_view_feed_streams"),
        0.0
    );

    // A resume after the end answers what the history answers.
    let resumed = app
        .api
        .get(
            &format!("/v1/threads/{thread}/history/stream"),
            &[("last-event-id", feed.last_id.as_str())],
        )
        .await;
    assert_eq!(resumed.status, 507, "{:.300}", resumed.body);
    assert_eq!(resumed.json(), history.json());
}
