//! The JetStream source (`HISTORY_VIEW_SOURCE=jetstream`) through the built binary, on aihub's class streams created
//! here the way aihub creates them (`agent_<Class>_stream` over `agent.<Class>.*.*.*.*.*.*.*`, file storage): the
//! conformance cases; a cut link and a restarted nats-server, neither a gap (the views stay complete, no store read);
//! a stream deleted and recreated under the worker, a gap; a restarted worker that replays what it missed.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use serde_json::Value;

use crate::cases;
use crate::helpers::{
    Api, BinaryApp, TestStore, chunk_row, encode, metric, publish_rows, turns, unique, user_row,
};
use crate::proxy::Proxy;
use crate::scene::{Scene, messages, now_ns, read_until_cache, wait_metric};
use test_support::servers::{MongoServer, NatsCluster, NatsServer};

const JETSTREAM: (&str, &str) = ("HISTORY_VIEW_SOURCE", "jetstream");

/// Creates aihub's stream of each agent class (the worker creates none).
async fn create_class_streams(nats_url: &str, classes: impl IntoIterator<Item = String>) {
    create_replicated_class_streams(nats_url, classes, 1).await;
}

/// [`create_class_streams`] with `replicas` (a cluster's meta leader may take a few seconds to be elected).
async fn create_replicated_class_streams(
    nats_url: &str,
    classes: impl IntoIterator<Item = String>,
    replicas: usize,
) {
    let client = async_nats::connect(nats_url).await.expect("nats client");
    let context = jetstream::new(client);
    for class in classes {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let created = context
                .create_stream(jetstream::stream::Config {
                    name: format!("agent_{class}_stream"),
                    subjects: vec![format!("agent.{class}.*.*.*.*.*.*.*")],
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(_) => break,
                Err(error) => assert!(Instant::now() < deadline, "a class stream: {error}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

fn classes(rows: &[Value]) -> BTreeSet<String> {
    rows.iter()
        .filter_map(|row| row["agent_class"].as_str().map(str::to_owned))
        .collect()
}

/// The hydrations the worker ran so far (on reads and in the background).
async fn hydrations(api: &Api) -> f64 {
    metric(
        &api.metrics().await,
        "history_view_hydrations_total{result=\"ok\"}",
    )
}

async fn resumes(api: &Api, outcome: &str) -> f64 {
    metric(
        &api.metrics().await,
        &format!("history_view_jetstream_resumes_total{{outcome=\"{outcome}\"}}"),
    )
}

/// A scene whose class streams exist before the worker starts, a JetStream worker reaching NATS at `nats_url`, and a
/// thread served from memory with one stored and published user turn.
async fn warm_jetstream(scene: &Scene, nats_url: String, thread: &str) -> BinaryApp {
    create_class_streams(&scene.nats.url(), ["UserAgent".into(), "A".into()]).await;
    let app = scene.worker(nats_url, &[JETSTREAM]).await;
    let first = user_row(thread, "d1", "e1", now_ns(0), "Q");
    scene.store.insert_rows(std::slice::from_ref(&first)).await;
    publish_rows(&scene.publisher, &[first]).await;
    read_until_cache(&app.api, thread, "").await;
    app
}

/// Waits until `/readyz` answers 200 (the consumers have caught up) within 20 s.
async fn wait_caught_up(api: &Api) {
    api.wait_readiness(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_live_case_passes_through_the_jetstream_source() {
    let mongo = Arc::new(MongoServer::start());
    let cases = cases::load("live");
    let total = cases.len();
    let failures: Vec<String> = futures_util::stream::iter(cases)
        .map(|case| {
            let mongo = mongo.clone();
            async move {
                // Each case has its own nats-server: the cases share thread ids.
                let nats = NatsServer::start();
                create_class_streams(&nats.url(), classes(&case.rows)).await;
                let database = unique("js");
                let store = TestStore::connect(&mongo.uri(), &database).await;
                store.create_aihub_indexes().await;
                let app = BinaryApp::start(&[
                    ("HISTORY_VIEW_NATS_URL", nats.url()),
                    ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
                    ("HISTORY_VIEW_MONGODB_DATABASE", database),
                    (JETSTREAM.0, JETSTREAM.1.to_owned()),
                ])
                .await;
                app.wait_ready().await;
                let publisher = async_nats::connect(nats.url()).await.expect("publisher");
                publish_rows(&publisher, &case.rows).await;
                let expected = case
                    .rows
                    .iter()
                    .filter(|r| r["event_type"] == "display_event")
                    .count();
                app.api.wait_for_events(expected as u64).await;
                let query = match &case.primary {
                    Some(p) => format!(
                        "agent_class={}&agent_id={}",
                        encode(&p.agent_class),
                        encode(&p.agent_id)
                    ),
                    None => String::new(),
                };
                let reply = app.api.history(&case.thread_id, &query).await;
                (reply.status != 200 || reply.json()["messages"] != case.expected.messages).then(
                    || {
                        format!(
                            "{} [jetstream]:\n  expected {}\n  actual   {}",
                            case.name, case.expected.messages, reply.body
                        )
                    },
                )
            }
        })
        .buffer_unordered(4)
        .filter_map(|failure| async move { failure })
        .collect()
        .await;
    println!("{total} live cases run through the JetStream source");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_is_no_gap_the_views_stay_complete_and_get_what_was_published_meanwhile() {
    let scene = Scene::new().await;
    let proxy = Proxy::start(scene.nats.address()).await;
    let thread = "t-js-cut";
    let app = warm_jetstream(&scene, proxy.nats_url(), thread).await;

    proxy.cut();
    app.api.wait_readiness(false).await;
    // Published while the worker is cut off: into the stream (and the store), not to the worker.
    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "meanwhile");
    scene.store.insert_rows(std::slice::from_ref(&answer)).await;
    publish_rows(&scene.publisher, &[answer]).await;
    // A read while the worker is behind is never served from memory without the answer.
    let read = app.api.history(thread, "").await;
    assert!(
        read.source() != Some("cache") || read.body.contains("meanwhile"),
        "{}",
        read.body
    );
    let before = hydrations(&app.api).await;
    proxy.restore();
    wait_metric(
        &app.api,
        "history_view_jetstream_resumes_total{outcome=\"continued\"}",
        1.0,
    )
    .await;
    wait_caught_up(&app.api).await;
    let served = read_until_cache(&app.api, thread, "").await;
    assert_eq!(
        messages(&served),
        turns(&[("user", "Q"), ("assistant", "meanwhile")])
    );
    assert_eq!(resumes(&app.api, "gap").await, 0.0);
    // The read during the cut read the store; since then the view was kept, not hydrated again.
    assert_eq!(hydrations(&app.api).await, before, "the view was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_nats_server_with_file_storage_is_no_gap() {
    let mut scene = Scene::new().await;
    let thread = "t-js-restart";
    let app = warm_jetstream(&scene, scene.nats.url(), thread).await;
    let before = hydrations(&app.api).await;
    tokio::task::block_in_place(|| scene.nats.restart());
    let publisher = async_nats::connect(scene.nats.url())
        .await
        .expect("publisher");
    scene.publisher = publisher;
    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "after restart");
    scene.store.insert_rows(std::slice::from_ref(&answer)).await;
    publish_rows(&scene.publisher, &[answer]).await;
    wait_metric(
        &app.api,
        "history_view_jetstream_resumes_total{outcome=\"continued\"}",
        1.0,
    )
    .await;
    wait_caught_up(&app.api).await;
    let served = read_until_cache(&app.api, thread, "").await;
    assert_eq!(
        messages(&served),
        turns(&[("user", "Q"), ("assistant", "after restart")])
    );
    assert_eq!(resumes(&app.api, "gap").await, 0.0);
    assert_eq!(hydrations(&app.api).await, before, "the view was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_recreated_under_the_worker_is_a_gap_and_no_stale_view_is_served() {
    let scene = Scene::new().await;
    let thread = "t-js-recreated";
    let app = warm_jetstream(&scene, scene.nats.url(), thread).await;
    let context = jetstream::new(scene.publisher.clone());
    context
        .delete_stream("agent_A_stream")
        .await
        .expect("delete");
    // Written while the stream is gone: the store has it, no stream does.
    let missed = chunk_row(thread, "d1", "A", "e2", now_ns(1), "missed");
    scene.store.insert_rows(std::slice::from_ref(&missed)).await;
    publish_rows(&scene.publisher, &[missed]).await;
    create_class_streams(&scene.nats.url(), ["A".into()]).await;
    wait_metric(
        &app.api,
        "history_view_jetstream_resumes_total{outcome=\"gap\"}",
        1.0,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let read = app.api.history(thread, "").await;
        let answered = messages(&read) == turns(&[("user", "Q"), ("assistant", "missed")]);
        assert!(
            answered || read.source() != Some("cache"),
            "a stale view served from memory: {}",
            read.body
        );
        if answered && read.source() == Some("cache") {
            break;
        }
        assert!(Instant::now() < deadline, "{}", read.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_replays_what_was_published_while_it_was_down() {
    let scene = Scene::new().await;
    let thread = "t-js-replay";
    let mut first = warm_jetstream(&scene, scene.nats.url(), thread).await;
    first.terminate();
    first.wait_exit(Duration::from_secs(10)).await;
    // Published while no worker runs, and not persisted yet (the persister lags).
    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "while down");
    publish_rows(&scene.publisher, std::slice::from_ref(&answer)).await;
    let second = scene.worker(scene.nats.url(), &[JETSTREAM]).await;
    let read = second.api.history(thread, "").await;
    assert_eq!(
        messages(&read),
        turns(&[("user", "Q"), ("assistant", "while down")]),
        "replayed from the stream"
    );
    scene.store.insert_rows(&[answer]).await;
    let served = read_until_cache(&second.api, thread, "").await;
    assert_eq!(
        messages(&served),
        turns(&[("user", "Q"), ("assistant", "while down")])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_of_a_replicated_stream_is_a_gap_and_no_stale_view_is_served() {
    let cluster = tokio::task::block_in_place(|| NatsCluster::start(3));
    let nats_url = cluster.servers[0].url();
    create_replicated_class_streams(&nats_url, ["UserAgent".into(), "A".into()], 3).await;
    let mongo = MongoServer::start();
    let database = unique("jsc");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats_url.clone()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        (JETSTREAM.0, JETSTREAM.1.to_owned()),
    ])
    .await;
    app.wait_ready().await;
    let publisher = async_nats::connect(&nats_url).await.expect("publisher");
    let thread = "t-js-leader";
    let first = user_row(thread, "d1", "e1", now_ns(0), "Q");
    store.insert_rows(std::slice::from_ref(&first)).await;
    publish_rows(&publisher, &[first]).await;
    read_until_cache(&app.api, thread, "").await;

    // While the leader steps down, an answer is published and persisted: Core publishes made during an election
    // may be captured by no replica, while aihub's persister writes them.
    publisher
        .request("$JS.API.STREAM.LEADER.STEPDOWN.agent_A_stream", "".into())
        .await
        .expect("a leader stepdown");
    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "elected");
    store.insert_rows(std::slice::from_ref(&answer)).await;
    publish_rows(&publisher, &[answer]).await;
    wait_metric(
        &app.api,
        "history_view_jetstream_resumes_total{outcome=\"gap\"}",
        1.0,
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let read = app.api.history(thread, "").await;
        let answered = messages(&read) == turns(&[("user", "Q"), ("assistant", "elected")]);
        assert!(
            answered || read.source() != Some("cache"),
            "a view without the stored answer served from memory: {}",
            read.body
        );
        if answered && read.source() == Some("cache") {
            break;
        }
        assert!(Instant::now() < deadline, "{}", read.body);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
