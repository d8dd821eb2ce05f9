//! The persister-lag rule through the built binary (default bound, 2 s): an event the worker did not hear live
//! and aihub persisted late is never hidden by a view served from memory. Each scenario makes its fault happen
//! for certain (a proxy cut, SIGSTOP, idle expiry, a tiny budget), holds every answer it reads on the way to the
//! promise (`test_support::promise`: a reader judging an answer every 50 ms where reads cannot change the
//! scenario, each read judged where they could, as an idle expiry or an eviction), and ends with a read served from
//! `cache` equal to the reference and to a cold read of a fresh worker. The rule's timing itself is unit-tested
//! with a hand-driven clock in `src/coverage.rs`.

use std::time::Duration;

use serde_json::Value;
use test_support::promise::{Kind, Ledger, Reader, Source, read_history};
use test_support::wait::{eventually, when};

use crate::helpers::{Api, chunk_row, metric, publish_rows, spawn_app_with, user_row};
use crate::promise::{publish, question, settled, target, warm};
use crate::scene::{Scene, now_ns, wait_check, wait_drops, wait_metric};
use test_support::proxy::Proxy;
use test_support::scrape::live_drops;

/// The workers' persister-lag bound (their default).
const LAG: Duration = Duration::from_secs(2);

/// The `n`th part of an answer streamed on `thread`'s first display: its row, its text starting with its token.
fn part(thread: &str, n: i64) -> Value {
    chunk_row(
        thread,
        "d1",
        "A",
        &format!("c{n}"),
        now_ns(1 + n),
        &format!("[c{n}]part{n} "),
    )
}

/// One judged read: its source and body; panics if it broke the promise.
async fn judged(ledger: &Ledger, api: &Api, thread: &str) -> (Option<Source>, String) {
    let read = read_history(&target(api), thread, None, ledger).await;
    read.report.assert_kept(&format!("a read of {thread}"));
    (read.source, read.body)
}

