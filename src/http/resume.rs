//! A running answer resumed in the Vercel AI SDK's dialect ([design 3.5](../../docs/design.md#3.5)), from the run
//! model ([`crate::run`], rendered by the cache as [`RunView`]):
//!
//! - `GET /v1/threads/{thread_id}/ui-message-stream`: the thread's resumable message (its latest run running,
//!   awaiting input or stalled) as a UI message stream (`x-vercel-ai-ui-message-stream: v1`): replayed from its
//!   start, then followed live while the run runs ([`next_change`], the feed's change notification) as long as
//!   every change appends to what was sent; any other change ends the stream with `finish`, so the client's next
//!   resume replays the message whole. Nothing resumable: 204, or a lone `finish` with `idle=finish`.
//! - `GET /v1/threads/{thread_id}/ui-messages`: the messages in the SDK's `UIMessage` shape, the same ids, the
//!   resumable message left out (the stream gives it), for `useChat`'s initial messages.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::feed::{FEED, StreamSlot, route_stream, sse};
use super::metrics::{ResumeDialect, ResumeOutcome};
use super::read::{Read, Seen, ThreadRequest, next_change, read, respond};
use super::{ApiError, AppState};
use crate::cache::{Answer, AnswerSource, RunMessage, RunView};
use crate::decode::Part;
use crate::project::{Identity, Role};
use crate::run::{RunPart, RunState};

/// The header naming the UI message stream protocol's version.
pub const UI_STREAM_HEADER: &str = "x-vercel-ai-ui-message-stream";

/// The tool name a HITL question is shown under (a dynamic tool call with input `{question}` and no output).
pub const QUESTION_TOOL: &str = "human_input";

/// What an idle resume (nothing resumable) answers: `idle=no_content` (the default, 204) or `idle=finish` (200, a
/// lone `finish`, for transports that loop on 204).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idle {
    NoContent,
    Finish,
}

fn idle_answer(request: &ThreadRequest) -> Result<Idle, ApiError> {
    let pairs = request.uri.query().map_or_else(Vec::new, |query| {
        url_pairs(query)
            .filter(|(name, _)| name == "idle")
            .map(|(_, value)| value)
            .collect()
    });
    match pairs.as_slice() {
        [] => Ok(Idle::NoContent),
        [value] if value == "no_content" => Ok(Idle::NoContent),
        [value] if value == "finish" => Ok(Idle::Finish),
        _ => Err(ApiError::InvalidQuery(
            "idle must be no_content or finish, once".into(),
        )),
    }
}

/// A query's decoded name and value pairs.
pub(super) fn url_pairs(query: &str) -> impl Iterator<Item = (String, String)> + '_ {
    query.split('&').filter(|p| !p.is_empty()).map(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        (decode(name), decode(value))
    })
}

/// The wall clock in nanoseconds since the Unix epoch (a run's state is judged on its events' `created_at`).
pub(super) fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// The resumable message of an answer: its index and its run's state, when its latest run has not finished.
fn resumable(view: &RunView, now_ns: i64) -> Option<(usize, RunState)> {
    let latest = view.latest.as_ref()?;
    let state = latest.state(now_ns);
    (state != RunState::Finished).then_some((latest.message, state))
}

/// `GET /v1/threads/{thread_id}/ui-message-stream`.
pub async fn ui_message_stream(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("the UI message stream")?;
    let idle = idle_answer(&request)?;
    if let Some(response) = route_stream(&state, &request).await? {
        return Ok(response);
    }
    let thread = request.thread.as_str().to_owned();
    let answer = state
        .views
        .read::<RunView>(&thread, primary.as_ref())
        .await
        .map_err(|error| ApiError::from_read(error, &thread))?;
    let Some((message, run_state)) = resumable(&answer.body, now_ns()) else {
        state
            .metrics
            .resume(ResumeDialect::UiMessageStream, ResumeOutcome::Idle);
        return Ok(match idle {
            Idle::NoContent => StatusCode::NO_CONTENT.into_response(),
            Idle::Finish => sse_response(stream::iter(
                [chunk(&json!({"type": "finish"})), done()].map(Ok::<_, Infallible>),
            )),
        });
    };
    let slot = StreamSlot::acquire(&state)?;
    state
        .metrics
        .resume(ResumeDialect::UiMessageStream, ResumeOutcome::Streamed);
    let mut resume = Resume {
        views: state.views.clone(),
        thread,
        primary,
        seen: Seen::of(&answer),
        sent: Sent::of(&answer.body.messages[message]),
        message,
        queue: VecDeque::new(),
        stop: state.views.stopping(),
        ended: false,
        _slot: slot,
    };
    resume.replay(&answer.body.messages[message], run_state);
    let events = stream::unfold(resume, |mut resume| async move {
        let event = resume.next().await?;
        Some((Ok::<_, Infallible>(event), resume))
    });
    Ok(sse_response(events))
}

