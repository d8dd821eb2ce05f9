//! The project's benchmark: the performance targets of [design section 7](../../docs/design.md#7), each measured as a
//! ratio or a bound in one run, side by side with its baseline, against real servers. The worker runs as the release
//! binary in its own process, configured by environment, exactly as it is deployed.
//!
//! Run it with `make bench` (installs the servers, builds the binary, then `cargo bench --bench bench`). Settings,
//! by environment:
//!
//! - `BENCH_WORKER_BIN`: the worker binary (default `target/release/chat-history-view`).
//! - `BENCH_EVENTS_P1` (default 200000) and `BENCH_EVENTS_P5` (default 1000000): events streamed in P1 (and in P1j,
//!   P9d and P12, which publish P1's messages) and P5.
//! - `BENCH_ROUNDS_P1` (default 6): P1's rounds.
//! - `BENCH_P1=tracing-off` (or `tracing-on`): only this side of P1's paired runs (the worker with tracing off, or
//!   on with the default sampler), to repeat one.
//! - `BENCH_FULL=1`: P4 also reconstructs a 100k-event thread (several minutes against the local store).
//! - `BENCH_ONLY=P1,P4`: run only these measurements (ids in any case: `P9d`, partitioned workers dividing the
//!   work, is `p9d` too).
//! - `BENCH_P13=partitioned-cold,core-warm`: only these of P13's restarts (`<core|jetstream|partitioned>-<cold|warm>`).
//!
//! Each measurement starts its own worker process(es) on its own database; the NATS and Mongo-wire servers are
//! shared by the run. Progress goes to stderr, the table to stdout.

mod counting;
mod data;
mod otlp_sink;
mod p10_pages;
mod p11_feed;
mod p12_witness;
mod p13_warm_restart;
mod p14_resume;
mod p1_ingest;
mod p1j_jetstream;
mod p2_cache_reads;
mod p2_ceiling;
mod p3_p4_store;
mod p5_breakdown;
mod p5_memory;
mod p6_freshness;
mod p7_multi_turn;
mod p8_hot_thread;
mod p9_faults;
mod p9d_partitions;
mod partitions;
mod report;
mod setup;
mod worker;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use report::{Row, progress};
use setup::{Settings, Setup};

/// jemalloc, as the worker's, counting the bytes each thread holds (P5's breakdown).
#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

fn main() {
    // P1 runs this binary again as its bare subscriber, a process of its own.
    if let Ok(spec) = std::env::var(p1_ingest::BARE_SUBSCRIBER_ENV) {
        p1_ingest::bare_subscriber_process(&spec);
        return;
    }
    // P1j runs it as its bare JetStream consumer.
    if let Ok(spec) = std::env::var(p1j_jetstream::BARE_CONSUMER_ENV) {
        p1j_jetstream::bare_consumer_process(&spec);
        return;
    }
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it,
    // and there it only proves that the benchmark compiles.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("the benchmark runs under `cargo bench --bench bench` (`make bench`); skipped");
        return;
    }
    let started = Instant::now();
    let settings = Settings::from_env();
    report::print_header(&settings);
    progress("setup", "starting nats-server and SecantusDB");
    let setup = Arc::new(Setup::start(settings));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the benchmark");
    let rows = runtime.block_on(run_all(Arc::clone(&setup)));
    drop(runtime);
    report::print_table(&rows);
    println!("total time: {:.0} s", started.elapsed().as_secs_f64());
}

async fn run_all(setup: Arc<Setup>) -> Vec<Row> {
    let mut rows = Vec::new();
    rows.extend(measure(&setup, "P1", p1_ingest::run).await);
    rows.extend(measure(&setup, "P1j", p1j_jetstream::run).await);
    rows.extend(measure(&setup, "P2", p2_cache_reads::run).await);
    rows.extend(measure(&setup, "P3", p3_p4_store::run_p3).await);
    rows.extend(measure(&setup, "P4", p3_p4_store::run_p4).await);
    rows.extend(measure(&setup, "P5", p5_memory::run).await);
    rows.extend(measure(&setup, "P6", p6_freshness::run).await);
    rows.extend(measure(&setup, "P7", p7_multi_turn::run).await);
    rows.extend(measure(&setup, "P8", p8_hot_thread::run).await);
    rows.extend(measure(&setup, "P9", p9_faults::run).await);
    rows.extend(measure(&setup, "P9d", p9d_partitions::run).await);
    rows.extend(measure(&setup, "P10", p10_pages::run).await);
    rows.extend(measure(&setup, "P11", p11_feed::run).await);
    rows.extend(measure(&setup, "P12", p12_witness::run).await);
    rows.extend(measure(&setup, "P13", p13_warm_restart::run).await);
    rows.extend(measure(&setup, "P14", p14_resume::run).await);
    rows
}

/// Runs one measurement in its own task, so a panic in it (a server or the worker misbehaving) becomes a failed
/// row and the other measurements still run. Its worker processes are killed as the task unwinds.
async fn measure<F, Fut>(setup: &Arc<Setup>, id: &'static str, run: F) -> Vec<Row>
where
    F: FnOnce(Arc<Setup>) -> Fut,
    Fut: Future<Output = Vec<Row>> + Send + 'static,
{
    if !setup.settings.runs(id) {
        return Vec::new();
    }
    let started = Instant::now();
    progress(id, "start");
    let result = tokio::spawn(run(Arc::clone(setup))).await;
    progress(
        id,
        &format!("done in {:.1} s", started.elapsed().as_secs_f64()),
    );
    result.unwrap_or_else(|error| {
        let message = error
            .try_into_panic()
            .ok()
            .and_then(|panic| {
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            })
            .unwrap_or_else(|| "cancelled".to_owned());
        vec![Row::failed(id, &message)]
    })
}
