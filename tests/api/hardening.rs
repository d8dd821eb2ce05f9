//! HTTP hardening: slow clients closed by the header and idle timeouts while reads and probes go on, a flood up to
//! the connection cap leaving the probes reachable, the in-flight cap answering 503 at once, and secrets never
//! printed (help, start-up errors, trace logs through start, reads, bad input and shutdown, `/metrics`).

use std::path::Path;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{Api, metric, spawn_app_with, user_row};
use crate::scene::wait_metric;
use test_support::servers::{MongoServer, NatsServer};
use test_support::wait::scaled;

/// The `host:port` of an [`Api`].
fn socket_address(api: &Api) -> String {
    api.address.trim_start_matches("http://").to_owned()
}

/// Opens a connection and sends `bytes` (nothing if empty).
async fn connect(api: &Api, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(socket_address(api))
        .await
        .expect("connect");
    if !bytes.is_empty() {
        stream.write_all(bytes).await.expect("send");
    }
    stream
}

/// Sends a whole request and reads its response head, leaving the connection open (keep-alive).
async fn idle_after_one_request(api: &Api) -> TcpStream {
    let mut stream = connect(api, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").await;
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await.expect("read the response");
        assert!(n > 0, "closed before answering");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
}

/// How long after `since` the server closed `stream` (reading until end of stream), or `None` if it was still
/// open at `limit` (scaled) after `since`.
async fn closed_after(stream: &mut TcpStream, since: Instant, limit: Duration) -> Option<Duration> {
    let limit = scaled(limit);
    let mut buf = [0u8; 1024];
    loop {
        let left = (since + limit).checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(since.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_keep_alives_are_closed_by_their_timeouts_while_reads_go_on() {
    let app = spawn_app_with(|c| {
        c.http.header_timeout = Duration::from_secs(1);
        c.http.idle_timeout = Duration::from_secs(3);
    })
    .await;
    app.store
        .insert_rows(&[user_row("t-slow", "d1", "e1", 1, "Q")])
        .await;
    let started = Instant::now();
    let mut partial = Vec::new();
    let mut idle = Vec::new();
    for _ in 0..20 {
        partial.push(
            connect(
                &app.api,
                b"GET /v1/threads/t-slow/history HTTP/1.1\r\nHost: t\r\n",
            )
            .await,
        );
        idle.push(idle_after_one_request(&app.api).await);
    }
    // Meanwhile, reads and probes are answered.
    let reads = Api::new(app.api.address.clone());
    assert_eq!(reads.history("t-slow", "").await.status, 200);
    assert_eq!(reads.get("/readyz", &[]).await.status, 200);

    for stream in &mut partial {
        let closed = closed_after(stream, started, Duration::from_secs(10)).await;
        let closed = closed.expect("a connection with partial headers stayed open");
        assert!(closed >= Duration::from_millis(900), "{closed:?}");
    }
    for stream in &mut idle {
        let closed = closed_after(stream, started, Duration::from_secs(15)).await;
        let closed = closed.expect("an idle keep-alive connection stayed open");
        // The idle timeout, not the header timeout: an idle connection is not a slow request.
        assert!(closed >= Duration::from_millis(2_500), "{closed:?}");
    }
    let metrics = app.api.metrics().await;
    assert!(
        metric(
            &metrics,
            r#"history_view_http_timeouts_total{kind="header"}"#
        ) >= 20.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, r#"history_view_http_timeouts_total{kind="idle"}"#) >= 20.0,
        "{metrics}"
    );
    // A fresh client: the first one's pooled connection has been idle past the idle timeout, and the server closes
    // it by design (a client may race that close with its next request).
    let fresh = Api::new(app.api.address.clone());
    assert_eq!(fresh.history("t-slow", "").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_up_to_the_connection_cap_leaves_the_probes_reachable() {
    const CAP: usize = 8;
    let probe_port = test_support::process::free_port();
    let app = spawn_app_with(|c| {
        c.http.max_connections = CAP;
        c.http.header_timeout = Duration::from_secs(2);
        c.http.probe_listen = Some(format!("127.0.0.1:{probe_port}").parse().unwrap());
    })
    .await;
    let probes = Api::new(format!("http://127.0.0.1:{probe_port}"));
    app.store
        .insert_rows(&[user_row("t-flood", "d1", "e1", 1, "Q")])
        .await;
    // Slow clients take every connection of the cap: all of them accepted (the gauge, read on the probes' own
    // listener, counts each one the server serves) before anyone else connects.
    let connections = "history_view_http_connections";
    let open = metric(&probes.metrics().await, connections);
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..CAP {
        slow.push(connect(&app.api, b"GET /v1/threads/t-flood/history HTTP/1.1\r\n").await);
    }
    wait_metric(&probes, connections, open + CAP as f64).await;

    // The probes and /metrics still answer; a read is turned away at once.
    let beyond = Api::new(app.api.address.clone());
    assert_eq!(beyond.get("/healthz", &[]).await.status, 200);
    assert_eq!(beyond.get("/readyz", &[]).await.status, 200);
    let metrics = beyond.get("/metrics", &[]).await;
    assert_eq!(metrics.status, 200);
    let read = Api::new(app.api.address.clone())
        .history("t-flood", "")
        .await;
    assert_eq!(read.status, 503, "{}", read.body);
    assert_eq!(read.json()["error"]["code"], "overloaded");
    assert_eq!(read.header("retry-after"), Some("1"));

    // Past the reserve too (half-sent probes hold it), a connection is closed at once; the probes' own listener
    // (HISTORY_VIEW_PROBE_LISTEN) still answers them, and only them.
    // Each connection past the cap is counted as refused when accepted (served from the reserve, or closed).
    let refusals = r#"history_view_http_refused_total{reason="connections"}"#;
    let refused_before = metric(&probes.metrics().await, refusals);
    let mut reserve = Vec::new();
    for _ in 0..chat_history_view::http::RESERVED_CONNECTIONS {
        reserve.push(connect(&app.api, b"GET /healthz HTTP/1.1\r\n").await);
    }
    wait_metric(
        &probes,
        refusals,
        refused_before + chat_history_view::http::RESERVED_CONNECTIONS as f64,
    )
    .await;
    let mut refused = connect(&app.api, b"").await;
    let closed = closed_after(&mut refused, Instant::now(), Duration::from_secs(5)).await;
    assert!(
        closed.is_some(),
        "a connection past the cap and the reserve stayed open"
    );
    assert_eq!(probes.get("/healthz", &[]).await.status, 200);
    assert_eq!(probes.get("/readyz", &[]).await.status, 200);
    let scraped = probes.get("/metrics", &[]).await;
    assert_eq!(scraped.status, 200);
    // The read turned away above is counted by its status.
    assert_eq!(
        metric(
            &scraped.body,
            r#"history_view_read_errors_total{code="503"}"#
        ),
        1.0
    );
    assert_eq!(probes.history("t-flood", "").await.status, 404);
    drop(reserve);

    // Once the slow clients' header timeout closed them, reads are answered again.
    for stream in &mut slow {
        assert!(
            closed_after(stream, started, Duration::from_secs(10))
                .await
                .is_some()
        );
    }
    let after = Api::new(app.api.address.clone());
    assert_eq!(after.history("t-flood", "").await.status, 200);
    assert!(
        metric(
            &after.metrics().await,
            r#"history_view_http_refused_total{reason="connections"}"#
        ) >= 2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_beyond_the_in_flight_cap_answer_503_at_once() {
    // The held read waits up to the store timeout: long enough that it still holds its permit on two loaded
    // cores (with 5 s, one full-suite run found it gone and the second read admitted).
    let app = spawn_app_with(|c| {
        c.http.max_in_flight = 1;
        c.bounds.store_timeout = Duration::from_secs(20);
    })
    .await;
    // A frozen store holds the one read in flight.
    app.mongo.pause();
    let holder = {
        let api = Api::new(app.api.address.clone());
        tokio::spawn(async move { api.history("t-held", "").await })
    };
    // The held read has its permit once it has missed the cache (a probe sent earlier could take the permit
    // itself and wait for the frozen store).
    wait_metric(&app.api, "history_view_cache_misses_total", 1.0).await;
    let turned_away = Api::new(app.api.address.clone())
        .history("t-other", "")
        .await;
    assert_eq!(turned_away.status, 503, "{}", turned_away.body);
    assert_eq!(turned_away.json()["error"]["code"], "overloaded");
    // Turned away while the held read still waits for the store, not queued behind it.
    assert!(!holder.is_finished());
    assert_eq!(turned_away.header("retry-after"), Some("1"));
    assert_eq!(app.api.get("/healthz", &[]).await.status, 200);
    app.mongo.resume();
    let _ = holder.await;
    assert_eq!(app.api.history("t-other", "").await.status, 200);
}

const TOKEN: &str = "tok-SECRET-4f1e";
const MONGO_PASSWORD: &str = "pw-SECRET-9a7c";
const NATS_PASSWORD: &str = "nats-SECRET-77b2";
const OTLP_PASSWORD: &str = "otlp-SECRET-3d5e";
const OTLP_HEADER: &str = "hdr-SECRET-c8a1";
const PEER_PASSWORD: &str = "peer-SECRET-61f0";

fn assert_no_secret(what: &str, text: &str) {
    for secret in [
        TOKEN,
        MONGO_PASSWORD,
        NATS_PASSWORD,
        OTLP_PASSWORD,
        OTLP_HEADER,
        PEER_PASSWORD,
    ] {
        assert!(!text.contains(secret), "{what} shows {secret}:\n{text}");
    }
}

/// The binary with `env` (and the secrets' settings), its output captured; returns (status, stdout, stderr).
fn run_to_end(args: &[&str], env: &[(&str, String)]) -> (std::process::ExitStatus, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_chat-history-view"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("run the binary");
    (
        output.status,
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_never_printed_in_help_errors_logs_or_metrics() {
    let nats = NatsServer::start();
    let mongo = MongoServer::start();
    let mongo_uri = mongo
        .uri()
        .replace("mongodb://", &format!("mongodb://chv:{MONGO_PASSWORD}@"));
    let nats_url = nats
        .url()
        .replace("nats://", &format!("nats://chv:{NATS_PASSWORD}@"));
    let secrets = vec![
        ("HISTORY_VIEW_API_TOKEN", TOKEN.to_owned()),
        ("HISTORY_VIEW_MONGODB_URI", mongo_uri.clone()),
        ("HISTORY_VIEW_NATS_URL", nats_url.clone()),
    ];

    // The OTLP endpoints may carry credentials too (`user:password@`): `--help` shows neither value.
    let mut with_collector = secrets.clone();
    for name in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ] {
        with_collector.push((
            name,
            format!("https://chv:{NATS_PASSWORD}@collector.example:4318"),
        ));
    }
    let (_, help, _) = run_to_end(&["--help"], &with_collector);
    assert!(help.contains("HISTORY_VIEW_API_TOKEN"), "{help}");
    assert!(
        help.contains("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        "{help}"
    );
    assert_no_secret("--help", &help);

    // Refused values are named, never echoed.
    for (setting, value) in [
        (
            "HISTORY_VIEW_MONGODB_URI",
            format!("postgres://u:{MONGO_PASSWORD}@h"),
        ),
        ("HISTORY_VIEW_API_TOKEN", format!("{TOKEN}\n")),
        (
            "HISTORY_VIEW_NATS_URL",
            format!("nats://u:{NATS_PASSWORD}@a b"),
        ),
    ] {
        let mut env = secrets.clone();
        env.retain(|(name, _)| *name != setting);
        env.push((setting, value));
        let (status, stdout, stderr) = run_to_end(&[], &env);
        assert!(!status.success(), "{setting} was accepted");
        assert!(stderr.contains(setting), "{stderr}");
        assert_no_secret("a start-up error", &format!("{stdout}{stderr}"));
    }

    // A whole run at trace level with a secret in every setting that can hold one: start, reads (authorized,
    // refused, bad input) whose spans the exporter fails to send (nothing listens at the collector's port),
    // /metrics, shutdown.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let collector = format!(
        "http://chv:{OTLP_PASSWORD}@{}",
        closed.local_addr().expect("its address")
    );
    drop(closed);
    let mut secrets = secrets;
    secrets.extend([
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector),
        (
            "OTEL_EXPORTER_OTLP_HEADERS",
            format!("x-api-key={OTLP_HEADER}"),
        ),
        (
            "HISTORY_VIEW_PEER_URL",
            format!("http://chv:{PEER_PASSWORD}@chv-{{partition}}.svc:8080"),
        ),
    ]);
    let dir = std::env::temp_dir().join(format!("chv-secrets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let stdout_path = dir.join("stdout");
    let stderr_path = dir.join("stderr");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_chat-history-view"))
        .envs(secrets.iter().map(|(k, v)| (*k, v.as_str())))
        .env("HISTORY_VIEW_LISTEN", "127.0.0.1:0")
        .env("HISTORY_VIEW_LOG_FORMAT", "json")
        .env("HISTORY_VIEW_STORE_TIMEOUT_MS", "500")
        // Naming the NATS client lifts the worker's hold on its lines: its own trace and debug lines (CONNECT, the
        // server address) are checked too.
        .env("RUST_LOG", "trace,async_nats=trace")
        .stdout(std::fs::File::create(&stdout_path).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr_path).expect("stderr file"))
        .spawn()
        .expect("start the binary");
    let address = wait_for_address(&stdout_path).await;
    let api = Api::new(format!("http://{address}"));
    let authorization = format!("Bearer {TOKEN}");
    let _ = api
        .get(
            "/v1/threads/t1/history",
            &[("authorization", authorization.as_str())],
        )
        .await;
    assert_eq!(
        api.get(
            "/v1/threads/t1/history",
            &[("authorization", "Bearer nope")]
        )
        .await
        .status,
        401
    );
    let bad = api
        .get(
            "/v1/threads/a%00b/history",
            &[("authorization", authorization.as_str())],
        )
        .await;
    assert_eq!(bad.status, 400);
    let metrics = api.get("/metrics", &[]).await;
    assert_eq!(metrics.status, 200);
    assert_no_secret("/metrics", &metrics.body);
    // An idle keep-alive connection is open at shutdown: it is closed, not reported as work in flight.
    let idle = idle_after_one_request(&api).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("wait");
    drop(idle);
    assert!(status.success(), "{status:?}");
    let stdout = std::fs::read_to_string(&stdout_path).expect("stdout");
    let stderr = std::fs::read_to_string(&stderr_path).expect("stderr");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        stdout.contains(r#""level":"TRACE""#),
        "trace logging was not on:\n{stdout}"
    );
    assert!(stdout.contains("\"stopped\""), "{stdout}");
    assert!(!stdout.contains("in flight"), "{stdout}");
    assert_no_secret("the logs", &format!("{stdout}{stderr}"));
}

/// Waits until the binary logs the address it listens on.
async fn wait_for_address(stdout: &Path) -> String {
    test_support::wait::eventually_within("the address logged", Duration::from_secs(30), || {
        let text = std::fs::read_to_string(stdout).unwrap_or_default();
        let address = text.lines().find_map(|line| {
            let entry: serde_json::Value = serde_json::from_str(line).ok()?;
            Some(entry["address"].as_str()?.to_owned())
        });
        async move { address.ok_or(text) }
    })
    .await
}
