//! `GET /v1/threads/{thread_id}/history/stream` ([design 3.2](../../docs/design.md#3.2)): the thread's answer as
//! Server-Sent Events. A `snapshot` (the history's body) first, then an `update` (`{"from", "messages"}`: the
//! messages from the first that changed) each time the answer changes; each event's id names the answer (the cache
//! entry's generation and the view's version), and a reconnect with `Last-Event-ID` resumes with an update when the
//! worker still knows that answer's message digests. The feed reads through the cache like a read (the same
//! completeness rules): after a read that needed the store (a gap, an eviction) it sends a snapshot, never an update.
//! Changes within [`COALESCE`] of the last event are sent together. It follows the thread across evictions, and ends
//! when the worker stops.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Uri, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::history::{HistoryQuery, Route, passed_back, route, thread_and_query};
use super::metrics::HttpRefusal;
use super::{ApiError, AppState};
use crate::cache::{Answer, Source, Transcript};
use crate::metrics::Metrics;
use crate::project::Identity;

/// Changes that follow an event within this time are sent together, in one event, after it.
pub const COALESCE: Duration = Duration::from_millis(5);

/// The longest a feed waits for a change notification before it reads again (an entry made while it waited, after
/// an eviction, is not listened to).
const RECHECK: Duration = Duration::from_secs(1);

/// How long a feed waits before reading again when a read failed (the store was needed and did not answer).
const RETRY_READ: Duration = Duration::from_secs(1);

/// The reconnection delay the feed asks clients for (`retry:`).
const CLIENT_RETRY: Duration = Duration::from_secs(1);

