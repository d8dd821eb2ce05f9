//! [`FeedClient`]: the live feed (`history/stream`) read as a client does (eventsource-stream over reqwest), its
//! transcript rebuilt from every `snapshot` and `update`, and, when a [`Ledger`] is given, the transcript after
//! every event judged as an answer.
//!
//! A task of its own reads the events as they come and stamps each with its arrival, so an event is judged
//! against when it was sent, not when the test got round to applying it. A feed's event does not say whether it
//! came from memory or the store ([`Source::Either`]), and its read happened before its arrival: the judge
//! allows [`TRANSIT`] (scaled) on top of the bound.

use std::time::{Duration, Instant};

use eventsource_stream::{Event, Eventsource};
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::mpsc;

use super::{Answer, Ledger, Report, Source, Target, judge};
use crate::wait::scaled;

/// How long an event may take from the worker's read to its arrival here, beyond the bound.
pub const TRANSIT: Duration = Duration::from_millis(500);

/// What judges a feed's transcripts.
struct Judged {
    ledger: Ledger,
    identity: Option<(String, String)>,
}

/// An open feed and the transcript its events build.
pub struct FeedClient {
    thread: String,
    events: mpsc::UnboundedReceiver<(Instant, Result<Event, String>)>,
    reading: tokio::task::JoinHandle<()>,
    /// The messages as the events so far make them.
    pub messages: Vec<Value>,
    /// The id of the last event.
    pub last_id: String,
    /// The kinds of the events received, in order.
    pub kinds: Vec<String>,
    /// The data of the feed's `end` event, once it came (the history's error body).
    pub ended: Option<Value>,
    /// The transcript after each event, in order.
    pub transcripts: Vec<Value>,
    judged: Option<Judged>,
    /// Every transcript judged so far (when judged).
    pub report: Report,
}

impl FeedClient {
    /// Opens the feed of `thread` with `query`, resuming after `last_id` when given; panics unless it answers 200
    /// `text/event-stream` with `Cache-Control: no-store`.
    ///
    /// # Panics
    /// When the feed does not answer so.
    pub async fn open(target: &Target, thread: &str, query: &str, last_id: Option<&str>) -> Self {
        let mut request = target.http.get(format!(
            "{}/v1/threads/{}/history/stream?{query}",
            target.address,
            super::readers::encode(thread)
        ));
        if let Some(id) = last_id {
            request = request.header("last-event-id", id);
        }
        let response = request.send().await.expect("the feed answers");
        assert_eq!(response.status(), 200, "the feed of {thread}");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        assert_eq!(response.headers()["cache-control"], "no-store");
        let mut stream = response.bytes_stream().eventsource();
        let (sender, events) = mpsc::unbounded_channel();
        let reading = tokio::spawn(async move {
            while let Some(event) = stream.next().await {
                let event = event.map_err(|e| e.to_string());
                if sender.send((Instant::now(), event)).is_err() {
                    return;
                }
            }
        });
        Self {
            thread: thread.to_owned(),
            events,
            reading,
            messages: Vec::new(),
            last_id: last_id.unwrap_or_default().to_owned(),
            kinds: Vec::new(),
            ended: None,
            transcripts: Vec::new(),
            judged: None,
            report: Report::default(),
        }
    }

    /// Judges the transcript after every event from now on against `ledger`, for reads with `identity`.
    pub fn judged(mut self, ledger: &Ledger, identity: Option<(&str, &str)>) -> Self {
        self.judged = Some(Judged {
            ledger: ledger.clone(),
            identity: identity.map(|(c, i)| (c.to_owned(), i.to_owned())),
        });
        self
    }

    /// The transcript as a JSON array.
    pub fn transcript(&self) -> Value {
        Value::Array(self.messages.clone())
    }

