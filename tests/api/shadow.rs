//! Shadow checks through the built binary (`HISTORY_VIEW_SHADOW_SAMPLE=1`): a row the view never saw is found and
//! healed (`missing`: in the store before the read, never published; `late`: persisted beyond the bound for an
//! event missed during a cut link; `differs`: stored in another form than published), no false alarm under the
//! multi-turn workload with a persister lagging within the bound, the covered-through instant on every answer, and
//! `verify` on demand. The comparison's rules are unit-tested in `src/shadow.rs`, the orchestration on a paused
//! clock in `src/cache/tests.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use serde_json::{Value, json};
use test_support::proxy::Proxy;
use test_support::turns::Conversation;

use crate::helpers::{Api, chunk_row, encode, metric, metric_sum, publish_rows, turns};
use crate::scene::{Scene, messages, now_ns, read_until_cache, wait_metric};

const SAMPLED: (&str, &str) = ("HISTORY_VIEW_SHADOW_SAMPLE", "1");

fn checks(metrics: &str, result: &str) -> f64 {
    metric(
        metrics,
        &format!("history_view_shadow_checks_total{{result=\"{result}\"}}"),
    )
}

/// Waits until `result` was counted `at_least` times.
async fn wait_checks(api: &Api, result: &str, at_least: f64) {
    wait_metric(
        api,
        &format!("history_view_shadow_checks_total{{result=\"{result}\"}}"),
        at_least,
    )
    .await;
}

/// Milliseconds since the Unix epoch of an RFC 3339 UTC instant with milliseconds (`2026-12-01T16:40:12.345Z`).
fn parse_instant(text: &str) -> u64 {
    let number = |range: std::ops::Range<usize>| -> i64 { text[range].parse().expect(text) };
    assert_eq!(text.len(), 24, "{text}");
    assert!(text.ends_with('Z'), "{text}");
    let (year, month, day) = (number(0..4), number(5..7), number(8..10));
    // Days from the civil date (Howard Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + number(11..13) * 3600 + number(14..16) * 60 + number(17..19);
    u64::try_from(secs * 1000 + number(20..23)).expect("after 1970")
}

pub fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_millis(),
    )
    .expect("fits")
}

