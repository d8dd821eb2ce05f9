//! The live feed (`history/stream`) through the binary with a real SSE client (`test_support::promise::FeedClient`:
//! eventsource-stream over reqwest), every transcript judged against the stored rows (`test_support::promise`): live
//! events arrive as updates and the client's transcript equals the reference; a resume with `Last-Event-ID` while
//! events keep arriving misses and doubles nothing; a gap and an eviction bring a fresh snapshot, no transcript
//! holds an event after the gap without the one missed in it, and the feed goes on; a stream outlives the idle
//! timeout and ends within the drain on shutdown, with an `end` event saying so; a thread that grows past the thread
//! limit ends its feed with the history's 507 body, and a resume answers 507. Every live conformance case also
//! streams to its expected history (`conformance::live_case`).

use std::time::{Duration, Instant};

use serde_json::Value;
use test_support::promise::{FeedClient, Ledger};
use test_support::proxy::Proxy;

use crate::helpers::{Api, chunk_row, metric, publish_rows, spawn_app_with, user_row};
use crate::promise::{target, warm};
use crate::scene::{Scene, now_ns, read_until_cache};

/// The workers' persister-lag bound (their default).
const LAG: Duration = Duration::from_secs(2);

/// Opens `thread`'s feed through `api` (resuming after `last_id`), every transcript judged against `ledger`.
async fn judged_feed(
    api: &Api,
    thread: &str,
    ledger: &Ledger,
    last_id: Option<&str>,
) -> FeedClient {
    FeedClient::open(&target(api), thread, "", last_id)
        .await
        .judged(ledger, None)
}

