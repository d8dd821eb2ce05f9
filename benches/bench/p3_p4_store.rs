//! P3: a cache-hit read against store reconstruction of the same 1,000-event thread (target: >= 100x faster).
//! P4: store reconstruction at 1k and 10k events (100k with `BENCH_FULL=1`) against the bare driver running the
//! same two queries (target: <= 1.2x bare, and linear in the thread's size).
//!
//! A cold read is the first read of a fresh worker process, started, ready and left alone for a moment (so its
//! store connections are made, as in a long-running worker): it answers from the store. P4 pairs each cold read
//! with one run of the baseline, back to back, alternating which goes first, and takes the median of the pairs'
//! ratios (the local server's times vary by tens of percent from one query to the next on a shared machine).
//!
//! Each size's thread is alone in its own database, so the collection holds exactly the thread: with copies of it
//! under other ids the local server's collection scans would grow with the copies and flatter the P3 ratio.
//!
//! Both the worker and the baseline run without the index hint: SecantusDB walks the whole collection in Python
//! for a hinted query, which would swamp everything measured here. The threads have 10 turns, each on its own
//! display, so stage 2's `$in` list stays at 10 displays at every size (the local server matches `$in` by a linear
//! scan of the list, which would make the baseline itself quadratic in the number of displays).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chat_history_view::store::{events_filter, events_sort, markers_pipeline, projection};
use mongodb::bson::raw::RawBsonRef;
use mongodb::bson::{Bson, RawDocumentBuf};

use crate::data::Conversation;
use crate::report::{Row, fmt_duration, median, progress};
use crate::setup::Setup;
use crate::worker::Worker;

const TURNS: usize = 10;
/// Cold reads (each a fresh worker) and cache-hit reads timed in P3.
const P3_COLD_READS: usize = 5;
const P3_HITS: usize = 200;
/// Time a fresh worker is left alone before its cold read.
const SETTLE: Duration = Duration::from_millis(300);
/// The worker's per-event time may grow from 1k to the largest size by this factor beyond flat, or beyond the bare
/// driver's own growth in the same run when the local server itself scaled worse than flat, and still count as
/// linear. The server's per-event time moves by tens of percent between sizes and runs, in both directions.
const LINEAR_TOLERANCE: f64 = 1.25;

fn shape(events: usize) -> Conversation {
    Conversation {
        turns: TURNS,
        events_per_turn: events / TURNS,
        displays: TURNS,
    }
}

/// The store reads may take seconds on the local server; the default 2 s read timeout would turn them into 503s.
fn store_env(events: usize) -> [(&'static str, &'static str); 1] {
    [(
        "HISTORY_VIEW_STORE_TIMEOUT_MS",
        if events > 20_000 { "600000" } else { "60000" },
    )]
}

pub async fn run_p3(setup: Arc<Setup>) -> Vec<Row> {
    let thread = "p3-thread";
    let conversation = shape(1_000);
    let store = setup.store("bench_p3").await;
    store.insert(&conversation.rows(thread)).await;

    let mut cold = Vec::new();
    let mut worker = None;
    for _ in 0..P3_COLD_READS {
        // The previous worker is killed before the next one starts.
        drop(worker.take());
        let (read, fresh) = cold_read(&setup, "bench_p3", thread, &conversation).await;
        cold.push(read.wall);
        worker = Some(fresh);
    }
    let worker = worker.expect("at least one cold read");
    worker.read_until_cached(thread).await;
    let mut hits = Vec::with_capacity(P3_HITS);
    for _ in 0..P3_HITS {
        let started = Instant::now();
        let reply = worker.history(thread).await;
        hits.push(started.elapsed());
        assert_eq!(
            (reply.status, reply.source.as_str()),
            (200, "cache"),
            "a cache-hit read"
        );
    }
    let (cold, hit) = (median(&cold), median(&hits));
    let ratio = cold.as_secs_f64() / hit.as_secs_f64();
    progress(
        "P3",
        &format!(
            "store {} vs cache {}",
            fmt_duration(cold),
            fmt_duration(hit)
        ),
    );
    vec![Row::check(
        "P3",
        "cache hit vs store reconstruction, 1k events",
        format!(
            "{ratio:.0}x (median cache hit {} of {P3_HITS} vs store {} of {P3_COLD_READS} cold reads)",
            fmt_duration(hit),
            fmt_duration(cold)
        ),
        ">= 100x",
        ratio >= 100.0,
    )]
}

