//! Graceful shutdown: SIGTERM makes `/readyz` answer 503 at once while the worker serves on for the shutdown delay
//! (no read refused), then a read in flight completes and the process exits within the drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::helpers::{Api, BinaryApp, OneThread, spawn_app, turns};
use crate::scene::wait_metric;
use test_support::wait::within;

/// Waits until the worker behind `api` has answered at least `reads` reads of a thread (from memory or the store).
async fn wait_reads(api: &Api, reads: f64) {
    api.wait_metric_sum("history_view_read_duration_seconds_count", reads)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_read_in_flight_completes_the_read_and_exits_in_time() {
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("shutdown").await;
    let mongo = Arc::new(mongo);
    let mut app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        ("HISTORY_VIEW_STORE_TIMEOUT_MS", "20000".to_owned()),
        ("HISTORY_VIEW_SHUTDOWN_DELAY_SECS", "0".to_owned()),
        ("HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", "5".to_owned()),
    ])
    .await;
    app.wait_ready().await;

    // Freeze the store, so the read hangs in its hydration until the store is let go.
    mongo.pause();
    let api = app.api.clone();
    let read = tokio::spawn(async move { api.history("t1", "").await });
    // The read reached the worker: it missed the cache and waits for its hydration.
    wait_metric(&app.api, "history_view_cache_misses_total", 1.0).await;

    app.terminate();
    // The signal was handled and the drain began; the process keeps draining while the read is in flight (and the
    // read's answer below is the proof that it drained rather than cut it off).
    app.wait_log("no new events or connections").await;
    assert!(
        !read.is_finished() && app.exited().is_none(),
        "exited with a read in flight"
    );
    mongo.resume();

    let reply = read.await.expect("the read task");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        reply.json()["messages"],
        turns(&[("user", "Q"), ("assistant", "A")])
    );
    let status = app
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the process exits after draining");
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn a_stop_request_ends_the_application_within_the_drain_time() {
    let mut app = spawn_app().await;
    assert_eq!(app.api.history("t1", "").await.status, 200);
    app.stop_within(Duration::from_secs(10))
        .await
        .expect("a clean stop");
}

