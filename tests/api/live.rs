//! The live path over a real nats-server: read-after-publish from a complete view, convergence of the live view,
//! the store path and the naive reference (`test_support::reference`) over random threads, gap safety across a
//! NATS restart, shared hydration, warnings once per view, and the cache's byte budget.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;
use serde_json::{Value, json};

use crate::helpers::{
    Api, chunk_row, metric, metric_sum, publish_rows, spawn_app, spawn_app_with, turns, user_row,
};
use crate::threads::{self, PRIMARY};
use test_support::reference;
use test_support::wait::eventually;

/// Reads until `check` accepts the body, and returns that body and its source; fails at the limit naming the last
/// body read.
async fn read_until(
    api: &Api,
    thread: &str,
    query: &str,
    check: impl Fn(&Value) -> bool,
) -> (Value, String) {
    let check = &check;
    eventually(
        &format!("{thread}?{query}: an answer the test accepts"),
        || async move {
            let reply = api.history(thread, query).await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            let body = reply.json();
            let source = reply.source().unwrap_or_default().to_owned();
            if check(&body) {
                Ok((body, source))
            } else {
                Err(format!("from {source:?}: {body}"))
            }
        },
    )
    .await
}

#[tokio::test]
async fn an_event_published_live_appears_in_the_next_read_of_a_complete_view() {
    let app = spawn_app().await;
    let thread = "t-read-after-publish";
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "Q")])
        .await;
    let first = app.api.history(thread, "").await;
    assert_eq!(first.source(), Some("store"));
    assert_eq!(first.json()["messages"], turns(&[("user", "Q")]));

    // Published live only: the store never gets it.
    publish_rows(
        &app.publisher,
        &[chunk_row(thread, "d1", "A", "e2", 2, "streamed")],
    )
    .await;
    // Counted once applied to its view: the very next read has it, from memory.
    app.api.wait_for_events(1).await;
    let next = app.api.history(thread, "").await;
    assert_eq!(next.status, 200, "{}", next.body);
    assert_eq!(
        next.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "streamed")])
    );
    assert_eq!(next.source(), Some("cache"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_view_store_path_and_projector_converge_on_random_threads() {
    const THREADS: usize = 200;
    let warm = spawn_app().await;
    let mut runner = TestRunner::deterministic();
    let generated: Vec<(String, threads::Thread, bool)> = (0..THREADS)
        .map(|i| {
            let id = format!("conv-{i}");
            let thread = threads::thread(id.clone())
                .new_tree(&mut runner)
                .expect("a thread")
                .current();
            (id, thread, i % 2 == 0)
        })
        .collect();
    let query = |with_primary: bool| {
        if with_primary {
            format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1)
        } else {
            String::new()
        }
    };

    // Complete, empty views first, so what follows is applied live to complete views.
    for (id, _, with_primary) in &generated {
        assert_eq!(
            warm.api.history(id, &query(*with_primary)).await.status,
            200
        );
    }
    let delivered: Vec<Value> = generated
        .iter()
        .flat_map(|(_, t, _)| t.delivered.clone())
        .collect();
    publish_rows(&warm.publisher, &delivered).await;
    warm.api.wait_for_events(delivered.len() as u64).await;
    let live: Vec<String> = futures_util::stream::iter(&generated)
        .then(|(id, _, with_primary)| {
            let api = warm.api.clone();
            async move {
                // The live view's answer: from memory, the views having been complete before the events came.
                let reply = api.history(id, &query(*with_primary)).await;
                assert_eq!(reply.source(), Some("cache"), "{id}: {}", reply.body);
                reply.body
            }
        })
        .collect()
        .await;

    // The store gets the same deliveries (one row per delivery, as aihub's replicas write them). The cold worker
    // runs unhinted: the test server walks the whole collection for a hinted query, which at this size would
    // exceed the read timeout (index use is the store tests' subject, not this one's).
    let cold = spawn_app_with(|c| c.store.index_hint = String::new()).await;
    cold.store.insert_rows(&delivered).await;
    for (i, (id, thread, with_primary)) in generated.iter().enumerate() {
        let stored = cold.api.history(id, &query(*with_primary)).await;
        assert_eq!(stored.source(), Some("store"));
        // The expected answer: the naive reference over the thread's rows (not the worker's own projector).
        let expected = reference::history(id, &thread.rows, with_primary.then_some(PRIMARY));
        let expected = serde_json::to_string(
            &serde_json::json!({"thread_id": id, "messages": expected.messages}),
        )
        .unwrap();
        assert_eq!(stored.body, expected, "{id}: store path vs reference");
        assert_eq!(live[i], expected, "{id}: live view vs reference");
    }
    let visible = live
        .iter()
        .filter(|b| !b.contains("\"messages\":[]"))
        .count();
    assert!(
        visible > THREADS / 2,
        "only {visible} threads have visible history: the generator is too sparse"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_downgrades_views_and_events_written_during_the_outage_appear() {
    let mut app = spawn_app().await;
    let thread = "t-gap";
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "Q")])
        .await;
    assert_eq!(app.api.history(thread, "").await.source(), Some("store"));
    assert_eq!(app.api.history(thread, "").await.source(), Some("cache"));

    // Events keep flowing for another thread while the server goes away and comes back.
    let url = app.nats.url();
    let flowing = tokio::spawn(async move {
        let Ok(client) = async_nats::connect(url).await else {
            return;
        };
        for i in 0..200 {
            let row = chunk_row("t-flow", "d1", "A", &format!("f{i}"), i, "x");
            let _ = client
                .publish(
                    threads::subject(&row),
                    serde_json::to_vec(&row["event_data"]).unwrap().into(),
                )
                .await;
            // A load generator's pacing (events keep flowing through the outage), not a wait for anything.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    app.nats.stop();
    app.api.wait_readiness(false).await;
    // Persisted by aihub while this worker could not hear it.
    app.store
        .insert_rows(&[chunk_row(thread, "d1", "A", "e2", 2, "during outage")])
        .await;
    app.nats.restart();
    app.wait_ready().await;
    let _ = flowing.await;

    let (body, source) = read_until(&app.api, thread, "", |b| {
        b["messages"].as_array().is_some_and(|m| m.len() == 2)
    })
    .await;
    assert_eq!(
        body["messages"],
        turns(&[("user", "Q"), ("assistant", "during outage")])
    );
    assert_eq!(source, "store", "the downgraded view was hydrated again");
    let metrics = app.api.metrics().await;
    assert!(
        metric(&metrics, "history_view_views_downgraded_total") >= 1.0,
        "{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "history_view_nats_connection_events_total{event=\"disconnected\"}"
        ) >= 1.0
    );

    // The reconnected subscription delivers again: a new live event reaches the complete view.
    publish_rows(
        &app.publisher,
        &[chunk_row(thread, "d1", "A", "e3", 3, " and after")],
    )
    .await;
    let (body, source) = read_until(&app.api, thread, "", |b| {
        b.to_string().contains("and after")
    })
    .await;
    assert_eq!(
        body["messages"],
        turns(&[("user", "Q"), ("assistant", "during outage and after")])
    );
    assert_eq!(source, "cache");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_readers_of_a_cold_thread_share_one_hydration() {
    // Without a bound the hydration completes the view; within one (right after start) the view stays partial and
    // the readers that waited share the hydration's answer all the same.
    for bound in [Duration::ZERO, Duration::from_secs(30)] {
        let app = spawn_app_with(|c| c.bounds.persist_lag = bound).await;
        let thread = "t-shared";
        app.store
            .insert_rows(&[
                user_row(thread, "d1", "e1", 1, "Q"),
                chunk_row(thread, "d1", "A", "e2", 2, "A"),
            ])
            .await;
        // The store is frozen while the readers arrive, so all of them are waiting when the first hydration runs
        // (a reader arriving after it finished would rightly read again: within the bound the view is partial).
        app.mongo.pause();
        let barrier = Arc::new(tokio::sync::Barrier::new(17));
        let readers: Vec<_> = (0..16)
            .map(|_| {
                let (api, barrier) = (app.api.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    api.history(thread, "").await
                })
            })
            .collect();
        barrier.wait().await;
        // Every reader has missed the cache (counted just before it runs or joins the hydration, with no wait in
        // between) before the store is let go.
        crate::scene::wait_metric(&app.api, "history_view_cache_misses_total", 16.0).await;
        app.mongo.resume();
        for reader in readers {
            let reply = reader.await.unwrap();
            assert_eq!(reply.status, 200);
            assert_eq!(
                reply.json()["messages"],
                turns(&[("user", "Q"), ("assistant", "A")])
            );
        }
        let metrics = app.api.metrics().await;
        assert_eq!(
            metric(&metrics, "history_view_hydrations_total{result=\"ok\"}"),
            1.0,
            "bound {bound:?}: {metrics}"
        );
        assert_eq!(
            metric(
                &metrics,
                "history_view_store_query_duration_seconds_count{stage=\"markers\"}"
            ),
            1.0
        );
    }
}

#[tokio::test]
async fn a_malformed_visible_event_is_warned_about_once_not_on_every_read() {
    let app = spawn_app().await;
    let thread = "t-warn";
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "Q")])
        .await;
    app.api.history(thread, "").await;
    let mut bad = chunk_row(thread, "d1", "A", "e2", 2, "x");
    bad["event_data"]["content"] = Value::from(12345);
    publish_rows(
        &app.publisher,
        &[bad, chunk_row(thread, "d1", "A", "e3", 3, "ok")],
    )
    .await;
    read_until(&app.api, thread, "", |b| b.to_string().contains("ok")).await;
    for _ in 0..3 {
        app.api.history(thread, "").await;
        app.api.history(thread, "agent_class=A&agent_id=a1").await;
    }
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(&metrics, "history_view_malformed_event_warnings_total"),
        1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_stays_within_its_byte_budget_while_many_threads_stream_in() {
    const BUDGET: u64 = 256 * 1024;
    let app = spawn_app_with(|c| c.cache.max_bytes = BUDGET).await;
    let mut rows = Vec::new();
    for t in 0..2_000 {
        let thread = format!("mem-{t}");
        rows.push(user_row(&thread, "d1", "u", 1, "question"));
        for c in 0..4 {
            rows.push(chunk_row(
                &thread,
                "d1",
                "A",
                &format!("c{c}"),
                2 + c,
                &"x".repeat(200),
            ));
        }
    }
    for batch in rows.chunks(1_000) {
        publish_rows(&app.publisher, batch).await;
        let metrics = app.api.metrics().await;
        let weighted = metric(&metrics, "history_view_cache_weighted_bytes");
        assert!(
            weighted <= BUDGET as f64,
            "weighted size {weighted} exceeds the budget {BUDGET}"
        );
    }
    app.api.wait_for_events(rows.len() as u64).await;
    let metrics = app.api.metrics().await;
    let weighted = metric(&metrics, "history_view_cache_weighted_bytes");
    let entries = metric(&metrics, "history_view_cache_entries");
    assert!(
        weighted <= BUDGET as f64,
        "weighted size {weighted} exceeds the budget {BUDGET}"
    );
    assert!(
        weighted > (BUDGET / 2) as f64,
        "the cache barely holds anything ({weighted} bytes)"
    );
    assert!(entries < 2_000.0, "nothing was evicted ({entries} entries)");
    assert_eq!(
        metric_sum(&metrics, "history_view_events_total"),
        rows.len() as f64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_drop_downgrades_complete_views() {
    let app = spawn_app_with(|c| c.nats.subscription_capacity = 4).await;
    let thread = "t-slow";
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "Q")])
        .await;
    app.api.history(thread, "").await;
    assert_eq!(app.api.history(thread, "").await.source(), Some("cache"));

    // Far more than the subscription buffers, as fast as the publisher can go.
    let flood: Vec<_> = (0..20_000)
        .map(|i| chunk_row("t-flood", "d1", "A", &format!("f{i}"), i, "x"))
        .collect();
    publish_rows(&app.publisher, &flood).await;
    crate::scene::wait_drops(&app.api, 1.0).await;
    // The view that may have missed events is hydrated again, and counted as downgraded when found so.
    assert_eq!(app.api.history(thread, "").await.source(), Some("store"));
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(&metrics, "history_view_views_downgraded_total"),
        1.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn a_hidden_display_made_visible_live_brings_back_its_earlier_persisted_events() {
    let app = spawn_app().await;
    let thread = "t-reveal";
    let mut question = chunk_row(thread, "d-hidden", "Travel", "q1", 3, "");
    question["event_name"] = json!("HumanInTheLoopChatRequestEvent");
    question["event_parents"] = json!([
        "HumanInTheLoopChatRequestEvent",
        "HumanInTheLoopRequestEvent"
    ]);
    question["event_data"] = json!({"created_at": 3, "question": "Which dates?",
        "_parent_event_names": ["HumanInTheLoopChatRequestEvent", "HumanInTheLoopRequestEvent"]});
    // Persisted before this worker ever saw the thread; the question's display is hidden so far.
    app.store
        .insert_rows(&[
            user_row(thread, "d1", "e1", 1, "Q"),
            chunk_row(thread, "d1", "A", "e2", 2, "A"),
            question,
        ])
        .await;
    assert_eq!(
        app.api.history(thread, "").await.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "A")])
    );
    assert_eq!(app.api.history(thread, "").await.source(), Some("cache"));

    // The user's answer lands on the hidden display (live, and persisted by aihub): both question and answer appear.
    let mut answer = user_row(thread, "d-hidden", "a1", 4, "");
    answer["event_name"] = json!("HumanInTheLoopChatResponseEvent");
    answer["event_parents"] = json!([
        "HumanInTheLoopChatResponseEvent",
        "HumanInTheLoopResponseEvent"
    ]);
    answer["event_data"] = json!({"created_at": 4, "response": "Next weekend",
        "_parent_event_names": ["HumanInTheLoopChatResponseEvent", "HumanInTheLoopResponseEvent"]});
    publish_rows(&app.publisher, std::slice::from_ref(&answer)).await;
    app.store.insert_rows(&[answer]).await;
    let (body, _) = read_until(&app.api, thread, "", |b| {
        b["messages"].as_array().is_some_and(|m| m.len() == 4)
    })
    .await;
    assert_eq!(
        body["messages"],
        turns(&[
            ("user", "Q"),
            ("assistant", "A"),
            ("assistant", "Which dates?"),
            ("user", "Next weekend")
        ])
    );
}