/// One size's medians.
struct Reconstruction {
    events: usize,
    reads: usize,
    worker: Duration,
    bare: Duration,
    /// The median of worker / bare over the back-to-back pairs.
    ratio: f64,
    markers: Duration,
    events_stage: Duration,
}

impl Reconstruction {
    fn per_event_us(&self, time: Duration) -> f64 {
        time.as_secs_f64() * 1e6 / self.events as f64
    }

    fn label(&self) -> String {
        format!("{}k", self.events / 1000)
    }
}

pub async fn run_p4(setup: Arc<Setup>) -> Vec<Row> {
    let mut sizes = vec![(1_000, 15), (10_000, 5)];
    if setup.settings.full {
        sizes.push((100_000, 3));
    }
    let mut results = Vec::new();
    for (events, reads) in sizes {
        results.push(reconstruct(&setup, events, reads).await);
    }
    let mut rows = Vec::new();
    for r in &results {
        rows.push(Row::check(
            "P4",
            format!("store reconstruction, {} events, vs bare driver", r.label()),
            format!(
                "{:.2}x (median of {} back-to-back pairs; medians worker {} vs bare {})",
                r.ratio,
                r.reads,
                fmt_duration(r.worker),
                fmt_duration(r.bare),
            ),
            "<= 1.2x bare",
            r.ratio <= 1.2,
        ));
        rows.push(Row::info(
            "P4",
            format!("{}: where the worker's read goes", r.label()),
            format!(
                "stage 1 {} + stage 2 with row decoding {} of {} (the worker's own histograms)",
                fmt_duration(r.markers),
                fmt_duration(r.events_stage),
                fmt_duration(r.worker),
            ),
        ));
    }
    if let (Some(first), Some(last)) = (results.first(), results.last()) {
        let per_event: Vec<String> = results
            .iter()
            .map(|r| {
                format!(
                    "{} {:.0} (bare {:.0})",
                    r.label(),
                    r.per_event_us(r.worker),
                    r.per_event_us(r.bare)
                )
            })
            .collect();
        let growth = last.per_event_us(last.worker) / first.per_event_us(first.worker);
        let bare_growth = last.per_event_us(last.bare) / first.per_event_us(first.bare);
        let allowed = LINEAR_TOLERANCE * bare_growth.max(1.0);
        rows.push(Row::check(
            "P4",
            "linear: worker time per event by size",
            format!(
                "{} µs/event; from {} to {} worker {growth:.2}x, bare {bare_growth:.2}x",
                per_event.join(", "),
                first.label(),
                last.label()
            ),
            format!("per-event growth <= {LINEAR_TOLERANCE}x max(1, bare's growth)"),
            growth <= allowed,
        ));
    }
    rows
}