/// Issue 37: on SIGTERM the listener closed at once, so a rolling update refused the connections Kubernetes still
/// sent while it removed the pod from the endpoints. Now `/readyz` answers 503 right after the signal, the worker
/// goes on answering reads for `HISTORY_VIEW_SHUTDOWN_DELAY_SECS`, and exits after the delay and the drain.
///
/// Every read opens a connection of its own, so a closed listener would show as a refused connection. The delay is
/// long (20 s) against the reads the test asserts after `/readyz` went 503 (a few seconds' worth), and the exit is
/// checked from below (not before the delay, which the worker sleeps) with a wide bound above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_makes_the_worker_unready_and_it_serves_on_through_the_delay_refusing_none() {
    const DELAY: Duration = Duration::from_secs(20);
    const DRAIN: Duration = Duration::from_secs(5);
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("shutdown-delay").await;
    let mut app = BinaryApp::start(&[
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        (
            "HISTORY_VIEW_SHUTDOWN_DELAY_SECS",
            DELAY.as_secs().to_string(),
        ),
        (
            "HISTORY_VIEW_SHUTDOWN_DRAIN_SECS",
            DRAIN.as_secs().to_string(),
        ),
    ])
    .await;
    app.wait_ready().await;

    // No connection pool: each request connects anew.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let history = format!("{}/v1/threads/t1/history", app.api.address);
    let readyz = format!("{}/readyz", app.api.address);

    // Reads go on, one after another, from before the signal until the test has seen enough after /readyz went 503.
    let unready = Arc::new(AtomicBool::new(false));
    let reader = tokio::spawn({
        let (client, unready) = (client.clone(), Arc::clone(&unready));
        async move {
            let (mut before, mut after, mut failures) = (0, 0, Vec::new());
            while after < 30 {
                let seen_unready = unready.load(Ordering::Acquire);
                match client.get(&history).send().await {
                    Ok(reply) if reply.status() == 200 => {}
                    Ok(reply) => failures.push(format!("status {}", reply.status())),
                    Err(error) => failures.push(format!("{error:?}")),
                }
                if seen_unready {
                    after += 1;
                } else {
                    before += 1;
                }
                assert!(failures.len() < 5, "reads failed: {failures:?}");
                // A load generator's pacing, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (before, after, failures)
        }
    });
    // A few reads answered before the signal.
    wait_reads(&app.api, 3.0).await;

    let signalled = Instant::now();
    app.terminate();
    // /readyz says so as soon as the signal is handled, naming the cause; meanwhile it always answers.
    let body = test_support::wait::eventually_within(
        "/readyz unready after SIGTERM",
        Duration::from_secs(10),
        || {
            let (client, readyz) = (&client, &readyz);
            async move {
                let reply = client
                    .get(readyz)
                    .send()
                    .await
                    .expect("/readyz answers after SIGTERM");
                let status = reply.status();
                let body: serde_json::Value = reply.json().await.expect("a JSON /readyz body");
                if status == 503 {
                    Ok(body)
                } else {
                    Err(format!("{status} {body}"))
                }
            }
        },
    )
    .await;
    unready.store(true, Ordering::Release);
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["checks"]["shutdown"]["ok"], false, "{body}");
    assert!(
        body["checks"]["shutdown"]["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("shutting down")),
        "{body}"
    );
    // Its dependencies are fine: only the shutdown makes it unready.
    assert_eq!(body["checks"]["nats"]["ok"], true, "{body}");
    assert_eq!(body["checks"]["store"]["ok"], true, "{body}");

    let (before, after, failures) = reader.await.expect("the reader");
    assert!(
        failures.is_empty(),
        "reads failed during the delay: {failures:?}"
    );
    assert!(
        before > 0 && after >= 30,
        "{before} reads before, {after} after"
    );
    assert!(app.exited().is_none(), "exited during the delay");
    assert!(
        app.log_lines("serving on while the endpoints are removed")
            .len()
            == 1,
        "the delay is not logged"
    );

    let status = app
        .wait_exit(DELAY + DRAIN + Duration::from_secs(30))
        .await
        .expect("the process exits after the delay and the drain");
    assert!(status.success(), "exit status {status}");
    assert!(
        signalled.elapsed() >= DELAY,
        "exited {:?} after SIGTERM, before the {DELAY:?} delay",
        signalled.elapsed()
    );
}

/// A client process of `tests/clients/` reading through `url` at 50 requests/s per connection, started and
/// answered once.
struct PooledClients {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl PooledClients {
    async fn start(program: &std::path::Path, script: &str, url: &str) -> Self {
        use tokio::io::AsyncBufReadExt;
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/clients")
            .join(script);
        let mut child = tokio::process::Command::new(program)
            .arg(script)
            .arg(url)
            .arg("50")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the client process starts");
        let lines = tokio::io::BufReader::new(child.stdout.take().expect("its stdout")).lines();
        let mut clients = Self { child, lines };
        assert_eq!(clients.line().await, "ready");
        clients
    }

    async fn line(&mut self) -> String {
        within(
            "the client process answers",
            Duration::from_secs(30),
            self.lines.next_line(),
        )
        .await
        .expect("its output")
        .expect("a line")
    }