/// The scenarios' end: memory answers the reference (every answer judged), and so does a fresh worker's cold read.
async fn ends_served_from_memory(scene: &Scene, ledger: &Ledger, api: &Api, thread: &str) {
    settled(ledger, api, thread).await;
    assert_eq!(
        scene.cold_read(thread, "").await.body,
        ledger.reference_body(thread, None)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_published_before_the_worker_started_appears_once_persisted() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let thread = "t-before-start";
    let rows = [question(thread), part(thread, 1)];
    // Published while no worker listens; aihub's persister has not written it yet.
    publish(&scene, &ledger, &rows).await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let (source, body) = judged(&ledger, &app.api, thread).await;
    assert_eq!(source, Some(Source::Store));
    assert!(body.contains(r#""messages":[]"#), "{body}");
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);

    // The persister catches up within the bound; the view is completed in the background.
    ledger.store(&scene.store.events(), &rows).await;
    wait_metric(
        &app.api,
        "history_view_background_rereads_total{result=\"complete\"}",
        1.0,
    )
    .await;
    ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
    reader.read_on_then_finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_missed_while_the_link_to_nats_was_cut_appear_once_persisted() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = scene.worker(proxy.nats_url(), &[]).await;
    let thread = "t-link-cut";
    warm(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);
    // A Conversations client paging one item at a time, judged like the history.
    let items = Reader::start(
        vec![target(&app.api)],
        thread,
        Kind::Items(None, 1),
        &ledger,
    );

    proxy.cut();
    app.api.wait_readiness(false).await;
    let missed = [part(thread, 2), part(thread, 3)];
    publish(&scene, &ledger, &missed).await;
    proxy.restore();
    app.wait_ready().await;

    // The persister is behind: the store lacks both events, and so does the answer; the view stays partial.
    let (source, body) = judged(&ledger, &app.api, thread).await;
    assert_eq!(source, Some(Source::Store));
    assert!(!body.contains("[c2]") && body.contains("[q]"), "{body}");
    ledger.store(&scene.store.events(), &missed).await;
    ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
    reader.read_on_then_finish().await;
    items.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_dropped_by_a_slow_consumer_appear_once_persisted() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let app = scene
        .worker(
            scene.nats.url(),
            &[("HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY", "8")],
        )
        .await;
    let thread = "t-slow";
    warm(&scene, &ledger, &app.api, thread).await;

    // Frozen, the worker reads nothing; let go, it finds thousands of messages and room for eight. Whether the
    // thread's event is among those dropped is up to the race, so the scenario repeats until it is.
    for attempt in 0..5 {
        let event = part(thread, attempt);
        let mut flood: Vec<Value> = (0..4_000)
            .map(|i| chunk_row("t-flood", "d1", "A", &format!("f{attempt}-{i}"), i, "x"))
            .collect();
        flood.insert(2_000, event.clone());
        let drops_before = live_drops(&app.api.metrics().await);
        app.pause();
        ledger.published(std::slice::from_ref(&event));
        publish_rows(&scene.publisher, &flood).await;
        app.resume();
        wait_drops(&app.api, drops_before + 1.0).await;
        let (_, body) = judged(&ledger, &app.api, thread).await;
        let dropped = !body.contains(&format!("[c{attempt}]"));
        ledger.store(&scene.store.events(), &[event]).await;
        if dropped {
            ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
            return;
        }
    }
    panic!("in five attempts the slow consumer never dropped the thread's event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_held_only_by_an_expired_entry_appears_once_persisted() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let app = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_CACHE_IDLE_SECS", "1")])
        .await;
    let thread = "t-expired";
    warm(&scene, &ledger, &app.api, thread).await;

    // Heard live and held by the entry only; the persister is behind. The entry then goes idle and expires (no
    // reader here: reads would keep it).
    let late = part(thread, 1);
    let received = metric(
        &app.api.metrics().await,
        "history_view_events_total{outcome=\"relevant\"}",
    );
    publish(&scene, &ledger, std::slice::from_ref(&late)).await;
    wait_metric(
        &app.api,
        "history_view_events_total{outcome=\"relevant\"}",
        received + 1.0,
    )
    .await;
    eventually("the idle entry expires", || async {
        let entries = metric(&app.api.metrics().await, "history_view_cache_entries");
        when(entries == 0.0, || format!("{entries} entries"))
    })
    .await;

    // The thread's next entry reads the store, which lacks the event: partial, not complete.
    let (source, body) = judged(&ledger, &app.api, thread).await;
    assert_eq!(source, Some(Source::Store));
    assert!(!body.contains("[c1]") && body.contains("[q]"), "{body}");
    ledger.store(&scene.store.events(), &[late]).await;
    ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_held_only_by_an_evicted_entry_appears_once_persisted() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let app = scene
        .worker(
            scene.nats.url(),
            &[("HISTORY_VIEW_CACHE_MAX_BYTES", "256KiB")],
        )
        .await;
    let thread = "t-evicted";
    warm(&scene, &ledger, &app.api, thread).await;

    // Each round: an event reaches the thread live only, then other threads stream in until the budget pushes
    // the thread out (the eviction policy decides when; the round repeats until it has). No reader: reads would
    // keep the thread in.
    for round in 0..5 {
        let event = part(thread, round);
        let received = metric(&app.api.metrics().await, "history_view_events_total");
        publish(&scene, &ledger, std::slice::from_ref(&event)).await;
        let flood: Vec<Value> = (0..1_500)
            .flat_map(|t| {
                (0..6).map(move |c| {
                    chunk_row(
                        &format!("other-{round}-{t}"),
                        "d1",
                        "A",
                        &format!("c{c}"),
                        c,
                        &"x".repeat(100),
                    )
                })
            })
            .collect();
        publish_rows(&scene.publisher, &flood).await;
        app.api
            .wait_for_events(received as u64 + 1 + flood.len() as u64)
            .await;
        let (source, body) = judged(&ledger, &app.api, thread).await;
        let evicted = source == Some(Source::Store);
        if evicted {
            assert!(
                !body.contains(&format!("[c{round}]")),
                "the store cannot have it yet: {body}"
            );
        }
        ledger.store(&scene.store.events(), &[event]).await;
        if evicted {
            ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
            return;
        }
    }
    panic!("in five rounds the budget never evicted the thread");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_persisted_late_after_a_store_outage_appear() {
    let scene = Scene::new().await;
    let ledger = Ledger::new(LAG);
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = scene
        .worker(
            proxy.nats_url(),
            &[("HISTORY_VIEW_STORE_TIMEOUT_MS", "500")],
        )
        .await;
    let thread = "t-outage";
    warm(&scene, &ledger, &app.api, thread).await;
    let reader = Reader::start(vec![target(&app.api)], thread, Kind::History(None), &ledger);

    // The store freezes; meanwhile the worker also loses NATS and misses an event, which aihub's persister cannot
    // write while the store is down.
    scene.mongo.pause();
    wait_check(&app.api, "store", false).await;
    proxy.cut();
    wait_check(&app.api, "nats", false).await;
    let missed = part(thread, 1);
    publish(&scene, &ledger, std::slice::from_ref(&missed)).await;
    proxy.restore();
    wait_check(&app.api, "nats", true).await;
    // The scenario's time, not a wait: long enough that the reconnect alone would no longer hold the view back,
    // only the outage's end does.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    scene.mongo.resume();
    app.wait_ready().await;

    let (_, body) = judged(&ledger, &app.api, thread).await;
    assert!(!body.contains("[c1]") && body.contains("[q]"), "{body}");
    ledger.store(&scene.store.events(), &[missed]).await;
    ends_served_from_memory(&scene, &ledger, &app.api, thread).await;
    reader.read_on_then_finish().await;
}

#[tokio::test]
async fn hydration_measures_the_persister_lag_and_counts_rows_beyond_the_bound() {
    let app = spawn_app_with(|c| c.bounds.persist_lag = Duration::from_secs(2)).await;
    let thread = "t-lag";
    app.store
        .insert_rows(&[
            user_row(thread, "d1", "e1", now_ns(0), "Q"),
            chunk_row(thread, "d1", "A", "e2", now_ns(1), "fresh"),
            // Persisted a minute after it was created.
            chunk_row(thread, "d1", "A", "e3", now_ns(-60_000_000_000), "stale"),
            // Clocks (or fixtures) that make no lag: created 30 s after it was stored, and at the epoch.
            chunk_row(thread, "d1", "A", "e4", now_ns(30_000_000_000), "ahead"),
            chunk_row(thread, "d1", "A", "e5", 5, "epoch"),
        ])
        .await;
    assert_eq!(app.api.history(thread, "").await.status, 200);
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(&metrics, "history_view_persister_lag_seconds_count"),
        3.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "history_view_persister_lag_exceeded_total"),
        1.0
    );
    let sum = metric(&metrics, "history_view_persister_lag_seconds_sum");
    assert!((59.0..=62.0).contains(&sum), "{sum}");
    for side in ["negative", "too_large"] {
        assert_eq!(
            metric(
                &metrics,
                &format!("history_view_persister_lag_out_of_range_total{{side=\"{side}\"}}")
            ),
            1.0,
            "{side}"
        );
    }
}
