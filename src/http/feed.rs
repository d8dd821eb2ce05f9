//! `GET /v1/threads/{thread_id}/history/stream` ([design 3.2](../../docs/design.md#3.2)): the thread's answer as
//! Server-Sent Events. A `snapshot` (the history's body) first, then an `update` (`{"from", "messages"}`: the
//! messages from the first that changed) each time the answer changes; each event's id names the answer (the cache
//! entry's generation and the view's version), and a reconnect with `Last-Event-ID` resumes with an update ([`resume`])
//! when the worker still knows that answer's message digests. The feed reads through the cache like a read (the same
//! completeness rules): after a read that needed the store (a gap, an eviction) it sends a snapshot, never an update.
//! Changes within [`COALESCE`] of the last event are sent together; the feed waits for changes as a read waiting
//! for a run does ([`next_change`]), at its own pace ([`FEED`]). It follows the thread across evictions. It ends
//! with an [`END`] event when a read fails (the thread past `HISTORY_VIEW_MAX_THREAD_BYTES`, the store refusing or
//! out: the history's error body) or the worker stops, so a client never holds a transcript it believes is live
//! while the feed has gone quiet.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::metrics::{FeedEvent, HttpRefusal};
use super::read::{Pace, STORE_REREAD_INTERVAL, Seen, ThreadRequest, next_change};
use super::route::{Forward, route};
use super::{ApiError, AppState, HttpMetrics};
use crate::cache::{Answer, AnswerSource, Transcript};
use crate::project::Identity;

/// Changes that follow an event within this time are sent together, in one event, after it.
pub const COALESCE: Duration = Duration::from_millis(5);

/// How a feed waits for the thread's answer to change ([`Pace`] says why it differs from a read waiting for a run):
/// it looks again after a second without a notification (an entry made while it waited, after an eviction, is not
/// listened to); after an event it waits [`COALESCE`] for the changes that follow, and after an answer from the
/// store (a partial view) [`STORE_REREAD_INTERVAL`].
pub const FEED: Pace = Pace {
    recheck: Duration::from_secs(1),
    after_cache: COALESCE,
    after_store: STORE_REREAD_INTERVAL,
};

/// The name of a feed's last event ([design 3.2](../../docs/design.md#3.2)), sent when a read fails or the worker
/// stops. Not `error`: an `EventSource` reports its own failures (and reconnects) under that name.
pub const END: &str = "end";

/// The reconnection delay the feed asks clients for (`retry:`).
const CLIENT_RETRY: Duration = Duration::from_secs(1);

/// A keep-alive comment is sent after this much silence.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `GET /v1/threads/{thread_id}/history/stream`.
pub async fn stream_history(
    State(state): State<AppState>,
    request: ThreadRequest,
) -> Result<Response, ApiError> {
    let primary = request.identity()?;
    request.refuse_run_wait("the feed")?;
    if let Some(response) = route_stream(&state, &request).await? {
        return Ok(response);
    }
    let thread = request.thread.as_str().to_owned();
    open(&state, thread, primary, &request.headers).await
}

/// Routes a long response (a feed, a resume stream) among partitioned workers: the owner's stream passed on as it
/// comes, or `None` when this worker answers it; 503 `owner_unreachable` when the owner does not answer (a stream
/// is never answered from the store by a worker that does not receive the thread's events).
pub(super) async fn route_stream(
    state: &AppState,
    request: &ThreadRequest,
) -> Result<Option<Response>, ApiError> {
    route(
        state,
        request.thread.as_str(),
        Forward::Feed,
        &request.uri,
        &request.headers,
    )
    .await
    .without_fallback()
}

