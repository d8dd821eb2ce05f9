//! Every conformance case through the paths it names, end to end: `store` (rows in a fresh database, the binary
//! as a separate process with a cold cache, read over HTTP) and `live` (rows published on a real nats-server,
//! nothing in the store, read over HTTP once consumed). Each is also read as Conversations items, paged in both
//! orders (the `items` read path of each), explained (the `explain` path of each: [`crate::explain`]), and each
//! live case streams through the feed, opened before its first event, to its expected history (the `feed` path).

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use crate::cases::{self, Case};
use crate::explain::check_explain;
use crate::helpers::{Api, BinaryApp, Reply, TestStore, encode, publish_rows, unique};
use test_support::servers::{MongoServer, NatsServer};

/// How many cases run at once (each has its own binary process).
const PARALLEL: usize = 4;

pub fn query(case: &Case) -> String {
    match &case.primary {
        Some(p) => format!(
            "agent_class={}&agent_id={}",
            encode(&p.agent_class),
            encode(&p.agent_id)
        ),
        None => String::new(),
    }
}

/// The case's expected history, paged as Conversations items through `api` (tail-first by two, and from the head
/// by three), as the `items` path of `path`.
pub async fn check_items(case: &Case, path: &str, api: &Api) -> Option<String> {
    for (order, limit) in [("desc", 2), ("asc", 3)] {
        match api
            .items_as_messages(&case.thread_id, &query(case), order, limit)
            .await
        {
            Ok(messages) if messages == case.expected.messages => {}
            Ok(messages) => {
                return Some(format!(
                    "{} [{path} items {order} {limit}]:\n  expected {}\n  actual   {}",
                    case.name, case.expected.messages, messages
                ));
            }
            Err(error) => return Some(format!("{} [{path} items]: {error}", case.name)),
        }
    }
    None
}

pub fn check(case: &Case, path: &str, reply: &Reply) -> Option<String> {
    if reply.status != 200 {
        return Some(format!(
            "{} [{path}]: status {} {}",
            case.name, reply.status, reply.body
        ));
    }
    let body = reply.json();
    (body["messages"] != case.expected.messages || body["thread_id"] != case.thread_id.as_str())
        .then(|| {
            format!(
                "{} [{path}]:\n  expected {}\n  actual   {}",
                case.name, case.expected.messages, body["messages"]
            )
        })
}

/// Runs every case that names `path`, a few at a time, and fails with all the failures.
pub async fn run_all<F, Fut>(path: &str, run: F)
where
    F: Fn(Case) -> Fut,
    Fut: Future<Output = Option<String>>,
{
    let cases = cases::load(path);
    let total = cases.len();
    let failures: Vec<String> = futures_util::stream::iter(cases)
        .map(run)
        .buffer_unordered(PARALLEL)
        .filter_map(|failure| async move { failure })
        .collect()
        .await;
    println!("{total} {path} cases run");
    assert!(
        failures.is_empty(),
        "{} of {total} {path} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_case_passes_end_to_end() {
    let mongo = Arc::new(MongoServer::start());
    let nats = Arc::new(NatsServer::start());
    run_all("store", |case| {
        let (mongo, nats) = (mongo.clone(), nats.clone());
        async move {
            let database = unique("conf");
            let store = TestStore::connect(&mongo.uri(), &database).await;
            store.create_aihub_indexes().await;
            store.insert_rows(&case.rows).await;
            let app = BinaryApp::start(&[
                ("HISTORY_VIEW_NATS_URL", nats.url()),
                ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
                ("HISTORY_VIEW_MONGODB_DATABASE", database),
            ])
            .await;
            let reply = app.api.history(&case.thread_id, &query(&case)).await;
            if let Some(failure) = check(&case, "store", &reply) {
                return Some(failure);
            }
            if let Some(failure) = check_items(&case, "store", &app.api).await {
                return Some(failure);
            }
            if let Some(failure) = check_explain(&case, "store", &app.api).await {
                return Some(failure);
            }
            (reply.source() != Some("store"))
                .then(|| format!("{}: a cold read must come from the store", case.name))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_live_case_passes_end_to_end() {
    let mongo = Arc::new(MongoServer::start());
    run_all("live", |case| live_case(mongo.clone(), case, "live", &[])).await;
}

/// One live case: its own nats-server (the cases share thread ids) prepared by `prepare`, a worker with `env` and
/// nothing in the store; the rows published on NATS, read over HTTP once consumed, checked as `path`.
pub async fn live_case(
    mongo: Arc<MongoServer>,
    case: Case,
    path: &str,
    env: &[(&str, &str)],
) -> Option<String> {
    live_case_prepared(mongo, case, path, env, |_, _| async {}).await
}

/// [`live_case`], with `prepare(nats_url, case)` run before the worker starts (streams to create, say).
pub async fn live_case_prepared<P, PFut>(
    mongo: Arc<MongoServer>,
    case: Case,
    path: &str,
    env: &[(&str, &str)],
    prepare: P,
) -> Option<String>
where
    P: FnOnce(String, &Case) -> PFut,
    PFut: Future<Output = ()>,
{
    let nats = NatsServer::start();
    prepare(nats.url(), &case).await;
    let database = unique("live");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let mut settings = vec![
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
    ];
    settings.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    let app = BinaryApp::start(&settings).await;
    app.wait_ready().await;
    // The feed is open before the first event: its transcript must end as the case's history.
    let mut feed = test_support::promise::FeedClient::open(
        &crate::promise::target(&app.api),
        &case.thread_id,
        &query(&case),
        None,
    )
    .await;
    let publisher = async_nats::connect(nats.url()).await.expect("publisher");
    publish_rows(&publisher, &case.rows).await;
    // Only display events reach the worker.
    let expected = case
        .rows
        .iter()
        .filter(|r| r["event_type"] == "display_event")
        .count();
    app.api.wait_for_events(expected as u64).await;
    let reply = app.api.history(&case.thread_id, &query(&case)).await;
    if let Some(failure) = check(&case, path, &reply) {
        return Some(failure);
    }
    if let Some(failure) = check_items(&case, path, &app.api).await {
        return Some(failure);
    }
    // Persisted now, as aihub's persister would: explain joins the view with the stored rows.
    store.insert_rows(&case.rows).await;
    if let Some(failure) = check_explain(&case, path, &app.api).await {
        return Some(failure);
    }
    let streamed = feed
        .until(&case.expected.messages, Duration::from_secs(10))
        .await;
    (streamed != case.expected.messages).then(|| {
        format!(
            "{} [{path} feed]:\n  expected {}\n  streamed {streamed} ({:?})",
            case.name, case.expected.messages, feed.kinds
        )
    })
}
