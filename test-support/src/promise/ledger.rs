//! [`Ledger`]: every row a scenario stored, per thread, with the instant its insert returned (the latest it can
//! have been stored: the promise is checked against that, never against an earlier instant), and the rows it
//! published, so the judge knows when a thread's answer must equal the reference whole.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::Document;
use serde_json::Value;

use crate::reference;
use crate::rows;

/// One stored row, its token and when its insert returned.
struct Stored {
    row: Value,
    token: Option<String>,
    at: Instant,
    /// Committed beyond the bound after its `created_at` (a persister that broke the worker's assumption): not
    /// judged by token, and its thread is never compared whole.
    late: bool,
}

#[derive(Default)]
struct Thread {
    stored: Vec<Stored>,
    /// The subjects (full delivery keys) of the rows stored and of the rows published.
    stored_keys: HashSet<String>,
    published_keys: HashSet<String>,
    /// The latest store or publication.
    last: Option<Instant>,
}

/// What a scenario stored and published, shared by its writers and readers (a cheap clone).
#[derive(Clone)]
pub struct Ledger {
    threads: Arc<Mutex<HashMap<String, Thread>>>,
    /// The persister-lag bound of the workers read (the promise is stated in it).
    pub lag: Duration,
    /// The workers' store timeout: a read joins a store read in flight started at most this long before it.
    pub store_timeout: Duration,
}

impl Ledger {
    /// A ledger for workers with persister-lag bound `lag` and the default store timeout (2 s).
    pub fn new(lag: Duration) -> Self {
        Self {
            threads: Arc::default(),
            lag,
            store_timeout: Duration::from_secs(2),
        }
    }

    /// The worker setting of the bound (`HISTORY_VIEW_PERSIST_LAG_MS`).
    pub fn lag_setting(&self) -> String {
        self.lag.as_millis().to_string()
    }

    /// Inserts `rows` (in order) into `events` and records them as stored when the insert returned.
    ///
    /// # Panics
    /// When the insert fails.
    pub async fn store(&self, events: &mongodb::Collection<Document>, rows: &[Value]) {
        if rows.is_empty() {
            return;
        }
        let documents: Vec<Document> = rows.iter().map(rows::document).collect();
        events.insert_many(documents).await.expect("insert rows");
        self.stored(rows, Instant::now(), false);
    }

    /// Records `rows` as stored at `at` (by a persister of the test's own); `late` when it committed them beyond
    /// the bound after their `created_at`.
    pub fn stored(&self, rows: &[Value], at: Instant, late: bool) {
        let mut threads = self.threads.lock().unwrap();
        for row in rows {
            let thread = threads.entry(thread_of(row)).or_default();
            thread.stored_keys.insert(rows::subject(row));
            thread.last = thread.last.max(Some(at));
            thread.stored.push(Stored {
                token: token(row),
                row: row.clone(),
                at,
                late,
            });
        }
    }

    /// Records `rows` as published now.
    pub fn published(&self, rows: &[Value]) {
        let now = Instant::now();
        let mut threads = self.threads.lock().unwrap();
        for row in rows {
            let thread = threads.entry(thread_of(row)).or_default();
            thread.published_keys.insert(rows::subject(row));
            thread.last = thread.last.max(Some(now));
        }
    }

    /// Stores `rows` and publishes them on Core NATS, as aihub's persister and agents do (stored first: the
    /// persister writes within the bound, and a read may see a row in the store before it arrives).
    pub async fn store_and_publish(
        &self,
        events: &mongodb::Collection<Document>,
        client: &async_nats::Client,
        rows: &[Value],
    ) {
        self.store(events, rows).await;
        self.published(rows);
        rows::publish(client, rows).await;
    }

    /// Every row stored of `thread`, in store order.
    pub fn rows(&self, thread: &str) -> Vec<Value> {
        self.threads
            .lock()
            .unwrap()
            .get(thread)
            .map(|t| t.stored.iter().map(|s| s.row.clone()).collect())
            .unwrap_or_default()
    }

    /// The messages `thread` must read as, with the `identity` of the read: the reference over its stored rows.
    pub fn reference(&self, thread: &str, identity: Option<(&str, &str)>) -> Value {
        reference::history(thread, &self.rows(thread), identity).messages
    }

    /// The history body `thread` must read as (`{"thread_id", "messages"}`, serialized as the worker does).
    pub fn reference_body(&self, thread: &str, identity: Option<(&str, &str)>) -> String {
        let body =
            serde_json::json!({"thread_id": thread, "messages": self.reference(thread, identity)});
        serde_json::to_string(&body).expect("serializes")
    }

    /// The tokens an answer to a read with `identity` that started after `cutoff` must show: those of the rows
    /// stored before `cutoff` (not late) that the reference over those rows shows. A row the reference leaves out
    /// (a hidden display, a malformed event, a duplicate) is not required; later rows only ever add to an answer.
    pub fn required(
        &self,
        thread: &str,
        identity: Option<(&str, &str)>,
        cutoff: Instant,
    ) -> Vec<(String, Duration)> {
        let threads = self.threads.lock().unwrap();
        let Some(stored) = threads.get(thread).map(|t| &t.stored) else {
            return Vec::new();
        };
        let old: Vec<&Stored> = stored.iter().filter(|s| s.at < cutoff).collect();
        let rows: Vec<Value> = old.iter().map(|s| s.row.clone()).collect();
        let shown = reference::history(thread, &rows, identity)
            .messages
            .to_string();
        old.iter()
            .filter(|s| !s.late)
            .filter_map(|s| s.token.clone().map(|token| (token, cutoff - s.at)))
            .filter(|(token, _)| shown.contains(token.as_str()))
            .collect()
    }

    /// Whether `thread` was quiet before `cutoff`: every row published was stored, none late, and nothing was
    /// stored or published since `cutoff`. An answer to a read started after it must equal the reference whole.
    pub fn quiet_before(&self, thread: &str, cutoff: Instant) -> bool {
        self.threads.lock().unwrap().get(thread).is_some_and(|t| {
            t.last.is_some_and(|last| last < cutoff)
                && t.published_keys.is_subset(&t.stored_keys)
                && t.stored.iter().all(|s| !s.late)
        })
    }
}

fn thread_of(row: &Value) -> String {
    row["thread_id"]
        .as_str()
        .expect("a row names its thread")
        .to_owned()
}

/// The bracketed start of a row's text (`[c12]` of `[c12]xxx`): a chunk's content, a user message's last text, a
/// HITL question or answer. `None` when the text has none.
pub fn token(row: &Value) -> Option<String> {
    let data = &row["event_data"];
    let text = [
        &data["content"],
        &data["question"],
        &data["response"],
        data["messages"]
            .as_array()
            .and_then(|m| m.last())
            .map_or(&Value::Null, |m| &m["blocks"][0]["text"]),
    ]
    .into_iter()
    .find_map(Value::as_str)?;
    let end = text.find(']')?;
    text.starts_with('[').then(|| text[..=end].to_owned())
}