/// Opens a feed of `thread` on this worker: a stream permit, the first read (its error is the request's), the
/// first event (a snapshot, or the update a resume allows), then the stream of changes.
async fn open(
    state: &AppState,
    thread: String,
    primary: Option<Identity>,
    headers: &HeaderMap,
) -> Result<Response, ApiError> {
    let slot = StreamSlot::acquire(state)?;
    // The feed starts from a complete answer, like a read: an error here is the read's error.
    let answer = state
        .views
        .read::<Transcript>(&thread, primary.as_ref())
        .await
        .map_err(|error| ApiError::from_read(error, &thread))?;
    let resumed = resume(state, &thread, primary.as_ref(), headers, &answer).await;
    let mut feed = Feed {
        views: state.views.clone(),
        metrics: state.metrics.clone(),
        thread,
        primary,
        sent: Sent::of(&answer),
        last_event: Instant::now(),
        stop: state.views.stopping(),
        first: None,
        ended: false,
        _slot: slot,
    };
    feed.first = match resumed {
        // The answer the client holds is known: only what changed since (nothing if nothing did).
        Some(digests) => answer
            .body
            .first_change(&digests)
            .map(|from| feed.event(&answer, FeedEvent::Update, from)),
        None => Some(feed.event(&answer, FeedEvent::Snapshot, 0)),
    }
    .map(|event| event.retry(CLIENT_RETRY));
    let events = stream::unfold(feed, |mut feed| async move {
        let event = feed.next().await?;
        Some((Ok::<_, Infallible>(event), feed))
    });
    Ok(sse(events))
}

/// A long response of Server-Sent Events (a feed, a resume stream): a keep-alive comment after [`KEEP_ALIVE`] of
/// silence, and never stored (axum's `Sse` says `no-cache`).
pub(super) fn sse<S>(events: S) -> Response
where
    S: futures_util::Stream<Item = Result<Event, Infallible>> + Send + 'static,
{
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// A feed's resume ([design 3.2](../../docs/design.md#3.2)): the message digests of the answer `Last-Event-ID`
/// names, when the thread's entry still keeps them (same generation, a kept version, the same identity) and the
/// feed's first answer came from memory; the feed then starts with an update from the first message that changed.
/// `None` (a snapshot) otherwise. Counted in `history_view_feed_resumes_total` when a `Last-Event-ID` came.
async fn resume(
    state: &AppState,
    thread: &str,
    primary: Option<&Identity>,
    headers: &HeaderMap,
    answer: &Answer<Transcript>,
) -> Option<Arc<[u64]>> {
    let (generation, version) = last_event_id(headers)?;
    let digests = state
        .views
        .recent_digests(thread, generation, version, primary)
        .await;
    let outcome = match &digests {
        Some(_) if answer.source == AnswerSource::Cache => FeedEvent::Update,
        _ => FeedEvent::Snapshot,
    };
    state.metrics.feed_resume(outcome);
    digests.filter(|_| outcome == FeedEvent::Update)
}

/// `Last-Event-ID` as this feed writes ids: `<generation>.<version>`.
fn last_event_id(headers: &HeaderMap) -> Option<(u64, u64)> {
    let value = headers.get("last-event-id")?.to_str().ok()?;
    let (generation, version) = value.trim().split_once('.')?;
    Some((generation.parse().ok()?, version.parse().ok()?))
}

/// What a feed sent last: the answer (its name and source) and its messages' digests.
struct Sent {
    seen: Seen,
    digests: Arc<[u64]>,
}

impl Sent {
    fn of(answer: &Answer<Transcript>) -> Self {
        Self {
            seen: Seen::of(answer),
            digests: Arc::clone(&answer.body.digests),
        }
    }
}

/// One open feed.
struct Feed {
    views: crate::cache::ViewCache,
    metrics: Arc<HttpMetrics>,
    thread: String,
    primary: Option<Identity>,
    sent: Sent,
    /// When the last event was sent (or the feed opened).
    last_event: Instant,
    stop: CancellationToken,
    /// The first event, sent before the feed waits for changes.
    first: Option<Event>,
    /// Whether the [`END`] event was sent: the stream ends after it.
    ended: bool,
    _slot: StreamSlot,
}

impl Feed {
    /// The next event to send, once the thread's answer changed; after the feed's [`END`] event, `None`.
    async fn next(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        if let Some(event) = self.first.take() {
            return Some(event);
        }
        match self.next_answer().await {
            Ok(event) => Some(event),
            Err(reason) => {
                self.ended = true;
                Some(end(&reason))
            }
        }
    }

    /// The event of the thread's next changed answer; the reason the feed ends instead: the answer the history
    /// would give the read that failed (the thread past the limit, the store refusing or out), or the worker
    /// stopping.
    async fn next_answer(&mut self) -> Result<Event, ApiError> {
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return Err(ApiError::ShuttingDown),
                // Changes right after the last event wait for the ones that follow them.
                () = next_change(&self.views, &self.thread, self.sent.seen, FEED, self.last_event, None) => {}
            }
            let answer = self
                .views
                .read::<Transcript>(&self.thread, self.primary.as_ref())
                .await
                .map_err(|error| ApiError::from_read(error, &self.thread))?;
            let seen = self.sent.seen;
            if answer.generation == seen.generation && answer.version == seen.version {
                continue;
            }
            let Some(from) = answer.body.first_change(&self.sent.digests) else {
                // The view changed, its answer did not (a duplicate, an event no message shows).
                self.sent = Sent::of(&answer);
                continue;
            };
            // An answer that needed the store (after a gap or an eviction) is sent whole, never as an update.
            let kind = match answer.source {
                AnswerSource::Store => FeedEvent::Snapshot,
                AnswerSource::Cache => FeedEvent::Update,
            };
            return Ok(self.event(&answer, kind, from));
        }
    }

    /// The event of `kind` for `answer` (an update from message `from`), counted and remembered as sent.
    fn event(&mut self, answer: &Answer<Transcript>, kind: FeedEvent, from: usize) -> Event {
        let coalesced = if answer.generation == self.sent.seen.generation {
            answer.version.saturating_sub(self.sent.seen.version + 1)
        } else {
            0
        };
        self.metrics.feed_event(kind, coalesced);
        let body = match kind {
            FeedEvent::Snapshot => answer.body.snapshot(&self.thread),
            FeedEvent::Update => answer.body.update(from),
        };
        self.sent = Sent::of(answer);
        self.last_event = Instant::now();
        Event::default()
            .event(kind.label())
            .id(format!("{}.{}", answer.generation, answer.version))
            // The bodies are JSON, so UTF-8 with no raw line breaks.
            .data(String::from_utf8_lossy(&body))
    }
}

