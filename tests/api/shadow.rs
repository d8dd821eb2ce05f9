//! Shadow checks through the built binary (`HISTORY_VIEW_SHADOW_SAMPLE=1`): a row the view never saw is found and
//! healed (`missing`: in the store before the read, never published; `late`: persisted beyond the bound for an
//! event missed during a cut link; `differs`: stored in another form than published), no false alarm under the
//! multi-turn workload with a persister lagging within the bound, the covered-through instant on every answer, and
//! `verify` on demand: within its own budget (a burst beyond it is refused with 429, its store queries bounded),
//! and `not_complete`, never a failure, for a view that is not complete. The comparison's rules are unit-tested in `src/shadow.rs`, the orchestration on a paused
//! clock in `src/cache/tests.rs`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use serde_json::{Value, json};
use test_support::proxy::Proxy;
use test_support::turns::Conversation;

use crate::helpers::{Api, chunk_row, encode, metric, metric_sum, publish_rows, turns};
use crate::scene::{Scene, messages, now_ns, read_until_cache, wait_metric};
use test_support::wait::eventually;

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
    // The backfilled row is surely older than the reads below (its `_id` time plus a second plus the margin). Not a
    // synchronization: the rule judges by the `_id`'s clock time, so the scenario lets that time pass.
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
    // background, without it (the persister has not written it). The scenario: the bound elapses on purpose.
    tokio::time::sleep(Duration::from_millis(
        (published + 5_500).saturating_sub(now_ms()),
    ))
    .await;
    let read = read_until_cache(&app.api, thread, "").await;
    assert_eq!(messages(&read), turns(&[("user", "Q")]));
    // The persister writes it now, well after the read and before the check (4 s after the read). The scenario: a
    // persister that lags past the read on purpose.
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
                // The scenario: the persister's lag, within the bound.
                tokio::time::sleep(Duration::from_millis(lag)).await;
                scene.store.insert_rows(&rows).await;
                let again = api
                    .history(&conversation.thread, &Conversation::query())
                    .await;
                assert_eq!(again.status, 200, "{}", again.body);
                // The workload's pacing: the user's time before the next turn.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            conversation
        }
    });
    let conversations = join_all(runs).await;
    // Every sampled check has run before the verdict: at a sample of 1 every answer from memory is drawn, and each
    // one drawn is either dropped (its thread being checked) or checked the bound after its read; so the checks
    // judged catch up with the answers from memory less those dropped (no read runs meanwhile).
    let api = &app.api;
    let metrics = eventually("every sampled read's check judged", || async move {
        let metrics = api.metrics().await;
        let drawn = metric(&metrics, "history_view_cache_hits_total");
        let dropped = checks(&metrics, "dropped");
        let judged = metric_sum(&metrics, "history_view_shadow_checks_total") - dropped;
        if judged >= drawn - dropped {
            Ok(metrics)
        } else {
            Err(format!(
                "{judged} judged of {drawn} drawn, {dropped} dropped:\n{metrics}"
            ))
        }
    })
    .await;
    for failure in ["missing", "late", "differs", "window", "uncertain", "error"] {
        assert_eq!(checks(&metrics, failure), 0.0, "{failure}:\n{metrics}");
    }
    assert!(checks(&metrics, "match") >= 1.0, "{metrics}");
    let judged =
        metric_sum(&metrics, "history_view_shadow_checks_total") - checks(&metrics, "dropped");
    eprintln!(
        "{judged} checks judged, {} dropped",
        checks(&metrics, "dropped")
    );
    assert!(
        judged >= (THREADS * 2) as f64,
        "{judged} checks judged:\n{metrics}"
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
    // Not a synchronization: the rule judges by the row's `_id` clock time (plus a second and the margin), so the
    // scenario lets that time pass.
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

/// The sum of `history_view_store_queries_total` over its kinds.
async fn store_queries(api: &Api) -> f64 {
    metric_sum(&api.metrics().await, "history_view_store_queries_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_verifies_beyond_their_budget_is_refused_with_retry_after_and_queries_stay_bounded()
 {
    const BURST: usize = 200;
    const PER_SEC: f64 = 5.0;
    let scene = Scene::new().await;
    // No sampled checks: every store query below is a verify's.
    let app = scene
        .worker(
            scene.nats.url(),
            &[
                ("HISTORY_VIEW_SHADOW_SAMPLE", "0"),
                ("HISTORY_VIEW_SHADOW_MAX_PER_SEC", "5"),
            ],
        )
        .await;
    let threads: Vec<String> = (0..8).map(|k| format!("t-burst-{k}")).collect();
    for thread in &threads {
        scene.warm(&app.api, thread).await;
    }
    let before = store_queries(&app.api).await;
    let started = std::time::Instant::now();
    let replies = join_all((0..BURST).map(|k| {
        let path = format!("/v1/threads/{}/verify", encode(&threads[k % threads.len()]));
        let api = app.api.clone();
        async move { api.post(&path).await }
    }))
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let queries = store_queries(&app.api).await - before;

    let mut answered = 0usize;
    let mut refused = 0usize;
    for reply in &replies {
        match reply.status {
            200 => {
                answered += 1;
                assert_eq!(reply.json()["result"], "match", "{}", reply.body);
            }
            429 => {
                refused += 1;
                assert_eq!(reply.json()["error"]["code"], "verify_limited");
                let retry: u64 = reply
                    .header("retry-after")
                    .unwrap_or_else(|| panic!("no Retry-After: {:?}", reply.headers))
                    .parse()
                    .expect("whole seconds");
                assert!(retry >= 1);
            }
            other => panic!("{other}: {}", reply.body),
        }
    }
    // The bucket holds one second's worth and refills PER_SEC a second: whatever the timing, no more passed.
    let budget = PER_SEC * (1.0 + elapsed);
    assert!(
        (answered as f64) <= budget,
        "{answered} verifies answered in {elapsed:.2} s"
    );
    assert!(refused > 0, "{answered} answered in {elapsed:.2} s");
    // Each answered verify costs its two stage queries at most; a refused one none.
    assert!(
        queries <= (2 * answered) as f64,
        "{queries} store queries for {answered} verifies"
    );
    let metrics = app.api.metrics().await;
    assert_eq!(checks(&metrics, "refused"), refused as f64);
    assert_eq!(checks(&metrics, "match"), answered as f64);
    assert_eq!(
        metric(&metrics, "history_view_read_errors_total{code=\"429\"}"),
        refused as f64
    );

    // A second later the budget admits again. The scenario: the bucket's refill time, let pass on purpose.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let again = app
        .api
        .post(&format!("/v1/threads/{}/verify", encode(&threads[0])))
        .await;
    assert_eq!(again.status, 200, "{}", again.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_of_a_view_not_complete_answers_not_complete_and_raises_no_alarm() {
    let scene = Scene::new().await;
    // A long bound: a read within it after the worker started leaves the view partial (never served as complete)
    // for as long.
    let app = scene
        .worker(
            scene.nats.url(),
            &[
                ("HISTORY_VIEW_SHADOW_SAMPLE", "0"),
                ("HISTORY_VIEW_PERSIST_LAG_MS", "60000"),
            ],
        )
        .await;
    let thread = "t-partial";
    scene
        .store
        .insert_rows(&[crate::helpers::user_row(thread, "d1", "e1", now_ns(0), "Q")])
        .await;
    let read = app.api.history(thread, "").await;
    assert_eq!(read.status, 200, "{}", read.body);
    assert_eq!(read.source(), Some("store"));
    // A row the view lacks, surely stored before the verify below (its `_id` time plus a second plus the margin).
    let backfill = chunk_row(thread, "d1", "A", "e2", now_ns(1), "backfilled");
    scene.store.insert_rows(&[backfill]).await;
    // Not a synchronization: the rule judges by the row's `_id` clock time, so the scenario lets that time pass.
    tokio::time::sleep(Duration::from_millis(2_200)).await;

    let before = store_queries(&app.api).await;
    let path = format!("/v1/threads/{}/verify", encode(thread));
    let verified = app.api.post(&path).await;
    assert_eq!(verified.status, 200, "{}", verified.body);
    let report: Value = verified.json();
    assert_eq!(report["result"], "not_complete", "{report}");
    assert_eq!(report["view"], "partial", "{report}");
    assert_eq!(report["healed"], false);
    assert_eq!(report["counts"]["missing"], 0);
    assert_eq!(report["divergent"], json!([]));
    let metrics = app.api.metrics().await;
    assert_eq!(
        metric_sum(&metrics, "history_view_store_queries_total"),
        before,
        "not compared: no store query"
    );
    assert_eq!(checks(&metrics, "not_complete"), 1.0);
    for failure in ["missing", "late", "differs"] {
        assert_eq!(checks(&metrics, failure), 0.0, "{failure}:\n{metrics}");
    }
    // The reads still hydrate and answer what the store holds.
    let again = app.api.history(thread, "").await;
    assert_eq!(again.source(), Some("store"));
    assert!(again.body.contains("backfilled"), "{}", again.body);
}
