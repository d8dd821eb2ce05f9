//! The Conversations items and read-your-writes over HTTP on a live worker: a read waiting for a run answers as
//! soon as the run's stop arrives live (and says when it gave up), and waiting reads take no in-flight permit.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_support::rows::{self, Event};
use test_support::servers::{MongoServer, NatsServer};

use crate::helpers::{BinaryApp, Reply, TestStore, publish_rows, unique, user_row};
use crate::scene::{now_ns, wait_metric};

/// A row of run `run` of agent `A` on display `d1`: a chunk, or its stop with `full` as the whole answer.
fn run_row(
    thread: &str,
    run: &str,
    event_id: &str,
    at: i64,
    chunk: Option<&str>,
    full: &str,
) -> Value {
    let event = |name, parents| Event {
        agent: ("A", "a1"),
        thread,
        display: "d1",
        run,
        event_id,
        name,
        parents,
        created_at: at,
    };
    match chunk {
        Some(text) => event("ChunkEvent", rows::CHUNK).row(rows::chunk(text)),
        None => event("LLMStopEvent", rows::LLM_STOP).row(json!({
            "output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": full}]}]
        })),
    }
}

async fn worker(
    extra: &[(&'static str, &str)],
) -> (NatsServer, MongoServer, BinaryApp, async_nats::Client) {
    let nats = NatsServer::start();
    let mongo = MongoServer::start();
    let database = unique("ryw");
    TestStore::connect(&mongo.uri(), &database)
        .await
        .create_aihub_indexes()
        .await;
    let mut env = vec![
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let app = BinaryApp::start(&env).await;
    app.wait_ready().await;
    let publisher = async_nats::connect(nats.url()).await.expect("publisher");
    (nats, mongo, app, publisher)
}

/// A thread with a user turn and a streaming answer of run `r1` (no stop yet), read once from memory; returns
/// when the user turn was made (`created_at`).
async fn streaming(app: &BinaryApp, publisher: &async_nats::Client, thread: &str) -> i64 {
    let asked = now_ns(0);
    let rows = [
        user_row(thread, "d1", "u1", asked, "Q"),
        run_row(thread, "r1", "c1", now_ns(1), Some("Hel"), ""),
    ];
    publish_rows(publisher, &rows).await;
    app.api.wait_for_events(2).await;
    let items = app.api.items(thread, "order=asc").await;
    assert_eq!(items.status, 200, "{}", items.body);
    assert_eq!(
        items.json()["data"][1]["status"],
        "in_progress",
        "{}",
        items.body
    );
    asked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_waiting_for_a_run_answers_when_its_stop_arrives_live() {
    let (_nats, _mongo, app, publisher) = worker(&[]).await;
    let thread = "ryw-thread";
    streaming(&app, &publisher, thread).await;

    // Waiting for r1: answered once its stop (which also supplies the unstreamed end) arrives, not before.
    let api = app.api.clone();
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let reply = api
            .items(
                thread,
                "order=asc&agent_class=A&agent_id=a1&wait_for_run=r1&wait_ms=5000",
            )
            .await;
        (reply, started.elapsed())
    });
    // It waits (counted by the gauge) and is not answered while the run goes on.
    wait_metric(&app.api, "history_view_http_waiting_reads", 1.0).await;
    assert!(!waiting.is_finished(), "answered before the run finished");
    publish_rows(
        &publisher,
        &[run_row(thread, "r1", "s1", now_ns(2), None, "Hello")],
    )
    .await;
    let (reply, took): (Reply, Duration) = waiting.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-history-run-pending"), None);
    let item = &reply.json()["data"][1];
    assert_eq!(item["status"], "completed", "{}", reply.body);
    assert_eq!(item["content"][0]["text"], "Hello", "{}", reply.body);
    assert!(took < Duration::from_secs(4), "{took:?}");

    // The same on the history: a finished run answers at once.
    let reply = app
        .api
        .history(thread, "agent_class=A&agent_id=a1&wait_for_run=r1")
        .await;
    assert_eq!(reply.header("x-history-run-pending"), None);
    assert_eq!(reply.json()["messages"][1]["content"][0]["text"], "Hello");

    // A run that does not finish within the wait: the answer as it is, saying so.
    let started = Instant::now();
    let reply = app.api.history(thread, "wait_for_run=r2&wait_ms=200").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-history-run-pending"), Some("r2"));
    assert!(started.elapsed() >= Duration::from_millis(200));

    // Bad waits are refused, naming the parameter.
    for (query, needle) in [
        ("wait_for_run=r1&wait_ms=5001", "wait_ms"),
        ("wait_for_run=r1&wait_ms=x", "wait_ms"),
        ("wait_ms=10", "wait_for_run"),
        ("wait_for_run=", "wait_for_run"),
    ] {
        let reply = app.api.history(thread, query).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.body);
        assert_eq!(reply.json()["error"]["code"], "invalid_query");
        assert!(reply.body.contains(needle), "{query}: {}", reply.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_reads_take_no_in_flight_permit_and_are_bounded_by_their_own_setting() {
    let (_nats, _mongo, app, publisher) = worker(&[
        ("HISTORY_VIEW_HTTP_MAX_IN_FLIGHT", "1"),
        ("HISTORY_VIEW_HTTP_MAX_WAITING", "2"),
    ])
    .await;
    let thread = "ryw-permits";
    streaming(&app, &publisher, thread).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let api = app.api.clone();
            tokio::spawn(async move { api.history(thread, "wait_for_run=r9&wait_ms=5000").await })
        })
        .collect();
    // Both wait (counted by the gauge); a third is refused; plain reads still get the one in-flight permit.
    wait_metric(&app.api, "history_view_http_waiting_reads", 2.0).await;
    let third = app.api.history(thread, "wait_for_run=r9&wait_ms=0").await;
    assert_eq!(third.status, 503, "{}", third.body);
    assert_eq!(third.json()["error"]["code"], "overloaded");
    for _ in 0..5 {
        let plain = app.api.history(thread, "").await;
        assert_eq!(plain.status, 200, "{}", plain.body);
        let page = app.api.items(thread, "limit=1").await;
        assert_eq!(page.status, 200, "{}", page.body);
    }
    let metrics = app.api.metrics().await;
    assert!(
        metrics.contains("history_view_http_refused_total{reason=\"waiting\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("history_view_http_refused_total{reason=\"in_flight\"} 0"));
    // The stop ends both waits.
    publish_rows(
        &publisher,
        &[run_row(thread, "r9", "s9", now_ns(3), None, "")],
    )
    .await;
    for waiter in waiters {
        let reply = waiter.await.unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header("x-history-run-pending"),
            None,
            "{}",
            reply.body
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn items_and_the_conversation_answer_errors_in_the_history_shape() {
    let (_nats, _mongo, app, publisher) = worker(&[]).await;
    let thread = "conv-errors";
    let asked = streaming(&app, &publisher, thread).await;
    for (query, code) in [
        ("limit=0", "invalid_query"),
        ("limit=101", "invalid_query"),
        ("limit=x", "invalid_query"),
        // Numbers are plain decimal digits: no sign, no leading zero, no space.
        ("limit=+5", "invalid_query"),
        ("limit=%2B5", "invalid_query"),
        ("limit=05", "invalid_query"),
        ("limit=%205", "invalid_query"),
        ("wait_for_run=r&wait_ms=0100", "invalid_query"),
        ("order=up", "invalid_query"),
        ("after=msg_0123", "invalid_cursor"),
        (
            "after=msg_00000000000000000000000000000000",
            "invalid_cursor",
        ),
        ("agent_class=A", "incomplete_identity"),
    ] {
        let reply = app.api.items(thread, query).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.body);
        assert_eq!(reply.json()["error"]["code"], code, "{query}");
    }
    // `include` is accepted and ignored; the default page is the newest 20, newest first.
    let page = app
        .api
        .items(thread, "include[]=message.output_text.logprobs&include=x")
        .await;
    assert_eq!(page.status, 200, "{}", page.body);
    let page = page.json();
    assert_eq!(page["data"][0]["role"], "assistant");
    assert_eq!(page["has_more"], false);
    // ETag and 304 as on the history.
    let first = app.api.items(thread, "").await;
    let etag = first.header("etag").unwrap().to_owned();
    assert!(first.source().is_some());
    let again = app
        .api
        .get(
            &format!("/v1/conversations/{thread}/items"),
            &[("if-none-match", &etag)],
        )
        .await;
    assert_eq!(again.status, 304);
    // A thread without a visible display has no conversation; its items list is empty.
    let none = app.api.get("/v1/conversations/conv-none", &[]).await;
    assert_eq!(none.status, 404, "{}", none.body);
    assert_eq!(none.json()["error"]["code"], "not_found");
    let empty = app.api.items("conv-none", "").await.json();
    assert_eq!(
        empty,
        json!({"object": "list", "data": [], "first_id": null, "last_id": null, "has_more": false})
    );
    let conversation = app
        .api
        .get(&format!("/v1/conversations/{thread}"), &[])
        .await;
    assert_eq!(conversation.status, 200, "{}", conversation.body);
    assert_eq!(conversation.json()["object"], "conversation");
    assert_eq!(
        conversation.json()["created_at"],
        json!(asked.div_euclid(1_000_000_000))
    );
}
