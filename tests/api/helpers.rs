//! Test applications: `spawn_app()` builds the real `Application` in-process on port 0 against its own NATS and
//! Mongo-wire servers and its own database; `BinaryApp` runs the compiled binary as a separate process. Both come
//! with typed helpers for the store, NATS and HTTP.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::Duration;

use chat_history_view::config::{Config, LogFormat};
use chat_history_view::http::SOURCE_HEADER;
use chat_history_view::startup::Application;
use clap::Parser;
use mongodb::IndexModel;
use mongodb::bson::Document;
use mongodb::options::IndexOptions;
use serde_json::Value;
use tokio::sync::oneshot;

use test_support::rows::{self, Event};
use test_support::servers::{MongoServer, NatsServer};
use test_support::wait::{LIMIT, eventually, eventually_within, poll_within, when};
use test_support::worker::WorkerProcess;

/// aihub's index set on `agent_events` ([contract section 3](../../docs/contract.md#3)), by name.
pub const AIHUB_INDEXES: [(&str, &[&str]); 10] = [
    ("thread_id_1_event_type_1", &["thread_id", "event_type"]),
    ("agent_id_1_event_type_1", &["agent_id", "event_type"]),
    (
        "thread_id_1_event_parents_1",
        &["thread_id", "event_parents"],
    ),
    ("run_id_1", &["run_id"]),
    ("event_data.created_at_1", &["event_data.created_at"]),
    ("display_id_1", &["display_id"]),
    (
        "thread_id_1_event_type_1_event_parents_1",
        &["thread_id", "event_type", "event_parents"],
    ),
    (
        "thread_id_1_event_data.created_at_1",
        &["thread_id", "event_data.created_at"],
    ),
    (
        "event_parents_1_event_data.created_at_1",
        &["event_parents", "event_data.created_at"],
    ),
    (
        "event_parents_1_event_data.tenant_id_1_event_data.created_at_1",
        &[
            "event_parents",
            "event_data.tenant_id",
            "event_data.created_at",
        ],
    ),
];

static TELEMETRY: Once = Once::new();

/// Logs go nowhere unless `TEST_LOG` is set.
fn init_telemetry() {
    TELEMETRY.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            chat_history_view::telemetry::init(LogFormat::Text, std::io::stderr, None);
        } else {
            chat_history_view::telemetry::init(LogFormat::Text, std::io::sink, None);
        }
    });
}

pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The configuration a test app starts from: its own servers, its own database, port 0, and no persister-lag
/// bound (this test's persister is the test itself, which writes before it reads; the tests of the bound set one).
pub fn base_config(nats_url: &str, mongodb_uri: &str, database: &str) -> Config {
    Config::try_parse_from([
        "chat-history-view",
        "--nats-url",
        nats_url,
        "--mongodb-uri",
        mongodb_uri,
        "--mongodb-database",
        database,
        "--listen",
        "127.0.0.1:0",
        "--log-format",
        "text",
        "--persist-lag-ms",
        "0",
        // Tests stop their apps at once; the delay is for an orchestrator's endpoints (tests/api/shutdown.rs).
        "--shutdown-delay-secs",
        "0",
        // No hot set handed over: tests/api/warm.rs turns it on.
        "--warm-max-threads",
        "0",
    ])
    .expect("test configuration parses")
}

/// The store side of a test: a database on a Mongo-wire server, with helpers.
pub struct TestStore {
    pub db: mongodb::Database,
}

impl TestStore {
    pub async fn connect(uri: &str, database: &str) -> Self {
        let client = mongodb::Client::with_uri_str(uri)
            .await
            .expect("mongo client");
        Self {
            db: client.database(database),
        }
    }

    pub fn events(&self) -> mongodb::Collection<Document> {
        self.db.collection("agent_events")
    }

    /// Creates aihub's index set (the worker never does).
    pub async fn create_aihub_indexes(&self) {
        let models = AIHUB_INDEXES.iter().map(|(name, fields)| {
            let mut keys = Document::new();
            for field in *fields {
                keys.insert(*field, 1);
            }
            IndexModel::builder()
                .keys(keys)
                .options(IndexOptions::builder().name(name.to_string()).build())
                .build()
        });
        self.events()
            .create_indexes(models)
            .await
            .expect("create aihub indexes");
    }

    /// Inserts rows in the persisted shape, in order.
    pub async fn insert_rows(&self, rows: &[Value]) {
        if rows.is_empty() {
            return;
        }
        let docs: Vec<Document> = rows
            .iter()
            .map(|row| mongodb::bson::to_document(row).expect("row converts to BSON"))
            .collect();
        self.events().insert_many(docs).await.expect("insert rows");
    }
}

