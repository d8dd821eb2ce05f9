//! `explain` held to each conformance case (the `explain` path of the store and live paths): every row of the case
//! is accounted for exactly once per delivery, with a fate consistent with the case's expected history (counted
//! events' text is in their message, every row of a hidden display is `display_not_visible`, repeated deliveries are
//! `duplicate`, expected warnings are `malformed` with their error type), metadata only.

use std::collections::{BTreeMap, HashSet};

use chat_history_view::decode::Family;
use chat_history_view::subject::KEY_FIELDS;
use serde_json::Value;

use crate::cases::Case;
use crate::conformance::query;
use crate::helpers::{Api, encode};

const MARKER_PARENTS: [&str; 2] = Family::parents(Family::MARKERS);
const FAMILY_PARENTS: [&str; 5] = Family::parents(Family::ALL);

/// `GET /v1/threads/{thread}/history/explain?{query}`.
pub async fn explain(api: &Api, thread: &str, query: &str) -> crate::helpers::Reply {
    api.get(
        &format!("/v1/threads/{}/history/explain?{query}", encode(thread)),
        &[],
    )
    .await
}

fn key_of(value: &Value) -> Vec<String> {
    KEY_FIELDS
        .iter()
        .map(|f| value[*f].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn parents(row: &Value) -> Vec<&str> {
    row["event_parents"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn is_marker(row: &Value) -> bool {
    row["agent_class"] == "UserAgent"
        && row["event_type"] == "display_event"
        && parents(row).iter().any(|p| MARKER_PARENTS.contains(p))
}

fn is_relevant(row: &Value) -> bool {
    row["event_type"] == "display_event" && parents(row).iter().any(|p| FAMILY_PARENTS.contains(p))
}

/// The text of a message's text parts, joined.
fn text_of(message: &Value) -> String {
    message["content"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<String>()
        })
        .unwrap_or_default()
}

/// Reads `explain` for the case through `api` (its rows all stored by now) and checks it; the failure, if any.
pub async fn check_explain(case: &Case, path: &str, api: &Api) -> Option<String> {
    let reply = explain(api, &case.thread_id, &query(case)).await;
    if reply.status != 200 {
        return Some(format!(
            "{} [{path} explain]: status {} {}",
            case.name, reply.status, reply.body
        ));
    }
    let failures = check(case, path == "live", &reply.json());
    (!failures.is_empty()).then(|| {
        format!(
            "{} [{path} explain]:\n  {}\n  explain: {}",
            case.name,
            failures.join("\n  "),
            reply.body
        )
    })
}

/// What is wrong with `explanation` for `case` (its rows all stored; `live`: its view was built from NATS).
fn check(case: &Case, live: bool, explanation: &Value) -> Vec<String> {
    let mut failures = Vec::new();
    let events = explanation["events"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let expected = case
        .expected
        .messages
        .as_array()
        .cloned()
        .unwrap_or_default();
    let rows: Vec<&Value> = case
        .rows
        .iter()
        .filter(|r| r["thread_id"] == case.thread_id.as_str())
        .collect();
    let visible: HashSet<&str> = rows
        .iter()
        .filter(|r| is_marker(r))
        .filter_map(|r| r["display_id"].as_str())
        .collect();

    // Every delivery of every row once, and nothing else.
    let mut by_key: BTreeMap<Vec<String>, Vec<&Value>> = BTreeMap::new();
    for event in &events {
        by_key.entry(key_of(event)).or_default().push(event);
    }
    let mut row_keys: BTreeMap<Vec<String>, Vec<&Value>> = BTreeMap::new();
    for row in &rows {
        row_keys.entry(key_of(row)).or_default().push(row);
    }
    for (key, listed) in &by_key {
        let stored = row_keys.get(key).map_or(0, Vec::len);
        if stored != listed.len() {
            failures.push(format!("{key:?}: {stored} rows, {} events", listed.len()));
        }
    }
    for (key, deliveries) in &row_keys {
        let row = deliveries[0];
        let Some(listed) = by_key.get(key) else {
            failures.push(format!("row {key:?} is not listed"));
            continue;
        };
        let fates: Vec<&str> = listed.iter().filter_map(|e| e["fate"].as_str()).collect();
        let shown = row["display_id"]
            .as_str()
            .is_some_and(|d| visible.contains(d));
        if listed.iter().any(|e| e["stored"] != true) {
            failures.push(format!("{key:?} is not marked stored"));
        }
        if !shown {
            if fates.iter().any(|f| *f != "display_not_visible") {
                failures.push(format!("{key:?} on a hidden display: {fates:?}"));
            }
            continue;
        }
        let repeats = fates.iter().filter(|f| **f == "duplicate").count();
        if repeats + 1 != deliveries.len() {
            failures.push(format!(
                "{key:?}: {} deliveries, fates {fates:?}",
                deliveries.len()
            ));
        }
        let first = listed
            .iter()
            .find(|e| e["fate"] != "duplicate")
            .copied()
            .unwrap_or(&Value::Null);
        if !is_relevant(row) {
            if first["fate"] != "family_not_projectable" {
                failures.push(format!("{key:?} is of no projectable family: {first}"));
            }
            continue;
        }
        if live && first["in_view"] != true {
            failures.push(format!("{key:?} arrived live but is not in the view"));
        }
        if first["fate"] == "not_in_view" || first["fate"] == "family_not_projectable" {
            failures.push(format!("{key:?}: {first}"));
        }
        let counted = first["fate"] == "counted"
            || (first["fate"] == "stop" && first["prefix_rule"] == "supplied");
        if !counted {
            continue;
        }
        let Some(message) = first["message"]
            .as_u64()
            .and_then(|m| expected.get(m as usize))
        else {
            failures.push(format!("{key:?} counted in no expected message: {first}"));
            continue;
        };
        let family = parents(row);
        let user =
            row["agent_class"] == "UserAgent" && family.iter().any(|p| MARKER_PARENTS.contains(p));
        let role = if user { "user" } else { "assistant" };
        if message["role"] != role {
            failures.push(format!("{key:?} counted in a {} message", message["role"]));
        }
        let data = &row["event_data"];
        let text = if family.contains(&"ChunkEvent") {
            data["content"].as_str().map(str::to_owned)
        } else if family.contains(&"HumanInTheLoopRequestEvent") && !user {
            data["question"].as_str().map(str::to_owned)
        } else if user && family.contains(&"HumanInTheLoopResponseEvent") {
            match &data["response"] {
                Value::Bool(b) => Some(b.to_string()),
                other => other.as_str().map(str::to_owned),
            }
        } else {
            None
        };
        if let Some(text) = text
            && !text_of(message).contains(&text)
        {
            failures.push(format!(
                "{key:?}'s text {text:?} is not in its message {message}"
            ));
        }
    }

    // The messages are the expected history's, each made of at least one event.
    let messages = explanation["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if messages.len() != expected.len() {
        failures.push(format!(
            "{} messages explained, {} expected",
            messages.len(),
            expected.len()
        ));
    }
    for (explained, message) in messages.iter().zip(&expected) {
        if explained["role"] != message["role"] {
            failures.push(format!(
                "message {} has role {}",
                explained["id"], explained["role"]
            ));
        }
        if explained["events"].as_array().is_none_or(Vec::is_empty) {
            failures.push(format!("message {} names no event", explained["id"]));
        }
    }

    // Expected warnings: the event is malformed with that error type, or lost an unsupported audio block.
    if let Some(warnings) = &case.warnings {
        for warning in warnings {
            let found = events.iter().any(|e| {
                e["event_id"] == warning.event_id.as_str()
                    && match &warning.audio_format {
                        Some(format) => e["unsupported_audio"]
                            .as_array()
                            .is_some_and(|f| f.iter().any(|f| f == format.as_str())),
                        None => {
                            e["fate"] == "malformed"
                                && e["error_type"] == warning.error_type.as_str()
                        }
                    }
            });
            if !found {
                failures.push(format!("warning {warning:?} is not explained"));
            }
        }
        let malformed = events.iter().filter(|e| e["fate"] == "malformed").count();
        let expected = warnings.iter().filter(|w| w.audio_format.is_none()).count();
        if malformed != expected {
            failures.push(format!("{malformed} malformed events, {expected} warnings"));
        }
    }

    // Metadata only: no chunk's or question's text is a value of the body.
    let mut values = HashSet::new();
    string_values(explanation, &mut values);
    for row in &rows {
        for field in ["content", "question"] {
            if let Some(text) = row["event_data"][field].as_str()
                && values.contains(text)
            {
                failures.push(format!("the body holds the text {text:?}"));
            }
        }
    }
    failures
}

/// Every string value in `value` (not the object keys).
fn string_values<'a>(value: &'a Value, into: &mut HashSet<&'a str>) {
    match value {
        Value::String(s) => {
            into.insert(s);
        }
        Value::Array(items) => items.iter().for_each(|v| string_values(v, into)),
        Value::Object(fields) => fields.values().for_each(|v| string_values(v, into)),
        _ => {}
    }
}

/// The transcript the inspector page shows, in the history's message shape (text parts as text; other parts as
/// the page names them).
const PAGE_TRANSCRIPT: &str = r#"Array.from(document.querySelectorAll('#transcript .message')).map(m => ({
    role: m.dataset.role,
    content: Array.from(m.querySelectorAll('.part')).map(p => ({type: p.dataset.type, text: p.textContent}))
}))"#;

