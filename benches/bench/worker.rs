//! The worker under test: the release binary as a child process ([`WorkerProcess`]), configured by environment;
//! HTTP helpers for it; its memory and CPU time from `/proc`.

use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chat_history_view::http::SOURCE_HEADER;

pub use test_support::memory::{Memory, memory};
use test_support::process::READY_TIMEOUT;
use test_support::worker::WorkerProcess;

use crate::setup::Setup;

/// A running worker process (killed, and its log removed, on drop) and an HTTP client for it.
pub struct Worker {
    process: WorkerProcess,
    base_url: String,
    http: reqwest::Client,
}

/// One HTTP answer of the worker.
pub struct Reply {
    pub status: u16,
    /// The `X-History-Source` header (`cache` or `store`), empty when absent.
    pub source: String,
    pub body: Bytes,
}

impl Reply {
    /// The number of history messages in the body.
    pub fn message_count(&self) -> usize {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|body| body["messages"].as_array().map(Vec::len))
            .unwrap_or(0)
    }

    pub fn contains(&self, needle: &[u8]) -> bool {
        self.body
            .windows(needle.len())
            .any(|window| window == needle)
    }
}

impl Worker {
    /// Starts the binary against the run's servers on `database` and waits until `/readyz` answers 200.
    ///
    /// Defaults: the index hints disabled (see `p3_p4_store`), a 256 MiB cache, JSON logs at `warn`. `env` overrides
    /// them or sets more. `HISTORY_VIEW_*` variables of the bench's own environment are not passed on.
    pub async fn start(setup: &Setup, database: &str, env: &[(&str, &str)]) -> Self {
        let worker = Self::spawn(setup, None, database, env).await;
        worker.wait_ready().await;
        worker
    }

    /// [`Worker::start`] listening on `port` (partitioned workers' ports are known to their peers), returned as soon
    /// as it answers `/healthz`: the caller waits for `/readyz` ([`Worker::wait_ready`]) and times it.
    pub async fn start_on(setup: &Setup, port: u16, database: &str, env: &[(&str, &str)]) -> Self {
        Self::spawn(setup, Some(port), database, env).await
    }

    async fn spawn(setup: &Setup, port: Option<u16>, database: &str, env: &[(&str, &str)]) -> Self {
        let defaults = [
            ("HISTORY_VIEW_NATS_URL", setup.nats_url()),
            ("HISTORY_VIEW_MONGODB_URI", setup.mongo_uri()),
            ("HISTORY_VIEW_MONGODB_DATABASE", database.to_owned()),
            ("HISTORY_VIEW_CACHE_MAX_BYTES", "256MiB".to_owned()),
            ("HISTORY_VIEW_MONGODB_INDEX_HINT", String::new()),
            ("HISTORY_VIEW_MONGODB_FILL_INDEX_HINT", String::new()),
            ("RUST_LOG", "warn".to_owned()),
        ];
        let env = defaults
            .into_iter()
            .chain(env.iter().map(|(name, value)| (*name, (*value).to_owned())))
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        let program = setup.settings.worker_bin.clone();
        let process = match port {
            Some(port) => WorkerProcess::start_on(port, program, Vec::new(), env).await,
            None => WorkerProcess::start(program, Vec::new(), env).await,
        };
        Self {
            base_url: process.base_url(),
            process,
            http: reqwest::Client::new(),
        }
    }