/// Chunk `n` of `thread`'s answer, its text starting with its token `[c<n>]`.
fn chunk(thread: &str, n: i64, text: &str) -> Value {
    chunk_row(
        thread,
        "d1",
        "A",
        &format!("c{n}"),
        now_ns(n),
        &format!("[c{n}]{text}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_events_arrive_as_updates_and_a_resume_misses_and_doubles_nothing() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let events = scene.store.events();
    let app = scene.worker(scene.nats.url(), &[]).await;
    let thread = "feed-live";
    // A stored turn, served from memory (past the persister-lag bound, so live events keep the view complete).
    warm(&scene, &ledger, &app.api, thread).await;
    let mut feed = judged_feed(&app.api, thread, &ledger, None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);
    assert_eq!(feed.kinds, ["snapshot"]);
    assert_eq!(feed.transcript(), ledger.reference(thread, None));

    // Events one by one, stored and published as aihub does: each arrives as an update, the transcript equals the
    // reference after each.
    let rows: Vec<Value> = (0..8)
        .map(|i| chunk(thread, 1 + i, &format!("{i} ")))
        .collect();
    for (n, row) in rows.iter().enumerate() {
        ledger
            .store_and_publish(&events, &scene.publisher, std::slice::from_ref(row))
            .await;
        app.api.wait_for_events(n as u64 + 1).await;
        feed.until_reference(Duration::from_secs(5)).await;
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
    let more: Vec<Value> = (8..40)
        .map(|i| chunk(thread, 1 + i, &format!("{i} ")))
        .collect();
    let (before, during) = more.split_at(10);
    ledger
        .store_and_publish(&events, &scene.publisher, before)
        .await;
    app.api.wait_for_events(rows.len() as u64 + 10).await;
    let during = during.to_vec();
    let publishing = {
        let (ledger, events, publisher) = (ledger.clone(), events.clone(), scene.publisher.clone());
        tokio::spawn(async move {
            for row in &during {
                ledger
                    .store_and_publish(&events, &publisher, std::slice::from_ref(row))
                    .await;
            }
        })
    };
    let mut resumed = judged_feed(&app.api, thread, &ledger, Some(&last)).await;
    // The resumed client goes on from what it held: the rest comes from updates alone.
    resumed.messages = held;
    publishing.await.unwrap();
    app.api
        .wait_for_events(rows.len() as u64 + more.len() as u64)
        .await;
    resumed.until_reference(Duration::from_secs(5)).await;
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
    let mut unknown = judged_feed(&app.api, thread, &ledger, Some("1.1")).await;
    assert!(unknown.apply_next(Duration::from_secs(5)).await);
    assert_eq!(unknown.kinds, ["snapshot"]);
    assert_eq!(unknown.transcript(), ledger.reference(thread, None));
    unknown
        .report
        .assert_kept("the feed resumed with an unknown id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_during_the_stream_brings_a_fresh_snapshot_and_nothing_stale() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let events = scene.store.events();
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = scene.worker(proxy.nats_url(), &[]).await;
    let thread = "feed-gap";
    warm(&scene, &ledger, &app.api, thread).await;
    let mut feed = judged_feed(&app.api, thread, &ledger, None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);
    assert_eq!(feed.transcript(), ledger.reference(thread, None));

    // Missed live during the cut, persisted: the view is partial, and the feed must not miss the event.
    proxy.cut();
    app.api.wait_readiness(false).await;
    let missed = chunk(thread, 2, "missed");
    ledger.published(std::slice::from_ref(&missed));
    publish_rows(&scene.publisher, std::slice::from_ref(&missed)).await;
    ledger.store(&events, std::slice::from_ref(&missed)).await;
    proxy.restore();
    app.wait_ready().await;
    // A live event after the gap: the feed reads again, and with the view partial, sends a snapshot.
    let before = feed.kinds.len();
    let after = chunk(thread, 3, " then");
    ledger
        .store_and_publish(&events, &scene.publisher, std::slice::from_ref(&after))
        .await;
    feed.until_reference(Duration::from_secs(10)).await;
    // Whatever came after the gap came as a snapshot, and no transcript held the later event without the missed
    // one (an update from a partial view).
    assert!(
        feed.kinds[before..].iter().any(|k| k == "snapshot"),
        "{:?}",
        feed.kinds
    );
    for transcript in &feed.transcripts {
        let text = transcript.to_string();
        assert!(
            !text.contains("[c3]") || text.contains("[c2]"),
            "a transcript with the later event but not the missed one: {text} ({:?})",
            feed.kinds
        );
    }
    assert!(
        feed.transcripts
            .last()
            .is_some_and(|t| t.to_string().contains("[c3]"))
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
    let ledger = Ledger::new(LAG);
    let events = scene.store.events();
    warm(&scene, &ledger, &app.api, thread).await;
    let mut feed = judged_feed(&app.api, thread, &ledger, None).await;
    assert!(feed.apply_next(Duration::from_secs(5)).await);

    // Other threads stream in until the budget has pushed the thread out (the eviction policy decides when); each
    // round the thread gets a stored and published event, which the feed delivers whatever happened to its entry.
    let mut evicted = false;
    for round in 0..5 {
        let event = chunk(thread, 1 + round, &format!("{round} "));
        ledger.store(&events, std::slice::from_ref(&event)).await;
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
        ledger.published(std::slice::from_ref(&event));
        publish_rows(&scene.publisher, std::slice::from_ref(&event)).await;
        let kinds = feed.kinds.len();
        feed.until_reference(Duration::from_secs(10)).await;
        evicted |= feed.kinds[kinds..].iter().any(|k| k == "snapshot");
        if evicted {
            break;
        }
    }
    assert!(evicted, "the thread was never evicted: {:?}", feed.kinds);

    // Longer than the idle timeout without an event (the scenario's time: the stream must outlive it): the
    // stream is not closed, and the next event arrives.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = chunk(thread, 100, "!");
    ledger
        .store_and_publish(&events, &scene.publisher, std::slice::from_ref(&later))
        .await;
    feed.until_reference(Duration::from_secs(10)).await;

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
    let mut feed = FeedClient::open(&target(&app.api), thread, "", None).await;
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
