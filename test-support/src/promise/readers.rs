//! Reads judged against a [`Ledger`]: one read of the history ([`read_history`], with or without an identity) or
//! of the Conversations items, paged as a client pages them ([`read_items`]); [`settle`], reading until memory
//! answers the reference; and [`Reader`], which keeps reading a thread all through a scenario.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chat_history_view::http::SOURCE_HEADER;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::{Answer, Ledger, Report, Source, judge};
use crate::wait::scaled;

/// A worker's HTTP address and the client that reads it.
#[derive(Clone)]
pub struct Target {
    pub address: String,
    pub http: reqwest::Client,
}

impl Target {
    pub fn new(address: impl Into<String>, http: reqwest::Client) -> Self {
        Self {
            address: address.into(),
            http,
        }
    }
}

/// What a read reads.
#[derive(Clone, Debug)]
pub enum Kind {
    /// `GET /v1/threads/{thread}/history`, with the identity `(agent_class, agent_id)` when given.
    History(Option<(String, String)>),
    /// `GET /v1/conversations/{thread}/items`, paged by `limit` in ascending order, turned back into history
    /// messages, with the identity when given.
    Items(Option<(String, String)>, usize),
}

impl Kind {
    fn identity(&self) -> Option<(&str, &str)> {
        match self {
            Self::History(identity) | Self::Items(identity, _) => {
                identity.as_ref().map(|(c, i)| (c.as_str(), i.as_str()))
            }
        }
    }
}

/// Percent-encodes a path segment.
pub fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn identity_query(identity: Option<(&str, &str)>) -> String {
    identity.map_or_else(String::new, |(class, id)| {
        format!("agent_class={}&agent_id={}", encode(class), encode(id))
    })
}

/// One GET: status, source, body; `Err` when no answer came.
async fn get(target: &Target, path: &str) -> Result<(u16, Option<String>, String), String> {
    let response = target
        .http
        .get(format!("{}{path}", target.address))
        .timeout(scaled(Duration::from_secs(60)))
        .send()
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    let status = response.status().as_u16();
    let source = response
        .headers()
        .get(SOURCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = response
        .text()
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    Ok((status, source, body))
}

/// One read's answer and its judgement.
pub struct Read {
    pub report: Report,
    /// The answer's status (0 when none came).
    pub status: u16,
    pub body: String,
    pub source: Option<Source>,
}

/// Reads `thread`'s history with `identity` through `target` and judges the answer.
pub async fn read_history(
    target: &Target,
    thread: &str,
    identity: Option<(&str, &str)>,
    ledger: &Ledger,
) -> Read {
    let started = Instant::now();
    let path = format!(
        "/v1/threads/{}/history?{}",
        encode(thread),
        identity_query(identity)
    );
    match get(target, &path).await {
        Ok((status, source, body)) => {
            let source = Source::from_header(source.as_deref());
            let messages = serde_json::from_str::<Value>(&body)
                .map(|body| body["messages"].clone())
                .unwrap_or(Value::Null);
            let answer = Answer {
                thread,
                identity,
                started,
                status,
                source,
                messages: &messages,
                body: &body,
            };
            Read {
                report: judge(ledger, &answer),
                status,
                body,
                source,
            }
        }
        Err(error) => Read {
            report: Report::failed(format!("{thread}: {error}")),
            status: 0,
            body: String::new(),
            source: None,
        },
    }
}

/// Reads every item of `thread`'s conversation with `identity`, `limit` a page in ascending order with `after`
/// as a client pages, turns them back into history messages and judges them as one answer that started with the
/// first page (from memory only when every page said so). Returns the messages too.
pub async fn read_items(
    target: &Target,
    thread: &str,
    identity: Option<(&str, &str)>,
    limit: usize,
    ledger: &Ledger,
) -> (Report, Value) {
    let started = Instant::now();
    let mut items: Vec<Value> = Vec::new();
    let mut sources = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/conversations/{}/items?order=asc&limit={limit}&{}",
            encode(thread),
            identity_query(identity)
        );
        if let Some(after) = &after {
            path.push_str(&format!("&after={after}"));
        }
        let (status, source, body) = match get(target, &path).await {
            Ok(answer) => answer,
            Err(error) => return (Report::failed(format!("{thread}: {error}")), Value::Null),
        };
        if status != 200 {
            let answer = Answer {
                thread,
                identity,
                started,
                status,
                source: Source::from_header(source.as_deref()),
                messages: &Value::Null,
                body: &body,
            };
            return (judge(ledger, &answer), Value::Null);
        }
        sources.push(Source::from_header(source.as_deref()));
        let page: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        let data = page["data"].as_array().cloned().unwrap_or_default();
        if page["object"] != "list" || data.len() > limit {
            let violation = format!("{thread}: {path}: not a page of at most {limit}: {body}");
            return (Report::failed(violation), Value::Null);
        }
        items.extend(data);
        if page["has_more"] != true {
            break;
        }
        after = page["last_id"].as_str().map(str::to_owned);
    }
    let source = if sources.iter().all(|s| *s == Some(Source::Memory)) {
        Some(Source::Memory)
    } else if sources.iter().all(Option::is_some) {
        Some(Source::Either)
    } else {
        None
    };
    let messages = Value::Array(items.iter().map(item_to_message).collect());
    let answer = Answer {
        thread,
        identity,
        started,
        status: 200,
        source,
        messages: &messages,
        body: "(items)",
    };
    (judge(ledger, &answer), messages)
}

