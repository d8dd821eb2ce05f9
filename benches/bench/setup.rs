//! What every measurement shares: the settings, the NATS and Mongo-wire servers of the run, a NATS client factory,
//! the bench's own view of the store, and starting worker processes.

use std::path::PathBuf;

use mongodb::IndexModel;
use mongodb::bson::{Document, doc};
use mongodb::options::IndexOptions;
use serde_json::Value;

use crate::data;
use crate::worker::Worker;
use test_support::servers::{MongoServer, NatsServer};

/// The only index the bench creates: the one both store stages may name ([design 2b](../../docs/design.md#2b)). aihub's
/// other nine indexes would make every insert several times slower on the local server without changing any read here.
pub const HINT_INDEX: &str = chat_history_view::config::DEFAULT_INDEX_HINT;
/// Rows per `insert_many`.
const INSERT_BATCH: usize = 1000;

/// The run's settings, read once from the environment.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The worker binary (`BENCH_WORKER_BIN`, default `target/release/chat-history-view`).
    pub worker_bin: PathBuf,
    /// Events streamed in P1 (`BENCH_EVENTS_P1`).
    pub events_p1: usize,
    /// P1's rounds (`BENCH_ROUNDS_P1`, default 6): more rounds narrow the median of the tracing pairs' ratios.
    pub rounds_p1: usize,
    /// Events streamed in P5 (`BENCH_EVENTS_P5`).
    pub events_p5: usize,
    /// Whether P4 also runs at 100k events (`BENCH_FULL=1`).
    pub full: bool,
    /// The measurements to run (`BENCH_ONLY`, comma-separated ids, in any case); all when unset.
    pub only: Option<Vec<String>>,
}

impl Settings {
    pub fn from_env() -> Self {
        let worker_bin = std::env::var_os("BENCH_WORKER_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/release/chat-history-view")
            });
        assert!(
            worker_bin.exists(),
            "worker binary {} not found: run `cargo build --release --bin chat-history-view` (or `make bench`), \
             or set BENCH_WORKER_BIN",
            worker_bin.display()
        );
        Self {
            worker_bin,
            events_p1: env_count("BENCH_EVENTS_P1", 200_000),
            rounds_p1: env_count("BENCH_ROUNDS_P1", 6).max(1),
            events_p5: env_count("BENCH_EVENTS_P5", 1_000_000),
            full: std::env::var("BENCH_FULL").is_ok_and(|v| v == "1"),
            only: std::env::var("BENCH_ONLY").ok().map(|ids| {
                ids.split(',')
                    .map(|id| id.trim().to_ascii_uppercase())
                    .filter(|id| !id.is_empty())
                    .collect()
            }),
        }
    }

    /// Whether measurement `id` is selected.
    pub fn runs(&self, id: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|o| o.eq_ignore_ascii_case(id)))
    }
}

fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(value) => value
            .replace('_', "")
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?} is not a whole number: {e}")),
        Err(_) => default,
    }
}

/// The servers of the run and the settings. Dropping it stops the servers.
pub struct Setup {
    pub settings: Settings,
    nats: NatsServer,
    mongo: MongoServer,
}

impl Setup {
    /// Starts both servers (blocking until each answers).
    pub fn start(settings: Settings) -> Self {
        Self {
            nats: NatsServer::start(),
            mongo: MongoServer::start(),
            settings,
        }
    }

    pub fn nats_url(&self) -> String {
        self.nats.url()
    }

    /// The nats-server's process id (partitioning moves work to it: P9(d) reads its CPU time).
    pub fn nats_pid(&self) -> u32 {
        self.nats.pid()
    }

    pub fn mongo_uri(&self) -> String {
        self.mongo.uri()
    }

    /// A new NATS connection of the bench's own (a publisher or the bare subscriber).
    pub async fn nats_client(&self) -> async_nats::Client {
        async_nats::connect(self.nats_url())
            .await
            .expect("the bench connects to its nats-server")
    }

    /// The bench's own handle on `database`, with the hint index created.
    pub async fn store(&self, database: &str) -> BenchStore {
        let client = mongodb::Client::with_uri_str(self.mongo_uri())
            .await
            .expect("a MongoDB client for the bench's own store access");
        let store = BenchStore {
            db: client.database(database),
        };
        store
            .events()
            .create_index(
                IndexModel::builder()
                    .keys(doc! {"thread_id": 1, "event_type": 1, "event_parents": 1})
                    .options(IndexOptions::builder().name(HINT_INDEX.to_owned()).build())
                    .build(),
            )
            .await
            .expect("create the hint index on agent_events");
        store
    }

    /// Starts a worker process on `database`; `env` overrides the defaults of [`Worker::start`].
    pub async fn start_worker(&self, database: &str, env: &[(&str, &str)]) -> Worker {
        Worker::start(self, database, env).await
    }
}

/// The bench's access to one database's `agent_events` (the worker only reads; the bench writes the rows).
pub struct BenchStore {
    db: mongodb::Database,
}

impl BenchStore {
    pub fn events(&self) -> mongodb::Collection<Document> {
        self.db.collection("agent_events")
    }

    /// Creates aihub's `display_id_1`, which the fills' query uses (P7's multi-turn workload fills a view at each
    /// turn's new display).
    pub async fn create_display_index(&self) {
        self.events()
            .create_index(
                IndexModel::builder()
                    .keys(doc! {"display_id": 1})
                    .options(
                        IndexOptions::builder()
                            .name("display_id_1".to_owned())
                            .build(),
                    )
                    .build(),
            )
            .await
            .expect("create display_id_1 on agent_events");
    }

    /// Inserts rows (aihub's persisted shape) in batches.
    pub async fn insert(&self, rows: &[Value]) {
        for batch in rows.chunks(INSERT_BATCH) {
            let documents: Vec<Document> = batch.iter().map(data::document).collect();
            self.events()
                .insert_many(documents)
                .await
                .expect("insert rows into agent_events");
        }
    }
}