/// The inspector page in a real browser (Debian's headless Chromium) while a thread's answer streams in live: the
/// transcript it renders from the feed equals the history after every event, each message lists its source
/// events (the stop that supplied the end among them), and the hidden display's event is listed as excluded, with
/// its fate. The page's policy allows its own script and stylesheet by hash, so both work, while a script or a
/// style attribute injected into the page is blocked. When the worker stops, the page shows the feed's `end` and
/// does not reconnect. A screenshot is written to `target/inspector.png`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inspector_page_shows_a_live_thread_in_a_real_browser() {
    use crate::helpers::{chunk_row, publish_rows, stop_row, user_row};
    use crate::scene::{Scene, now_ns};
    use std::time::Duration;
    use test_support::browser::Browser;

    let scene = Scene::new().await;
    let app = scene.worker(scene.nats.url(), &[]).await;
    let (store, publisher) = (&scene.store, &scene.publisher);
    let thread = "inspected-thread";
    let query = "agent_class=A&agent_id=a1";
    // Stored and published as aihub does: the persister writes each event as it is published.
    let publish = async |row: Value| {
        store.insert_rows(std::slice::from_ref(&row)).await;
        publish_rows(publisher, &[row]).await;
    };
    publish(user_row(
        thread,
        "d1",
        "e1",
        now_ns(0),
        "What is the answer?",
    ))
    .await;
    publish(chunk_row(
        thread,
        "d2",
        "A",
        "e-hidden",
        now_ns(1),
        "a hidden step",
    ))
    .await;

    let url = format!("{}/inspect/threads/{thread}?{query}", app.api.address);
    let mut browser = tokio::task::block_in_place(|| {
        let mut browser = Browser::start();
        browser.navigate(&url);
        let status = browser.eval_until(
            "document.getElementById('status').dataset.state",
            Duration::from_secs(20),
            |s| s == "live",
        );
        assert_eq!(status, "live", "the page did not connect to the feed");
        browser
    });

    let steps = [
        chunk_row(thread, "d1", "A", "e3", now_ns(3), "Forty"),
        chunk_row(thread, "d1", "A", "e4", now_ns(4), "-two"),
        stop_row(thread, "d1", "A", "e5", now_ns(5), "Forty-two, of course."),
    ];
    for step in steps {
        publish(step).await;
        let expected = app.api.history(thread, query).await.json()["messages"].clone();
        let shown = tokio::task::block_in_place(|| {
            browser.eval_until(PAGE_TRANSCRIPT, Duration::from_secs(20), |shown| {
                *shown == expected
            })
        });
        assert_eq!(shown, expected, "the page's transcript is not the history");
    }
    assert_eq!(
        app.api.history(thread, query).await.json()["messages"],
        crate::helpers::turns(&[
            ("user", "What is the answer?"),
            ("assistant", "Forty-two, of course.")
        ])
    );

    tokio::task::block_in_place(|| {
        let excluded = browser.eval_until(
            "Array.from(document.querySelectorAll('#excluded tr.excluded')).map(r => [r.dataset.eventId, r.dataset.fate])",
            Duration::from_secs(20),
            |rows| rows.to_string().contains("e-hidden"),
        );
        assert!(
            excluded.as_array().is_some_and(
                |rows| rows.contains(&serde_json::json!(["e-hidden", "display_not_visible"]))
            ),
            "the hidden display's event is not listed as excluded: {excluded}"
        );
        let sources = browser.eval_until(
            "Array.from(document.querySelectorAll('#transcript .message[data-role=assistant] .sources li')).map(l => [l.dataset.eventId, l.dataset.fate])",
            Duration::from_secs(20),
            |rows| rows.as_array().is_some_and(|r| r.len() == 3),
        );
        assert_eq!(
            sources,
            serde_json::json!([["e3", "counted"], ["e4", "counted"], ["e5", "stop"]]),
            "the answer's source events"
        );
        let png = browser.screenshot();
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        std::fs::create_dir_all(&target).expect("target/");
        std::fs::write(target.join("inspector.png"), png).expect("the screenshot is written");

        // The stylesheet applies (its hash is in the policy), the rule that replaced a style attribute with it.
        let styled = browser.eval(
            "[getComputedStyle(document.body).fontSize, getComputedStyle(document.querySelector('table + h2')).marginTop]",
        );
        assert_eq!(
            styled,
            serde_json::json!(["14px", "16px"]),
            "the page's stylesheet"
        );
        // An inline script and a style attribute injected into the page do not run; the browser reports both.
        browser.eval(INJECT);
        let injected = browser.eval_until(
            "[window.injectedRan === true, getComputedStyle(document.getElementById('injected')).color, window.violations]",
            Duration::from_secs(10),
            |state| state[2].as_array().is_some_and(|v| v.len() >= 2),
        );
        assert_eq!(
            injected[0], false,
            "an injected inline script ran: {injected}"
        );
        assert_ne!(
            injected[1], "rgb(255, 0, 0)",
            "an injected style attribute applied"
        );
        let violated = injected[2].as_array().cloned().unwrap_or_default();
        for directive in ["script-src", "style-src"] {
            assert!(
                violated
                    .iter()
                    .any(|v| v.as_str().is_some_and(|v| v.starts_with(directive))),
                "no {directive} violation reported: {injected}"
            );
        }
    });

    // The worker stops: the page shows the feed's end and its reason, and stays stopped rather than reconnecting.
    app.terminate();
    tokio::task::block_in_place(|| {
        let ended = browser.eval_until(
            "[document.body.dataset.ended, document.getElementById('status').dataset.state, document.getElementById('status').textContent]",
            Duration::from_secs(10),
            |state| state[0] == "shutting_down",
        );
        assert_eq!(
            ended[0], "shutting_down",
            "the page did not show the end: {ended}"
        );
        assert_eq!(ended[1], "ended");
        assert!(
            ended[2]
                .as_str()
                .is_some_and(|text| text.contains("shutting down")),
            "{ended}"
        );
        // Past the feed's reconnection delay, the page has not tried again (it would show an error: the worker is
        // gone). The scenario: an absence over the delay, which only the delay's passing shows.
        std::thread::sleep(Duration::from_millis(1_500));
        let later = browser.eval("document.getElementById('status').dataset.state");
        assert_eq!(later, "ended");
    });
}

