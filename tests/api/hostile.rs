//! Hostile publishers through the built binary: subjects that are not UTF-8 (skipped and counted, no reconnect),
//! and one hot thread fed in reverse `created_at` order, and read meanwhile, while another thread's events must stay
//! fresh.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::helpers::{chunk_row, metric, publish_rows, user_row, worker_binary};
use crate::scene::{Scene, now_ns, read_until_cache, wait_metric};
use test_support::hot_thread::{self, Probes};
use test_support::scrape::live_drops;
use test_support::wait::{eventually, when};

/// A NATS client speaking the protocol by hand, so that it can publish what async-nats refuses to.
struct RawClient {
    stream: BufReader<TcpStream>,
}

impl RawClient {
    async fn connect(address: std::net::SocketAddr) -> Self {
        let mut stream =
            BufReader::new(TcpStream::connect(address).await.expect("connect to NATS"));
        let mut info = String::new();
        stream.read_line(&mut info).await.expect("INFO");
        assert!(info.starts_with("INFO"), "{info}");
        stream
            .get_mut()
            .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\n")
            .await
            .expect("CONNECT");
        Self { stream }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.stream
            .get_mut()
            .write_all(bytes)
            .await
            .expect("write to NATS");
    }

    /// Waits until the server has processed everything sent (PING answered by PONG).
    async fn flush(&mut self) {
        self.send(b"PING\r\n").await;
        let mut line = String::new();
        loop {
            line.clear();
            self.stream
                .read_line(&mut line)
                .await
                .expect("read from NATS");
            assert!(!line.starts_with("-ERR"), "the server refused: {line}");
            if line.starts_with("PONG") {
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subjects_that_are_not_utf8_are_counted_without_a_reconnect_or_a_downgrade() {
    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let thread = "t-utf8";
    scene
        .store
        .insert_rows(&[user_row(thread, "d1", "e1", now_ns(0), "Q")])
        .await;
    read_until_cache(&app.api, thread, "").await;

    let mut raw = RawClient::connect(scene.nats.address()).await;
    // A thread id, a run id and a reply subject that are not UTF-8, and one with headers (HPUB).
    raw.send(b"PUB agent.A.a.\xff.d1.r.display_event.ChunkEvent.x1 2\r\n{}\r\n")
        .await;
    raw.send(b"PUB agent.A.a.t-utf8.d1.\xfe\xfe.display_event.ChunkEvent.x2 2\r\n{}\r\n")
        .await;
    raw.send(b"PUB agent.A.a.t-utf8.d1.r.display_event.ChunkEvent.x3 _INBOX.\xc3 2\r\n{}\r\n")
        .await;
    raw.send(
        b"HPUB agent.A.a.\xff.d1.r.display_event.ChunkEvent.x4 12 14\r\nNATS/1.0\r\n\r\n{}\r\n",
    )
    .await;
    raw.flush().await;
    wait_metric(
        &app.api,
        "history_view_events_total{outcome=\"bad_subject\"}",
        4.0,
    )
    .await;

    // The connection stayed up, so the complete view stayed complete and the next event is applied live.
    publish_rows(
        &scene.publisher,
        &[chunk_row(thread, "d1", "A", "c1", now_ns(1), "after")],
    )
    .await;
    let api = &app.api;
    eventually("the live event in the view", || async move {
        let reply = api.history(thread, "").await;
        assert_eq!(reply.source(), Some("cache"), "{}", reply.body);
        when(reply.body.contains("after"), || reply.body)
    })
    .await;
    let metrics = app.api.metrics().await;
    for event in ["disconnected", "client_error", "server_error"] {
        assert_eq!(
            metric(
                &metrics,
                &format!("history_view_nats_connection_events_total{{event=\"{event}\"}}")
            ),
            0.0,
            "{event}"
        );
    }
    assert_eq!(
        metric(
            &metrics,
            "history_view_events_total{outcome=\"bad_subject\"}"
        ),
        4.0
    );
    assert_eq!(metric(&metrics, "history_view_views_downgraded_total"), 0.0);
}

/// Events on the hot thread; published at a fixed rate well below what the worker the tests build (its own crate
/// unoptimized) ingests in order. The release worker's rate is the benchmark's (P8).
const HOT_EVENTS: usize = 50_000;
const HOT_RATE: f64 = 6_000.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_thread_in_reverse_order_neither_drops_events_nor_delays_other_threads() {
    let scene = Scene::new().await;
    let app = scene
        .worker_binary(&worker_binary(), scene.nats.url(), &[])
        .await;
    let (probe_thread, hot_thread) = ("t-probe", "t-hot");
    scene
        .store
        .insert_rows(&[
            user_row(probe_thread, "d1", "e1", now_ns(0), "Q"),
            user_row(hot_thread, "d1", "e1", 0, "Q"),
        ])
        .await;
    read_until_cache(&app.api, probe_thread, "").await;

    let hot = hot_thread::hot_chunks(hot_thread, HOT_EVENTS, true);
    let done = AtomicBool::new(false);
    let publishing = async {
        hot_thread::publish_paced(&scene.publisher, &hot, Some(HOT_RATE)).await;
        done.store(true, Ordering::Release);
    };
    let events = scene.store.events();
    let probing = hot_thread::probe(
        &scene.publisher,
        &events,
        &app.api.address,
        probe_thread,
        now_ns(1),
        &done,
    );
    // Reads of the hot thread hold its view while they render it; its events then wait beside the view.
    let reading_hot = async {
        let mut reads = 0;
        while !done.load(Ordering::Acquire) {
            assert_eq!(app.api.history(hot_thread, "").await.status, 200);
            reads += 1;
        }
        reads
    };
    let ((), probes, hot_reads): ((), Probes, usize) =
        tokio::join!(publishing, probing, reading_hot);
    assert!(hot_reads > 0);

    wait_metric(
        &app.api,
        "history_view_events_total{outcome=\"relevant\"}",
        (HOT_EVENTS + probes.sent()) as f64,
    )
    .await;
    let metrics = app.api.metrics().await;
    assert_eq!(live_drops(&metrics), 0.0, "events were dropped:\n{metrics}");
    assert!(probes.sent() >= 200, "{probes:?}");
    assert_eq!(probes.lost, 0, "{probes:?}");
    let judged: Vec<&str> = metrics
        .lines()
        .filter(|line| {
            [
                "shadow_checks_total",
                "orphaned",
                "hydrations_total",
                "views_downgraded",
                "reads_total",
            ]
            .iter()
            .any(|name| line.contains(name))
                && !line.starts_with('#')
        })
        .collect();
    assert_eq!(probes.not_from_cache, 0, "{probes:?}\n{judged:#?}");
    assert!(
        probes.max() <= Duration::from_secs(1),
        "a probe took {:?} to show",
        probes.max()
    );
}
