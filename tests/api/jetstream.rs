//! The JetStream source (`HISTORY_VIEW_SOURCE=jetstream`) through the built binary, on aihub's class streams created
//! here the way aihub creates them (`agent_<Class>_stream` over `agent.<Class>.*.*.*.*.*.*.*`, file storage): the
//! conformance cases and random threads; a cut link and a restarted nats-server, neither a gap (the views stay complete, no store read);
//! a stream deleted and recreated under the worker, a gap; a restarted worker that replays what it missed.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde_json::Value;

use crate::conformance::{live_case_prepared, run_all};
use crate::helpers::{
    Api, BinaryApp, TestStore, chunk_row, metric, publish_rows, turns, unique, user_row,
};
use crate::scene::{Scene, messages, now_ns, read_until_cache, wait_metric};
use crate::threads;
use test_support::class_streams::{create_class_streams, create_replicated_class_streams};
use test_support::proxy::Proxy;
use test_support::reference;
use test_support::servers::{MongoServer, NatsCluster};
use test_support::wait::{eventually, when};

const JETSTREAM: (&str, &str) = ("HISTORY_VIEW_SOURCE", "jetstream");

/// The agent classes of `rows`: the class streams they need.
pub fn classes(rows: &[Value]) -> BTreeSet<String> {
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

/// The sample of resumes with `outcome` (`continued` or `gap`).
fn resumes_sample(outcome: &str) -> String {
    format!("history_view_jetstream_resumes_total{{outcome=\"{outcome}\"}}")
}

/// Waits until the worker counted `at_least` resumes with `outcome`.
async fn wait_resumes(api: &Api, outcome: &str, at_least: f64) {
    wait_metric(api, &resumes_sample(outcome), at_least).await;
}

async fn resumes(api: &Api, outcome: &str) -> f64 {
    metric(&api.metrics().await, &resumes_sample(outcome))
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

/// Reads `thread` until it is served from memory with the stored answer `answer` after the first turn, and fails if
/// memory ever serves it without: the view a gap made stale is never served.
async fn served_from_memory_only_with(api: &Api, thread: &str, answer: &str) {
    let expected = &turns(&[("user", "Q"), ("assistant", answer)]);
    eventually(
        &format!("{thread} served from memory with {answer:?}"),
        || async move {
            let read = api.history(thread, "").await;
            let answered = messages(&read) == *expected;
            assert!(
                answered || read.source() != Some("cache"),
                "a stale view served from memory: {}",
                read.body
            );
            when(answered && read.source() == Some("cache"), || {
                format!("from {:?}: {}", read.source(), read.body)
            })
        },
    )
    .await;
}

/// The end of a fault that is no gap: the consumers resumed (`continued`) and caught up, the view is served from
/// memory with `answer` (published during the fault), no resume was a gap, and no hydration ran since `before`.
async fn resumed_without_a_gap(api: &Api, thread: &str, answer: &str, before: f64) {
    wait_resumes(api, "continued", 1.0).await;
    api.wait_readiness(true).await;
    let served = read_until_cache(api, thread, "").await;
    assert_eq!(
        messages(&served),
        turns(&[("user", "Q"), ("assistant", answer)])
    );
    // The consumers are seen drained every second: soon after the resume (whose first request may take a while,
    // and the instant is taken before it) answers from memory cover up to a moment ago.
    test_support::wait::eventually_within(
        "answers from memory covering up to a moment ago",
        Duration::from_secs(10),
        || async move {
            let reply = api.history(thread, "").await;
            assert_eq!(reply.status, 200, "{}", reply.body);
            let covered = crate::shadow::covered_through(&reply);
            let now = crate::shadow::now_ms();
            assert!(covered <= now + 1_000, "{covered} is ahead of {now}");
            when(
                reply.source() == Some("cache") && covered + 3_000 > now,
                || {
                    format!(
                        "from {:?}, covered through {covered}, now {now}",
                        reply.source()
                    )
                },
            )
        },
    )
    .await;
    assert_eq!(resumes(api, "gap").await, 0.0);
    assert_eq!(hydrations(api).await, before, "the view was kept");
}

/// The persister-lag bound the workers here run with (the default).
const LAG: Duration = Duration::from_millis(2_000);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_live_case_passes_through_the_jetstream_source() {
    let mongo = Arc::new(MongoServer::start());
    run_all("live", |case| {
        live_case_prepared(
            mongo.clone(),
            case,
            "jetstream",
            &[JETSTREAM],
            |url, case| {
                let classes = classes(&case.rows);
                async move { create_class_streams(&url, classes).await }
            },
        )
    })
    .await;
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
    let publishing = crate::shadow::now_ms();
    scene.store.insert_rows(std::slice::from_ref(&answer)).await;
    publish_rows(&scene.publisher, &[answer]).await;
    let stored = Instant::now();
    // Reads while the worker is cut off: each is answered (the store is up); one from memory without the answer is
    // allowed only within the persister-lag bound of its storing, and says it covers only up to a moment before
    // it; past the bound, no read lacks it (they wait, then read the store).
    let api = &app.api;
    eventually(
        "a read during the cut with the chunk stored meanwhile",
        || async move {
            let asked = Instant::now();
            let read = api.history(thread, "").await;
            assert_eq!(read.status, 200, "{}", read.body);
            let answered = read.body.contains("meanwhile");
            if read.source() == Some("cache") && !answered {
                assert!(
                    asked < stored + LAG,
                    "from memory without a chunk stored past the bound: {}",
                    read.body
                );
                assert!(crate::shadow::covered_through(&read) < publishing + 1);
            }
            when(answered, || {
                format!("from {:?}: {}", read.source(), read.body)
            })
        },
    )
    .await;
    // The read during the cut read the store; from here on the view is kept, not hydrated again.
    let before = hydrations(&app.api).await;
    proxy.restore();
    resumed_without_a_gap(&app.api, thread, "meanwhile", before).await;
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
    resumed_without_a_gap(&app.api, thread, "after restart", before).await;
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
    wait_resumes(&app.api, "gap", 1.0).await;
    served_from_memory_only_with(&app.api, thread, "missed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_then_created_again_is_consumed_again() {
    let scene = Scene::new().await;
    let thread = "t-js-deleted";
    let app = warm_jetstream(&scene, scene.nats.url(), thread).await;
    let context = jetstream::new(scene.publisher.clone());
    context
        .delete_stream("agent_A_stream")
        .await
        .expect("delete");
    // The worker notices the deletion (a gap) before the stream comes back.
    wait_resumes(&app.api, "gap", 1.0).await;
    create_class_streams(&scene.nats.url(), ["A".into()]).await;
    // Found again as a new stream (another gap), and consumed: an answer only published, not persisted yet,
    // reaches the view.
    wait_resumes(&app.api, "gap", 2.0).await;
    app.api.wait_readiness(true).await;
    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "live only");
    publish_rows(&scene.publisher, &[answer]).await;
    // The view itself holds it: served from memory (the store never had it).
    let expected = &turns(&[("user", "Q"), ("assistant", "live only")]);
    let api = &app.api;
    eventually("the stream consumed again into the view", || async move {
        let read = api.history(thread, "").await;
        when(
            messages(&read) == *expected && read.source() == Some("cache"),
            || format!("from {:?}: {}", read.source(), read.body),
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_replays_what_was_published_while_it_was_down() {
    let scene = Scene::new().await;
    let thread = "t-js-replay";
    let mut first = warm_jetstream(&scene, scene.nats.url(), thread).await;
    first.terminate();
    first
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the first worker exits");
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
    wait_resumes(&app.api, "gap", 1.0).await;
    served_from_memory_only_with(&app.api, thread, "elected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_threads_through_the_jetstream_source_equal_the_projector_and_a_cold_read() {
    const THREADS: usize = 60;
    let generated = threads::generated("js-conv", THREADS);
    let delivered: Vec<Value> = generated
        .iter()
        .flat_map(|(_, t)| t.delivered.clone())
        .collect();
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), classes(&delivered)).await;
    let app = scene
        .worker(
            scene.nats.url(),
            &[JETSTREAM, ("HISTORY_VIEW_MONGODB_INDEX_HINT", "")],
        )
        .await;
    publish_rows(&scene.publisher, &delivered).await;
    let display_events = delivered
        .iter()
        .filter(|r| r["event_type"] == "display_event")
        .count();
    app.api.wait_for_events(display_events as u64).await;
    // The store gets the same deliveries afterwards (the persister lags): the JetStream view has them all already.
    scene.store.insert_rows(&delivered).await;
    let mut visible = 0;
    for (id, thread) in &generated {
        // The expected answer: the naive reference over the thread's rows (not the worker's own projector).
        let expected = reference::history(id, &thread.rows, None);
        let expected = serde_json::to_string(
            &serde_json::json!({"thread_id": id, "messages": expected.messages}),
        )
        .unwrap();
        // The JetStream view's answer: from memory (a first read hydrates from the store, which has them too).
        let live = read_until_cache(&app.api, id, "").await;
        assert_eq!(live.body, expected, "{id}: JetStream view vs reference");
        visible += usize::from(!live.body.contains("\"messages\":[]"));
    }
    assert!(
        visible > THREADS / 2,
        "only {visible} threads have visible history"
    );
    // A fresh Core worker's cold reads answer the same.
    let cold = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_MONGODB_INDEX_HINT", "")])
        .await;
    for (id, _) in generated.iter().take(20) {
        let stored = cold.api.history(id, "").await;
        assert_eq!(stored.source(), Some("store"));
        assert_eq!(
            stored.body,
            app.api.history(id, "").await.body,
            "{id}: cold read"
        );
    }
}

/// An event of a class no stream captures (aihub publishes it on Core NATS and persists it; no class stream exists
/// for it): the Core witness sees it and no stream delivers it, so its thread hydrates again. Beside it a worker
/// without the witness serves the stale view from memory for longer than the bound: the case the witness covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_no_stream_captures_is_witnessed_on_core_and_never_missing_from_memory_past_the_bound()
 {
    const BOUND: Duration = Duration::from_millis(2_000);
    let scene = Scene::new().await;
    let thread = "t-js-witness";
    // Only the user's class has a stream: the agent's chunks reach Core NATS and the store, no stream.
    create_class_streams(&scene.nats.url(), ["UserAgent".into()]).await;
    let witnessed = scene
        .worker(
            scene.nats.url(),
            &[JETSTREAM, ("HISTORY_VIEW_JETSTREAM_WITNESS", "true")],
        )
        .await;
    let blind = scene.worker(scene.nats.url(), &[JETSTREAM]).await;
    let first = user_row(thread, "d1", "e1", now_ns(0), "Q");
    scene.store.insert_rows(std::slice::from_ref(&first)).await;
    publish_rows(&scene.publisher, &[first]).await;
    read_until_cache(&witnessed.api, thread, "").await;
    read_until_cache(&blind.api, thread, "").await;

    let answer = chunk_row(thread, "d1", "A", "e2", now_ns(1), "unstreamed");
    scene.store.insert_rows(std::slice::from_ref(&answer)).await;
    let stored = Instant::now();
    publish_rows(&scene.publisher, &[answer]).await;
    let expected = &turns(&[("user", "Q"), ("assistant", "unstreamed")]);
    // Both workers read side by side for three bounds at least, and until the witnessed one served the event from
    // memory: every answer of the witnessed one is judged.
    let (blind_stale, served_complete) = (&Cell::new(false), &Cell::new(false));
    let (witnessed, blind) = (&witnessed, &blind);
    eventually(
        "three bounds watched, the event served from memory",
        || async move {
            let read = witnessed.api.history(thread, "").await;
            let complete = messages(&read) == *expected;
            assert!(
                complete || read.source() != Some("cache") || stored.elapsed() < BOUND,
                "served from memory without an event stored {:?} ago: {}",
                stored.elapsed(),
                read.body
            );
            served_complete
                .set(served_complete.get() || complete && read.source() == Some("cache"));
            let other = blind.api.history(thread, "").await;
            if other.source() == Some("cache")
                && messages(&other) != *expected
                && stored.elapsed() > BOUND
            {
                blind_stale.set(true);
            }
            when(
                stored.elapsed() >= BOUND * 3 && served_complete.get(),
                || {
                    format!(
                        "{:?} since stored; the witnessed worker answered {}",
                        stored.elapsed(),
                        read.body
                    )
                },
            )
        },
    )
    .await;
    let blind_stale_past_bound = blind_stale.get();
    assert!(
        blind_stale_past_bound,
        "without the witness the view stays stale: the case is real"
    );
    assert!(
        metric(
            &witnessed.api.metrics().await,
            "history_view_jetstream_witnessed_total{result=\"missing\"}"
        ) >= 1.0
    );
}

/// A thread deleted from the store while its events are still in the class streams' replay window
/// ([design 2.1.8](../../docs/design.md#2.1.8)): aihub's own read shows nothing, and so does the worker. A worker
/// holding the thread in memory learns it from a shadow check (the held turn is `orphaned`: read from the store before,
/// or arrived more than the bound before the read, and no longer stored), which makes the view partial; its next read hydrates and drops the
/// turn. A worker started afterwards replays the turn from the streams, and its first read's hydration drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_deleted_within_the_replay_window_stays_deleted() {
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["UserAgent".into(), "A".into()]).await;
    let settings = [
        JETSTREAM,
        ("HISTORY_VIEW_SHADOW_SAMPLE", "1"),
        ("HISTORY_VIEW_JETSTREAM_REPLAY_SECS", "600"),
    ];
    let mut first = scene.worker(scene.nats.url(), &settings).await;
    let thread = unique("deleted-");
    let kept = unique("kept-");
    // Created ten seconds ago (the persister stored them long since), published now.
    let rows: Vec<Value> = [&thread, &kept]
        .into_iter()
        .flat_map(|t| {
            [
                user_row(t, "d1", "e1", now_ns(-10_000_000_000), "Q"),
                chunk_row(t, "d1", "A", "e2", now_ns(-9_000_000_000), "the answer"),
            ]
        })
        .collect();
    scene.store.insert_rows(&rows).await;
    publish_rows(&scene.publisher, &rows).await;
    let full = turns(&[("user", "Q"), ("assistant", "the answer")]);
    for t in [&thread, &kept] {
        assert_eq!(messages(&read_until_cache(&first.api, t, "").await), full);
    }
    let deleted = scene
        .store
        .events()
        .delete_many(mongodb::bson::doc! {"thread_id": &thread})
        .await
        .expect("the thread is deleted");
    assert_eq!(deleted.deleted_count, 2);
    // Until the check the view is what it was (the worker sees no deletion); then it is healed.
    let before = first.api.history(&thread, "").await;
    assert_eq!(before.source(), Some("cache"));
    wait_metric(
        &first.api,
        "history_view_shadow_checks_total{result=\"orphaned\"}",
        1.0,
    )
    .await;
    let after = read_until_cache(&first.api, &thread, "").await;
    assert_eq!(messages(&after), Value::Array(Vec::new()), "{}", after.body);
    let metrics = first.api.metrics().await;
    assert_eq!(metric(&metrics, "history_view_orphaned_events_total"), 1.0);
    assert_eq!(
        metric(
            &metrics,
            "history_view_shadow_checks_total{result=\"missing\"}"
        ),
        0.0
    );
    first.terminate();
    first
        .wait_exit(Duration::from_secs(20))
        .await
        .expect("the first worker exits");

    // A new worker replays both threads from the streams; its reads show what the store shows.
    let second = scene.worker(scene.nats.url(), &settings).await;
    let cold = second.api.history(&thread, "").await;
    assert_eq!(cold.status, 200, "{}", cold.body);
    assert_eq!(messages(&cold), Value::Array(Vec::new()), "{}", cold.body);
    let warm = read_until_cache(&second.api, &thread, "").await;
    assert_eq!(messages(&warm), Value::Array(Vec::new()), "{}", warm.body);
    assert_eq!(
        messages(&read_until_cache(&second.api, &kept, "").await),
        full
    );
    let metrics = second.api.metrics().await;
    assert_eq!(metric(&metrics, "history_view_orphaned_events_total"), 1.0);
}