/// A keep-alive comment is sent after this much silence.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// `GET /v1/threads/{thread_id}/history/stream`.
pub async fn stream_history(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    RawQuery(raw_query): RawQuery,
    query: Result<Query<HistoryQuery>, QueryRejection>,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (thread_id, query) = thread_and_query(path, raw_query, query)?;
    let primary = query.identity()?;
    if query.run_wait()?.is_some() {
        return Err(ApiError::InvalidQuery(
            "wait_for_run applies to the history and the items, not to the feed".into(),
        ));
    }
    let thread = thread_id.as_str().to_owned();
    match route(&state, &thread, &headers) {
        Route::Local => {}
        Route::Owner(partition) => {
            let Some(peers) = &state.peers else {
                return Err(ApiError::OwnerUnreachable);
            };
            let forwarded = peers.forward_stream(partition, &uri, &headers).await;
            return passed_back(&state, partition, forwarded).ok_or(ApiError::OwnerUnreachable);
        }
        // A forwarded feed for a thread this worker does not own either: it holds no view of it.
        Route::Store => return Err(ApiError::OwnerUnreachable),
    }
    let Ok(permit) = Arc::clone(&state.streams).try_acquire_owned() else {
        state.metrics.http.refused(HttpRefusal::Streams);
        return Err(ApiError::Overloaded);
    };
    // The feed starts from a complete answer, like a read: an error here is the read's error.
    let answer = state
        .views
        .read::<Transcript>(&thread, primary.as_ref())
        .await
        .map_err(|error| ApiError::from_read(error, &thread))?;
    let resumed = match last_event_id(&headers) {
        Some((generation, version)) => {
            let digests = state
                .views
                .recent_digests(&thread, generation, version, primary.as_ref())
                .await;
            let outcome = match &digests {
                Some(_) if answer.source == Source::Cache => FeedEvent::Update,
                _ => FeedEvent::Snapshot,
            };
            state.metrics.http.feed_resume(outcome);
            digests.filter(|_| outcome == FeedEvent::Update)
        }
        None => None,
    };
    let mut feed = Feed {
        views: state.views.clone(),
        metrics: state.metrics.clone(),
        thread,
        primary,
        sent: Sent::of(&answer),
        last_event: Instant::now(),
        stop: state.views.stopping(),
        first: None,
        _slot: StreamSlot::new(permit, &state.metrics),
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
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // axum's Sse says `no-cache`; a feed must not be stored at all.
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

/// `Last-Event-ID` as this feed writes ids: `<generation>.<version>`.
fn last_event_id(headers: &HeaderMap) -> Option<(u64, u64)> {
    let value = headers.get("last-event-id")?.to_str().ok()?;
    let (generation, version) = value.trim().split_once('.')?;
    Some((generation.parse().ok()?, version.parse().ok()?))
}

/// What a feed sent last: the answer's name and its messages' digests.
struct Sent {
    generation: u64,
    version: u64,
    digests: Arc<[u64]>,
    source: Source,
}

impl Sent {
    fn of(answer: &Answer<Transcript>) -> Self {
        Self {
            generation: answer.generation,
            version: answer.version,
            digests: Arc::clone(&answer.body.digests),
            source: answer.source,
        }
    }
}

/// One open feed.
struct Feed {
    views: crate::cache::ViewCache,
    metrics: Metrics,
    thread: String,
    primary: Option<Identity>,
    sent: Sent,
    /// When the last event was sent (or the feed opened).
    last_event: Instant,
    stop: CancellationToken,
    /// The first event, sent before the feed waits for changes.
    first: Option<Event>,
    _slot: StreamSlot,
}

impl Feed {
    /// The next event to send, once the thread's answer changed; `None` when the worker stops.
    async fn next(&mut self) -> Option<Event> {
        if let Some(event) = self.first.take() {
            return Some(event);
        }
        loop {
            let until = Instant::now() + RECHECK;
            let changed =
                self.views
                    .changed(&self.thread, self.sent.generation, self.sent.version, until);
            // After an answer from the store the view was partial: read again at most every 100 ms.
            let pause = match self.sent.source {
                Source::Store => super::history::STORE_REREAD_INTERVAL,
                Source::Cache => COALESCE,
            };
            tokio::select! {
                () = self.stop.cancelled() => return None,
                () = async {
                    changed.await;
                    // Changes right after the last event wait for the ones that follow them.
                    tokio::time::sleep_until(self.last_event + pause).await;
                } => {}
            }
            let answer = match self
                .views
                .read::<Transcript>(&self.thread, self.primary.as_ref())
                .await
            {
                Ok(answer) => answer,
                Err(_) => {
                    // The store was needed and failed: send nothing, try again.
                    tokio::select! {
                        () = self.stop.cancelled() => return None,
                        () = tokio::time::sleep(RETRY_READ) => continue,
                    }
                }
            };
            if answer.generation == self.sent.generation && answer.version == self.sent.version {
                continue;
            }
            let Some(from) = answer.body.first_change(&self.sent.digests) else {
                // The view changed, its answer did not (a duplicate, an event no message shows).
                self.sent = Sent::of(&answer);
                continue;
            };
            // An answer that needed the store (after a gap or an eviction) is sent whole, never as an update.
            let kind = match answer.source {
                Source::Store => FeedEvent::Snapshot,
                Source::Cache => FeedEvent::Update,
            };
            return Some(self.event(&answer, kind, from));
        }
    }

    /// The event of `kind` for `answer` (an update from message `from`), counted and remembered as sent.
    fn event(&mut self, answer: &Answer<Transcript>, kind: FeedEvent, from: usize) -> Event {
        let coalesced = if answer.generation == self.sent.generation {
            answer.version.saturating_sub(self.sent.version + 1)
        } else {
            0
        };
        self.metrics.http.feed_event(kind, coalesced);
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

/// The kinds of a live feed's events (and of a resume's first event): the SSE event name, and the `kind` of
/// `history_view_feed_events_total` and `outcome` of `history_view_feed_resumes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedEvent {
    /// The whole answer.
    Snapshot,
    /// The messages from the first that changed.
    Update,
}

impl FeedEvent {
    pub const ALL: [FeedEvent; 2] = [FeedEvent::Snapshot, FeedEvent::Update];

    pub fn label(self) -> &'static str {
        match self {
            FeedEvent::Snapshot => "snapshot",
            FeedEvent::Update => "update",
        }
    }
}

/// A feed's permit and its place in `history_view_feed_streams`, both given back when the feed ends.
struct StreamSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Metrics,
}

impl StreamSlot {
    fn new(permit: OwnedSemaphorePermit, metrics: &Metrics) -> Self {
        metrics.http.feed_streams(1);
        Self {
            _permit: permit,
            metrics: metrics.clone(),
        }
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.metrics.http.feed_streams(-1);
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
