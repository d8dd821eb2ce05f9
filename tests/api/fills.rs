//! aihub's read pattern through the built binary: a read at the start of every turn, each turn on a new display,
//! is served from memory after a thread's first read, because a marker that lands live on a display the view has
//! not read is filled off the read path. A read during a fill waits for it; a failed fill, or a gap during one,
//! leaves the view partial. Each scenario ends with a read from `cache` equal to a fresh worker's cold read.

use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::future::join_all;

use crate::helpers::{Api, BinaryApp, metric, metric_sum, publish_rows};
use crate::scene::{Scene, read_until_cache, wait_check, wait_metric};
use test_support::proxy::Proxy;
use test_support::turns::Conversation;
use test_support::wait::{eventually, when};

/// Two turns persisted before the worker starts: the second asked a HITL question on a hidden display, which the
/// next turn answers.
async fn persisted_conversation(scene: &Scene, thread: &str) -> Conversation {
    let mut conversation = Conversation::new(thread);
    for _ in 0..2 {
        let rows = conversation.next_turn();
        scene.store.insert_rows(&rows).await;
    }
    conversation
}

/// A worker without a persister-lag bound (these scenarios are about fills) reaching NATS at `nats_url`, after its
/// first read of the conversation (a hydration that completes the view), checked.
async fn worker_after_first_read(
    scene: &Scene,
    nats_url: String,
    store_timeout: &str,
    conversation: &Conversation,
) -> BinaryApp {
    let app = scene
        .worker(
            nats_url,
            &[
                ("HISTORY_VIEW_PERSIST_LAG_MS", "0"),
                ("HISTORY_VIEW_STORE_TIMEOUT_MS", store_timeout),
            ],
        )
        .await;
    let reply = app
        .api
        .history(&conversation.thread, &Conversation::query())
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.source(), Some("store"));
    assert_eq!(reply.json(), conversation.expected());
    app
}

/// Publishes the conversation's next turn and waits until the worker has received all of it.
async fn publish_turn(
    scene: &Scene,
    api: &Api,
    conversation: &mut Conversation,
) -> Vec<serde_json::Value> {
    let received = metric(&api.metrics().await, "history_view_events_total");
    let turn = conversation.next_turn();
    publish_rows(&scene.publisher, &turn).await;
    api.wait_for_events(received as u64 + turn.len() as u64)
        .await;
    turn
}

/// The scenarios' end: the conversation served from memory, equal to a fresh worker's cold read.
async fn ends_in_cache(scene: &Scene, api: &Api, conversation: &Conversation) {
    scene
        .assert_served_from_cache_for(
            api,
            &conversation.thread,
            &Conversation::query(),
            conversation.expected()["messages"].clone(),
        )
        .await;
}

