//! The promise's oracle (`test_support::promise`) held to account: the judge passes what keeps the promise and
//! flags what breaks it, on constructed answers and on a real worker's stale answer (the negative control: a row
//! stored without ever being published is one the worker cannot know, so its answer from memory past the bound
//! lacks it); and `eventually` waits on state and fails at its limit with the last state seen.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use test_support::promise::{Answer, Kind, Ledger, Source, Target, judge, read_history, settle};
use test_support::wait::{eventually, eventually_within};

use crate::helpers::{Api, chunk_row, publish_rows, user_row};
use crate::scene::{Scene, now_ns};

/// The oracle's view of a test's [`Api`].
pub fn target(api: &Api) -> Target {
    Target::new(api.address.clone(), api.http.clone())
}

/// The user turn opening `thread` (token `[q]`).
pub fn question(thread: &str) -> Value {
    user_row(thread, "d1", "e1", now_ns(0), "[q]Q")
}

/// Stores `thread`'s question (the ledger) and reads until the worker behind `api` serves it from memory.
pub async fn warm(scene: &Scene, ledger: &Ledger, api: &Api, thread: &str) {
    ledger
        .store(&scene.store.events(), &[question(thread)])
        .await;
    settled(ledger, api, thread).await;
}

/// Reads until memory answers the reference, every answer judged.
pub async fn settled(ledger: &Ledger, api: &Api, thread: &str) {
    settle(
        &target(api),
        thread,
        &Kind::History(None),
        ledger,
        Duration::from_secs(20),
    )
    .await
    .unwrap_or_else(|failure| panic!("{failure}"));
}

/// Publishes `rows` (the ledger knows).
pub async fn publish(scene: &Scene, ledger: &Ledger, rows: &[Value]) {
    ledger.published(rows);
    publish_rows(&scene.publisher, rows).await;
}

/// A thread's question and first chunk, each with a token.
fn rows(thread: &str) -> [Value; 2] {
    [
        user_row(thread, "d1", "q", now_ns(0), "[q]what?"),
        chunk_row(thread, "d1", "A", "c1", now_ns(1), "[c1]this"),
    ]
}

fn answer<'a>(
    thread: &'a str,
    started: Instant,
    source: Source,
    messages: &'a Value,
) -> Answer<'a> {
    Answer {
        thread,
        identity: None,
        started,
        status: 200,
        source: Some(source),
        messages,
        body: "",
    }
}

#[test]
fn the_judge_flags_an_answer_from_memory_lacking_a_row_stored_past_the_bound_and_passes_the_rest() {
    let thread = "judged";
    let ledger = Ledger::new(Duration::from_millis(200));
    let [question, chunk] = rows(thread);
    let long_ago = Instant::now() - Duration::from_secs(10);
    ledger.stored(std::slice::from_ref(&question), long_ago, false);
    let now = Instant::now();
    ledger.stored(
        std::slice::from_ref(&chunk),
        now - Duration::from_millis(100),
        false,
    );
    let asked = json!([{"role": "user", "content": [{"type": "text", "text": "[q]what?"}]}]);
    let stale = json!([]);

    // Within the bound of the chunk: an answer without it keeps the promise; one without the question does not.
    assert!(
        judge(&ledger, &answer(thread, now, Source::Memory, &asked))
            .violations
            .is_empty()
    );
    let verdict = judge(&ledger, &answer(thread, now, Source::Memory, &stale));
    assert_eq!(verdict.violations.len(), 1, "{verdict:?}");
    assert!(verdict.violations[0].contains("lacks [q]"), "{verdict:?}");

    // Past the bound of the chunk, from memory: it must be there, and, the thread quiet, the answer whole.
    let later = now + Duration::from_millis(400);
    let verdict = judge(&ledger, &answer(thread, later, Source::Memory, &asked));
    assert!(verdict.violations[0].contains("lacks [c1]"), "{verdict:?}");
    let reference = ledger.reference(thread, None);
    let whole = judge(&ledger, &answer(thread, later, Source::Memory, &reference));
    assert!(whole.violations.is_empty(), "{whole:?}");
    assert_eq!(whole.whole, 1);
    let mut reordered = reference.clone();
    reordered.as_array_mut().unwrap().reverse();
    let verdict = judge(&ledger, &answer(thread, later, Source::Memory, &reordered));
    assert!(
        verdict.violations[0].contains("differs from the reference"),
        "{verdict:?}"
    );

    // From the store, the store timeout (2 s) is the bound: a read may share one in flight.
    assert!(
        judge(&ledger, &answer(thread, later, Source::Store, &asked))
            .violations
            .is_empty()
    );

    // A row committed late (the persister broke the assumption) is not required, and its thread never compared
    // whole; a row published but not stored keeps the thread from being compared whole too.
    let late = chunk_row(thread, "d1", "A", "c2", now_ns(2), "[c2]late");
    ledger.stored(
        std::slice::from_ref(&late),
        now - Duration::from_secs(5),
        true,
    );
    let verdict = judge(&ledger, &answer(thread, later, Source::Memory, &reference));
    assert!(
        verdict.violations.is_empty() && verdict.whole == 0,
        "{verdict:?}"
    );

    // Not a 200, or no source named: a violation; a 503 store_unavailable: counted apart.
    let failed = Answer {
        status: 500,
        ..answer(thread, later, Source::Memory, &reference)
    };
    assert_eq!(judge(&ledger, &failed).violations.len(), 1);
    let unavailable = Answer {
        status: 503,
        source: None,
        body: r#"{"error":{"code":"store_unavailable"}}"#,
        ..answer(thread, later, Source::Memory, &reference)
    };
    let verdict = judge(&ledger, &unavailable);
    assert_eq!((verdict.unavailable, verdict.violations.len()), (1, 0));
}