/// A Conversations item as the history message it renders: `input_text`/`output_text` as `text`, `input_image` as
/// `image_url`, an audio `input_file` (a `data:audio/<format>;base64,` URL) as `input_audio`.
pub fn item_to_message(item: &Value) -> Value {
    let content: Vec<Value> = item["content"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|part| match part["type"].as_str().unwrap_or_default() {
            "input_text" | "output_text" => json!({"type": "text", "text": part["text"]}),
            "input_image" => json!({"type": "image_url", "image_url": {"url": part["image_url"]}}),
            "input_file" => {
                let data = part["file_data"].as_str().unwrap_or_default();
                let (format, data) = data
                    .strip_prefix("data:audio/")
                    .and_then(|rest| rest.split_once(";base64,"))
                    .unwrap_or(("?", data));
                json!({"type": "input_audio", "input_audio": {"data": data, "format": format}})
            }
            other => json!({"type": format!("unexpected {other}")}),
        })
        .collect();
    json!({"role": item["role"], "content": content})
}

/// Reads `thread` (as `kind` says) through `target` until memory answers it equal to the reference, judging every
/// answer on the way; returns the tally, or what went wrong: an answer that broke the promise, or no answer from
/// memory equal to the reference within `limit` (scaled).
pub async fn settle(
    target: &Target,
    thread: &str,
    kind: &Kind,
    ledger: &Ledger,
    limit: Duration,
) -> Result<Report, String> {
    let limit = scaled(limit);
    let begun = Instant::now();
    let mut report = Report::default();
    loop {
        let (judged, messages, source) = read(target, thread, kind, ledger).await;
        report.add(judged);
        if !report.violations.is_empty() {
            return Err(format!(
                "settling {thread}: {}",
                report.violations.join("\n")
            ));
        }
        let reference = ledger.reference(thread, kind.identity());
        if source == Some(Source::Memory) && messages == reference {
            return Ok(report);
        }
        if begun.elapsed() > limit {
            return Err(format!(
                "{thread} never served from memory equal to the reference within {limit:?}:\n got ({source:?}) {messages}\nwant {reference}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One read of `kind`, judged: the tally, the messages and the source.
async fn read(
    target: &Target,
    thread: &str,
    kind: &Kind,
    ledger: &Ledger,
) -> (Report, Value, Option<Source>) {
    match kind {
        Kind::History(_) => {
            let read = read_history(target, thread, kind.identity(), ledger).await;
            let messages = serde_json::from_str::<Value>(&read.body)
                .map(|body| body["messages"].clone())
                .unwrap_or(Value::Null);
            (read.report, messages, read.source)
        }
        Kind::Items(_, limit) => {
            let (report, messages) =
                read_items(target, thread, kind.identity(), *limit, ledger).await;
            let source = (report.cache == 1).then_some(Source::Memory);
            (report, messages, source)
        }
    }
}

/// How often a reader starts a read. While more than [`FEW_IN_FLIGHT`] of its reads wait (on a frozen worker), it
/// starts one every [`READ_EVERY_WAITING`] only, up to [`MAX_IN_FLIGHT`]: reads started all through a freeze wait
/// for the worker's first answers when it wakes up.
const READ_EVERY: Duration = Duration::from_millis(50);
const FEW_IN_FLIGHT: usize = 4;
const READ_EVERY_WAITING: Duration = Duration::from_millis(250);
const MAX_IN_FLIGHT: usize = 120;

/// Keeps reading a thread (every [`READ_EVERY`], through its targets in turn, at most [`MAX_IN_FLIGHT`] reads
/// waiting) and judges every answer, until [`Reader::finish`].
pub struct Reader {
    thread: String,
    running: Arc<AtomicBool>,
    latest: Arc<Mutex<Option<Instant>>>,
    task: tokio::task::JoinHandle<Report>,
}

impl Reader {
    /// Starts reading `thread` as `kind` says through `targets` in turn.
    pub fn start(targets: Vec<Target>, thread: &str, kind: Kind, ledger: &Ledger) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let latest = Arc::new(Mutex::new(None));
        let task = {
            let (running, latest, thread, ledger) = (
                running.clone(),
                latest.clone(),
                thread.to_owned(),
                ledger.clone(),
            );
            tokio::spawn(async move {
                let mut reads = JoinSet::new();
                let mut report = Report::default();
                let mut tick = tokio::time::interval(READ_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut turn = 0usize;
                let mut last = Instant::now();
                while running.load(Ordering::SeqCst) {
                    tick.tick().await;
                    while let Some(done) = reads.try_join_next() {
                        report.add(done.expect("a read"));
                    }
                    let due = reads.len() < FEW_IN_FLIGHT
                        || (reads.len() < MAX_IN_FLIGHT && last.elapsed() >= READ_EVERY_WAITING);
                    if due {
                        let target = targets[turn % targets.len()].clone();
                        turn += 1;
                        last = Instant::now();
                        *latest.lock().unwrap() = Some(last);
                        let (thread, ledger, kind) = (thread.clone(), ledger.clone(), kind.clone());
                        reads.spawn(async move { read(&target, &thread, &kind, &ledger).await.0 });
                    }
                }
                while let Some(done) = reads.join_next().await {
                    report.add(done.expect("a read"));
                }
                report
            })
        };
        Self {
            thread: thread.to_owned(),
            running,
            latest,
            task,
        }
    }

    /// Waits until a read started after `instant` (a frozen worker's reads wait, so they are what it answers on
    /// waking up).
    ///
    /// # Panics
    /// When the reader stopped reading.
    pub async fn wait_started_after(&self, instant: Instant) {
        let limit = instant.saturating_duration_since(Instant::now()) + Duration::from_secs(30);
        crate::wait::eventually_within(
            &format!("{}: a read started", self.thread),
            limit,
            || async {
                let latest = *self.latest.lock().unwrap();
                match latest {
                    Some(latest) if latest > instant => Ok(()),
                    other => Err(format!("the latest read started at {other:?}")),
                }
            },
        )
        .await;
    }

    /// Reads on for a second after the fault has settled (still complete), then [`Reader::finish`].
    pub async fn read_on_then_finish(self) -> Report {
        self.wait_started_after(Instant::now() + Duration::from_secs(1))
            .await;
        self.finish().await
    }

    /// Stops reading, waits for the reads still waiting, and asserts that every answer kept the promise.
    ///
    /// # Panics
    /// When an answer broke the promise, or no read was made.
    pub async fn finish(self) -> Report {
        self.running.store(false, Ordering::SeqCst);
        let report = self.task.await.expect("the reader");
        report.assert_kept(&format!("reader of {}", self.thread));
        assert!(report.reads > 0, "{}: no read", self.thread);
        report
    }
}