/// Stores a thread of `events` events in its own database, then times `reads` cold reads of fresh workers, each
/// paired with a run of the bare driver's two queries (alternating which goes first).
async fn reconstruct(setup: &Setup, events: usize, reads: usize) -> Reconstruction {
    let database = format!("bench_p4_{events}");
    let thread = format!("p4-thread-{events}");
    let conversation = shape(events);
    let store = setup.store(&database).await;
    let started = Instant::now();
    store.insert(&conversation.rows(&thread)).await;
    progress(
        "P4",
        &format!(
            "{events} rows inserted in {}",
            fmt_duration(started.elapsed())
        ),
    );
    // Like each cold worker, each baseline run gets a fresh client that has connected, pinged and settled: the
    // two sides then differ only in what the worker does beyond the driver.
    let bare_read = || async {
        let client = mongodb::Client::with_uri_str(setup.mongo_uri())
            .await
            .expect("a fresh baseline client");
        client
            .database("admin")
            .run_command(mongodb::bson::doc! {"ping": 1})
            .await
            .expect("the baseline client connects");
        tokio::time::sleep(SETTLE).await;
        let collection = client
            .database(&database)
            .collection::<RawDocumentBuf>("agent_events");
        let (elapsed, rows) = bare_two_queries(&collection, &thread).await;
        assert_eq!(rows, events, "the baseline reads every row of the thread");
        elapsed
    };
    let mut bare = Vec::new();
    let mut cold: Vec<ColdRead> = Vec::new();
    for read in 1..=reads {
        if read % 2 == 1 {
            bare.push(bare_read().await);
        }
        let (worker_read, worker) = cold_read(setup, &database, &thread, &conversation).await;
        drop(worker);
        cold.push(worker_read);
        if read % 2 == 0 {
            bare.push(bare_read().await);
        }
        progress(
            "P4",
            &format!(
                "{events} events, read {read}/{reads}: bare {}, worker {} (stages {} + {})",
                fmt_duration(bare[read - 1]),
                fmt_duration(worker_read.wall),
                fmt_duration(worker_read.markers),
                fmt_duration(worker_read.events),
            ),
        );
    }
    let medians =
        |field: fn(&ColdRead) -> Duration| median(&cold.iter().map(field).collect::<Vec<_>>());
    let mut ratios: Vec<f64> = cold
        .iter()
        .zip(&bare)
        .map(|(worker, bare)| worker.wall.as_secs_f64() / bare.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    Reconstruction {
        events,
        reads,
        worker: medians(|r| r.wall),
        bare: median(&bare),
        ratio: ratios[ratios.len() / 2],
        markers: medians(|r| r.markers),
        events_stage: medians(|r| r.events),
    }
}

/// A fresh worker's first read, and where the worker says its time went.
#[derive(Debug, Clone, Copy)]
struct ColdRead {
    /// Request to last byte, as the bench sees it.
    wall: Duration,
    /// Stage 1 (the markers aggregation), from the worker's store-query histogram.
    markers: Duration,
    /// Stage 2 (the sorted find), including the worker decoding each row as the cursor yields it.
    events: Duration,
}

/// Starts a worker on `database`, lets its start-up connections settle, and times its first read of `thread`: it
/// must come from the store and hold the whole thread.
async fn cold_read(
    setup: &Setup,
    database: &str,
    thread: &str,
    conversation: &Conversation,
) -> (ColdRead, Worker) {
    let worker = setup
        .start_worker(database, &store_env(conversation.events()))
        .await;
    // The driver's monitor and pool connections, and the first readiness ping, are made at start; a long-running
    // worker has them already.
    tokio::time::sleep(SETTLE).await;
    let started = Instant::now();
    let reply = worker.history(thread).await;
    let wall = started.elapsed();
    assert_eq!(
        (reply.status, reply.source.as_str()),
        (200, "store"),
        "a cold read answers from the store: {}\n{}",
        String::from_utf8_lossy(&reply.body[..reply.body.len().min(300)]),
        worker.log_tail()
    );
    assert_eq!(
        reply.message_count(),
        conversation.messages(),
        "the whole thread"
    );
    let scrape = worker.metrics().await;
    let stage = |name: &str| {
        Duration::from_secs_f64(scrape.sample(&format!(
            "history_view_store_query_duration_seconds_sum{{stage=\"{name}\"}}"
        )))
    };
    let read = ColdRead {
        wall,
        markers: stage("markers"),
        events: stage("events"),
    };
    (read, worker)
}

/// The baseline: the worker's two store queries (`chat_history_view::store`), without a hint, through the bare
/// driver; stage 2's rows iterated as raw documents and not decoded. Returns the time and the rows read.
async fn bare_two_queries(
    collection: &mongodb::Collection<RawDocumentBuf>,
    thread: &str,
) -> (Duration, usize) {
    let started = Instant::now();
    let mut cursor = collection
        .aggregate(markers_pipeline(thread))
        .await
        .expect("baseline stage 1");
    let mut displays = Vec::new();
    while cursor.advance().await.expect("baseline stage 1 cursor") {
        if let Ok(Some(value)) = cursor.current().get("_id")
            && !matches!(value, RawBsonRef::Null)
            && let Ok(display) = Bson::try_from(value.to_raw_bson())
        {
            displays.push(display);
        }
    }
    let mut cursor = collection
        .find(events_filter(thread, &displays))
        .sort(events_sort())
        .projection(projection())
        .await
        .expect("baseline stage 2");
    let mut rows = 0;
    while cursor.advance().await.expect("baseline stage 2 cursor") {
        rows += 1;
    }
    (started.elapsed(), rows)
}
