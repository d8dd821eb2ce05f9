//! A run resumed as an OpenAI Responses background stream ([design 3.5](../../docs/design.md#3.5)), from the run
//! model ([`crate::run`], rendered by the cache as [`RunView`]): `GET /v1/threads/{thread_id}/responses/{run_id}`,
//! the path the official SDKs' `responses.retrieve(run_id, stream=True, starting_after=N)` sends when their base URL
//! is the thread's (`…/v1/threads/{thread_id}`): aihub's run ids are ObjectIds that name no thread, and the store
//! has no index from a run to its thread, so the thread is in the path.
//!
//! The run's events are a function of its parts and state, numbered in projector order: `response.created`,
//! `response.in_progress`, per text block a `message` item (`output_item.added`, `content_part.added`, one
//! `output_text.delta` per piece of text in projector order, and once the block is closed `output_text.done`,
//! `content_part.done`, `output_item.done`), per HITL question an `mcp_approval_request` item (`output_item.added`,
//! `output_item.done`), and at the run's end `response.completed`. A run that grows only appends events, so a
//! `sequence_number` names the same event on every read: `starting_after=N` sends the events after `N`, and a
//! stream follows the run live while every change appends; any other change ends the stream, and the next request
//! without a cursor replays the run whole.

use std::convert::Infallible;

use axum::extract::{Path, State};
use axum::response::Response;
use axum::response::sse::Event;
use bytes::Bytes;
use futures_util::stream;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::feed::{FEED, StreamSlot, route_stream, sse};
use super::metrics::{ResumeDialect, ResumeOutcome};
use super::read::{Read, Seen, ThreadRequest, next_change, read, respond};
use super::resume::{now_ns, url_pairs};
use super::{ApiError, AppState};
use crate::cache::{AnswerSource, RunMessage, RunView};
use crate::project::Identity;
use crate::run::{Run, RunPart, RunState};

/// The model the responses name (the worker is no model: the agent's class would be a guess).
const MODEL: &str = "aihub-agent";

/// What a request asked: a stream, and after which event.
struct Asked {
    stream: bool,
    starting_after: Option<u64>,
}

fn asked(request: &ThreadRequest) -> Result<Asked, ApiError> {
    let mut asked = Asked {
        stream: false,
        starting_after: None,
    };
    let invalid = |message: &str| ApiError::InvalidQuery(message.into());
    for (name, value) in request.uri.query().map(url_pairs).into_iter().flatten() {
        match name.as_str() {
            "stream" => {
                asked.stream = match value.as_str() {
                    "true" => true,
                    "false" => false,
                    _ => return Err(invalid("stream must be true or false")),
                }
            }
            "starting_after" => {
                asked.starting_after = Some(
                    value
                        .parse()
                        .map_err(|_| invalid("starting_after must be a non-negative integer"))?,
                )
            }
            _ => {}
        }
    }
    if asked.starting_after.is_some() && !asked.stream {
        return Err(invalid("starting_after needs stream=true"));
    }
    Ok(asked)
}

/// The run `run_id` of an answer, with the messages it wrote (a run answered after its HITL question goes on in
/// the next assistant message).
fn find<'a>(view: &'a RunView, run_id: &str) -> Option<(&'a Run, Vec<&'a RunMessage>)> {
    let run = view.runs.iter().find(|run| &*run.run_id == run_id)?;
    let messages = run
        .messages
        .iter()
        .filter_map(|&at| view.messages.get(at))
        .collect();
    Some((run, messages))
}