pub use test_support::rows::publish as publish_rows;

pub use test_support::promise::item_to_message;

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: String,
}

impl Reply {
    /// The status, headers and whole body of `response`.
    async fn read(response: reqwest::Response) -> Self {
        Self {
            status: response.status().as_u16(),
            headers: response.headers().clone(),
            body: response.text().await.expect("body"),
        }
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// Where the history came from (`cache` or `store`), if the reply says.
    pub fn source(&self) -> Option<&str> {
        self.header(SOURCE_HEADER)
    }
}

/// HTTP helpers shared by both kinds of app.
#[derive(Clone)]
pub struct Api {
    pub address: String,
    pub http: reqwest::Client,
}

impl Api {
    pub fn new(address: String) -> Self {
        Self {
            address,
            http: reqwest::Client::new(),
        }
    }

    pub async fn get(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let mut request = self.http.get(format!("{}{path}", self.address));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        Reply::read(response).await
    }

    /// `POST {path}` without a body.
    pub async fn post(&self, path: &str) -> Reply {
        let response = self
            .http
            .post(format!("{}{path}", self.address))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        Reply::read(response).await
    }

    /// `GET /v1/threads/{thread}/history` with the given query string (without `?`).
    pub async fn history(&self, thread: &str, query: &str) -> Reply {
        let path = format!("/v1/threads/{}/history?{query}", encode(thread));
        self.get(&path, &[]).await
    }

    /// `GET /v1/conversations/{thread}/items` with the given query string (without `?`).
    pub async fn items(&self, thread: &str, query: &str) -> Reply {
        let path = format!("/v1/conversations/{}/items?{query}", encode(thread));
        self.get(&path, &[]).await
    }

    /// Every item of `thread`'s conversation, paging by `limit` in `order` (`asc` or `desc`) with `after` as a
    /// client does, turned back into history messages in history order; `extra` is added to every page's query.
    /// An error names the page that was not a 200 or broke the list shape.
    pub async fn items_as_messages(
        &self,
        thread: &str,
        extra: &str,
        order: &str,
        limit: usize,
    ) -> Result<Value, String> {
        let mut items = Vec::new();
        let mut after: Option<String> = None;
        for _ in 0..10_000 {
            let mut query = format!("order={order}&limit={limit}&{extra}");
            if let Some(after) = &after {
                query.push_str(&format!("&after={after}"));
            }
            let page = self.items(thread, &query).await;
            if page.status != 200 {
                return Err(format!("items?{query}: {} {}", page.status, page.body));
            }
            let page = page.json();
            let data = page["data"].as_array().cloned().unwrap_or_default();
            if page["object"] != "list" || data.len() > limit {
                return Err(format!(
                    "items?{query}: not a page of at most {limit}: {page}"
                ));
            }
            let (first, last) = (
                data.first().map(|i| &i["id"]),
                data.last().map(|i| &i["id"]),
            );
            if first.unwrap_or(&Value::Null) != &page["first_id"]
                || last.unwrap_or(&Value::Null) != &page["last_id"]
            {
                return Err(format!(
                    "items?{query}: first_id/last_id do not name the page's ends: {page}"
                ));
            }
            items.extend(data);
            if page["has_more"] != true {
                if order == "desc" {
                    items.reverse();
                }
                return Ok(Value::Array(items.iter().map(item_to_message).collect()));
            }
            after = page["last_id"].as_str().map(str::to_owned);
        }
        Err("more than 10,000 pages".into())
    }

    /// Waits until `/readyz` answers 200 (`ready`) or 503 (not `ready`).
    pub async fn wait_readiness(&self, ready: bool) {
        self.wait_readiness_within(ready, LIMIT).await;
    }

    /// [`Api::wait_readiness`] for up to `limit` (scaled).
    pub async fn wait_readiness_within(&self, ready: bool, limit: Duration) {
        let what = format!("readiness to become {ready}");
        eventually_within(&what, limit, || async move {
            let reply = self.get("/readyz", &[]).await;
            when((reply.status == 200) == ready, || {
                format!("{} {}", reply.status, reply.body)
            })
        })
        .await;
    }

    pub async fn metrics(&self) -> String {
        self.get("/metrics", &[]).await.body
    }

    /// Waits until the worker has received at least `count` NATS messages (any outcome).
    pub async fn wait_for_events(&self, count: u64) {
        self.wait_for_events_within(count, LIMIT).await;
    }