#[tokio::test]
async fn a_message_carrying_a_traceparent_is_applied_and_with_tracing_off_nothing_of_it_is_kept() {
    let app = spawn_app().await;
    let thread = "t-traceparent-off";
    app.store
        .insert_rows(&[user_row(thread, "d1", "e1", 1, "Q")])
        .await;
    assert_eq!(app.api.history(thread, "").await.source(), Some("store"));
    // As aihub publishes: W3C trace context in the headers (a name in another case, flags 03).
    let row = chunk_row(thread, "d1", "A", "e2", 2, "streamed");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "Traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",
    );
    app.publisher
        .publish_with_headers(
            test_support::rows::subject(&row),
            headers,
            test_support::rows::payload(&row).into(),
        )
        .await
        .expect("publish");
    app.publisher.flush().await.expect("flush");
    let (body, source) = read_until(&app.api, thread, "", |b| {
        b["messages"].as_array().is_some_and(|m| m.len() == 2)
    })
    .await;
    assert_eq!(
        body["messages"],
        turns(&[("user", "Q"), ("assistant", "streamed")])
    );
    assert_eq!(source, "cache");
    // No endpoint set: the header was not read, so explain names no publisher trace.
    let explanation = crate::explain::explain(&app.api, thread, "").await;
    assert_eq!(explanation.status, 200, "{}", explanation.body);
    let events = explanation.json()["events"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(events.len(), 2, "{}", explanation.body);
    assert!(
        events.iter().all(|e| e.get("publisher_trace_id").is_none()),
        "{}",
        explanation.body
    );
}
