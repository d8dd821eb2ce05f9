//! The soak: overlapping faults under load, on the worker binary (`make soak`: the release build) with real servers (the Mongo-wire server on
//! disk, so a restart keeps the data). A publisher plays multi-turn conversations over many threads (nested
//! helpers, HITL reveals, duplicate deliveries); a persister like aihub's (its own NATS connection, not through
//! the faults) writes every event 0-500 ms after receiving it, sometimes twice as a second replica would; readers
//! read all the time, half with the primary identity, and every answer is judged against the rows the persister
//! had committed (`test_support::promise`: nothing stored more than the bound before a read is missing from an
//! answer from memory); and a chaos loop cuts the worker's link to NATS, leaves it half-open, freezes and restarts
//! nats-server, and freezes and restarts the Mongo-wire server, some faults overlapping. Once per cycle a quiet
//! point (faults stopped, persister caught up, the worker's lag bound elapsed) compares every thread's answer with
//! a fresh worker's cold read and with the reference over the committed rows.
//!
//! `SOAK_SECS` (default 60: one cycle, what `make test` runs; `make soak` runs 300: five) sets the length, one
//! cycle per started minute; `SOAK_THREADS` (default 40; `make soak` 200) the number of threads. It prints a table
//! and writes `target/soak.json`.
//!
//! - this file: the choreography (the faults in their order, the quiet points);
//! - [`load`]: the persister, the publisher, the judged readers and the RSS sampler;
//! - [`verdict`]: the verdict, a pure function of what was observed (unit-tested there);
//! - [`report`]: the table and `target/soak.json`.

mod load;
mod report;
mod verdict;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_support::promise::Ledger;
use test_support::proxy::Proxy;
use test_support::servers::{MongoServer, NatsServer};
use test_support::turns::PRIMARY;
use test_support::wait::{eventually_within, when};
use tokio::sync::watch;

use crate::helpers::{Api, BinaryApp, TestStore, metric, unique, worker_binary};
use crate::promise::target;
use load::{LateCommits, Reads, Sentinel, persister, publisher, readers, rss_sampler};
use verdict::{Observations, missing_events, verdict};

/// The worker's persister-lag bound (its default) and the persister's largest delay.
const LAG: Duration = Duration::from_millis(2000);
const PERSIST_DELAY_MS: u64 = 500;
/// Readiness must be back this soon after a fault ends.
const RECOVERY: Duration = Duration::from_secs(15);
/// Long enough for the worker to notice a frozen server or a half-open link (about three 4 s pings).
const DEAD_LINK_HOLD: Duration = Duration::from_secs(14);
/// Reads after recovery and the lag bound, before the next fault: the window whose reads must mostly be served
/// from memory.
const CALM: Duration = Duration::from_secs(5);
/// The worker's default cache budget, and the RSS it may reach.
const RSS_LIMIT_KIB: u64 = (256 + 64) * 1024;
const READERS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    LinkCut,
    LinkHalfOpen,
    NatsFrozen,
    NatsRestarted,
    MongoFrozen,
    MongoRestarted,
}

/// A tiny xorshift generator: the soak needs variety, not quality, and no extra crate.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Lets the worker serve undisturbed: the lag bound first (reads within it cannot come from memory after a
/// reconnect, by design), then [`CALM`] during which reads count as between faults. Both are the scenario's
/// time, not a wait for something to happen.
async fn calm_window(calm: &AtomicBool) {
    tokio::time::sleep(LAG).await;
    calm.store(true, Ordering::SeqCst);
    tokio::time::sleep(CALM).await;
    calm.store(false, Ordering::SeqCst);
}

/// Waits until `client` is connected again and the server has processed everything it sent (its subscriptions
/// included, which it re-sends on reconnecting).
async fn reconnected(client: &async_nats::Client) {
    eventually_within(
        "a test client reconnects",
        Duration::from_secs(30),
        || async {
            let state = client.connection_state();
            let flushed = tokio::time::timeout(Duration::from_secs(1), client.flush())
                .await
                .is_ok_and(|r| r.is_ok());
            when(
                state == async_nats::connection::State::Connected && flushed,
                || format!("{state:?}, flushed: {flushed}"),
            )
        },
    )
    .await;
}