/// `GET /v1/threads/{thread_id}/responses/{run_id}`.
pub async fn get_response(
    State(state): State<AppState>,
    Path((_, run_id)): Path<(String, String)>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("a response")?;
    let asked = asked(&request)?;
    if !asked.stream {
        // A read like the history's: forwarded whole, or from the store when the owner does not answer.
        let answer = match read::<RunView>(&state, &request, primary.as_ref(), None).await? {
            Read::Forwarded(response) => return Ok(response),
            Read::Answered { answer, .. } => answer,
        };
        let (run, messages) = find(&answer.body, &run_id).ok_or(ApiError::NoResponse)?;
        let (_, response) = events(run, &messages, run.state(now_ns()));
        let body = Bytes::from(response.to_string());
        let etag = crate::cache::etag_of(&body);
        return Ok(respond(&answer, &etag, body, None, &request.headers));
    }
    // A long response, routed as a feed is: the owner's stream passed on as it comes.
    if let Some(response) = route_stream(&state, &request).await? {
        return Ok(response);
    }
    let thread = request.thread.as_str();
    let answer = state
        .views
        .read::<RunView>(thread, primary.as_ref())
        .await
        .map_err(|error| ApiError::from_read(error, thread))?;
    let (run, messages) = find(&answer.body, &run_id).ok_or(ApiError::NoResponse)?;
    let run_state = run.state(now_ns());
    let (events, _) = events(run, &messages, run_state);
    let slot = StreamSlot::acquire(&state)?;
    state
        .metrics
        .resume(ResumeDialect::Responses, ResumeOutcome::Streamed);
    let from = asked.starting_after.map_or(0, |n| {
        usize::try_from(n).unwrap_or(usize::MAX).saturating_add(1)
    });
    let mut follow = Follow {
        views: state.views.clone(),
        thread: request.thread.as_str().to_owned(),
        primary,
        run_id,
        seen: Seen::of(&answer),
        sent: events,
        // A cursor past what the run holds: nothing to send until it has more.
        next: from,
        stop: state.views.stopping(),
        ended: false,
        done: false,
        _slot: slot,
    };
    if run_state != RunState::Running {
        follow.ended = true;
    }
    let events = stream::unfold(follow, |mut follow| async move {
        let event = follow.next_event().await?;
        Some((Ok::<_, Infallible>(event), follow))
    });
    Ok(sse(events))
}

/// One open response stream: the run's events so far, the next one to send.
struct Follow {
    views: crate::cache::ViewCache,
    thread: String,
    primary: Option<Identity>,
    run_id: String,
    seen: Seen,
    /// The run's events as last derived (each a JSON string with its `sequence_number`).
    sent: Vec<String>,
    /// The index (sequence number) of the next event to send.
    next: usize,
    stop: CancellationToken,
    /// Whether the run ended (or the stream must end): after the events derived, `[DONE]` and the end.
    ended: bool,
    /// Whether `[DONE]` was sent.
    done: bool,
    _slot: StreamSlot,
}

impl Follow {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.sent.get(self.next) {
                self.next += 1;
                return Some(Event::default().data(event.clone()));
            }
            if self.done {
                return None;
            }
            if self.ended {
                self.done = true;
                return Some(Event::default().data("[DONE]"));
            }
            self.follow().await;
        }
    }

    /// Waits for the thread's answer to change; takes the run's new events when they only append, and ends the
    /// stream otherwise (or when the run ended, a read failed or the worker stops).
    async fn follow(&mut self) {
        tokio::select! {
            () = self.stop.cancelled() => {
                self.ended = true;
                return;
            }
            () = next_change(&self.views, &self.thread, self.seen, FEED, Instant::now(), None) => {}
        }
        let Ok(answer) = self
            .views
            .read::<RunView>(&self.thread, self.primary.as_ref())
            .await
        else {
            self.ended = true;
            return;
        };
        self.seen = Seen::of(&answer);
        let Some((run, messages)) = find(&answer.body, &self.run_id) else {
            self.ended = true;
            return;
        };
        let state = run.state(now_ns());
        let (events, _) = events(run, &messages, state);
        let appends = answer.source == AnswerSource::Cache
            && events.len() >= self.sent.len()
            && events[..self.sent.len()] == self.sent[..];
        if !appends {
            self.ended = true;
            return;
        }
        self.sent = events;
        if state != RunState::Running {
            self.ended = true;
        }
    }
}