/// The `X-History-Covered-Through` of a reply, in milliseconds since the Unix epoch.
pub fn covered_through(reply: &crate::helpers::Reply) -> u64 {
    parse_instant(
        reply
            .header("x-history-covered-through")
            .unwrap_or_else(|| panic!("no covered-through header: {:?}", reply.headers)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_view_never_saw_are_found_missing_or_differing_and_healed() {
    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[SAMPLED]).await;
    let (backfilled, rewritten) = ("t-backfilled", "t-rewritten");
    for thread in [backfilled, rewritten] {
        scene.warm(&app.api, thread).await;
    }
    // Both first reads from memory were checked against the store, which held what their views held.
    wait_checks(&app.api, "match", 2.0).await;

    // A backfill writes a row the worker never hears of; a second persister stores another form of an event the
    // worker heard live.
    let backfill = chunk_row(backfilled, "d1", "A", "e2", now_ns(1), "from a backfill");
    scene.store.insert_rows(&[backfill]).await;
    let live = chunk_row(rewritten, "d1", "A", "e2", now_ns(1), "as published");
    publish_rows(&scene.publisher, std::slice::from_ref(&live)).await;
    let mut stored = live.clone();
    stored["event_data"]["content"] = json!("as stored");
    scene.store.insert_rows(&[stored]).await;
    // The backfilled row is surely older than the reads below (its `_id` time plus a second plus the margin).
    tokio::time::sleep(Duration::from_millis(2_200)).await;

    let before = app.api.history(backfilled, "").await;
    assert_eq!(before.source(), Some("cache"));
    assert_eq!(messages(&before), turns(&[("user", "Q")]));
    let covered = covered_through(&before);
    assert!(
        covered + 3_000 > now_ms() && covered <= now_ms(),
        "{covered}"
    );
    let heard = read_until_cache(&app.api, rewritten, "").await;
    assert_eq!(
        messages(&heard),
        turns(&[("user", "Q"), ("assistant", "as published")])
    );

    wait_checks(&app.api, "missing", 1.0).await;
    wait_checks(&app.api, "differs", 1.0).await;
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "history_view_shadow_events_total{result=\"missing\"}"
        ),
        1.0
    );
    assert_eq!(metric(&metrics, "history_view_shadow_heals_total"), 2.0);
    // Healed: the next reads hydrate and hold what the store has.
    let healed = app.api.history(backfilled, "").await;
    assert_eq!(healed.source(), Some("store"));
    assert_eq!(
        messages(&healed),
        turns(&[("user", "Q"), ("assistant", "from a backfill")])
    );
    let store_covered = covered_through(&healed);
    assert!(
        store_covered + 1_500 < now_ms(),
        "a store answer covers up to its start less the bound"
    );
    let rewritten_now = app.api.history(rewritten, "").await;
    assert_eq!(rewritten_now.source(), Some("store"));
    assert!(
        rewritten_now.body.contains("as stored"),
        "{}",
        rewritten_now.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_missed_during_a_cut_link_and_persisted_beyond_the_bound_is_found_late() {
    let scene = Scene::new().await;
    let proxy = Proxy::start(scene.nats.address()).await;
    // A longer bound, so that the row lands after the read and before its check.
    let app = scene
        .worker(
            proxy.nats_url(),
            &[SAMPLED, ("HISTORY_VIEW_PERSIST_LAG_MS", "4000")],
        )
        .await;
    let thread = "t-late";
    scene.warm(&app.api, thread).await;
    wait_checks(&app.api, "match", 1.0).await;

    proxy.cut();
    app.api.wait_readiness(false).await;
    let missed = chunk_row(thread, "d1", "A", "e2", now_ns(1), "missed live");
    publish_rows(&scene.publisher, std::slice::from_ref(&missed)).await;
    let published = now_ms();
    proxy.restore();
    app.wait_ready().await;
    // No read until the event is more than the bound (and the clock margin) old: the view completes in the
    // background, without it (the persister has not written it).
    tokio::time::sleep(Duration::from_millis(
        (published + 5_500).saturating_sub(now_ms()),
    ))
    .await;
    let read = read_until_cache(&app.api, thread, "").await;
    assert_eq!(messages(&read), turns(&[("user", "Q")]));
    // The persister writes it now, well after the read and before the check (4 s after the read).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    scene.store.insert_rows(&[missed]).await;

    wait_checks(&app.api, "late", 1.0).await;
    let healed = app.api.history(thread, "").await;
    assert_eq!(healed.source(), Some("store"));
    assert_eq!(
        messages(&healed),
        turns(&[("user", "Q"), ("assistant", "missed live")])
    );
    assert_eq!(checks(&app.api.metrics().await, "missing"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_multi_turn_workload_with_a_lagging_persister_raises_no_false_alarm() {
    const THREADS: usize = 3;
    const TURNS: usize = 6;
    let scene = Scene::new().await;
    let app = scene
        .worker(
            scene.nats.url(),
            &[SAMPLED, ("HISTORY_VIEW_SHADOW_MAX_PER_SEC", "1000")],
        )
        .await;
    let runs = (0..THREADS).map(|t| {
        let (api, scene) = (app.api.clone(), &scene);
        async move {
            let mut conversation = Conversation::new(format!("shadow-turns-{t}"));
            for turn in 0..TURNS {
                let rows = conversation.next_turn();
                publish_rows(&scene.publisher, &rows).await;
                // Read while the persister is behind (the view is ahead of the store), then persist within the
                // bound (up to 1.5 s after publishing), and read again.
                let ahead = api
                    .history(&conversation.thread, &Conversation::query())
                    .await;
                assert_eq!(ahead.status, 200, "{}", ahead.body);
                let lag = 300 * ((turn + t) % 6) as u64;
                tokio::time::sleep(Duration::from_millis(lag)).await;
                scene.store.insert_rows(&rows).await;
                api.history(&conversation.thread, &Conversation::query())
                    .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            conversation
        }
    });
    let conversations = join_all(runs).await;
    // Every check has run: the bound and the window after the last read.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let metrics = app.api.metrics().await;
    for failure in ["missing", "late", "differs", "window", "uncertain", "error"] {
        assert_eq!(checks(&metrics, failure), 0.0, "{failure}:\n{metrics}");
    }
    assert!(checks(&metrics, "match") >= 1.0, "{metrics}");
    assert!(
        metric_sum(&metrics, "history_view_shadow_checks_total") >= (THREADS * 2) as f64,
        "{metrics}"
    );
    assert_eq!(metric(&metrics, "history_view_shadow_heals_total"), 0.0);
    for conversation in &conversations {
        let reply = read_until_cache(&app.api, &conversation.thread, &Conversation::query()).await;
        assert_eq!(reply.json(), conversation.expected());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_compares_a_cached_thread_now_and_heals_it() {
    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let thread = "t-verify";
    scene.warm(&app.api, thread).await;
    let path = format!("/v1/threads/{}/verify", encode(thread));
    let clean = app.api.post(&path).await;
    assert_eq!(clean.status, 200, "{}", clean.body);
    assert_eq!(clean.json()["result"], "match");
    assert_eq!(clean.json()["view"], "complete");

    let backfill = chunk_row(thread, "d1", "A", "e2", now_ns(1), "backfilled");
    scene.store.insert_rows(&[backfill]).await;
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    let found = app.api.post(&path).await;
    let report: Value = found.json();
    assert_eq!(report["result"], "missing", "{report}");
    assert_eq!(report["counts"]["missing"], 1);
    assert_eq!(report["healed"], true);
    assert_eq!(report["divergent"][0]["event_id"], "e2");
    assert!(
        !found.body.contains("backfilled"),
        "metadata only: {}",
        found.body
    );
    let healed = app.api.history(thread, "").await;
    assert_eq!(healed.source(), Some("store"));
    assert!(healed.body.contains("backfilled"));

    let unknown = app.api.post("/v1/threads/t-never-read/verify").await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["error"]["code"], "thread_not_cached");
    let age = metric(
        &app.api.metrics().await,
        "history_view_covered_through_age_seconds",
    );
    assert!((0.0..5.0).contains(&age), "{age}");
}
