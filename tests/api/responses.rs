//! A run resumed as an OpenAI Responses background stream with the official Python SDK (`openai`, pinned by
//! scripts/services.sh; tests/clients/responses_resume.py, strict response validation): random runs published live
//! (the resume tests' conversations) followed with `responses.retrieve(run, stream=True, starting_after=N)` from
//! the last sequence number seen after each random disconnect, every event typed and numbered without a gap or a
//! repeat, each run assembled to exactly its Conversations item; and, on a finished run, from memory and from a cold
//! worker's store read, every cursor resumes exactly after itself.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use test_support::json_lines::JsonLines;

use crate::helpers::{Api, BinaryApp, spawn_app};
use crate::resume::{PRIMARY, Rng, items, open_threads, seed};
use test_support::rows;

const THREADS: usize = 30;

/// The Python client (tests/clients/responses_resume.py) with the `openai` SDK.
struct PythonClient(JsonLines);

impl PythonClient {
    fn start() -> Self {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/");
        let mut python = tokio::process::Command::new(format!("{root}.tools/venv/bin/python"));
        python.arg(format!("{root}tests/clients/responses_resume.py"));
        Self(JsonLines::start(python))
    }

    /// `command`'s answer; fails on an error the client reports.
    async fn ask(&self, command: Value) -> Value {
        let reply = self.0.ask(command.clone(), Duration::from_secs(120)).await;
        assert!(reply.get("error").is_none(), "{command}: {reply}");
        reply
    }
}

/// The base URL a client of `thread` through `api` gives the SDK.
fn base(api: &Api, thread: &str) -> String {
    format!("{}/v1/threads/{thread}", api.address)
}

/// The read's identity, as the SDK's extra query: the primary agent, whose stops end its runs.
fn identity() -> Value {
    json!({"agent_class": PRIMARY.0, "agent_id": PRIMARY.1})
}

/// The runs of a conversation's rows, in order.
fn runs(rows: &[Value]) -> Vec<String> {
    let mut runs: Vec<String> = Vec::new();
    for row in rows {
        let run = row["run_id"].as_str().unwrap().to_owned();
        if row["agent_class"] == PRIMARY.0 && !runs.contains(&run) {
            runs.push(run);
        }
    }
    runs
}

/// A session's parts as the items show its message's text: texts and questions, in order.
fn parts_text(reply: &Value) -> String {
    reply["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|part| {
            part["text"]
                .as_str()
                .or(part["question"].as_str())
                .unwrap()
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_resumes_runs_after_their_last_sequence_number_and_every_cursor_is_exact() {
    let app = Arc::new(spawn_app().await);
    let sdk = Arc::new(PythonClient::start());
    let conversations = open_threads(&app, "responses", THREADS, seed()).await;
    let mut tasks = Vec::new();
    for (thread, mut rng, rows) in conversations {
        let (app, sdk) = (Arc::clone(&app), Arc::clone(&sdk));
        let runs = runs(&rows);
        let sessions: Vec<_> = runs
            .iter()
            .map(|run| {
                let disconnects: Vec<u64> = (0..rng.below(6)).map(|_| 1 + rng.below(8)).collect();
                json!({"op": "session", "base": base(&app.api, &thread), "run": run, "query": identity(),
                    "disconnects": disconnects})
            })
            .collect();
        let pace = rng.next();
        let mut rng = Rng(rng.next());
        tasks.push(tokio::spawn(async move {
            let publisher = {
                let app = Arc::clone(&app);
                async move {
                    let mut rng = Rng(pace);
                    for row in &rows {
                        app.store.insert_rows(std::slice::from_ref(row)).await;
                        rows::publish(&app.publisher, std::slice::from_ref(row)).await;
                        // The agent's pace between events (the scenario's time).
                        tokio::time::sleep(Duration::from_millis(40 + rng.below(100))).await;
                    }
                }
            };
            let followers =
                futures_util::future::join_all(sessions.into_iter().map(|s| sdk.ask(s)));
            let ((), replies) = futures_util::future::join(publisher, followers).await;
            // The one run wrote every assistant item (it goes on after its question is answered).
            let found = items(&app.api, &thread).await;
            let text: String = found
                .iter()
                .skip(1)
                .step_by(2)
                .map(|(_, t)| t.as_str())
                .collect();
            assert_eq!(replies.len(), 1, "{thread}");
            let mut disconnects = 0;
            for reply in &replies {
                assert_eq!(reply["status"], "completed", "{thread}: {reply}");
                assert_eq!(
                    parts_text(reply),
                    text,
                    "{thread}: {reply}; items {found:?}"
                );
                disconnects += reply["disconnects"].as_u64().unwrap();
            }
            // The finished run read again, with a disconnect every few events: each resume after the last
            // sequence number seen ends with the same output.
            for run in &runs {
                for _ in 0..5 {
                    let cuts: Vec<u64> = (0..20).map(|_| 1 + rng.below(3)).collect();
                    let reply = sdk
                        .ask(
                            json!({"op": "session", "base": base(&app.api, &thread), "run": run,
                            "query": identity(), "disconnects": cuts}),
                        )
                        .await;
                    assert_eq!(parts_text(&reply), text, "{thread}: {reply}");
                    disconnects += reply["disconnects"].as_u64().unwrap();
                }
            }
            disconnects
        }));
    }
    let mut disconnects = 0;
    for task in tasks {
        disconnects += task.await.unwrap();
    }
    eprintln!(
        "{THREADS} threads: {disconnects} disconnects resumed after the last sequence number"
    );
    assert!(
        disconnects >= THREADS as u64,
        "too few disconnects: {disconnects}"
    );

    // Finished runs: every cursor, from memory, and from a cold worker whose first read is the store's.
    let cold = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", app.nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", app.mongo.uri()),
        (
            "HISTORY_VIEW_MONGODB_DATABASE",
            app.store.db.name().to_owned(),
        ),
        ("HISTORY_VIEW_MONGODB_INDEX_HINT", String::new()),
    ])
    .await;
    cold.wait_ready().await;
    for t in 0..3 {
        let thread = format!("responses-{t}");
        let run = "r0";
        let from_store = cold.api.history(&thread, "").await;
        for api in [&app.api, &cold.api] {
            let reply = sdk
                .ask(json!({"op": "boundary", "base": base(api, &thread), "run": run, "query": identity()}))
                .await;
            assert!(reply["events"].as_u64().unwrap() >= 6, "{reply}");
        }
        assert_eq!(from_store.status, 200);
    }
    // A run the thread does not hold is not found; a cursor without a stream is refused.
    let missing = app
        .api
        .get("/v1/threads/responses-0/responses/nope", &[])
        .await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    let refused = app
        .api
        .get("/v1/threads/responses-0/responses/r0?starting_after=3", &[])
        .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    let metrics = app.api.metrics().await;
    assert!(
        crate::helpers::metric(
            &metrics,
            "history_view_resume_requests_total{dialect=\"responses\",outcome=\"streamed\"}"
        ) >= THREADS as f64
    );
}