fn progress(started: Instant, cycle: usize, what: &str) {
    eprintln!(
        "soak {:>5.1} s, cycle {cycle}: {what}",
        started.elapsed().as_secs_f64()
    );
}

/// A dead link held for [`DEAD_LINK_HOLD`] must have been noticed: readiness 503. The failure, if not.
async fn noticed(api: &Api, fault: Fault) -> Option<String> {
    let status = api.get("/readyz", &[]).await.status;
    (status != 503)
        .then(|| format!("{fault:?} not noticed within {DEAD_LINK_HOLD:?} (readiness {status})"))
}

/// How long the worker took to answer ready again, or `None` past [`RECOVERY`] (a measurement: the verdict
/// judges it).
async fn recovery(api: &Api) -> Option<Duration> {
    let since = Instant::now();
    let ready = eventually_within("readiness", RECOVERY, || async {
        let status = api.get("/readyz", &[]).await.status;
        when(status == 200, || format!("readiness {status}"))
    });
    tokio::time::timeout(RECOVERY, ready)
        .await
        .ok()
        .map(|()| since.elapsed())
}

/// The quiet point's comparison: every thread, with and without the primary identity, as the worker answers it,
/// as a fresh worker answers it cold, and as the reference makes it of the committed rows. Returns the
/// divergences.
async fn compare(worker: &Api, fresh: &Api, ledger: &Ledger, names: &[String]) -> Vec<String> {
    let mut divergences = Vec::new();
    for thread in names {
        for identity in [None, Some(PRIMARY)] {
            let query = identity.map_or_else(String::new, |(class, id)| {
                format!("agent_class={class}&agent_id={id}")
            });
            let served = worker.history(thread, &query).await;
            let cold = fresh.history(thread, &query).await;
            let source = served.source().unwrap_or("-").to_owned();
            if served.status != 200 || cold.status != 200 {
                divergences.push(format!(
                    "{thread} ?{query}: status {} (cold {})",
                    served.status, cold.status
                ));
            } else if served.body != cold.body {
                divergences.push(format!(
                    "{thread} ?{query}: from {source}, differs from a cold read"
                ));
            } else if served.json()["messages"] != ledger.reference(thread, identity) {
                divergences.push(format!(
                    "{thread} ?{query}: from {source}, differs from the committed rows"
                ));
            }
        }
    }
    divergences
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_faults_under_load_lose_nothing_and_recover() {
    let secs: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let thread_count: usize = std::env::var("SOAK_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let cycles = secs.div_ceil(60).max(1) as usize;
    let started = Instant::now();

    let mut nats = NatsServer::start();
    let mut mongo = MongoServer::start_on_disk();
    let database = unique("soak");
    let store = TestStore::connect(&mongo.uri(), &database).await;
    store.create_aihub_indexes().await;
    let proxy = Proxy::start(nats.address()).await;
    let mongo_uri = mongo.uri();
    let worker_env = |nats_url: String| {
        vec![
            ("HISTORY_VIEW_NATS_URL", nats_url),
            ("HISTORY_VIEW_MONGODB_URI", mongo_uri.clone()),
            ("HISTORY_VIEW_MONGODB_DATABASE", database.clone()),
            // The Mongo-wire server walks the whole collection in Python for any hinted query (see
            // docs/benchmark.md); unhinted, it uses the index.
            ("HISTORY_VIEW_MONGODB_INDEX_HINT", String::new()),
            ("HISTORY_VIEW_MONGODB_FILL_INDEX_HINT", String::new()),
            // Every read from memory is a candidate for a shadow check (5 a second): a missing, late or differing
            // row fails the soak; reads a gap followed within the window count as `window`.
            ("HISTORY_VIEW_SHADOW_SAMPLE", "1".to_owned()),
        ]
    };
    let worker = BinaryApp::start_binary(&worker_binary(), &worker_env(proxy.nats_url())).await;
    worker.wait_ready().await;

    let ledger = Ledger::new(LAG);
    let pending = Arc::new(AtomicUsize::new(0));
    let late_commits = Arc::new(Mutex::new(LateCommits::default()));
    let sentinel = Sentinel::default();
    let persister_client = async_nats::connect(nats.url())
        .await
        .expect("persister connects");
    persister(
        persister_client.clone(),
        TestStore::connect(&mongo.uri(), &database).await,
        pending.clone(),
        late_commits.clone(),
        ledger.clone(),
        sentinel.clone(),
    );
    let names: Vec<String> = (0..thread_count).map(|i| format!("soak-{i:04}")).collect();
    let (gate, open) = watch::channel(true);
    let stop = Arc::new(AtomicBool::new(false));
    let publisher_client = async_nats::connect(nats.url())
        .await
        .expect("publisher connects");
    let publishing = publisher(
        publisher_client.clone(),
        names.clone(),
        open,
        stop.clone(),
        ledger.clone(),
        sentinel.clone(),
    )
    .await;
    let reads = Arc::new(Reads::default());
    let calm = Arc::new(AtomicBool::new(false));
    readers(&target(&worker.api), &names, &ledger, &reads, &calm, &stop);
    let rss = rss_sampler(worker.pid(), started, stop.clone());

    let mut observed = Observations {
        cycles,
        ..Observations::default()
    };
    let mut quiet_points: Vec<Value> = Vec::new();
    // Closes the gate and returns once the publisher is between turns (nothing half published).
    let hold_publisher = async |gate: &watch::Sender<bool>| {
        gate.send_replace(false);
        sentinel.publisher_idle().await;
    };

    for cycle in 0..cycles {
        // The worker's link cut and restored.
        progress(started, cycle, "link cut");
        proxy.cut();
        // The fault's duration (the scenario's time).
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.restore();
        *observed.injected.entry(Fault::LinkCut).or_default() += 1;
        observed
            .recoveries
            .push((Fault::LinkCut, recovery(&worker.api).await));
        calm_window(&calm).await;

        // The link left half-open; the Mongo-wire server frozen for 5 s meanwhile. (The sleeps are how long each
        // fault lasts.)
        progress(started, cycle, "link half-open, Mongo frozen");
        proxy.half_open();
        let dead = Instant::now();
        // The faults' durations (the scenario's time), here and below.
        tokio::time::sleep(Duration::from_secs(3)).await;
        mongo.pause();
        tokio::time::sleep(Duration::from_secs(5)).await;
        mongo.resume();
        *observed.injected.entry(Fault::MongoFrozen).or_default() += 1;
        tokio::time::sleep(DEAD_LINK_HOLD.saturating_sub(dead.elapsed())).await;
        observed
            .unnoticed
            .extend(noticed(&worker.api, Fault::LinkHalfOpen).await);
        proxy.restore();
        *observed.injected.entry(Fault::LinkHalfOpen).or_default() += 1;
        observed
            .recoveries
            .push((Fault::LinkHalfOpen, recovery(&worker.api).await));
        calm_window(&calm).await;

        // nats-server frozen (nothing can be published: the publisher is held); the Mongo-wire server restarted
        // meanwhile.
        progress(started, cycle, "NATS frozen, Mongo restarted");
        hold_publisher(&gate).await;
        nats.pause();
        let dead = Instant::now();
        // The faults' durations (the scenario's time).
        tokio::time::sleep(Duration::from_secs(3)).await;
        tokio::task::block_in_place(|| mongo.restart());
        *observed.injected.entry(Fault::MongoRestarted).or_default() += 1;
        tokio::time::sleep(DEAD_LINK_HOLD.saturating_sub(dead.elapsed())).await;
        observed
            .unnoticed
            .extend(noticed(&worker.api, Fault::NatsFrozen).await);
        nats.resume();
        *observed.injected.entry(Fault::NatsFrozen).or_default() += 1;
        observed
            .recoveries
            .push((Fault::NatsFrozen, recovery(&worker.api).await));
        reconnected(&persister_client).await;
        gate.send_replace(true);
        calm_window(&calm).await;

        // nats-server restarted.
        progress(started, cycle, "NATS restarted");
        hold_publisher(&gate).await;
        tokio::task::block_in_place(|| nats.restart());
        *observed.injected.entry(Fault::NatsRestarted).or_default() += 1;
        observed
            .recoveries
            .push((Fault::NatsRestarted, recovery(&worker.api).await));
        // Nothing is published before the persister is subscribed again (aihub's persister would have missed it
        // as well, and the comparison would find an event only the worker heard).
        reconnected(&persister_client).await;
        reconnected(&publisher_client).await;
        gate.send_replace(true);
        calm_window(&calm).await;

        // Quiet point: nothing published, the persister caught up (it has received a sentinel published after the
        // last turn, and written everything before it), the lag bound elapsed.
        progress(started, cycle, "quiet point");
        hold_publisher(&gate).await;
        let quiet = Instant::now();
        sentinel.round_trip(&publisher_client).await;
        eventually_within(
            "the persister catches up",
            Duration::from_secs(60),
            || async {
                let left = pending.load(Ordering::SeqCst);
                when(left == 0, || format!("{left} rows to write"))
            },
        )
        .await;
        progress(started, cycle, "persister caught up");
        // The bound, elapsed on purpose: until then a view may still be partial by design.
        tokio::time::sleep(LAG + Duration::from_millis(500)).await;
        worker.wait_ready().await;
        let fresh = BinaryApp::start_binary(&worker_binary(), &worker_env(nats.url())).await;
        fresh.wait_ready().await;
        progress(started, cycle, "comparing");
        let found = compare(&worker.api, &fresh.api, &ledger, &names).await;
        quiet_points.push(json!({
            "cycle": cycle, "at_secs": started.elapsed().as_secs(), "divergences": found.len(),
            "took_ms": quiet.elapsed().as_millis() as u64,
        }));
        observed.divergences.extend(
            found
                .into_iter()
                .map(|d| format!("quiet point {cycle}: {d}")),
        );
        drop(fresh);
        gate.send_replace(true);
    }

    stop.store(true, Ordering::SeqCst);
    gate.send_replace(true);
    let _ = publishing.await;
    let rss = rss.await.expect("RSS samples");

    // What the worker and the readers saw, the verdict and its report.
    let metrics = worker.api.metrics().await;
    for result in report::SHADOW_RESULTS {
        let name = format!("history_view_shadow_checks_total{{result=\"{result}\"}}");
        observed
            .shadow
            .insert(result.to_owned(), metric(&metrics, &name));
    }
    observed.lag_exceeded = metric(&metrics, "history_view_persister_lag_exceeded_total");
    observed.missing_events_total = metric(
        &metrics,
        "history_view_shadow_events_total{result=\"missing\"}",
    );
    observed.warnings = worker.log_lines("A shadow check found");
    observed.named_missing = observed
        .warnings
        .iter()
        .flat_map(|line| missing_events(line))
        .collect();
    let (late_committed, commit_lag_max) = {
        let late = late_commits.lock().unwrap();
        for id in &observed.named_missing {
            let lag = late.lags.get(id.as_str());
            eprintln!("missing event {id}: committed {lag:?} after its created_at");
        }
        observed.late_events = late.events.clone();
        (late.events.len(), late.max)
    };
    {
        let judged = reads.judged.lock().unwrap();
        observed.judged_reads = judged.reads;
        observed.judged_whole = judged.whole;
        observed.judged_violations = judged.violations.clone();
    }
    observed.calm_total = reads.calm_total.load(Ordering::Relaxed);
    observed.calm_cache = reads.calm_cache.load(Ordering::Relaxed);
    observed.rss_peak_kib = rss.iter().map(|(_, kib)| *kib).max().unwrap_or(0);

    let failures = verdict(&observed);
    let extra = report::Extra {
        secs: started.elapsed().as_secs(),
        threads: thread_count,
        reads: reads.all.lock().unwrap().clone(),
        quiet_points,
        rss,
        late_committed,
        commit_lag_max,
    };
    report::report(&observed, &extra, &failures);
    assert!(failures.is_empty(), "soak failed:\n{}", failures.join("\n"));
}