#[test]
fn a_row_the_reference_leaves_out_is_not_required() {
    let thread = "judged-hidden";
    let ledger = Ledger::new(Duration::from_millis(200));
    let [question, _] = rows(thread);
    // A chunk on a display no marker made visible: no answer shows it.
    let hidden = chunk_row(thread, "hidden", "A", "h1", now_ns(1), "[h1]hidden");
    ledger.stored(
        &[question, hidden],
        Instant::now() - Duration::from_secs(10),
        false,
    );
    let reference = ledger.reference(thread, None);
    assert!(!reference.to_string().contains("[h1]"), "{reference}");
    let verdict = judge(
        &ledger,
        &answer(thread, Instant::now(), Source::Memory, &reference),
    );
    assert!(verdict.violations.is_empty(), "{verdict:?}");
}

/// The negative control on a real worker: a row stored but never published is one the worker cannot know (the
/// promise assumes the persister writes what was published), so past the bound its answer from memory is stale,
/// and the judge must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_judge_flags_a_real_workers_stale_answer() {
    let scene = Scene::new().await;
    // No shadow check may heal the view while the test waits.
    let app = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_SHADOW_SAMPLE", "0")])
        .await;
    let target = target(&app.api);
    let thread = "t-stale-control";
    let ledger = Ledger::new(Duration::from_millis(2_000));
    let [question, chunk] = rows(thread);
    ledger
        .store_and_publish(&scene.store.events(), &scene.publisher, &[question])
        .await;
    settle(
        &target,
        thread,
        &Kind::History(None),
        &ledger,
        Duration::from_secs(20),
    )
    .await
    .expect("the question settles");

    ledger
        .store(&scene.store.events(), std::slice::from_ref(&chunk))
        .await;
    let stored = Instant::now();
    let stale = eventually("a read past the bound answered from memory", || async {
        let read = read_history(&target, thread, None, &ledger).await;
        if read.source == Some(Source::Memory) && stored.elapsed() > ledger.lag {
            Ok((read.report, read.body))
        } else {
            Err(format!("{:?} {}", read.source, read.body))
        }
    })
    .await;
    let (verdict, body) = stale;
    assert!(
        !body.contains("[c1]"),
        "the worker found the unpublished row: {body}"
    );
    assert_eq!(verdict.violations.len(), 1, "{verdict:?}");
    assert!(verdict.violations[0].contains("lacks [c1]"), "{verdict:?}");
}

#[tokio::test]
async fn eventually_returns_the_first_ok_and_polls_until_then() {
    let polls = AtomicUsize::new(0);
    let value = eventually("the third poll", || async {
        let n = polls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 3 {
            Ok(n)
        } else {
            Err(format!("poll {n}"))
        }
    })
    .await;
    assert_eq!(value, 3);
}

#[tokio::test]
#[should_panic(expected = "never: not within")]
async fn eventually_fails_at_its_limit_with_the_last_state() {
    eventually_within("never", Duration::from_millis(50), || async {
        Err::<(), _>("still false".to_owned())
    })
    .await;
}
