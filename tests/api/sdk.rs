//! The Conversations endpoints through the official OpenAI Python SDK (`tests/sdk/conversations.py`, `openai` as
//! pinned in `scripts/services.sh`, strict response validation on): every store conformance case and random
//! threads, listed with the SDK's auto-pagination in both orders and several limits, read as exactly the history's
//! messages, with the same text and parts; and `conversations.retrieve`. Both run with the SDK's default retries;
//! `tests/sdk/retries.py` shows which error answers the SDK sends again, counted by the worker.

use std::collections::HashSet;

use serde_json::{Value, json};
use test_support::process::temp_dir;
use test_support::reference;
use test_support::servers::{MongoServer, NatsServer, python};

use crate::cases;
use crate::helpers::{BinaryApp, TestStore, chunk_row, item_to_message, unique, user_row};
use crate::threads;
use test_support::scrape::metric;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_sdk_pages_every_thread_as_the_history() {
    let mongo = MongoServer::start();
    let nats = NatsServer::start();
    let database = unique("sdk");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let cases: Vec<cases::Case> = cases::load("store")
        .into_iter()
        .enumerate()
        .map(|(i, case)| case.on_thread(format!("sdk-case-{i}")))
        .collect();
    let generated = threads::generated("sdk-random", 20);
    let mut rows: Vec<Value> = cases.iter().flat_map(|c| c.rows.clone()).collect();
    rows.extend(generated.iter().flat_map(|(_, t)| t.rows.clone()));
    store.insert_rows(&rows).await;
    let app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
    ])
    .await;
    app.wait_ready().await;

    // Each thread with its read's identity, and its rows in store order (what the reference reads).
    let mut threads: Vec<(String, Value, Vec<Value>)> = cases
        .iter()
        .map(|case| {
            let query = match &case.primary {
                Some(p) => json!({"agent_class": p.agent_class, "agent_id": p.agent_id}),
                None => json!({}),
            };
            let own: Vec<Value> = rows_of(&case.rows, &case.thread_id);
            (case.thread_id.clone(), query, own)
        })
        .collect();
    threads.extend(
        generated
            .iter()
            .map(|(id, thread)| (id.clone(), json!({}), thread.rows.clone())),
    );
    threads.push(("sdk-no-such-thread".into(), json!({}), Vec::new()));
    let listed: Vec<Value> = threads
        .iter()
        .map(|(thread, query, _)| json!({"thread": thread, "query": query}))
        .collect();
    let dir = temp_dir("sdk");
    let input = dir.join("threads.json");
    std::fs::write(&input, serde_json::to_vec(&listed).unwrap()).unwrap();
    let base_url = format!("{}/v1", app.api.address);
    let input = input.to_string_lossy().into_owned();
    let report = run_script("conversations.py", vec![base_url, input]).await;

    let mut failures = Vec::new();
    let mut paged = 0;
    for (thread, query, own) in &threads {
        let query_string = query
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
            .collect::<Vec<_>>()
            .join("&");
        let expected = app.api.history(thread, &query_string).await.json()["messages"].clone();
        // The naive reference's answer over the thread's rows, for the history and the conversation.
        let identity = query["agent_class"]
            .as_str()
            .map(|class| (class, query["agent_id"].as_str().unwrap()));
        let answer = reference::history(thread, own, identity);
        if expected != answer.messages {
            failures.push(format!(
                "{thread} history:\n  reference {}\n  served    {expected}",
                answer.messages
            ));
        }
        let read = &report[thread.as_str()];
        let lists = read["lists"].as_object().expect("lists");
        let mut ids_seen: Option<Vec<Value>> = None;
        for (walk, items) in lists {
            let mut items = items.as_array().unwrap().clone();
            if walk.starts_with("desc") || walk.starts_with("default") {
                items.reverse();
            }
            let messages = Value::Array(items.iter().map(item_to_message).collect());
            if messages != expected {
                failures.push(format!(
                    "{thread} {walk}:\n  expected {expected}\n  actual   {messages}"
                ));
            }
            let ids: Vec<Value> = items.iter().map(|i| i["id"].clone()).collect();
            let unique: HashSet<String> = ids.iter().map(Value::to_string).collect();
            if unique.len() != ids.len() {
                failures.push(format!("{thread} {walk}: item ids repeat: {ids:?}"));
            }
            match &ids_seen {
                Some(seen) if seen != &ids => {
                    failures.push(format!("{thread} {walk}: other ids than another walk"))
                }
                _ => ids_seen = Some(ids),
            }
            paged += 1;
        }
        // The conversation exists when a display is visible; it began with the first visible event.
        let conversation = &read["conversation"];
        let wanted = if answer.visible {
            json!({
                "id": thread,
                "object": "conversation",
                "created_at": answer.first_visible_at.map_or(0, |ns| ns.div_euclid(1_000_000_000)),
                "metadata": {},
            })
        } else {
            json!({"error": 404})
        };
        if conversation != &wanted {
            failures.push(format!(
                "{thread} conversation: expected {wanted}, got {conversation}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("{} threads, {paged} SDK walks", threads.len());
}

/// The rows of `thread` among `rows` (a case's other threads' rows stay out), in store order.
fn rows_of(rows: &[Value], thread: &str) -> Vec<Value> {
    rows.iter()
        .filter(|row| row["thread_id"] == thread)
        .cloned()
        .collect()
}

/// Issue 37: with its default retries, the official SDK made three requests of one `items.list` of a too-large
/// thread (507), each a full store read, because it retries every 5xx. The permanent errors now say
/// `x-should-retry: false`: the worker receives exactly one request for each of a 507, a 404, a 400 and a 405 (the
/// last with its JSON body, whose code the SDK reports). An overload (503 with `Retry-After`) is still retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_sdk_sends_a_permanent_error_once_and_retries_an_overload() {
    let mongo = MongoServer::start();
    let nats = NatsServer::start();
    let database = unique("sdk-retries");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let big = "x".repeat(100_000);
    store
        .insert_rows(&[
            user_row("sdk-too-large", "d1", "u1", 1, "Q"),
            chunk_row("sdk-too-large", "d1", "A", "c1", 2, &big),
            chunk_row("sdk-too-large", "d1", "A", "c2", 3, &big),
            user_row("sdk-small", "d1", "u2", 1, "Q"),
            chunk_row("sdk-small", "d1", "A", "c3", 2, "A"),
        ])
        .await;
    let app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        ("HISTORY_VIEW_MAX_THREAD_BYTES", "64KiB".to_owned()),
        // One read at a time: a read held in flight turns the next into a 503 overloaded.
        ("HISTORY_VIEW_HTTP_MAX_IN_FLIGHT", "1".to_owned()),
        ("HISTORY_VIEW_STORE_TIMEOUT_MS", "60000".to_owned()),
    ])
    .await;
    app.wait_ready().await;
    let base_url = format!("{}/v1", app.api.address);
    let errors = |text: &str, status: u16| {
        metric(
            text,
            &format!("history_view_read_errors_total{{code=\"{status}\"}}"),
        )
    };

    let mut default_retries = 0;
    for (call, thread, status, code) in [
        ("too_large", "sdk-too-large", 507, "thread_too_large"),
        ("not_found", "sdk-no-such-thread", 404, "not_found"),
        ("bad_request", "sdk-small", 400, "invalid_query"),
        ("method_not_allowed", "sdk-small", 405, "method_not_allowed"),
    ] {
        let before = errors(&app.api.metrics().await, status);
        let report = run_retries(&base_url, thread, call).await;
        assert_eq!(report[call]["status"], status, "{call}: {report}");
        assert_eq!(report[call]["code"], code, "{call}: {report}");
        let received = errors(&app.api.metrics().await, status) - before;
        assert_eq!(
            received, 1.0,
            "{call}: the worker received {received} requests"
        );
        default_retries = report["max_retries"].as_u64().expect("the SDK's default");
    }
    // Otherwise the counts above would prove nothing.
    assert!(
        default_retries >= 1,
        "the SDK's default retries: {default_retries}"
    );

    // A read of a thread not cached holds the one in-flight permit while the store is frozen; the SDK's list is
    // answered 503 overloaded with Retry-After at once, every time, and sent again after each.
    let misses = |text: &str| metric(text, "history_view_cache_misses_total");
    let misses_before = misses(&app.api.metrics().await);
    mongo.pause();
    let api = app.api.clone();
    let held = tokio::spawn(async move { api.history("sdk-held", "").await });
    let (probe_api, misses) = (&app.api, &misses);
    test_support::wait::eventually("the held read reached the store", || async move {
        let now = misses(&probe_api.metrics().await);
        test_support::wait::when(now > misses_before, || format!("{now} misses"))
    })
    .await;
    let before = errors(&app.api.metrics().await, 503);
    let report = run_retries(&base_url, "sdk-small", "overloaded").await;
    let received = errors(&app.api.metrics().await, 503) - before;
    mongo.resume();
    assert_eq!(report["overloaded"]["status"], 503, "{report}");
    assert_eq!(report["overloaded"]["code"], "overloaded", "{report}");
    assert_eq!(
        received,
        (1 + default_retries) as f64,
        "the worker received {received} requests of a retried overload"
    );
    assert_eq!(held.await.expect("the held read").status, 200);
}

/// Runs `tests/sdk/retries.py` for one call on `thread` and returns its report.
async fn run_retries(base_url: &str, thread: &str, call: &str) -> Value {
    let args = [base_url, thread, call].map(str::to_owned).to_vec();
    run_script("retries.py", args).await
}

/// Runs the SDK script `tests/sdk/<name>` with the tools' Python and `args`, and returns the JSON report it prints.
async fn run_script(name: &str, args: Vec<String>) -> Value {
    let script = format!("{}/tests/sdk/{name}", env!("CARGO_MANIFEST_DIR"));
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python())
            .arg(script)
            .args(args)
            .output()
            .expect("the tools' python runs")
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "the SDK script failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the script's JSON report")
}