    /// Waits until `/readyz` answers 200 (at most [`READY_TIMEOUT`] plus `extra`).
    pub async fn wait_ready_within(&self, extra: Duration) {
        let deadline = Instant::now() + READY_TIMEOUT + extra;
        loop {
            if let Ok(response) = self
                .http
                .get(format!("{}/readyz", self.base_url))
                .send()
                .await
                && response.status().is_success()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the worker was not ready within {:?}:\n{}",
                READY_TIMEOUT + extra,
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends SIGTERM, as Kubernetes does, and waits until the process has exited.
    pub async fn stop(mut self) {
        self.process.terminate();
        let deadline = Instant::now() + READY_TIMEOUT;
        while self.process.try_wait().is_none() {
            assert!(
                Instant::now() < deadline,
                "the worker did not exit within {READY_TIMEOUT:?} of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_ready(&self) {
        self.wait_ready_within(Duration::ZERO).await;
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The last lines the worker logged (it logs at `warn`, so usually nothing).
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    pub async fn get(&self, path: &str) -> Reply {
        get(&self.http, &format!("{}{path}", self.base_url)).await
    }

    /// `GET /v1/threads/{thread}/history` (bench thread ids need no escaping).
    pub async fn history(&self, thread: &str) -> Reply {
        self.get(&format!("/v1/threads/{thread}/history")).await
    }

    /// Reads `thread` until the answer comes from memory. A view first read within the persister-lag bound after the
    /// worker confirmed its subscription is completed by a background re-read once the bound has passed ([design
    /// 2.1.1](../../docs/design.md#2.1.1)); this waits for that re-read (at most half a second, as a first read past the
    /// bound completes the view itself) instead of reading the store again and again.
    pub async fn read_until_cached(&self, thread: &str) -> Reply {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let rereads = self
                .metrics()
                .await
                .sum("history_view_background_rereads_total");
            let reply = self.history(thread).await;
            if reply.source == "cache" {
                return reply;
            }
            // A first read that completed the view schedules no re-read: read again after a while anyway.
            let again = Instant::now() + Duration::from_millis(500);
            while Instant::now() < again
                && self
                    .metrics()
                    .await
                    .sum("history_view_background_rereads_total")
                    <= rereads
            {
                assert!(
                    Instant::now() < deadline,
                    "{thread} was not served from memory within {READY_TIMEOUT:?}:\n{}",
                    self.log_tail()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Scrapes `/metrics` every `poll` until the worker has received `expected` events; returns when it had, or, if
    /// it received nothing for `stall` (the rest was lost), when it last made progress.
    pub async fn wait_received(&self, expected: u64, poll: Duration, stall: Duration) -> Instant {
        let mut received = 0;
        let mut last_progress = Instant::now();
        loop {
            let count = self.metrics().await.events_received();
            let now = Instant::now();
            if count >= expected {
                return now;
            }
            if count > received {
                received = count;
                last_progress = now;
            } else if now - last_progress > stall {
                return last_progress;
            }
            tokio::time::sleep(poll).await;
        }
    }

    pub async fn metrics(&self) -> Scrape {
        let reply = self.get("/metrics").await;
        assert_eq!(reply.status, 200, "GET /metrics");
        Scrape(String::from_utf8_lossy(&reply.body).into_owned())
    }

    pub fn memory(&self) -> Memory {
        memory(self.pid())
    }

    /// User plus system CPU time the worker has used.
    pub fn cpu_time(&self) -> Duration {
        cpu_time(&self.pid().to_string())
    }
}

/// A GET through `http`, body read in full. Panics (with the URL) when the worker does not answer at all.
pub async fn get(http: &reqwest::Client, url: &str) -> Reply {
    let response = http
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = response.status().as_u16();
    let source = response
        .headers()
        .get(SOURCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response
        .bytes()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: reading the body: {e}"));
    Reply {
        status,
        source,
        body,
    }
}

/// A Prometheus text scrape of the worker.
pub struct Scrape(String);

impl Scrape {
    /// Sum of every sample of a metric family (all label sets).
    pub fn sum(&self, name: &str) -> f64 {
        test_support::scrape::metric_sum(&self.0, name)
    }

    /// One sample, e.g. `history_view_events_total{outcome="relevant"}`; 0 when absent.
    pub fn sample(&self, sample: &str) -> f64 {
        test_support::scrape::metric(&self.0, sample)
    }

    /// Messages the worker took from NATS (every outcome).
    pub fn events_received(&self) -> u64 {
        self.sum("history_view_events_total") as u64
    }

    /// Signs of lost messages: slow-consumer events of the NATS client.
    pub fn drops(&self) -> u64 {
        test_support::scrape::live_drops(&self.0) as u64
    }

    /// NATS connection events of one kind (`slow_consumer`, `disconnected`, ...).
    pub fn connection_events(&self, event: &str) -> u64 {
        self.sample(&format!(
            "history_view_nats_connection_events_total{{event=\"{event}\"}}"
        )) as u64
    }
}

/// User plus system CPU time of `/proc/<pid>` (`pid` may be `self`).
pub fn cpu_time(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may contain spaces; fields after its closing parenthesis are plain.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime are fields 14 and 15 of the line; after the command name, field 3 (state) is index 0.
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second())
}

fn clock_ticks_per_second() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    })
}