    /// [`Api::wait_for_events`] for at most `limit` (scaled).
    pub async fn wait_for_events_within(&self, count: u64, limit: Duration) {
        let what = format!("the worker to receive {count} events");
        eventually_within(&what, limit, || async move {
            let received = metric_sum(&self.metrics().await, "history_view_events_total");
            when(received >= count as f64, || format!("{received} received"))
        })
        .await;
    }

    /// The sum over label sets of the sample `name` on `/metrics`, once it is at least `at_least` (a counter or a
    /// gauge reaching a value); fails after [`LIMIT`] naming the last value and the exposition.
    pub async fn wait_metric_sum(&self, name: &str, at_least: f64) -> f64 {
        eventually(&format!("{name} to reach {at_least}"), || async move {
            let metrics = self.metrics().await;
            let value = metric_sum(&metrics, name);
            if value >= at_least {
                Ok(value)
            } else {
                Err(format!("{value}:\n{metrics}"))
            }
        })
        .await
    }
}

pub use test_support::promise::encode;

pub use test_support::scrape::{metric, metric_sum};

/// The real application, in-process, with its own servers and database.
pub struct TestApp {
    pub api: Api,
    pub nats: NatsServer,
    pub mongo: MongoServer,
    pub store: TestStore,
    pub publisher: async_nats::Client,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(tweak: impl FnOnce(&mut Config)) -> TestApp {
    init_telemetry();
    let nats = NatsServer::start();
    let mongo = MongoServer::start();
    let database = unique("chv");
    let mut config = base_config(&nats.url(), &mongo.uri(), &database);
    tweak(&mut config);
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let application = Application::build(config)
        .await
        .expect("application builds");
    let api = Api::new(format!("http://127.0.0.1:{}", application.port()));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(application.run_until_stopped(async {
        let _ = stopped.await;
    }));
    let publisher = async_nats::connect(nats.url())
        .await
        .expect("publisher connects");
    let app = TestApp {
        api,
        nats,
        mongo,
        store,
        publisher,
        stop: Some(stop),
        task: Some(task),
    };
    app.wait_ready().await;
    app
}

impl TestApp {
    /// Waits until `/readyz` says ready.
    pub async fn wait_ready(&self) {
        self.api.wait_readiness(true).await;
    }

    /// Asks the application to stop and waits up to `limit` (scaled) for `run_until_stopped` to return.
    pub async fn stop_within(&mut self, limit: Duration) -> anyhow::Result<()> {
        self.signal_stop();
        let task = self.task.take().expect("the application runs");
        let limit = test_support::wait::scaled(limit);
        tokio::time::timeout(limit, task)
            .await
            .map_err(|_| anyhow::anyhow!("the application did not stop within {limit:?}"))?
            .map_err(anyhow::Error::new)?
    }

    /// Asks the application to stop, as a signal would.
    pub fn signal_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The compiled binary as a separate process, configured through the environment, with HTTP helpers.
pub struct BinaryApp {
    pub api: Api,
    worker: WorkerProcess,
}

impl BinaryApp {
    /// Starts `chat-history-view` (the test build) with `env` and waits until it answers `/healthz`.
    pub async fn start(env: &[(&str, String)]) -> Self {
        Self::start_binary(Path::new(env!("CARGO_BIN_EXE_chat-history-view")), env).await
    }

    /// [`BinaryApp::start`] for the binary at `binary`.
    pub async fn start_binary(binary: &Path, env: &[(&str, String)]) -> Self {
        Self::start_command(binary.as_os_str().to_owned(), Vec::new(), env).await
    }

    /// [`BinaryApp::start`] through `program` with `args`: the binary, or a wrapper that sets up its environment
    /// and then executes it.
    pub async fn start_command(
        program: OsString,
        args: Vec<OsString>,
        env: &[(&str, String)],
    ) -> Self {
        Self::start_command_on(None, program, args, env).await
    }

    /// [`BinaryApp::start`] listening on `port` (a free one when `None`).
    pub async fn start_on(port: u16, env: &[(&str, String)]) -> Self {
        let binary = Path::new(env!("CARGO_BIN_EXE_chat-history-view"));
        Self::start_command_on(Some(port), binary.as_os_str().to_owned(), Vec::new(), env).await
    }

    async fn start_command_on(
        port: Option<u16>,
        program: OsString,
        args: Vec<OsString>,
        env: &[(&str, String)],
    ) -> Self {
        let env = env
            .iter()
            .map(|(name, value)| ((*name).to_owned(), value.clone()))
            .collect();
        let worker = match port {
            Some(port) => WorkerProcess::start_on(port, program, args, env).await,
            None => WorkerProcess::start(program, args, env).await,
        };
        Self {
            api: Api::new(worker.base_url()),
            worker,
        }
    }

