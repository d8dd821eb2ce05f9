//! `HISTORY_VIEW_MAX_THREAD_BYTES`: a read of a thread past it answers 507 within the store timeout, and memory stays
//! within its bound while such reads run and falls back after (through the worker binary, as deployed); a live view
//! that outgrows it leaves the cache and its reads answer as a store read would.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::{
    chunk_row, metric, publish_rows, spawn_app_with, turns, unique, user_row, worker_binary,
};
use crate::scene::{Scene, read_until_cache, wait_metric};
use test_support::memory::memory;
use test_support::wait::eventually_within;

const MIB: u64 = 1 << 20;

/// The rows of a thread of about `chunks` × `chunk_bytes` bytes: a user turn, then an answer in chunks.
fn big_thread(thread: &str, chunks: usize, chunk_bytes: usize) -> Vec<Value> {
    let text = "x".repeat(chunk_bytes);
    std::iter::once(user_row(thread, "d1", "u1", 1, "Q"))
        .chain((0..chunks).map(|i| {
            let created_at = 2 + i64::try_from(i).expect("few chunks");
            chunk_row(thread, "d1", "A", &format!("c{i}"), created_at, &text)
        }))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_threads_past_the_limit_answer_507_in_bounded_memory_that_is_given_back() {
    const BUDGET_MIB: u64 = 16;
    const LIMIT_MIB: u64 = 32;
    // The default HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS.
    const HYDRATIONS: u64 = 10;
    const STORE_TIMEOUT: Duration = Duration::from_secs(20);
    let scene = Scene::new().await;
    // Three threads of 60 MB each in the store.
    let threads: Vec<String> = (0..3).map(|_| unique("t-huge")).collect();
    for thread in &threads {
        for batch in big_thread(thread, 600, 100_000).chunks(50) {
            scene.store.insert_rows(batch).await;
        }
    }
    let worker = scene
        .worker_binary(
            &worker_binary(),
            scene.nats.url(),
            &[
                ("HISTORY_VIEW_CACHE_MAX_BYTES", "16MiB"),
                ("HISTORY_VIEW_MAX_THREAD_BYTES", "32MiB"),
                ("HISTORY_VIEW_STORE_TIMEOUT_MS", "20000"),
            ],
        )
        .await;
    let pid = worker.pid();
    let before = memory(pid);

    let started = Instant::now();
    let replies =
        futures_util::future::join_all(threads.iter().map(|t| worker.api.history(t, ""))).await;
    let elapsed = started.elapsed();
    let peak = memory(pid);
    // The bound the settings promise (without the limit, the three reads peaked at 431 MiB).
    let bound_kib = (BUDGET_MIB + 64 + HYDRATIONS * LIMIT_MIB) * 1024;
    let settled_kib = (BUDGET_MIB + 64) * 1024;
    // RSS must fall back within 10 s.
    let settling = Instant::now();
    let after = eventually_within(
        &format!("RSS back within {settled_kib} KiB"),
        Duration::from_secs(10),
        || {
            let now = memory(pid);
            let settled = if now.rss_kib <= settled_kib {
                Ok(now)
            } else {
                Err(format!("{} KiB", now.rss_kib))
            };
            async move { settled }
        },
    )
    .await;
    eprintln!(
        "RSS before {} KiB, peak {} KiB (bound {bound_kib}), {} KiB after {:?} (bound {settled_kib} KiB); reads \
         took {elapsed:?}",
        before.rss_kib,
        peak.hwm_kib,
        after.rss_kib,
        settling.elapsed()
    );
    for reply in &replies {
        assert_eq!(reply.status, 507, "{:.300}", reply.body);
        let error = &reply.json()["error"];
        assert_eq!(error["code"], "thread_too_large");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&(LIMIT_MIB * MIB).to_string())
                && message.contains("HISTORY_VIEW_MAX_THREAD_BYTES"),
            "{message}"
        );
        assert_eq!(reply.header("retry-after"), None);
    }
    assert!(elapsed < STORE_TIMEOUT, "{elapsed:?}");
    assert_eq!(
        metric(
            &worker.api.metrics().await,
            r#"history_view_thread_limit_exceeded_total{path="read"}"#
        ),
        3.0
    );

    assert!(peak.hwm_kib <= bound_kib, "peak {} KiB", peak.hwm_kib);
    assert!(after.rss_kib <= settled_kib, "after {} KiB", after.rss_kib);

    // A thread within the limit still reads, and from memory once complete.
    let small = unique("t-small");
    scene.store.insert_rows(&big_thread(&small, 3, 1_000)).await;
    read_until_cache(&worker.api, &small, "").await;
}

#[tokio::test]
async fn a_live_view_that_outgrows_the_limit_leaves_the_cache_and_its_reads_answer_507() {
    let app = spawn_app_with(|c| c.cache.max_thread_bytes = 1 << 20).await;
    let (thread, other) = ("t-growing", "t-neighbour");
    // Persisted and published, as aihub does.
    let first = big_thread(thread, 2, 10_000);
    let neighbour = big_thread(other, 2, 10_000);
    app.store.insert_rows(&first).await;
    app.store.insert_rows(&neighbour).await;
    for t in [thread, other] {
        assert_eq!(app.api.history(t, "").await.status, 200);
    }
    let complete = read_until_cache(&app.api, thread, "").await;
    assert_eq!(
        complete.json()["messages"].as_array().map(Vec::len),
        Some(2)
    );

    // The answer grows past 1 MiB live (12 more chunks of 100 kB); the store gets the rows too.
    let more: Vec<Value> = (0..12)
        .map(|i| {
            chunk_row(
                thread,
                "d1",
                "A",
                &format!("more{i}"),
                100 + i,
                &"y".repeat(100_000),
            )
        })
        .collect();
    app.store.insert_rows(&more).await;
    publish_rows(&app.publisher, &more).await;
    wait_metric(
        &app.api,
        r#"history_view_thread_limit_exceeded_total{path="live"}"#,
        1.0,
    )
    .await;
    let reply = app.api.history(thread, "").await;
    assert_eq!(reply.status, 507, "{:.300}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "thread_too_large");
    assert_eq!(reply.source(), None);
    // Other threads are not touched.
    let neighbour = read_until_cache(&app.api, other, "").await;
    assert_eq!(neighbour.json()["messages"][0], turns(&[("user", "Q")])[0]);
}
