//! NATS liveness through the built binary with its default ping interval (4 s): a frozen nats-server (SIGSTOP) and
//! a half-open link (a proxy that swallows bytes and closes nothing) are both noticed within 15 s: readiness
//! answers 503 and every view is downgraded, so an event the store has but the worker never heard is served. With
//! the client's own default (60 s) both went unnoticed for minutes.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::{Api, chunk_row, publish_rows, turns};
use crate::scene::{Scene, messages, now_ns};
use test_support::proxy::Proxy;
use test_support::wait::eventually_within;

/// How soon a dead link must be noticed (about three ping intervals, with room for a loaded machine).
const NOTICED_WITHIN: Duration = Duration::from_secs(15);

/// Waits until `/readyz` answers 503 with NATS named as the failing check; panics after [`NOTICED_WITHIN`]
/// (scaled) from `since`.
async fn wait_noticed(api: &Api, since: Instant) -> Duration {
    let limit = NOTICED_WITHIN.saturating_sub(since.elapsed());
    eventually_within("the dead link noticed", limit, || async move {
        let reply = api.get("/readyz", &[]).await;
        if reply.status != 503 {
            return Err(reply.body);
        }
        assert_eq!(
            reply.json()["checks"]["nats"]["ok"],
            false,
            "{}",
            reply.body
        );
        Ok(since.elapsed())
    })
    .await
}

/// The rest of both scenarios, once the link died at `dead_since`: an answer the worker never heard reaches the
/// store (aihub's persister has its own connection); once the dead link is noticed, a read serves it instead of
/// the stale view, and once the link is back the view is served from memory again, complete.
async fn missed_event_is_served(
    scene: &Scene,
    api: &Api,
    thread: &str,
    missed: Value,
    dead_since: Instant,
) {
    scene.store.insert_rows(&[missed]).await;
    let noticed = wait_noticed(api, dead_since).await;
    eprintln!("{thread}: dead link noticed after {noticed:?}");
    let read = api.history(thread, "").await;
    assert_ne!(read.source(), Some("cache"), "{}", read.body);
    assert_eq!(messages(&read), answered());
}

/// The thread's history once the missed answer is in.
fn answered() -> Value {
    turns(&[("user", "Q"), ("assistant", "missed")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_nats_server_is_noticed_and_the_views_recover_after_it() {
    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let thread = "t-frozen-nats";
    scene.warm(&app.api, thread).await;

    let frozen = Instant::now();
    scene.nats.pause();
    // Nothing reaches a frozen server; the answer is in the store all the same (written by a persister that
    // heard it elsewhere, say through another node of the cluster).
    let missed = chunk_row(thread, "d1", "A", "e2", now_ns(1), "missed");
    missed_event_is_served(&scene, &app.api, thread, missed, frozen).await;

    scene.nats.resume();
    app.wait_ready().await;
    scene
        .assert_served_from_cache(&app.api, thread, answered())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_link_to_nats_is_noticed_and_the_views_recover_after_it() {
    let scene = Scene::new().await;
    let proxy = Proxy::start(scene.nats.address()).await;
    let app = scene.worker(proxy.nats_url(), &[]).await;
    let thread = "t-half-open";
    scene.warm(&app.api, thread).await;

    let dead = Instant::now();
    proxy.half_open();
    let missed = chunk_row(thread, "d1", "A", "e2", now_ns(1), "missed");
    publish_rows(&scene.publisher, std::slice::from_ref(&missed)).await;
    missed_event_is_served(&scene, &app.api, thread, missed, dead).await;

    proxy.restore();
    app.wait_ready().await;
    scene
        .assert_served_from_cache(&app.api, thread, answered())
        .await;
}
