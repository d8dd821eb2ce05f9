//! P14: a running answer resumed in the AI SDK's UI message stream ([design 3.5](../../docs/design.md#3.5)), on
//! one worker in one run. Targets: (a) the first byte of a resume of a run held in memory, p99 <= 5 ms; (b) an idle
//! resume (nothing running: 204), p99 <= 2 ms; (c) the worker's CPU per resume independent of the run's chunk count
//! beyond the bytes it sends: a run of 10 chunks and one of 10,000 chunks of the same total text (10,000 bytes)
//! within 1.5x of each other; (d) 1,000 idle resumes a second cost less than 5% of a core.
//!
//! The runs have no stop and their events are old, so each is `stalled` ([design 3.1](../../docs/design.md#3.1)): a
//! resume replays the message whole and finishes, which makes a resume one request whose whole cost is measured.
//! Every thread is read until served from memory first, and resumed once before the series (its run form
//! rendered, as a page that reads then resumes would have it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::data::{self, Conversation};
use crate::report::{Row, fmt_duration, progress, quantile};
use crate::setup::Setup;
use crate::worker::Worker;

const FEW: &str = "p14-few";
const MANY: &str = "p14-many";
const IDLE: &str = "p14-idle";
const RESUMES: usize = 300;
/// Resumes per CPU series: the worker's CPU time counts in 10 ms ticks, so a series must cost seconds of it.
const CPU_RESUMES: usize = 3_000;
const TEXT_BYTES: usize = 10_000;
const IDLE_RATE: u32 = 1_000;
const IDLE_FOR: Duration = Duration::from_secs(5);

/// A thread of one marker and `chunks` chunks sharing [`TEXT_BYTES`] bytes of text.
fn run_rows(thread: &str, chunks: usize) -> Vec<serde_json::Value> {
    let display = data::display(thread, 0, 1);
    let piece = "x".repeat(TEXT_BYTES / chunks);
    std::iter::once(data::marker(thread, &display, 0))
        .chain((1..=chunks).map(|seq| data::chunk_with_text(thread, &display, seq, &piece)))
        .collect()
}

fn url(worker: &Worker, thread: &str) -> String {
    format!(
        "{}/v1/threads/{thread}/ui-message-stream",
        worker.base_url()
    )
}

/// Time to the first byte of `thread`'s resume (the stream is dropped after it).
async fn first_byte(http: &reqwest::Client, url: &str) -> Duration {
    let started = Instant::now();
    let mut response = http.get(url).send().await.expect("a resume");
    assert_eq!(response.status(), 200, "{url}");
    response
        .chunk()
        .await
        .expect("the body")
        .expect("a first chunk");
    started.elapsed()
}

/// One whole resume: the body to its end; its length.
async fn whole(http: &reqwest::Client, url: &str) -> usize {
    let response = http.get(url).send().await.expect("a resume");
    assert_eq!(response.status(), 200, "{url}");
    let body = response.bytes().await.expect("the body");
    assert!(body.ends_with(b"data: [DONE]\n\n"), "{url}: a whole stream");
    body.len()
}