/// Injected into the inspector page by the browser test: an inline script that would set `injectedRan`, and an
/// element with a style attribute that would make it red; `violations` collects the policy's reports.
const INJECT: &str = r#"(() => {
    window.violations = [];
    document.addEventListener('securitypolicyviolation', (e) => window.violations.push(e.effectiveDirective));
    const script = document.createElement('script');
    script.textContent = 'window.injectedRan = true;';
    document.body.append(script);
    const styled = document.createElement('p');
    styled.id = 'injected';
    styled.setAttribute('style', 'color: rgb(255, 0, 0)');
    styled.textContent = 'injected';
    document.body.append(styled);
    return true;
})()"#;

/// The inspector is off by default behind an API token, served with `HISTORY_VIEW_INSPECTOR=on`, and `explain`
/// answers only with the token, like every read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inspector_is_off_behind_a_token_unless_turned_on() {
    use crate::helpers::{BinaryApp, unique};
    use test_support::servers::{MongoServer, NatsServer};

    let (nats, mongo) = (NatsServer::start(), MongoServer::start());
    let env = |inspector: &str| {
        vec![
            ("HISTORY_VIEW_NATS_URL", nats.url()),
            ("HISTORY_VIEW_MONGODB_URI", mongo.uri()),
            ("HISTORY_VIEW_MONGODB_DATABASE", unique("inspect")),
            ("HISTORY_VIEW_API_TOKEN", "s3cret-token".to_owned()),
            ("HISTORY_VIEW_INSPECTOR", inspector.to_owned()),
        ]
    };
    let auto = BinaryApp::start(&env("auto")).await;
    assert_eq!(auto.api.get("/inspect/threads/t1", &[]).await.status, 404);
    let explained = explain(&auto.api, "t1", "").await;
    assert_eq!(explained.status, 401, "{}", explained.body);
    let authorized = auto
        .api
        .get(
            "/v1/threads/t1/history/explain",
            &[("Authorization", "Bearer s3cret-token")],
        )
        .await;
    assert_eq!(authorized.status, 200, "{}", authorized.body);
    assert_eq!(authorized.json()["events"], serde_json::json!([]));
    let waiting = auto
        .api
        .get(
            "/v1/threads/t1/history/explain?wait_for_run=r1",
            &[("Authorization", "Bearer s3cret-token")],
        )
        .await;
    assert_eq!(waiting.status, 400, "{}", waiting.body);

    let on = BinaryApp::start(&env("on")).await;
    let page = on.api.get("/inspect/threads/t1", &[]).await;
    assert_eq!(page.status, 200);
    assert!(
        page.body
            .contains("<title>chat-history-view inspector</title>")
    );
    // The page's own script and style are allowed by hash; nothing inline else.
    let policy = page.header("content-security-policy").unwrap_or_default();
    assert!(
        policy.contains("script-src 'sha256-") && policy.contains("style-src 'sha256-"),
        "{policy}"
    );
    assert!(!policy.contains("unsafe-inline"), "{policy}");
    assert_eq!(on.api.get("/inspect/threads/a.b", &[]).await.status, 400);
}

