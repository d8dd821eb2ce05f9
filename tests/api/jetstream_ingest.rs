//! The JetStream source under load: a class stream of a few hundred thousand events, replayed at start by one
//! worker after another, is consumed without a resume and without a pause of consumption. The stall this catches:
//! the pull stream of async-nats lost count of a request whose reply outran its own bookkeeping, sent no new one,
//! and waited for two missed heartbeats (4 s) before the consumer was resumed (vendor/async-nats/PATCH.md).

use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::helpers::BinaryApp;
use crate::scene::Scene;
use test_support::class_streams::{create_class_streams, wait_until_stored};
use test_support::hot_thread::chunk;
use test_support::scrape::metric_sum;

/// Events in the stream, spread over [`THREADS`] threads; about 500 B each with their subject.
const EVENTS: usize = 200_000;
const THREADS: usize = 1_000;
/// How many workers replay the stream, one after the other.
const REPLAYS: usize = 3;
/// Longer than any pause of a consumer that keeps pulling, shorter than the two missed heartbeats (4 s) that end a
/// stalled one.
const PAUSE: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_replay_is_consumed_without_a_resume_or_a_pause_again_and_again() {
    let scene = Scene::new().await;
    create_class_streams(&scene.nats.url(), ["Hot".into()]).await;
    let text = "x".repeat(300);
    for i in 0..EVENTS {
        let thread = format!("t{:04}", i % THREADS);
        let (subject, payload) = chunk(&thread, &format!("e{i}"), i as i64 + 1, &text);
        scene
            .publisher
            .publish(subject, payload)
            .await
            .expect("publish");
    }
    scene.publisher.flush().await.expect("flush");
    wait_until_stored(
        &jetstream::new(scene.publisher.clone()),
        "agent_Hot_stream",
        EVENTS as u64,
    )
    .await;
    for replay in 1..=REPLAYS {
        // Not waited ready: a JetStream worker is ready once its replay caught up, and the replay is what is watched.
        let app = BinaryApp::start(&[
            ("HISTORY_VIEW_NATS_URL", scene.nats.url()),
            ("HISTORY_VIEW_MONGODB_URI", scene.mongo.uri()),
            ("HISTORY_VIEW_MONGODB_DATABASE", scene.database.clone()),
            ("HISTORY_VIEW_SOURCE", "jetstream".into()),
            ("HISTORY_VIEW_JETSTREAM_REPLAY_SECS", "3600".into()),
        ])
        .await;
        let started = Instant::now();
        let mut progress = (0.0, Instant::now());
        loop {
            let text = app.api.metrics().await;
            let events = metric_sum(&text, "history_view_events_total");
            let now = Instant::now();
            if events > progress.0 {
                progress = (events, now);
            }
            assert_eq!(
                metric_sum(&text, "history_view_jetstream_resumes_total"),
                0.0,
                "replay {replay}: the consumer was resumed, at {events} of {EVENTS} events"
            );
            if events >= EVENTS as f64 {
                break;
            }
            assert!(
                now - progress.1 < PAUSE,
                "replay {replay}: consumption paused at {events} of {EVENTS} events"
            );
            // The watch's sampling interval: what is asserted is that progress never pauses for PAUSE, so consumption
            // is sampled throughout rather than waited for.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        eprintln!(
            "replay {replay}: {EVENTS} events in {:?}",
            started.elapsed()
        );
    }
}