fn fills(metrics: &str, outcome: &str) -> f64 {
    metric(
        metrics,
        &format!("history_view_fills_total{{outcome=\"{outcome}\"}}"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_multi_turn_read_pattern_is_served_from_memory_after_each_threads_first_read() {
    const THREADS: usize = 4;
    const TURNS: usize = 5;
    let scene = Scene::new().await;
    let app = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_PERSIST_LAG_MS", "300")])
        .await;
    // The workload starts once the bound has passed since the worker confirmed its subscription, as it does for a
    // worker that has been running for a while: a thread of its own is served from memory.
    read_until_cache(&app.api, "multi-turn-bound-passed", "").await;
    let markers = "history_view_store_queries_total{kind=\"hydration_markers\"}";
    let hydrated_before = metric(&app.api.metrics().await, markers);
    // The threads go turn by turn together: once every thread's turn is published, the worker has applied all its
    // events and completed its fill (one a turn) before the next reads.
    let (turned, published) = (&tokio::sync::Barrier::new(THREADS), &AtomicU64::new(0));
    let runs = (0..THREADS).map(|t| {
        let (api, scene) = (app.api.clone(), &scene);
        async move {
            let mut conversation = Conversation::new(format!("multi-turn-{t}"));
            let mut sources = Vec::new();
            for turn in 0..TURNS {
                let reply = api
                    .history(&conversation.thread, &Conversation::query())
                    .await;
                assert_eq!(reply.status, 200, "{}", reply.body);
                assert_eq!(
                    reply.json(),
                    conversation.expected(),
                    "{}",
                    conversation.thread
                );
                sources.push(reply.source().unwrap_or_default().to_owned());
                let rows = conversation.next_turn();
                publish_rows(&scene.publisher, &rows).await;
                scene.store.insert_rows(&rows).await;
                published.fetch_add(rows.len() as u64, Ordering::SeqCst);
                turned.wait().await;
                let (events, filled) = (published.load(Ordering::SeqCst), THREADS * (turn + 1));
                eventually("every turn so far applied and filled", || {
                    let api = &api;
                    async move {
                        let metrics = api.metrics().await;
                        let applied = metric_sum(&metrics, "history_view_events_total");
                        let fills = fills(&metrics, "complete");
                        when(applied >= events as f64 && fills >= filled as f64, || {
                            format!(
                                "{applied} of {events} events applied, {fills} of {filled} fills"
                            )
                        })
                    }
                })
                .await;
            }
            (conversation, sources)
        }
    });
    let threads = join_all(runs).await;
    for (conversation, sources) in &threads {
        assert_eq!(
            sources[0], "store",
            "{}: the first read hydrates",
            conversation.thread
        );
        assert!(
            sources[1..].iter().all(|s| s == "cache"),
            "{}: every later read from memory: {sources:?}",
            conversation.thread
        );
    }
    let metrics = app.api.metrics().await;
    let turns = (THREADS * TURNS) as f64;
    assert_eq!(fills(&metrics, "complete"), turns, "{metrics}");
    assert_eq!(fills(&metrics, "error") + fills(&metrics, "partial"), 0.0);
    assert_eq!(
        metric(&metrics, markers) - hydrated_before,
        THREADS as f64,
        "one hydration per thread, at its first read"
    );
    for (conversation, _) in &threads {
        ends_in_cache(&scene, &app.api, conversation).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hitl_answer_reveals_a_display_whose_events_were_persisted_turns_earlier() {
    let scene = Scene::new().await;
    let mut conversation = persisted_conversation(&scene, "t-reveal-fill").await;
    let app = worker_after_first_read(&scene, scene.nats.url(), "2000", &conversation).await;

    // The answer lands live on the hidden display: the question and the helper's chunk, stored turns ago and never
    // read by this worker, become visible.
    let answer_turn = conversation.next_turn();
    publish_rows(&scene.publisher, &answer_turn).await;
    scene.store.insert_rows(&answer_turn).await;
    wait_metric(
        &app.api,
        "history_view_fills_total{outcome=\"complete\"}",
        1.0,
    )
    .await;
    let revealed = app
        .api
        .history(&conversation.thread, &Conversation::query())
        .await;
    assert_eq!(revealed.source(), Some("cache"));
    assert_eq!(revealed.json(), conversation.expected());
    assert!(revealed.body.contains("may I ask 1?"), "{}", revealed.body);
    ends_in_cache(&scene, &app.api, &conversation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_during_a_fill_waits_for_it_instead_of_hydrating() {
    let scene = Scene::new().await;
    let mut conversation = persisted_conversation(&scene, "t-fill-race").await;
    let app = worker_after_first_read(&scene, scene.nats.url(), "15000", &conversation).await;

    // The store is frozen, so the fill the answer starts is in flight when the read comes.
    scene.mongo.pause();
    let answer_turn = publish_turn(&scene, &app.api, &mut conversation).await;
    let read = {
        let (api, thread) = (app.api.clone(), conversation.thread.clone());
        tokio::spawn(async move { api.history(&thread, &Conversation::query()).await })
    };
    wait_metric(&app.api, "history_view_cache_misses_total", 2.0).await;
    scene.mongo.resume();
    let waited = read.await.expect("the read task");
    assert_eq!(waited.source(), Some("store"), "it waited for the fill");
    assert_eq!(waited.json(), conversation.expected());
    let metrics = app.api.metrics().await;
    assert_eq!(fills(&metrics, "complete"), 1.0, "{metrics}");
    assert_eq!(
        metric(&metrics, "history_view_hydrations_total{result=\"ok\"}"),
        1.0,
        "the read did not hydrate: it shared the fill"
    );
    scene.store.insert_rows(&answer_turn).await;
    ends_in_cache(&scene, &app.api, &conversation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fill_leaves_the_view_partial_and_the_next_read_hydrates() {
    let scene = Scene::new().await;
    let mut conversation = persisted_conversation(&scene, "t-fill-fails").await;
    let app = worker_after_first_read(&scene, scene.nats.url(), "500", &conversation).await;

    scene.mongo.pause();
    let answer_turn = conversation.next_turn();
    publish_rows(&scene.publisher, &answer_turn).await;
    wait_metric(&app.api, "history_view_fills_total{outcome=\"error\"}", 1.0).await;
    // The failed fill made the complete view partial, and says so (no read has found a stale view yet).
    assert!(
        metric(
            &app.api.metrics().await,
            "history_view_views_downgraded_total"
        ) >= 1.0
    );
    scene.mongo.resume();
    app.wait_ready().await;
    scene.store.insert_rows(&answer_turn).await;

    let next = app
        .api
        .history(&conversation.thread, &Conversation::query())
        .await;
    assert_eq!(next.source(), Some("store"));
    assert_eq!(next.json(), conversation.expected());
    ends_in_cache(&scene, &app.api, &conversation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_during_a_fill_leaves_the_view_partial() {
    let scene = Scene::new().await;
    let mut conversation = persisted_conversation(&scene, "t-fill-gap").await;
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = worker_after_first_read(&scene, proxy.nats_url(), "15000", &conversation).await;

    // The fill waits on the frozen store while the link to NATS drops and comes back.
    scene.mongo.pause();
    let answer_turn = publish_turn(&scene, &app.api, &mut conversation).await;
    proxy.cut();
    wait_check(&app.api, "nats", false).await;
    proxy.restore();
    wait_check(&app.api, "nats", true).await;
    scene.mongo.resume();
    wait_metric(
        &app.api,
        "history_view_fills_total{outcome=\"partial\"}",
        1.0,
    )
    .await;
    scene.store.insert_rows(&answer_turn).await;

    let next = read_until_cache(&app.api, &conversation.thread, &Conversation::query()).await;
    assert_eq!(next.json(), conversation.expected());
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(&metrics, "history_view_hydrations_total{result=\"ok\"}"),
        2.0,
        "the view was hydrated again after the gap: {metrics}"
    );
    ends_in_cache(&scene, &app.api, &conversation).await;
}