/// An SSE response in the UI message stream protocol: its header, never stored.
fn sse_response<S>(events: S) -> Response
where
    S: futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let mut response = sse(events);
    let headers = response.headers_mut();
    headers.insert(UI_STREAM_HEADER, HeaderValue::from_static("v1"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

fn chunk(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

fn done() -> Event {
    Event::default().data("[DONE]")
}

/// A text block's id in the stream: the message's id and the block's index among its parts.
fn text_id(message_id: &str, at: usize) -> String {
    format!("{message_id}_{at}")
}

/// A question's tool call id: its event's id.
fn call_id(event_id: &str) -> String {
    format!("call_{event_id}")
}

/// What a stream sent of its message: its id, and its parts as sent (the last one open when it is text and the
/// run runs).
struct Sent {
    id: String,
    parts: Vec<RunPart>,
    /// Whether the last part is a text block not ended yet.
    open: bool,
}

impl Sent {
    fn of(message: &RunMessage) -> Self {
        Self {
            id: message.id.clone(),
            parts: Vec::new(),
            open: false,
        }
    }
}

/// One open resume stream.
struct Resume {
    views: crate::cache::ViewCache,
    thread: String,
    primary: Option<Identity>,
    /// The answer the stream last derived chunks from.
    seen: Seen,
    sent: Sent,
    /// The message's index in the history.
    message: usize,
    /// Chunks to send before the stream waits again.
    queue: VecDeque<Event>,
    stop: CancellationToken,
    /// Whether the last chunk (`[DONE]`) is queued: nothing follows.
    ended: bool,
    _slot: StreamSlot,
}

impl Resume {
    /// The message from its start: `start`, `start-step`, its parts, and the end unless its run runs.
    fn replay(&mut self, message: &RunMessage, state: RunState) {
        self.push(json!({"type": "start", "messageId": message.id}));
        self.push(json!({"type": "start-step"}));
        self.append(&message.parts, state);
    }

    fn push(&mut self, value: Value) {
        self.queue.push_back(chunk(&value));
    }

    /// Sends `parts` after those sent: the open text block's new text as one delta, then each new part; ends the
    /// stream unless the run runs.
    fn append(&mut self, parts: &[RunPart], state: RunState) {
        let sent = self.sent.parts.len();
        // The open block's new text ([`extends`] checked that it only grew).
        if self.sent.open
            && let Some(now @ RunPart::Text { text: grown, .. }) = parts.get(sent - 1)
            && let Some(before) = self.sent.parts.last_mut()
            && let RunPart::Text {
                text: sent_text, ..
            } = &*before
            && grown.len() > sent_text.len()
        {
            let delta = json!({"type": "text-delta", "id": text_id(&self.sent.id, sent - 1),
                "delta": &grown[sent_text.len()..]});
            before.clone_from(now);
            self.push(delta);
        }
        for (at, part) in parts.iter().enumerate().skip(sent) {
            self.close_text();
            match part {
                RunPart::Text { text, .. } => {
                    let id = text_id(&self.sent.id, at);
                    self.push(json!({"type": "text-start", "id": id}));
                    if !text.is_empty() {
                        self.push(json!({"type": "text-delta", "id": id, "delta": text}));
                    }
                    self.sent.open = true;
                }
                RunPart::Question { event_id, text } => self.push(json!({
                    "type": "tool-input-available",
                    "toolCallId": call_id(event_id),
                    "toolName": QUESTION_TOOL,
                    "input": {"question": text},
                    "dynamic": true,
                })),
            }
            self.sent.parts.push(part.clone());
        }
        match state {
            RunState::Running => {}
            RunState::AwaitingInput => self.finish(Some("tool-calls")),
            RunState::Finished => self.finish(Some("stop")),
            RunState::Stalled => self.finish(None),
        }
    }

    /// Ends the open text block, if any.
    fn close_text(&mut self) {
        if self.sent.open {
            let id = text_id(&self.sent.id, self.sent.parts.len() - 1);
            self.push(json!({"type": "text-end", "id": id}));
            self.sent.open = false;
        }
    }

    /// Ends the message (`finish-step`, `finish` with `reason` when it is known) and the stream.
    fn finish(&mut self, reason: Option<&str>) {
        self.close_text();
        self.push(json!({"type": "finish-step"}));
        self.push(match reason {
            Some(reason) => json!({"type": "finish", "finishReason": reason}),
            None => json!({"type": "finish"}),
        });
        self.end();
    }

    fn end(&mut self) {
        self.queue.push_back(done());
        self.ended = true;
    }

    /// The next chunk: queued ones first, then those of the thread's next change; `None` after `[DONE]`.
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.ended {
                return None;
            }
            self.follow().await;
        }
    }

    /// Waits for the thread's answer to change and queues what it adds; ends the stream on any other change, a
    /// failed read (`error`, the history's error body) or the worker stopping (`abort`).
    async fn follow(&mut self) {
        tokio::select! {
            () = self.stop.cancelled() => {
                self.push(json!({"type": "abort", "reason": "shutting_down"}));
                return self.end();
            }
            () = next_change(&self.views, &self.thread, self.seen, FEED, Instant::now(), None) => {}
        }
        let answer = match self
            .views
            .read::<RunView>(&self.thread, self.primary.as_ref())
            .await
        {
            Ok(answer) => answer,
            Err(error) => {
                let error = ApiError::from_read(error, &self.thread);
                if let Some(log) = error.log_line() {
                    log.write();
                }
                self.push(json!({"type": "error", "errorText": error.body().to_string()}));
                return self.end();
            }
        };
        self.advance(&answer);
    }

    /// Queues what `answer` adds to the message sent, or ends the stream when it does not only add.
    fn advance(&mut self, answer: &Answer<RunView>) {
        let fresh =
            answer.generation != self.seen.generation || answer.version != self.seen.version;
        self.seen = Seen::of(answer);
        let now = now_ns();
        let message = answer.body.messages.get(self.message);
        let run = answer.body.latest.as_ref();
        let appends = answer.source == AnswerSource::Cache
            && run.is_some_and(|run| run.message == self.message)
            && message.is_some_and(|m| m.id == self.sent.id && extends(&self.sent, &m.parts));
        match (message, run) {
            (Some(message), Some(run)) if appends => {
                let state = run.state(now);
                if fresh || state != RunState::Running {
                    self.append(&message.parts, state);
                }
            }
            // Not an append (an earlier part changed, a late event sorted first, the message's id changed, a new
            // message, an answer from the store): the client's next resume replays the message whole.
            _ => self.finish(None),
        }
    }
}

/// Whether `parts` only add to what was sent: every part sent is there unchanged, but the open text block, which
/// may have grown.
fn extends(sent: &Sent, parts: &[RunPart]) -> bool {
    let Some(last) = sent.parts.len().checked_sub(1) else {
        return true;
    };
    if parts.len() < sent.parts.len() || parts[..last] != sent.parts[..last] {
        return false;
    }
    match (&sent.parts[last], &parts[last]) {
        (RunPart::Text { text: before, .. }, RunPart::Text { text: now, .. }) if sent.open => {
            now.starts_with(before.as_str())
        }
        (before, now) => before == now,
    }
}

/// `GET /v1/threads/{thread_id}/ui-messages`: `{"thread_id", "messages": [UIMessage…]}`, the resumable message
/// left out.
pub async fn ui_messages(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("the UI messages")?;
    match read::<RunView>(&state, &request, primary.as_ref(), None).await? {
        Read::Forwarded(response) => Ok(response),
        Read::Answered { answer, .. } => {
            let left_out = resumable(&answer.body, now_ns()).map(|(at, _)| at);
            let messages: Vec<Value> = answer
                .body
                .messages
                .iter()
                .enumerate()
                .filter(|(at, _)| Some(*at) != left_out)
                .map(|(_, message)| ui_message(message))
                .collect();
            let body = Bytes::from(
                json!({"thread_id": request.thread.as_str(), "messages": messages}).to_string(),
            );
            let etag = crate::cache::etag_of(&body);
            Ok(respond(&answer, &etag, body, None, &request.headers))
        }
    }
}

/// A message in the AI SDK's `UIMessage` shape, as a client that read its stream to the end holds it.
pub fn ui_message(message: &RunMessage) -> Value {
    let parts: Vec<Value> = match message.role {
        Role::User => message.user.iter().map(user_part).collect(),
        Role::Assistant => std::iter::once(json!({"type": "step-start"}))
            .chain(message.parts.iter().map(|part| match part {
                RunPart::Text { text, .. } => {
                    json!({"type": "text", "text": text, "state": "done"})
                }
                RunPart::Question { event_id, text } => json!({
                    "type": "dynamic-tool",
                    "toolName": QUESTION_TOOL,
                    "toolCallId": call_id(event_id),
                    "state": "input-available",
                    "input": {"question": text},
                }),
            }))
            .collect(),
    };
    let role = match message.role {
        Role::User => "user",
        Role::Assistant => "assistant",
    };
    json!({"id": message.id, "role": role, "parts": parts})
}

/// A user part as a `UIMessage` part: text, or a file (an image by its URL, audio as a `data:` URL).
fn user_part(part: &Part) -> Value {
    match part {
        Part::Text { text } => json!({"type": "text", "text": text}),
        Part::ImageUrl { image_url } => {
            let media_type = image_url
                .url
                .strip_prefix("data:")
                .and_then(|rest| rest.split([';', ',']).next())
                .filter(|t| !t.is_empty())
                .unwrap_or("image/*");
            json!({"type": "file", "mediaType": media_type, "url": image_url.url})
        }
        Part::InputAudio { input_audio } => json!({
            "type": "file",
            "mediaType": format!("audio/{}", input_audio.format),
            "url": format!("data:audio/{};base64,{}", input_audio.format, input_audio.data),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> RunPart {
        RunPart::Text {
            text: t.into(),
            pieces: vec![],
        }
    }

    fn question(id: &str) -> RunPart {
        RunPart::Question {
            event_id: id.into(),
            text: "?".into(),
        }
    }

    #[test]
    fn only_growth_of_the_open_block_and_new_parts_extend_what_was_sent() {
        let sent = Sent {
            id: "m".into(),
            parts: vec![text("a"), question("q"), text("b")],
            open: true,
        };
        assert!(extends(&sent, &[text("a"), question("q"), text("b")]));
        assert!(extends(&sent, &[text("a"), question("q"), text("bc")]));
        assert!(extends(
            &sent,
            &[text("a"), question("q"), text("bc"), question("r")]
        ));
        assert!(!extends(&sent, &[text("a"), question("q"), text("xb")]));
        assert!(!extends(&sent, &[text("za"), question("q"), text("b")]));
        assert!(!extends(&sent, &[text("a"), question("q")]));
        let closed = Sent {
            open: false,
            ..sent
        };
        assert!(!extends(&closed, &[text("a"), question("q"), text("bc")]));
        assert!(extends(
            &Sent {
                id: "m".into(),
                parts: vec![],
                open: false
            },
            &[text("a")]
        ));
    }

    #[test]
    fn user_parts_become_text_and_files() {
        assert_eq!(
            user_part(&Part::Text { text: "hi".into() }),
            json!({"type": "text", "text": "hi"})
        );
        assert_eq!(
            user_part(&Part::ImageUrl {
                image_url: crate::decode::ImageUrl {
                    url: "data:image/png;base64,AA==".into()
                }
            }),
            json!({"type": "file", "mediaType": "image/png", "url": "data:image/png;base64,AA=="})
        );
        assert_eq!(
            user_part(&Part::InputAudio {
                input_audio: crate::decode::InputAudio {
                    data: "AA==".into(),
                    format: "wav".into()
                }
            })["url"],
            "data:audio/wav;base64,AA=="
        );
    }
}