/// A storm of explains of a large thread held complete in memory ([design 3.3]): the fates come from memory (no
/// hydration), every explain in flight together shares one row scan, and a cold history read of another thread
/// during the storm is answered. Made deterministic by freezing the store: every explain has read its fates (the
/// read metric counts them) and waits for the one scan, which waits for the store, while the cold read takes the
/// slot the explain share leaves it; then the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_explains_shares_one_scan_and_leaves_cold_reads_answered() {
    use crate::helpers::{chunk_row, metric, user_row};
    use crate::scene::{Scene, now_ns, read_until_cache, wait_metric};

    const EXPLAINS: usize = 32;
    const EVENTS: i64 = 3_000;
    let scene = Scene::new().await;
    let thread = "explained-thread";
    let mut rows = vec![user_row(thread, "d1", "e0", now_ns(0), "Q")];
    rows.extend(
        (1..EVENTS).map(|i| chunk_row(thread, "d1", "A", &format!("e{i}"), now_ns(i), "x")),
    );
    scene.store.insert_rows(&rows).await;
    let cold = "cold-thread";
    scene
        .store
        .insert_rows(&[user_row(cold, "d1", "e1", now_ns(0), "cold question")])
        .await;
    // Two slots: the explain share is one, the other stays for history reads. The store timeout outlasts the
    // freeze, so the frozen store is no outage.
    let app = scene
        .worker(
            scene.nats.url(),
            &[
                ("HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS", "2"),
                ("HISTORY_VIEW_STORE_TIMEOUT_MS", "20000"),
            ],
        )
        .await;
    read_until_cache(&app.api, thread, "").await;
    let cache_reads = "history_view_read_duration_seconds_count{source=\"cache\"}";
    let queries = |kind: &str| format!("history_view_store_queries_total{{kind=\"{kind}\"}}");
    let before = app.api.metrics().await;

    scene.mongo.pause();
    let explains: Vec<_> = (0..EXPLAINS)
        .map(|_| {
            let api = app.api.clone();
            tokio::spawn(async move { explain(&api, thread, "").await })
        })
        .collect();
    wait_metric(
        &app.api,
        cache_reads,
        metric(&before, cache_reads) + EXPLAINS as f64,
    )
    .await;
    let cold_read = {
        let api = app.api.clone();
        tokio::spawn(async move { api.history(cold, "").await })
    };
    // The cold read has missed the cache and gone for the store, frozen too, while every explain waits.
    let misses = "history_view_cache_misses_total";
    wait_metric(&app.api, misses, metric(&before, misses) + 1.0).await;
    assert!(explains.iter().all(|explained| !explained.is_finished()));
    scene.mongo.resume();

    let cold_reply = cold_read.await.unwrap();
    assert_eq!(cold_reply.status, 200, "{}", cold_reply.body);
    assert_eq!(cold_reply.source(), Some("store"));
    assert!(cold_reply.body.contains("cold question"));
    let mut bodies = HashSet::new();
    for explained in explains {
        let reply = explained.await.unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.source(), Some("cache"));
        let json = reply.json();
        assert_eq!(
            json["events"].as_array().map(Vec::len),
            Some(EVENTS as usize)
        );
        assert_eq!(json["counts"]["not_in_view"], 0);
        bodies.insert(reply.body);
    }
    assert_eq!(bodies.len(), 1, "every explain answered the same");
    let after = app.api.metrics().await;
    let delta = |name: &str| metric(&after, name) - metric(&before, name);
    assert_eq!(
        delta(&queries("explain")),
        1.0,
        "one scan for every explain"
    );
    assert_eq!(
        delta(&queries("hydration_markers")),
        1.0,
        "only the cold read hydrated"
    );
    assert_eq!(delta("history_view_hydration_slot_timeouts_total"), 0.0);

    // Explains one after another each scan again (the rows are never reused), and still hydrate nothing.
    for _ in 0..2 {
        assert_eq!(explain(&app.api, thread, "").await.status, 200);
    }
    let last = app.api.metrics().await;
    assert_eq!(
        metric(&last, &queries("explain")) - metric(&after, &queries("explain")),
        2.0
    );
    assert_eq!(
        metric(&last, &queries("hydration_markers")),
        metric(&after, &queries("hydration_markers"))
    );
}