    /// Stops it; each client's `(name, answers, failures, first failure)`.
    async fn stop(mut self, clients: usize) -> Vec<(String, u64, u64, String)> {
        use tokio::io::AsyncWriteExt;
        let mut stdin = self.child.stdin.take().expect("its stdin");
        stdin.write_all(b"stop\n").await.expect("stop the clients");
        drop(stdin);
        let mut results = Vec::new();
        for _ in 0..clients {
            let line = self.line().await;
            let fields: Vec<&str> = line.split(' ').collect();
            let [name, answers, failures, first] = fields[..] else {
                panic!("a client reported {line:?}");
            };
            results.push((
                name.to_owned(),
                answers.parse().unwrap(),
                failures.parse().unwrap(),
                first.to_owned(),
            ));
        }
        results
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_clients_follow_a_rolling_restart_without_a_failed_request() {
    const DELAY: Duration = Duration::from_secs(3);
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("rollout").await;
    let env = [
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        (
            "HISTORY_VIEW_SHUTDOWN_DELAY_SECS",
            DELAY.as_secs().to_string(),
        ),
        ("HISTORY_VIEW_SHUTDOWN_DRAIN_SECS", "2".into()),
    ];
    let mut old = BinaryApp::start(&env).await;
    let new = BinaryApp::start(&env).await;
    old.wait_ready().await;
    new.wait_ready().await;
    let address = |app: &BinaryApp| -> std::net::SocketAddr {
        app.api
            .address
            .trim_start_matches("http://")
            .parse()
            .expect("a worker's address")
    };
    // The Service: every connection to the old worker until the orchestrator removes it from the endpoints.
    let service = test_support::proxy::Balancer::start(address(&old)).await;
    let url = format!("{}/v1/threads/t1/history", service.http_url());
    let python = PooledClients::start(&test_support::servers::python(), "pooled.py", &url).await;
    let node = PooledClients::start(std::path::Path::new("node"), "pooled.mjs", &url).await;
    // Each client has had an answer; the three are under way against the old worker (half a second's worth).
    wait_reads(&old.api, 75.0).await;

    // A rollout: SIGTERM, and the endpoint removal reaching the Service a moment later; the clients' pooled
    // connections stay with the old worker until they close.
    old.terminate();
    // The scenario: the endpoint removal reaches the Service half a second after the signal, as in a cluster.
    tokio::time::sleep(Duration::from_millis(500)).await;
    service.route_to(address(&new));
    assert!(
        old.wait_exit(DELAY + Duration::from_secs(10))
            .await
            .is_some(),
        "the old worker exits"
    );
    // The clients went on against the new worker (a second's worth of their reads).
    wait_reads(&new.api, 150.0).await;

    let mut results = python.stop(2).await;
    results.extend(node.stop(1).await);
    for (name, answers, failures, first) in &results {
        assert_eq!(
            *failures, 0,
            "{name}: {failures} failed requests (the first: {first}), {answers} answered"
        );
        // 50/s for over 4.5 s on a loaded machine: most of them.
        assert!(*answers >= 100, "{name}: only {answers} answers");
    }
}

/// Stops a worker that read the store (its driver's connection pools busy in the background) 100 times, four at a
/// time: every one exits 0 and none panics on the way out (the driver's tasks once outlived the runtime's drop and
/// panicked after the `stopped` line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_stops_exit_cleanly() {
    const STOPS: usize = 100;
    const AT_ONCE: usize = 4;
    let OneThread {
        mongo,
        nats,
        database,
    } = OneThread::start("stops").await;
    let env = [
        ("HISTORY_VIEW_NATS_URL", nats.url()),
        ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
        ("HISTORY_VIEW_MONGODB_DATABASE", database),
        ("HISTORY_VIEW_SHUTDOWN_DELAY_SECS", "0".to_owned()),
    ];
    let one = |round: usize| {
        let env = env.clone();
        async move {
            let mut app = BinaryApp::start(&env).await;
            app.wait_ready().await;
            let read = app.api.history("t1", "").await;
            assert_eq!(read.status, 200, "stop {round}: {}", read.body);
            app.terminate();
            let status = app
                .wait_exit(Duration::from_secs(20))
                .await
                .unwrap_or_else(|| panic!("stop {round}: the worker did not exit"));
            let panics = app.log_lines("panicked");
            assert!(
                status.success() && panics.is_empty(),
                "stop {round}: {status}, {panics:?}"
            );
        }
    };
    for batch in 0..STOPS / AT_ONCE {
        futures_util::future::join_all((0..AT_ONCE).map(|i| one(batch * AT_ONCE + i))).await;
    }
}
