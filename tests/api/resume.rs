//! Resuming a running answer with the real Vercel AI SDK (`ai`, pinned in tests/clients/node): random runs (text,
//! HITL questions and answers, late chunks that sort earlier, stops that supply the unstreamed end by the prefix
//! rule) published live while a client per thread resumes over and over, disconnecting at random points. Every
//! chunk passes the SDK's schemas; every stream that ends with the run's end assembled exactly the Conversations
//! item of its message (same id, same text, the question as its dynamic tool call, nothing doubled or missing);
//! and once a run finished the resume is idle and the `UIMessage` list ends with that item.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use test_support::json_lines::JsonLines;

use crate::helpers::{Api, TestApp, spawn_app, spawn_app_with};
use test_support::rows::{self, Event};

pub const PRIMARY: (&str, &str) = ("A", "a1");
const THREADS: usize = 120;

/// The Node client (tests/clients/ui_resume.mjs) with the AI SDK.
struct SdkClient(JsonLines);

impl SdkClient {
    fn start() -> Self {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/");
        let mut node = tokio::process::Command::new("node");
        node.arg(format!("{root}tests/clients/ui_resume.mjs"))
            .env("NODE_CLIENTS_DIR", format!("{root}.tools/node"));
        Self(JsonLines::start(node))
    }

    /// One resume of `thread` through `api`, disconnecting after `abort_after` message snapshots when given.
    async fn resume(&self, api: &Api, thread: &str, abort_after: Option<u32>) -> Value {
        let url = format!(
            "{}/v1/threads/{thread}/ui-message-stream?agent_class={}&agent_id={}",
            api.address, PRIMARY.0, PRIMARY.1
        );
        let command = json!({"url": url, "chat": thread, "abort_after": abort_after});
        self.0.ask(command, Duration::from_secs(60)).await
    }
}

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random conversation on `thread`: a question, a run streaming chunks (now and then one that sorts before the
/// chunk published before it), maybe a HITL question answered by the user after which the run goes on in a new
/// message, ending with a stop whose answer may hold an unstreamed end. Rows in publish order.
pub fn conversation(thread: &str, rng: &mut Rng) -> Vec<Value> {
    let base = crate::scene::now_ns(0);
    let mut rows_out = Vec::new();
    let mut at = base;
    let mut n = 0;
    let mut row = |agent: (&str, &str),
                   run: &str,
                   name: &str,
                   parents: &[&str],
                   created_at: i64,
                   fields: Value| {
        n += 1;
        Event {
            agent,
            thread,
            display: "d1",
            run,
            event_id: &format!("e{n:03}"),
            name,
            parents,
            created_at,
        }
        .row(fields)
    };
    at += 1_000_000;
    rows_out.push(row(
        ("UserAgent", "user-1"),
        "ru",
        "UserMessageEvent",
        rows::USER_MESSAGE,
        at,
        rows::user_message("[q]hello"),
    ));
    // One run, as aihub's agent goes on with its run once its HITL question is answered (the answer carries the
    // question's run id); a segment per assistant message.
    let run = "r0".to_owned();
    let segments = 1 + rng.below(2);
    for r in 0..segments {
        // Chunks in projector order (created_at), to compute what streamed for the prefix rule.
        let mut streamed: Vec<(i64, String)> = Vec::new();
        let chunks = 3 + rng.below(8);
        for c in 0..chunks {
            at += 1_000_000;
            let text = format!("[c{r}.{c}]part {c} ");
            // Now and then a late chunk: created just before the previous one, so it sorts first.
            let created = if c > 0 && rng.below(6) == 0 {
                streamed.last().map_or(at, |(prev, _)| prev - 1)
            } else {
                at
            };
            streamed.push((created, text.clone()));
            rows_out.push(row(
                PRIMARY,
                &run,
                "ChunkEvent",
                rows::CHUNK,
                created,
                rows::chunk(&text),
            ));
        }
        streamed.sort();
        let streamed: String = streamed.into_iter().map(|(_, t)| t).collect();
        let asks = r + 1 < segments;
        if asks {
            at += 1_000_000;
            rows_out.push(row(
                PRIMARY,
                &run,
                "HumanInTheLoopChatRequestEvent",
                rows::HITL_CHAT_REQUEST,
                at,
                json!({"question": format!("[k{r}]may I go on?"), "hitl_type": "chat"}),
            ));
            at += 1_000_000;
            rows_out.push(row(
                ("UserAgent", "user-1"),
                &run,
                "HumanInTheLoopChatResponseEvent",
                rows::HITL_CHAT_RESPONSE,
                at,
                json!({"response": format!("[h{r}]yes")}),
            ));
        } else {
            at += 1_000_000;
            let full = match rng.below(3) {
                0 => streamed.clone(),
                _ => format!("{streamed}[end{r}] and the end."),
            };
            rows_out.push(row(PRIMARY, &run, "LLMStopEvent", rows::LLM_STOP, at,
                json!({"output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": full}]}]})));
        }
    }
    rows_out
}