    /// Applies the next event (within `limit`); `false` when none came or the feed ended.
    pub async fn apply_next(&mut self, limit: Duration) -> bool {
        let Ok(Some((arrived, Ok(event)))) = tokio::time::timeout(limit, self.events.recv()).await
        else {
            return false;
        };
        self.apply(arrived, event);
        true
    }

    /// Applies `event` to the transcript (an `end` to [`FeedClient::ended`]) and judges the transcript; panics on
    /// an event after the `end`.
    fn apply(&mut self, arrived: Instant, event: Event) {
        assert_eq!(self.ended, None, "an event after the end: {event:?}");
        let data: Value = serde_json::from_str(&event.data).expect("an event's data is JSON");
        match event.event.as_str() {
            "end" => {
                // The end names no answer: the client resumes after the last one it applied.
                assert_eq!(event.id, self.last_id, "the end carries no id of its own");
                self.ended = Some(data);
                self.kinds.push(event.event);
                return;
            }
            "snapshot" => self.messages = data["messages"].as_array().expect("messages").clone(),
            "update" => {
                let from = data["from"].as_u64().expect("from") as usize;
                assert!(from <= self.messages.len(), "an update from past the end");
                self.messages.truncate(from);
                self.messages.extend(
                    data["messages"]
                        .as_array()
                        .expect("messages")
                        .iter()
                        .cloned(),
                );
            }
            other => panic!("unexpected event {other}"),
        }
        self.last_id = event.id;
        self.kinds.push(event.event);
        let transcript = self.transcript();
        self.transcripts.push(transcript.clone());
        if let Some(judged) = &self.judged {
            let identity = judged
                .identity
                .as_ref()
                .map(|(c, i)| (c.as_str(), i.as_str()));
            let started = arrived.checked_sub(scaled(TRANSIT)).unwrap_or(arrived);
            let verdict = judge(
                &judged.ledger,
                &Answer {
                    thread: &self.thread,
                    identity,
                    started,
                    status: 200,
                    source: Some(Source::Either),
                    messages: &transcript,
                    body: &data.to_string(),
                },
            );
            self.report.add(verdict);
        }
    }

    /// Applies events until the transcript equals `expected` (within `limit`, scaled); the transcript either way.
    pub async fn until(&mut self, expected: &Value, limit: Duration) -> Value {
        let deadline = Instant::now() + scaled(limit);
        while self.transcript() != *expected {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || !self.apply_next(left).await {
                break;
            }
        }
        self.transcript()
    }

    /// Applies events until the transcript equals the ledger's reference, then asserts that every transcript kept
    /// the promise.
    ///
    /// # Panics
    /// When the feed is not judged, the transcript does not reach the reference within `limit` (scaled), or a
    /// transcript broke the promise.
    pub async fn until_reference(&mut self, limit: Duration) {
        let judged = self.judged.as_ref().expect("a judged feed");
        let identity = judged
            .identity
            .as_ref()
            .map(|(c, i)| (c.as_str(), i.as_str()));
        let reference = judged.ledger.reference(&self.thread, identity);
        let got = self.until(&reference, limit).await;
        assert_eq!(
            got, reference,
            "{}: the feed's transcript ({:?})",
            self.thread, self.kinds
        );
        self.report
            .assert_kept(&format!("the feed of {}", self.thread));
    }

    /// Whether the feed ends (the body closes) within `limit` (scaled), applying what comes before.
    pub async fn ends_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + scaled(limit);
        loop {
            match tokio::time::timeout_at(deadline.into(), self.events.recv()).await {
                Err(_) => return false,
                Ok(None) | Ok(Some((_, Err(_)))) => return true,
                Ok(Some((arrived, Ok(event)))) => self.apply(arrived, event),
            }
        }
    }

    /// The code of the feed's `end` event, if it came.
    pub fn end_code(&self) -> Option<&str> {
        self.ended.as_ref()?["error"]["code"].as_str()
    }
}

impl Drop for FeedClient {
    /// Closes the connection: the reading task owns it.
    fn drop(&mut self) {
        self.reading.abort();
    }
}