/// The feed's last event: `reason`'s body, exactly what the history answers for it (`{"error": {"code",
/// "message"}}`). It carries no id, so a client resumes after the last answer it applied, and that resume gets the
/// history's status while the reason lasts.
fn end(reason: &ApiError) -> Event {
    if let Some(log) = reason.log_line() {
        log.write();
    }
    Event::default().event(END).data(reason.body().to_string())
}

/// A long response's permit (a feed's, a resume stream's) and its place in `history_view_feed_streams`, both given
/// back when it ends.
pub(super) struct StreamSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<HttpMetrics>,
}

impl StreamSlot {
    /// One of the `HISTORY_VIEW_HTTP_MAX_STREAMS` permits, or 503 `overloaded` (counted as refused: `streams`).
    pub(super) fn acquire(state: &AppState) -> Result<Self, ApiError> {
        let Ok(permit) = Arc::clone(&state.streams).try_acquire_owned() else {
            state.metrics.refused(HttpRefusal::Streams);
            return Err(ApiError::Overloaded);
        };
        state.metrics.feed_streams(1);
        Ok(Self {
            _permit: permit,
            metrics: state.metrics.clone(),
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.metrics.feed_streams(-1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_event_ids_are_a_generation_and_a_version() {
        let mut headers = HeaderMap::new();
        assert_eq!(last_event_id(&headers), None);
        for (value, parsed) in [
            ("17.4", Some((17, 4))),
            (" 17.4 ", Some((17, 4))),
            ("17", None),
            ("x.4", None),
            ("17.-1", None),
        ] {
            headers.insert("last-event-id", HeaderValue::from_static(value));
            assert_eq!(last_event_id(&headers), parsed, "{value}");
        }
    }
}
