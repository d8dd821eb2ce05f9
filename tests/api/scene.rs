//! `Scene`: what a scenario through the built binary needs: real servers, a database with aihub's indexes, a
//! publisher playing aihub's agents, workers started on demand, and the waits and reads the scenarios share.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::helpers::{Api, BinaryApp, Reply, TestStore, metric, unique};
use test_support::scrape::live_drops;
use test_support::servers::{MongoServer, NatsServer};
use test_support::wait::{eventually, when};

/// Real servers, a database with aihub's indexes, and a publisher playing aihub's agents.
pub struct Scene {
    pub nats: NatsServer,
    pub mongo: MongoServer,
    pub database: String,
    pub store: TestStore,
    pub publisher: async_nats::Client,
}

impl Scene {
    pub async fn new() -> Self {
        let nats = NatsServer::start();
        let mongo = MongoServer::start();
        let database = unique("lag");
        let store = TestStore::connect(&mongo.uri(), &database).await;
        store.create_aihub_indexes().await;
        let publisher = async_nats::connect(nats.url()).await.expect("publisher");
        Self {
            nats,
            mongo,
            database,
            store,
            publisher,
        }
    }

    /// The binary with its default persister-lag bound, reaching NATS at `nats_url`; ready.
    pub async fn worker(&self, nats_url: String, env: &[(&str, &str)]) -> BinaryApp {
        self.worker_binary(
            Path::new(env!("CARGO_BIN_EXE_chat-history-view")),
            nats_url,
            env,
        )
        .await
    }

    /// [`Scene::worker`] for the binary at `binary`.
    pub async fn worker_binary(
        &self,
        binary: &Path,
        nats_url: String,
        env: &[(&str, &str)],
    ) -> BinaryApp {
        let mut settings = vec![
            ("HISTORY_VIEW_NATS_URL", nats_url),
            ("HISTORY_VIEW_MONGODB_URI", self.mongo.uri()),
            ("HISTORY_VIEW_MONGODB_DATABASE", self.database.clone()),
        ];
        settings.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let app = BinaryApp::start_binary(binary, &settings).await;
        app.wait_ready().await;
        app
    }

    /// Persists a first user turn of `thread` and reads it until the worker behind `api` serves it from memory.
    pub async fn warm(&self, api: &Api, thread: &str) {
        self.store
            .insert_rows(&[crate::helpers::user_row(thread, "d1", "e1", now_ns(0), "Q")])
            .await;
        read_until_cache(api, thread, "").await;
    }

    /// What a fresh worker answers for `thread` and `query` (its first read comes from the store).
    pub async fn cold_read(&self, thread: &str, query: &str) -> Reply {
        let fresh = self.worker(self.nats.url(), &[]).await;
        let reply = fresh.api.history(thread, query).await;
        assert_eq!(reply.source(), Some("store"));
        reply
    }

    /// The scenarios' common end: the worker serves `thread` from memory, with `expected` messages, byte for byte
    /// what a fresh worker reads from the store.
    pub async fn assert_served_from_cache(&self, api: &Api, thread: &str, expected: Value) {
        self.assert_served_from_cache_for(api, thread, "", expected)
            .await;
    }

    /// [`Scene::assert_served_from_cache`] for a read with `query`.
    pub async fn assert_served_from_cache_for(
        &self,
        api: &Api,
        thread: &str,
        query: &str,
        expected: Value,
    ) {
        let served = read_until_cache(api, thread, query).await;
        assert_eq!(served.json()["messages"], expected, "{}", served.body);
        assert_eq!(served.body, self.cold_read(thread, query).await.body);
    }
}

/// A `created_at` (ns) for the `i`th event of a scenario: now, as aihub stamps events.
pub fn now_ns(i: i64) -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(now.as_nanos()).expect("ns fit i64") + i
}

/// Reads until the answer comes from memory (the bound passes within a few seconds), and returns it. Every answer
/// until then is a 200.
pub async fn read_until_cache(api: &Api, thread: &str, query: &str) -> Reply {
    eventually(
        &format!("{thread}?{query} served from memory"),
        || async move {
            let reply = api.history(thread, query).await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            if reply.source() == Some("cache") {
                Ok(reply)
            } else {
                Err(format!("from {:?}: {}", reply.source(), reply.body))
            }
        },
    )
    .await
}

/// Waits until `/metrics` shows `name` at `at_least` or more.
pub async fn wait_metric(api: &Api, name: &str, at_least: f64) {
    eventually(&format!("{name} to reach {at_least}"), || async move {
        let metrics = api.metrics().await;
        let value = metric(&metrics, name);
        when(value >= at_least, || format!("{value}:\n{metrics}"))
    })
    .await;
}

/// Waits until the worker has reported at least `at_least` signs of lost live events ([`live_drops`]).
pub async fn wait_drops(api: &Api, at_least: f64) {
    eventually(&format!("{at_least} drops reported"), || async move {
        let metrics = api.metrics().await;
        let drops = live_drops(&metrics);
        when(drops >= at_least, || format!("{drops}:\n{metrics}"))
    })
    .await;
}

/// Waits until `/readyz` reports `check` (`nats` or `store`) as `ok`.
pub async fn wait_check(api: &Api, check: &str, ok: bool) {
    eventually(
        &format!("the {check} check to become {ok}"),
        || async move {
            let reply = api.get("/readyz", &[]).await;
            when(reply.json()["checks"][check]["ok"] == ok, || reply.body)
        },
    )
    .await;
}

pub fn messages(reply: &Reply) -> Value {
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["messages"].clone()
}
