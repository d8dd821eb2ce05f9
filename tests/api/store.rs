//! The store path against a real Mongo-wire server: index use (explain), the missing-index fallback, an unavailable
//! store (503 within the timeout, then recovery), and thread ids that look like query operators.

use std::time::{Duration, Instant};

use chat_history_view::config::DEFAULT_FILL_INDEX_HINT;
use chat_history_view::store::{
    events_filter, events_sort, fill_filter, markers_pipeline, projection,
};
use mongodb::bson::{Bson, doc};
use serde_json::json;

use crate::helpers::{chunk_row, metric, spawn_app, spawn_app_with, turns, user_row};

const INDEX: &str = "thread_id_1_event_type_1_event_parents_1";

fn assert_uses_index(explain: &mongodb::bson::Document, stage: &str) {
    assert_uses(explain, stage, INDEX);
}

fn assert_uses(explain: &mongodb::bson::Document, stage: &str, index: &str) {
    let text = serde_json::to_string(explain).unwrap();
    assert!(
        text.contains("IXSCAN"),
        "{stage} does not scan an index: {text}"
    );
    assert!(text.contains(index), "{stage} does not use {index}: {text}");
    assert!(
        !text.contains("COLLSCAN"),
        "{stage} scans the collection: {text}"
    );
}

#[tokio::test]
async fn store_stages_use_the_thread_event_type_parents_index() {
    let app = spawn_app().await;
    let thread = "66f10000000000000000aaaa";
    let mut rows = vec![
        user_row(thread, "d1", "e1", 1, "Q"),
        chunk_row(thread, "d1", "A", "e2", 2, "answer"),
    ];
    // Other threads and hidden displays, so a scan would have something to skip.
    for i in 0..40 {
        rows.push(chunk_row(
            &format!("other{}", i % 4),
            "dx",
            "A",
            &format!("o{i}"),
            i,
            "x",
        ));
        rows.push(chunk_row(
            thread,
            "hidden",
            "B",
            &format!("h{i}"),
            i,
            "hidden",
        ));
    }
    app.store.insert_rows(&rows).await;

    let stage1 = app
        .store
        .db
        .run_command(doc! {"explain": {
            "aggregate": "agent_events", "pipeline": markers_pipeline(thread).to_vec(), "cursor": {}, "hint": INDEX,
        }})
        .await
        .expect("explain stage 1");
    assert_uses_index(&stage1, "stage 1");
    let displays = vec![Bson::String("d1".into())];
    let stage2 = app
        .store
        .db
        .run_command(doc! {"explain": {
            "find": "agent_events", "filter": events_filter(thread, &displays), "sort": events_sort(),
            "projection": projection(), "hint": INDEX,
        }})
        .await
        .expect("explain stage 2");
    assert_uses_index(&stage2, "stage 2");

    // And the worker's own read, with the same stages, answers from the store.
    let reply = app.api.history(thread, "").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "answer")])
    );
    assert_eq!(reply.source(), Some("store"));
}

#[tokio::test]
async fn a_fill_reads_the_display_index() {
    let app = spawn_app().await;
    let thread = "66f10000000000000000bbbb";
    let mut rows = vec![user_row(thread, "d1", "e1", 1, "Q")];
    for i in 0..40 {
        rows.push(chunk_row(
            thread,
            &format!("d{}", i % 5),
            "A",
            &format!("c{i}"),
            i,
            "x",
        ));
    }
    app.store.insert_rows(&rows).await;
    // The worker's fill: stage 2's filter for the newly visible displays of a batch of threads, hinted with the
    // display index.
    let displays = vec![Bson::String("d3".into())];
    let fill = app
        .store
        .db
        .run_command(doc! {"explain": {
            "find": "agent_events", "filter": fill_filter(&[thread], &displays), "projection": projection(),
            "hint": DEFAULT_FILL_INDEX_HINT,
        }})
        .await
        .expect("explain the fill");
    assert_uses(&fill, "the fill", DEFAULT_FILL_INDEX_HINT);
}

#[tokio::test]
async fn reads_still_answer_when_the_index_is_missing() {
    let app = spawn_app().await;
    let thread = "t-no-index";
    app.store
        .insert_rows(&[
            user_row(thread, "d1", "e1", 1, "Q"),
            chunk_row(thread, "d1", "A", "e2", 2, "A"),
        ])
        .await;
    app.store
        .events()
        .drop_index(INDEX)
        .await
        .expect("drop index");

    let reply = app.api.history(thread, "").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "A")])
    );
    let fallbacks = || async {
        metric(
            &app.api.metrics().await,
            "history_view_index_hint_fallbacks_total",
        )
    };
    // Stage 1 was retried without the hint; stage 2 already knew.
    assert_eq!(fallbacks().await, 1.0);
    // Later reads do not name the missing index again (for a few minutes).
    for other in ["t-no-index-2", "t-no-index-3"] {
        assert_eq!(app.api.history(other, "").await.status, 200);
    }
    assert_eq!(fallbacks().await, 1.0);
}