/// The worker's CPU per whole resume of `url` over `count` resumes, and the bytes of one.
async fn cpu_per_resume(
    worker: &Worker,
    http: &reqwest::Client,
    url: &str,
    count: usize,
) -> (Duration, usize) {
    let cpu = worker.cpu_time();
    let mut bytes = 0;
    for _ in 0..count {
        bytes = whole(http, url).await;
    }
    let spent = worker.cpu_time().saturating_sub(cpu);
    (spent / u32::try_from(count).unwrap_or(u32::MAX), bytes)
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let store = setup.store("bench_p14").await;
    let mut rows = run_rows(FEW, 10);
    rows.extend(run_rows(MANY, 10_000));
    rows.extend(
        Conversation {
            turns: 1,
            events_per_turn: 1,
            displays: 1,
        }
        .rows(IDLE),
    );
    store.insert(&rows).await;
    // The shadow checks sample reads from memory, resumes among them, and compare them with the store in the
    // background at most HISTORY_VIEW_SHADOW_MAX_PER_SEC a second: their own budget, measured as such elsewhere
    // (as in P10), not a resume's cost.
    let worker = setup
        .start_worker("bench_p14", &[("HISTORY_VIEW_SHADOW_SAMPLE", "0")])
        .await;
    let http = reqwest::Client::new();
    for thread in [FEW, MANY, IDLE] {
        worker.history(thread).await;
        worker.read_until_cached(thread).await;
    }
    whole(&http, &url(&worker, FEW)).await;
    whole(&http, &url(&worker, MANY)).await;

    progress(
        "P14",
        &format!("{RESUMES} first bytes and {RESUMES} idle resumes"),
    );
    let few = url(&worker, FEW);
    let mut firsts = Vec::with_capacity(RESUMES);
    for _ in 0..RESUMES {
        firsts.push(first_byte(&http, &few).await);
    }
    firsts.sort();
    let idle_url = url(&worker, IDLE);
    let mut idles = Vec::with_capacity(RESUMES);
    for _ in 0..RESUMES {
        let started = Instant::now();
        let reply = http.get(&idle_url).send().await.expect("an idle resume");
        assert_eq!(reply.status(), 204, "nothing runs on {IDLE}");
        idles.push(started.elapsed());
    }
    idles.sort();

    progress("P14", "CPU per resume, 10 vs 10,000 chunks");
    let many = url(&worker, MANY);
    // Two rounds, alternating; the better of each.
    let (mut few_cpu, mut many_cpu) = (Duration::MAX, Duration::MAX);
    let (mut few_bytes, mut many_bytes) = (0, 0);
    for _ in 0..2 {
        let (cpu, bytes) = cpu_per_resume(&worker, &http, &few, CPU_RESUMES).await;
        (few_cpu, few_bytes) = (few_cpu.min(cpu), bytes);
        let (cpu, bytes) = cpu_per_resume(&worker, &http, &many, CPU_RESUMES).await;
        (many_cpu, many_bytes) = (many_cpu.min(cpu), bytes);
    }
    let ratio = many_cpu.as_secs_f64() / few_cpu.as_secs_f64().max(1e-9);

    progress(
        "P14",
        &format!("{IDLE_RATE} idle resumes a second for {IDLE_FOR:?}, then as many history reads"),
    );
    let total = u64::from(IDLE_RATE) * IDLE_FOR.as_secs();
    let (answered, share) = paced(&worker, &http, &idle_url, 204).await;
    // The baseline beside it: the same pace of the thread's history, from memory.
    let history = format!("{}/v1/threads/{IDLE}/history", worker.base_url());
    let (read, read_share) = paced(&worker, &http, &history, 200).await;

    let first_p99 = quantile(&firsts, 0.99);
    let idle_p99 = quantile(&idles, 0.99);
    vec![
        Row::check(
            "P14",
            "first byte of a resume of a run held in memory",
            format!(
                "p50 {}, p99 {}",
                fmt_duration(quantile(&firsts, 0.5)),
                fmt_duration(first_p99)
            ),
            "p99 <= 5 ms",
            first_p99 <= Duration::from_millis(5),
        ),
        Row::check(
            "P14",
            "an idle resume (204)",
            format!(
                "p50 {}, p99 {}",
                fmt_duration(quantile(&idles, 0.5)),
                fmt_duration(idle_p99)
            ),
            "p99 <= 2 ms",
            idle_p99 <= Duration::from_millis(2),
        ),
        Row::check(
            "P14",
            "worker CPU per whole resume, 10,000 chunks vs 10 chunks of the same text",
            format!(
                "{} vs {} ({ratio:.2}x; {many_bytes} and {few_bytes} bytes sent)",
                fmt_duration(many_cpu),
                fmt_duration(few_cpu)
            ),
            "within 1.5x",
            ratio <= 1.5,
        ),
        Row::check(
            "P14",
            "1,000 idle resumes a second",
            format!("{answered} of {total} answered 204; worker CPU {share:.2}% of a core"),
            "< 5% of a core",
            answered == total && share < 5.0,
        ),
        Row::info(
            "P14",
            "1,000 history reads a second of the same thread, from memory (the baseline beside it)",
            format!("{read} of {total} answered 200; worker CPU {read_share:.2}% of a core"),
        ),
    ]
}

/// [`IDLE_RATE`] requests a second to `url` for [`IDLE_FOR`], each sent on the pooled client as it comes: how many
/// answered `status`, and the worker's CPU over them as a percentage of a core.
async fn paced(worker: &Worker, http: &reqwest::Client, url: &str, status: u16) -> (u64, f64) {
    let cpu = worker.cpu_time();
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / IDLE_RATE);
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..u64::from(IDLE_RATE) * IDLE_FOR.as_secs() {
        tick.tick().await;
        let (http, url) = (http.clone(), url.to_owned());
        requests.spawn(async move { http.get(&url).send().await.map(|r| r.status().as_u16()) });
    }
    let mut answered = 0u64;
    while let Some(done) = requests.join_next().await {
        if matches!(done, Ok(Ok(code)) if code == status) {
            answered += 1;
        }
    }
    let spent = worker.cpu_time().saturating_sub(cpu);
    (
        answered,
        spent.as_secs_f64() / started.elapsed().as_secs_f64() * 100.0,
    )
}
