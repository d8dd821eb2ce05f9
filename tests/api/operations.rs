//! Operations: metrics move by the right amounts for a known workload; readiness follows the store and NATS.

use std::time::Duration;

use serde_json::json;

use crate::helpers::{chunk_row, metric, publish_rows, spawn_app_with, turns, user_row};
use crate::threads;

#[tokio::test]
async fn metrics_count_a_known_workload_exactly() {
    // A subject wide enough to also deliver messages that are not display-event subjects.
    let app = spawn_app_with(|c| c.nats.subject = "agent.>".into()).await;
    let thread = "t-metrics";
    let marker = user_row(thread, "d1", "e1", 1, "Q");
    let chunks: Vec<_> = (0..3)
        .map(|i| chunk_row(thread, "d1", "A", &format!("c{i}"), 2 + i, "x"))
        .collect();
    let mut irrelevant = chunk_row(thread, "d1", "A", "u1", 9, "x");
    irrelevant["event_name"] = json!("ThoughtEvent");
    irrelevant["event_data"]["_parent_event_names"] = json!(["ThoughtEvent", "DisplayEvent"]);
    let mut control = chunk_row(thread, "d1", "A", "k1", 9, "x");
    control["event_type"] = json!("control_event");

    // aihub persisted the marker; the chunks exist only live so far.
    app.store.insert_rows(std::slice::from_ref(&marker)).await;
    publish_rows(&app.publisher, &[marker]).await;
    publish_rows(&app.publisher, &chunks).await;
    publish_rows(&app.publisher, &[chunks[0].clone(), irrelevant, control]).await;
    app.publisher
        .publish(
            threads::subject(&chunks[1]).replace("c1", "broken"),
            "{not json".into(),
        )
        .await
        .unwrap();
    app.publisher
        .publish("agent.too.short", "{}".into())
        .await
        .unwrap();
    app.publisher.flush().await.unwrap();
    app.api.wait_for_events(9).await;

    let cold = app.api.history(thread, "").await;
    let hot = app.api.history(thread, "").await;
    assert_eq!(cold.source(), Some("store"));
    assert_eq!(hot.source(), Some("cache"));
    assert_eq!(
        hot.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "xxx")])
    );

    let m = app.api.metrics().await;
    let events = |outcome: &str| {
        metric(
            &m,
            &format!("history_view_events_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(events("relevant"), 4.0, "{m}");
    assert_eq!(events("duplicate"), 1.0);
    // A family outside the five and a control event.
    assert_eq!(events("irrelevant"), 2.0);
    assert_eq!(events("malformed"), 1.0);
    assert_eq!(events("bad_subject"), 1.0);
    assert_eq!(metric(&m, "history_view_cache_misses_total"), 1.0);
    assert_eq!(metric(&m, "history_view_cache_hits_total"), 1.0);
    assert_eq!(
        metric(&m, "history_view_hydrations_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "history_view_store_query_duration_seconds_count{stage=\"markers\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "history_view_store_query_duration_seconds_count{stage=\"events\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "history_view_read_duration_seconds_count{source=\"store\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &m,
            "history_view_read_duration_seconds_count{source=\"cache\"}"
        ),
        1.0
    );
    // Every decoded event with a valid created_at is observed, the duplicate included.
    assert_eq!(metric(&m, "history_view_ingest_lag_seconds_count"), 5.0);
    assert_eq!(metric(&m, "history_view_cache_entries"), 1.0);
    assert!(metric(&m, "history_view_cache_weighted_bytes") > 0.0);
    assert!(
        metric(
            &m,
            "history_view_nats_connection_events_total{event=\"connected\"}"
        ) >= 1.0
    );
    assert_eq!(metric(&m, "history_view_index_hint_fallbacks_total"), 0.0);
}

#[tokio::test]
async fn readiness_follows_the_store_and_nats() {
    let mut app = spawn_app_with(|c| c.bounds.store_timeout = Duration::from_millis(300)).await;
    let ready = app.api.get("/readyz", &[]).await;
    assert_eq!(ready.status, 200);
    assert_eq!(ready.json()["checks"]["store"]["ok"], true);
    assert_eq!(ready.json()["checks"]["nats"]["ok"], true);

    app.mongo.stop();
    app.api.wait_readiness(false).await;
    let unready = app.api.get("/readyz", &[]).await;
    assert_eq!(unready.json()["ready"], false);
    assert_eq!(unready.json()["checks"]["store"]["ok"], false);
    assert_eq!(unready.json()["checks"]["nats"]["ok"], true);
    // Liveness is not readiness.
    assert_eq!(app.api.get("/healthz", &[]).await.status, 200);
    app.mongo.restart();
    app.api.wait_readiness(true).await;

    app.nats.stop();
    app.api.wait_readiness(false).await;
    let unready = app.api.get("/readyz", &[]).await;
    assert_eq!(unready.json()["checks"]["nats"]["ok"], false);
    app.nats.restart();
    app.api.wait_readiness(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_waiting_on_a_failing_store_fail_together_instead_of_queueing() {
    let app = spawn_app_with(|c| c.bounds.store_timeout = Duration::from_millis(700)).await;
    app.mongo.pause();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(8));
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let (api, barrier) = (app.api.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                api.history("t-down", "").await
            })
        })
        .collect();
    for reader in readers {
        let reply = reader.await.unwrap();
        assert_eq!(reply.status, 503, "{}", reply.body);
        assert_eq!(reply.json()["error"]["code"], "store_unavailable");
    }
    app.mongo.resume();
    let m = app.api.metrics().await;
    // One store attempt for all eight readers.
    assert_eq!(
        metric(&m, "history_view_hydrations_total{result=\"error\"}"),
        1.0,
        "{m}"
    );
}

#[tokio::test]
async fn the_worker_starts_without_nats_and_becomes_ready_when_nats_appears() {
    let mongo = test_support::servers::MongoServer::start();
    let mut nats = test_support::servers::NatsServer::start();
    nats.stop();
    let app = crate::helpers::BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        (
            "HISTORY_VIEW_MONGODB_DATABASE",
            crate::helpers::unique("nonats"),
        ),
    ])
    .await;
    let unready = app.api.get("/readyz", &[]).await;
    assert_eq!(unready.status, 503);
    assert_eq!(unready.json()["checks"]["nats"]["ok"], false);
    nats.restart();
    app.wait_ready().await;
}

#[test]
fn a_bad_setting_stops_start_up_naming_it() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_chat-history-view"))
        .env("HISTORY_VIEW_CACHE_MAX_BYTES", "lots")
        .output()
        .expect("run the binary");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cache-max-bytes"), "{stderr}");
}