#[tokio::test]
async fn a_marker_whose_display_id_is_not_a_string_is_skipped_not_fatal() {
    let app = spawn_app().await;
    let thread = "t-poisoned";
    let mut poisoned = user_row(thread, "d0", "e0", 1, "never shown");
    poisoned["display_id"] = json!({"$ne": 1});
    app.store
        .insert_rows(&[
            poisoned,
            user_row(thread, "d1", "e1", 2, "Q"),
            chunk_row(thread, "d1", "A", "e2", 3, "A"),
        ])
        .await;
    for _ in 0..2 {
        let reply = app.api.history(thread, "").await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(
            reply.json()["messages"],
            turns(&[("user", "Q"), ("assistant", "A")])
        );
    }
    assert_eq!(
        metric(
            &app.api.metrics().await,
            "history_view_markers_skipped_total"
        ),
        1.0
    );
}

#[tokio::test]
async fn a_stopped_store_answers_503_within_the_timeout_and_reads_recover() {
    let mut app = spawn_app_with(|c| c.bounds.store_timeout = Duration::from_millis(500)).await;
    let thread = "t-outage";
    app.mongo.stop();

    let started = Instant::now();
    let reply = app.api.history(thread, "").await;
    let elapsed = started.elapsed();
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "store_unavailable");
    assert_eq!(reply.header("retry-after"), Some("1"));
    // Bounded by the configured timeout (a generous margin: this asserts "no hang", not speed).
    assert!(
        elapsed < Duration::from_secs(5),
        "the read took {elapsed:?}"
    );

    app.mongo.restart();
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "back")])
        .await;
    let api = &app.api;
    let reply = test_support::wait::eventually("reads answered again", || async move {
        let reply = api.history(thread, "").await;
        if reply.status == 200 {
            Ok(reply)
        } else {
            Err(format!("{} {}", reply.status, reply.body))
        }
    })
    .await;
    assert_eq!(reply.json()["messages"], turns(&[("user", "back")]));
}

#[tokio::test]
async fn thread_ids_with_operator_characters_are_plain_strings() {
    let app = spawn_app().await;
    app.store
        .insert_rows(&[
            user_row("victim", "d1", "e1", 1, "secret"),
            user_row("$gt", "d1", "e2", 1, "dollar thread"),
        ])
        .await;
    for id in [r#"{"$ne":1}"#, "$ne", r#"{"$gt":""}"#] {
        let reply = app.api.history(id, "").await;
        assert_eq!(reply.status, 200, "{id}: {}", reply.body);
        assert_eq!(
            reply.json(),
            json!({"thread_id": id, "messages": []}),
            "{id}"
        );
    }
    let reply = app.api.history("$gt", "").await;
    assert_eq!(
        reply.json()["messages"],
        turns(&[("user", "dollar thread")])
    );
}

#[tokio::test]
async fn reads_beyond_the_hydration_limit_wait_within_the_store_timeout_then_answer_503() {
    let app = spawn_app_with(|c| {
        c.bounds.store_timeout = Duration::from_millis(1_000);
        c.cache.concurrent_hydrations = 1;
    })
    .await;
    // A frozen store holds the one slot for the whole timeout.
    app.mongo.pause();
    let started = Instant::now();
    let replies = futures_util::future::join_all(
        ["t-slot-1", "t-slot-2", "t-slot-3"].map(|thread| app.api.history(thread, "")),
    )
    .await;
    let elapsed = started.elapsed();
    app.mongo.resume();
    for reply in &replies {
        assert_eq!(reply.status, 503, "{}", reply.body);
        assert_eq!(reply.json()["error"]["code"], "store_unavailable");
    }
    // Every read ended within its own timeout, not one timeout after another: the slot's holder at its deadline,
    // each waiter with what was left of its own (the slot passes in arrival order, so a waiter usually gets it just
    // before its deadline and times out in the store; one that does not counts in
    // `history_view_hydration_slot_timeouts_total`).
    assert!(elapsed < Duration::from_millis(1_900), "{elapsed:?}");
    // Once the store answers, reads work again.
    assert_eq!(app.api.history("t-slot-1", "").await.status, 200);
}