/// The run's events in order (each serialized, its index its `sequence_number`) and its `Response` object now.
/// Only a stop ends a response: awaiting input, its events stop at the question (the run goes on once answered).
pub fn events(run: &Run, messages: &[&RunMessage], state: RunState) -> (Vec<String>, Value) {
    let created_at = run.first_event_ns.unwrap_or(0).div_euclid(1_000_000_000);
    let id = run.run_id.to_string();
    let response = |status: &str, output: &[Value]| {
        json!({
            "id": id, "object": "response", "created_at": created_at, "status": status, "model": MODEL,
            "output": output, "parallel_tool_calls": false, "tool_choice": "auto", "tools": [], "error": null,
            "incomplete_details": null, "instructions": null, "metadata": {}, "temperature": null, "top_p": null,
        })
    };
    let mut events: Vec<Value> = vec![
        json!({"type": "response.created", "response": response("in_progress", &[])}),
        json!({"type": "response.in_progress", "response": response("in_progress", &[])}),
    ];
    let mut output = Vec::new();
    let ended = state == RunState::Finished;
    let parts: Vec<(&str, usize, &RunPart)> = messages
        .iter()
        .flat_map(|m| {
            m.parts
                .iter()
                .enumerate()
                .map(|(at, p)| (m.id.as_str(), at, p))
        })
        .collect();
    for (n, &(message_id, at, part)) in parts.iter().enumerate() {
        let index = output.len();
        // A block is closed when a part follows it or the run ended.
        let closed = n + 1 < parts.len() || ended;
        match part {
            RunPart::Text { text, pieces } => {
                let item_id = format!("{message_id}_{at}");
                let item = |status: &str, content: Value| {
                    json!({"id": item_id, "type": "message", "role": "assistant", "status": status,
                        "content": content})
                };
                let part =
                    |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
                events.push(
                    json!({"type": "response.output_item.added", "output_index": index,
                    "item": item("in_progress", json!([]))}),
                );
                events.push(
                    json!({"type": "response.content_part.added", "item_id": item_id,
                    "output_index": index, "content_index": 0, "part": part("")}),
                );
                let mut start = 0;
                for &len in pieces {
                    let end = (start + len as usize).min(text.len());
                    events.push(json!({"type": "response.output_text.delta", "item_id": item_id,
                        "output_index": index, "content_index": 0, "delta": &text[start..end], "logprobs": []}));
                    start = end;
                }
                let done = item("completed", json!([part(text)]));
                if closed {
                    events.push(
                        json!({"type": "response.output_text.done", "item_id": item_id,
                        "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                    );
                    events.push(
                        json!({"type": "response.content_part.done", "item_id": item_id,
                        "output_index": index, "content_index": 0, "part": part(text)}),
                    );
                    events.push(
                        json!({"type": "response.output_item.done", "output_index": index,
                        "item": done}),
                    );
                    output.push(item("completed", json!([part(text)])));
                } else {
                    output.push(item("in_progress", json!([part(text)])));
                }
            }
            RunPart::Question { event_id, text } => {
                let item = json!({"id": format!("mcpr_{event_id}"), "type": "mcp_approval_request",
                    "server_label": "aihub", "name": super::resume::QUESTION_TOOL,
                    "arguments": json!({"question": text}).to_string()});
                events.push(
                    json!({"type": "response.output_item.added", "output_index": index,
                    "item": item}),
                );
                events.push(
                    json!({"type": "response.output_item.done", "output_index": index,
                    "item": item}),
                );
                output.push(item);
            }
        }
    }
    let status = if ended { "completed" } else { "in_progress" };
    if ended {
        events.push(json!({"type": "response.completed", "response": response(status, &output)}));
    }
    let events = events
        .into_iter()
        .enumerate()
        .map(|(n, mut event)| {
            event["sequence_number"] = json!(n);
            event.to_string()
        })
        .collect();
    (events, response(status, &output))
}