/// A UI message's text as the items show it: its text parts and its questions, in order.
fn ui_text(message: &Value) -> String {
    message["parts"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|part| match part["type"].as_str() {
            Some("text") => part["text"].as_str().unwrap_or_default().to_owned(),
            Some("dynamic-tool") => part["input"]["question"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        })
        .collect()
}

/// The thread's Conversations items with the primary identity, as `(id, text)` (a thread here has fewer than 100).
pub async fn items(api: &Api, thread: &str) -> Vec<(String, String)> {
    let query = format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1);
    let reply = api
        .get(
            &format!("/v1/conversations/{thread}/items?order=asc&limit=100&{query}"),
            &[],
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let page = reply.json();
    assert_eq!(page["has_more"], false, "{page}");
    page["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            let text = item["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p["text"].as_str().unwrap_or_default())
                .collect::<String>();
            (item["id"].as_str().unwrap().to_owned(), text)
        })
        .collect()
}

/// The run's seed: `RESUME_SEED` if set (to replay one), else the time; printed.
pub fn seed() -> u64 {
    let seed = std::env::var("RESUME_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("RESUME_SEED={seed}");
    seed
}

/// `count` random conversations on threads `<prefix>-<n>`, each opened by its user's question and read once, as a
/// chat page has read it before the answer comes (its view complete, so that what follows reads held threads):
/// each thread with its generator and the rest of its rows.
pub async fn open_threads(
    app: &TestApp,
    prefix: &str,
    count: usize,
    seed: u64,
) -> Vec<(String, Rng, Vec<Value>)> {
    let mut conversations = Vec::new();
    for t in 0..count {
        let thread = format!("{prefix}-{t}");
        let mut rng = Rng(seed ^ (t as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        let mut rows = conversation(&thread, &mut rng);
        let question = rows.remove(0);
        app.store.insert_rows(std::slice::from_ref(&question)).await;
        rows::publish(&app.publisher, std::slice::from_ref(&question)).await;
        conversations.push((thread, rng, rows));
    }
    for (thread, _, _) in &conversations {
        crate::scene::read_until_cache(&app.api, thread, "").await;
    }
    conversations
}

#[derive(Default)]
struct Counts {
    resumes: AtomicUsize,
    disconnects: AtomicUsize,
    ended: AtomicUsize,
    compared: AtomicUsize,
    idle: AtomicUsize,
    unavailable: AtomicUsize,
}

/// Resumes `thread` over and over (disconnecting at random points) until its conversation is published and a
/// resume is idle; checks each stream that ended with its run's end against the items.
async fn follow(
    app: &TestApp,
    sdk: &SdkClient,
    thread: &str,
    published: &tokio::sync::watch::Receiver<bool>,
    seed: u64,
    counts: &Counts,
) -> Option<Value> {
    let mut rng = Rng(seed);
    let mut last_full: Option<Value> = None;
    loop {
        let abort_after = (rng.below(10) > 0).then(|| 1 + rng.below(3) as u32);
        let reply = sdk.resume(&app.api, thread, abort_after).await;
        counts.resumes.fetch_add(1, Ordering::SeqCst);
        if let Some(error) = reply["error"].as_str() {
            // The worker's own answer under load (a store read it could not make): retried, as a client does.
            // Anything else (a chunk the SDK refused, a broken request) fails.
            assert!(
                error.contains("\"store_unavailable\"") || error.contains("\"overloaded\""),
                "{thread}: {reply}"
            );
            counts.unavailable.fetch_add(1, Ordering::SeqCst);
        } else if reply["idle"] == true {
            counts.idle.fetch_add(1, Ordering::SeqCst);
            if *published.borrow() {
                return last_full;
            }
        } else if reply["aborted"] == true {
            counts.disconnects.fetch_add(1, Ordering::SeqCst);
        } else {
            counts.ended.fetch_add(1, Ordering::SeqCst);
            let reason = reply["finish_reason"].as_str();
            if matches!(reason, Some("stop" | "tool-calls")) {
                // The run ended: the message no longer changes, and its item says exactly what was assembled.
                let message = &reply["message"];
                let id = message["id"].as_str().expect("a message id");
                let found = items(&app.api, thread).await;
                let item = found.iter().find(|(item, _)| item == id);
                assert_eq!(
                    item.map(|(_, text)| text.as_str()),
                    Some(ui_text(message).as_str()),
                    "{thread}: assembled {message} ({reason:?}); items {found:?}"
                );
                let questions = message["parts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|p| p["type"] == "dynamic-tool")
                    .count();
                assert_eq!(
                    questions,
                    usize::from(reason == Some("tool-calls")),
                    "{message}"
                );
                counts.compared.fetch_add(1, Ordering::SeqCst);
                last_full = (reason == Some("stop")).then(|| message.clone());
            }
        }
        // The client's pace between resumes (a reconnect delay, longer after an idle answer), not a wait for
        // anything.
        let pause = if reply["idle"] == true {
            40 + rng.below(40)
        } else {
            2 + rng.below(10)
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ai_sdk_resumes_random_runs_at_random_disconnect_points_without_a_part_doubled_or_missing()
 {
    let app = Arc::new(spawn_app().await);
    let sdk = Arc::new(SdkClient::start());
    let counts = Arc::new(Counts::default());
    let seed = seed();
    let mut tasks = Vec::new();
    let conversations = open_threads(&app, "resume", THREADS, seed).await;
    for (thread, mut rng, rows) in conversations {
        let (done, published) = tokio::sync::watch::channel(false);
        let (app_p, rows_p, pace) = (Arc::clone(&app), rows.clone(), rng.next());
        let publisher = tokio::spawn(async move {
            let mut rng = Rng(pace);
            for row in &rows_p {
                // The persister first, as aihub's writes within the bound.
                app_p.store.insert_rows(std::slice::from_ref(row)).await;
                rows::publish(&app_p.publisher, std::slice::from_ref(row)).await;
                // The agent's pace between events (the scenario's time).
                tokio::time::sleep(Duration::from_millis(40 + rng.below(100))).await;
            }
            let _ = done.send(true);
        });
        let (app_f, sdk_f, counts_f, follower_seed) = (
            Arc::clone(&app),
            Arc::clone(&sdk),
            Arc::clone(&counts),
            rng.next(),
        );
        tasks.push(tokio::spawn(async move {
            let last = follow(
                &app_f,
                &sdk_f,
                &thread,
                &published,
                follower_seed,
                &counts_f,
            )
            .await;
            publisher.await.unwrap();
            // The run finished: idle, and the messages end with its item, as the last full stream assembled it.
            let found = items(&app_f.api, &thread).await;
            let (last_id, last_text) = found.last().cloned().expect("items");
            let query = format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1);
            let listed = app_f
                .api
                .get(&format!("/v1/threads/{thread}/ui-messages?{query}"), &[])
                .await;
            assert_eq!(listed.status, 200, "{}", listed.body);
            let messages = listed.json()["messages"].as_array().unwrap().clone();
            assert_eq!(messages.len(), found.len(), "{thread}: {}", listed.body);
            for (message, (id, text)) in messages.iter().zip(&found) {
                assert_eq!(message["id"], id.as_str(), "{thread}");
                assert_eq!(&ui_text(message), text, "{thread}: {message}");
            }
            if let Some(last) = last {
                assert_eq!(last["id"], last_id.as_str(), "{thread}");
                assert_eq!(ui_text(&last), last_text, "{thread}");
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let metrics = app.api.metrics().await;
    eprintln!(
        "{} resumes: {} disconnected, {} ended ({} compared with the items), {} idle, {} unavailable",
        counts.resumes.load(Ordering::SeqCst),
        counts.disconnects.load(Ordering::SeqCst),
        counts.ended.load(Ordering::SeqCst),
        counts.compared.load(Ordering::SeqCst),
        counts.idle.load(Ordering::SeqCst),
        counts.unavailable.load(Ordering::SeqCst),
    );
    assert!(
        counts.disconnects.load(Ordering::SeqCst) >= 1_000,
        "too few disconnect points"
    );
    assert!(
        counts.compared.load(Ordering::SeqCst) >= THREADS / 2,
        "too few streams to their run's end"
    );
    assert!(
        crate::helpers::metric(
            &metrics,
            "history_view_resume_requests_total{dialect=\"ui_message_stream\",outcome=\"streamed\"}"
        ) >= 1_000.0,
        "{metrics}"
    );
    assert_eq!(
        crate::helpers::metric(&metrics, "history_view_feed_streams"),
        0.0,
        "every stream's slot given back"
    );
}

#[tokio::test]
async fn an_idle_thread_answers_204_or_a_lone_finish_and_bad_options_are_refused() {
    let app = spawn_app().await;
    let thread = "resume-idle";
    let idle = app
        .api
        .get(&format!("/v1/threads/{thread}/ui-message-stream"), &[])
        .await;
    assert_eq!(idle.status, 204, "{}", idle.body);
    let finish = app
        .api
        .get(
            &format!("/v1/threads/{thread}/ui-message-stream?idle=finish"),
            &[],
        )
        .await;
    assert_eq!(finish.status, 200);
    assert_eq!(
        finish
            .headers
            .get("x-vercel-ai-ui-message-stream")
            .map(|v| v.to_str().unwrap()),
        Some("v1")
    );
    assert_eq!(
        finish.body,
        "data: {\"type\":\"finish\"}\n\ndata: [DONE]\n\n"
    );
    for bad in [
        "idle=maybe",
        "idle=finish&idle=finish",
        "agent_class=A",
        "wait_for_run=r",
    ] {
        let refused = app
            .api
            .get(
                &format!("/v1/threads/{thread}/ui-message-stream?{bad}"),
                &[],
            )
            .await;
        assert_eq!(refused.status, 400, "{bad}: {}", refused.body);
    }
    let metrics = app.api.metrics().await;
    assert_eq!(
        crate::helpers::metric(
            &metrics,
            "history_view_resume_requests_total{dialect=\"ui_message_stream\",outcome=\"idle\"}"
        ),
        2.0
    );
}

/// The SSE `data` lines of `response` until one equals `until` (or the body ends); each line is a chunk or `[DONE]`.
async fn data_until(
    response: &mut reqwest::Response,
    buffer: &mut String,
    until: &str,
) -> Vec<String> {
    let mut lines = Vec::new();
    loop {
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            if let Some(data) = event.trim_end().strip_prefix("data: ") {
                lines.push(data.to_owned());
                if data == until {
                    return lines;
                }
            }
        }
        let chunk = test_support::wait::within(
            "the stream's next bytes",
            Duration::from_secs(20),
            response.chunk(),
        )
        .await
        .expect("the stream");
        match chunk {
            Some(bytes) => buffer.push_str(std::str::from_utf8(&bytes).expect("UTF-8")),
            None => return lines,
        }
    }
}

/// A stream open on a running answer: the replay, then each appended chunk as one delta on the open block, then
/// the HITL question as a dynamic tool call ending the message; the answer to the question is a user turn, and the
/// next resume is idle.
#[tokio::test]
async fn a_live_stream_appends_deltas_then_ends_on_the_question() {
    let app = spawn_app().await;
    let thread = "live-resume";
    let Running {
        mut response,
        mut buffer,
        id,
        now,
    } = open_running(&app, thread).await;
    let query = format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1);
    let block = format!("{id}_0");
    let delta = |text: &str| json!({"type": "text-delta", "id": block, "delta": text}).to_string();
    let row = |agent, name, parents, id, at, fields| {
        run_row(thread, agent, name, parents, id, at, fields)
    };
    let publish = |rows: Vec<Value>| {
        let app = &app;
        async move { store_and_publish(app, &rows).await }
    };
    publish(vec![row(
        PRIMARY,
        "ChunkEvent",
        rows::CHUNK,
        "e3",
        now + 2,
        rows::chunk("lo"),
    )])
    .await;
    assert_eq!(
        data_until(&mut response, &mut buffer, &delta("lo")).await,
        [delta("lo")]
    );
    publish(vec![row(
        PRIMARY,
        "HumanInTheLoopChatRequestEvent",
        rows::HITL_CHAT_REQUEST,
        "e4",
        now + 3,
        json!({"question": "go on?", "hitl_type": "chat"}),
    )])
    .await;
    assert_eq!(
        data_until(&mut response, &mut buffer, "[DONE]").await,
        [
            json!({"type": "text-end", "id": block}).to_string(),
            json!({"type": "tool-input-available", "toolCallId": "call_e4", "toolName": "human_input",
                "input": {"question": "go on?"}, "dynamic": true})
            .to_string(),
            json!({"type": "finish-step"}).to_string(),
            json!({"type": "finish", "finishReason": "tool-calls"}).to_string(),
            "[DONE]".to_owned(),
        ]
    );
    assert_eq!(
        response.chunk().await.unwrap(),
        None,
        "the stream ends after [DONE]"
    );
    // Awaiting input, the UI messages leave the message out (a resume gives it); answered, it is a message like
    // any other and nothing is resumable.
    let listed = app
        .api
        .get(&format!("/v1/threads/{thread}/ui-messages?{query}"), &[])
        .await;
    assert_eq!(
        listed.json()["messages"].as_array().unwrap().len(),
        1,
        "{}",
        listed.body
    );
    publish(vec![row(
        ("UserAgent", "user-1"),
        "HumanInTheLoopChatResponseEvent",
        rows::HITL_CHAT_RESPONSE,
        "e5",
        now + 4,
        json!({"response": "yes"}),
    )])
    .await;
    app.api.wait_for_events(5).await;
    let idle = app
        .api
        .get(
            &format!("/v1/threads/{thread}/ui-message-stream?{query}"),
            &[],
        )
        .await;
    assert_eq!(idle.status, 204, "{}", idle.body);
    let listed = app
        .api
        .get(&format!("/v1/threads/{thread}/ui-messages?{query}"), &[])
        .await;
    assert_eq!(
        listed.json()["messages"][1],
        json!({"id": id, "role": "assistant", "parts": [
            {"type": "step-start"},
            {"type": "text", "text": "Hello", "state": "done"},
            {"type": "dynamic-tool", "toolName": "human_input", "toolCallId": "call_e4", "state": "input-available",
             "input": {"question": "go on?"}},
        ]}),
        "{}",
        listed.body
    );
    assert_eq!(
        listed.json()["messages"][2]["role"],
        "user",
        "{}",
        listed.body
    );
}

/// A row of run `r0` on display `d1` of `thread`.
fn run_row(
    thread: &str,
    agent: (&str, &str),
    name: &str,
    parents: &[&str],
    event_id: &str,
    created_at: i64,
    fields: Value,
) -> Value {
    Event {
        agent,
        thread,
        display: "d1",
        run: "r0",
        event_id,
        name,
        parents,
        created_at,
    }
    .row(fields)
}

/// Stores `rows`, then publishes them, as aihub's persister and agents do.
async fn store_and_publish(app: &TestApp, rows: &[Value]) {
    app.store.insert_rows(rows).await;
    rows::publish(&app.publisher, rows).await;
}

/// A UI message stream open on a running answer: its response and what was read past its replay, the message's
/// item id, and the `created_at` its rows started at.
struct Running {
    response: reqwest::Response,
    buffer: String,
    id: String,
    now: i64,
}

/// Opens the UI message stream of `thread`'s running answer (a question and the chunk `Hel`, its view held
/// complete, as a thread a chat page has read: what follows is derived from answers from memory) and reads its
/// replay, which must be exactly the message so far.
async fn open_running(app: &TestApp, thread: &str) -> Running {
    let now = crate::scene::now_ns(0);
    let user = ("UserAgent", "user-1");
    store_and_publish(
        app,
        &[
            run_row(
                thread,
                user,
                "UserMessageEvent",
                rows::USER_MESSAGE,
                "e1",
                now,
                rows::user_message("[q]hi"),
            ),
            run_row(
                thread,
                PRIMARY,
                "ChunkEvent",
                rows::CHUNK,
                "e2",
                now + 1,
                rows::chunk("Hel"),
            ),
        ],
    )
    .await;
    app.api.wait_for_events(2).await;
    crate::scene::read_until_cache(&app.api, thread, "").await;
    let url = format!(
        "{}/v1/threads/{thread}/ui-message-stream?agent_class={}&agent_id={}",
        app.api.address, PRIMARY.0, PRIMARY.1
    );
    let mut response = app.api.http.get(url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-vercel-ai-ui-message-stream"], "v1");
    let id = items(&app.api, thread).await[1].0.clone();
    let block = format!("{id}_0");
    let delta = json!({"type": "text-delta", "id": block, "delta": "Hel"}).to_string();
    let mut buffer = String::new();
    assert_eq!(
        data_until(&mut response, &mut buffer, &delta).await,
        [
            json!({"type": "start", "messageId": id}).to_string(),
            json!({"type": "start-step"}).to_string(),
            json!({"type": "text-start", "id": block}).to_string(),
            delta,
        ]
    );
    Running {
        response,
        buffer,
        id,
        now,
    }
}

/// The worker's shutdown cuts a stream with `abort` (`shutting_down`), a thread past the limit with `error` (the
/// history's error body); both then `[DONE]`, and the stream's slot is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_by_the_shutdown_aborts_and_one_past_the_thread_limit_errors() {
    let mut app = spawn_app_with(|c| c.cache.max_thread_bytes = 1 << 20).await;
    let mut outgrown = open_running(&app, "resume-outgrown").await;
    let mut cut = open_running(&app, "resume-cut").await;
    // Past the limit in three chunks (a NATS message holds at most 1 MiB).
    let big: Vec<Value> = (0..3)
        .map(|n| {
            let text = "x".repeat(512 << 10);
            let id = format!("big{n}");
            let at = outgrown.now + 2 + n;
            run_row(
                "resume-outgrown",
                PRIMARY,
                "ChunkEvent",
                rows::CHUNK,
                &id,
                at,
                rows::chunk(&text),
            )
        })
        .collect();
    store_and_publish(&app, &big).await;
    let ended = data_until(&mut outgrown.response, &mut outgrown.buffer, "[DONE]").await;
    let error = ended
        .iter()
        .rev()
        .nth(1)
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .expect("a chunk before [DONE]");
    assert_eq!(error["type"], "error", "{ended:?}");
    let body: Value = serde_json::from_str(error["errorText"].as_str().unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "thread_too_large", "{error}");

    app.signal_stop();
    let ended = data_until(&mut cut.response, &mut cut.buffer, "[DONE]").await;
    assert_eq!(
        ended[ended.len() - 2],
        json!({"type": "abort", "reason": "shutting_down"}).to_string(),
        "{ended:?}"
    );
    assert_eq!(ended.last().map(String::as_str), Some("[DONE]"));
}