    /// Waits until `/readyz` says ready (subscribed to NATS, store answering).
    pub async fn wait_ready(&self) {
        self.api.wait_readiness(true).await;
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.worker.pid()
    }

    /// Every line the worker logged that contains `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.worker.log_lines(needle)
    }

    /// Sends SIGTERM, as Kubernetes does.
    pub fn terminate(&self) {
        self.worker.terminate();
    }

    /// Freezes the process (SIGSTOP): its sockets stay open, nothing is read.
    pub fn pause(&self) {
        self.worker.pause();
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.worker.resume();
    }

    /// Waits up to `limit` (scaled) for the process to exit; `None` if it still runs then.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let worker = &mut self.worker;
        poll_within(limit, || {
            let exited = worker.try_wait().ok_or_else(|| "running".to_owned());
            async move { exited }
        })
        .await
        .ok()
    }

    /// The exit status if the process has exited, without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.worker.try_wait()
    }

    /// Waits until the worker has logged a line containing `needle`, and returns the first such line.
    pub async fn wait_log(&self, needle: &str) -> String {
        eventually(&format!("a log line containing {needle:?}"), || {
            let line = self.log_lines(needle).into_iter().next();
            let tail = || self.worker.log_tail();
            let found = line.ok_or_else(tail);
            async move { found }
        })
        .await
    }
}

/// The worker binary for the scenarios that measure how it keeps up: the one the tests built (its dependencies
/// optimized, see Cargo.toml's dev profile), or the one `CHV_WORKER_BINARY` names (`make soak` runs the release
/// build).
pub fn worker_binary() -> PathBuf {
    let binary = std::env::var_os("CHV_WORKER_BINARY").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_chat-history-view")),
        PathBuf::from,
    );
    assert!(binary.exists(), "{} is missing", binary.display());
    binary
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.signal_stop();
    }
}

/// A fresh nats-server, and a Mongo-wire server whose database (named after `prefix`, with aihub's indexes) holds
/// one thread, `t1`: a question and its answer. What the tests of the worker process's life (start, rotation,
/// shutdown) start from.
pub struct OneThread {
    pub mongo: MongoServer,
    pub nats: NatsServer,
    pub database: String,
}

impl OneThread {
    pub async fn start(prefix: &str) -> Self {
        let mongo = MongoServer::start();
        let nats = NatsServer::start();
        let database = unique(prefix);
        let store = TestStore::connect(&mongo.uri(), &database).await;
        store.create_aihub_indexes().await;
        store
            .insert_rows(&[
                user_row("t1", "d1", "e1", 1, "Q"),
                chunk_row("t1", "d1", "A", "e2", 2, "A"),
            ])
            .await;
        Self {
            mongo,
            nats,
            database,
        }
    }
}

/// A `UserAgent` user message row (a visibility marker) with one text block.
pub fn user_row(thread: &str, display: &str, event_id: &str, created_at: i64, text: &str) -> Value {
    Event {
        agent: ("UserAgent", "user-1"),
        thread,
        display,
        run: "run-1",
        event_id,
        name: "UserMessageEvent",
        parents: rows::USER_MESSAGE,
        created_at,
    }
    .row(rows::user_message(text))
}

/// A chunk row from `agent` on `display`.
pub fn chunk_row(
    thread: &str,
    display: &str,
    agent: &str,
    event_id: &str,
    created_at: i64,
    text: &str,
) -> Value {
    Event {
        agent: (agent, "a1"),
        thread,
        display,
        run: "run-1",
        event_id,
        name: "ChunkEvent",
        parents: rows::CHUNK,
        created_at,
    }
    .row(rows::chunk(text))
}

/// A stop event of `agent` on `display` whose last output message says `text`.
pub fn stop_row(
    thread: &str,
    display: &str,
    agent: &str,
    event_id: &str,
    created_at: i64,
    text: &str,
) -> Value {
    Event {
        agent: (agent, "a1"),
        thread,
        display,
        run: "run-1",
        event_id,
        name: "LLMStopEvent",
        parents: rows::LLM_STOP,
        created_at,
    }
    .row(serde_json::json!({
        "output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": text}]}]
    }))
}

/// The history JSON of alternating user/assistant text turns.
pub fn turns(turns: &[(&str, &str)]) -> Value {
    Value::Array(
        turns
            .iter()
            .map(|(role, text)| serde_json::json!({"role": role, "content": [{"type": "text", "text": text}]}))
            .collect(),
    )
}
