//! Graceful shutdown: SIGTERM with a read in flight completes that read, then the process exits within the drain.

use std::sync::Arc;
use std::time::Duration;

use crate::helpers::{BinaryApp, TestStore, chunk_row, metric, spawn_app, turns, unique, user_row};
use test_support::servers::{MongoServer, NatsServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_read_in_flight_completes_the_read_and_exits_in_time() {
    let mongo = Arc::new(MongoServer::start());
    let nats = NatsServer::start();
    let database = unique("shutdown");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    store
        .insert_rows(&[
            user_row("t1", "d1", "e1", 1, "Q"),
            chunk_row("t1", "d1", "A", "e2", 2, "A"),
        ])
        .await;
    let mut app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        ("HISTORY_VIEW_STORE_TIMEOUT_MS", "20000".to_owned()),
        ("HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", "5".to_owned()),
    ])
    .await;
    app.wait_ready().await;

    // Freeze the store, so the read hangs in its hydration until the store is let go.
    mongo.pause();
    let api = app.api.clone();
    let read = tokio::spawn(async move { api.history("t1", "").await });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while metric(&app.api.metrics().await, "history_view_cache_misses_total") < 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the read never reached the worker"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    app.terminate();
    // The process keeps draining while the read is in flight.
    assert!(
        app.wait_exit(Duration::from_millis(300)).await.is_none(),
        "exited with a read in flight"
    );
    mongo.resume();

    let reply = read.await.expect("the read task");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "A")])
    );
    let status = app
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the process exits after draining");
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn a_stop_request_ends_the_application_within_the_drain_time() {
    let mut app = spawn_app().await;
    assert_eq!(app.api.history("t1", "").await.status, 200);
    app.stop_within(Duration::from_secs(10))
        .await
        .expect("a clean stop");
}
