//! The accept loop: HTTP/1 connections under a cap, with a header-read timeout and an idle keep-alive timeout, and
//! a small reserve of connections that only reach the probes and `/metrics`, so a flood of clients cannot get the
//! pod killed by its liveness probe. Stops accepting on shutdown and lets every connection finish its request.
//!
//! Chosen: the timeouts are kept here, per connection, rather than by hyper's `header_read_timeout`, whose timer
//! also runs while a keep-alive connection waits for its next request, so it cannot be set apart from the idle
//! timeout.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service;

use super::HttpMetrics;
use super::metrics::{HttpRefusal, HttpTimeout};

/// Connections beyond the cap that are still accepted, to answer the probes and `/metrics` only.
pub const RESERVED_CONNECTIONS: usize = 16;

/// The limits of the accept loop.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Connections served at once (`HISTORY_VIEW_HTTP_MAX_CONNECTIONS`), besides the reserve.
    pub max_connections: usize,
    /// Time from a request's first byte to the end of its headers (`HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS`).
    pub header_timeout: Duration,
    /// Time a connection may stay open without a request in flight and without a byte of the next request
    /// (`HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS`).
    pub idle_timeout: Duration,
}

/// Accepts connections until `stop` is cancelled. Connections within the cap get `api`; those in the reserve get
/// `reserve` (the probes and `/metrics`); beyond both, a connection is closed at once. Each connection is served
/// on `connections`, which the caller waits on to drain.
pub async fn accept_loop(
    listener: TcpListener,
    api: Router,
    reserve: Router,
    limits: ConnectionLimits,
    metrics: Arc<HttpMetrics>,
    connections: TaskTracker,
    stop: CancellationToken,
) {
    let api_slots = Arc::new(Semaphore::new(limits.max_connections));
    let reserve_slots = Arc::new(Semaphore::new(RESERVED_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(error) => {
                // Out of file descriptors, most likely: wait a little instead of spinning.
                tracing::warn!(%error, "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (router, slot) = if let Ok(slot) = Arc::clone(&api_slots).try_acquire_owned() {
            (api.clone(), slot)
        } else if let Ok(slot) = Arc::clone(&reserve_slots).try_acquire_owned() {
            metrics.refused(HttpRefusal::Connections);
            (reserve.clone(), slot)
        } else {
            metrics.refused(HttpRefusal::Connections);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(serve_connection(
            stream,
            router,
            slot,
            limits,
            metrics.clone(),
            stop.clone(),
        ));
    }
}

/// Serves one connection until the client closes it, a timeout closes it, or `stop` asks it to finish.
async fn serve_connection(
    stream: TcpStream,
    router: Router,
    _slot: OwnedSemaphorePermit,
    limits: ConnectionLimits,
    metrics: Arc<HttpMetrics>,
    stop: CancellationToken,
) {
    let activity = Arc::new(Watch {
        state: Mutex::new(Activity::new()),
        changed: Notify::new(),
    });
    let io = TokioIo::new(WatchedStream {
        stream,
        activity: Arc::clone(&activity),
    });
    let service_activity = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let request = request.map(Body::new);
        let in_flight = InFlight::begin(&service_activity);
        let mut router = router.clone();
        async move {
            // In flight until the body has been sent (or dropped): a live feed's response is a long body.
            let response = router.call(request).await;
            response.map(|response| {
                response.map(|body| {
                    Body::new(Tracked {
                        body,
                        _in_flight: in_flight,
                    })
                })
            })
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, service);
    tokio::pin!(connection);
    metrics.connection_opened();
    let mut stopping = false;
    loop {
        let deadline = activity.lock().deadline(&limits);
        tokio::select! {
            _ = connection.as_mut() => break,
            // A request began or ended, or its first byte came: the deadline moved.
            () = activity.changed.notified() => {}
            () = stop.cancelled(), if !stopping => {
                // Ends the connection after the request in flight, or now if there is none.
                connection.as_mut().graceful_shutdown();
                stopping = true;
            }
            () = tokio::time::sleep_until(deadline.at) => {
                if activity.lock().deadline(&limits).at <= Instant::now() {
                    // Dropping the connection closes the socket.
                    metrics.timeout(deadline.kind);
                    break;
                }
            }
        }
    }
    metrics.connection_closed();
}

/// What a connection is doing, as its watchdog sees it.
struct Activity {
    /// Requests whose headers were read and whose response is not produced yet.
    in_flight: u32,
    /// When the connection last became ready for a request (accepted, or a response produced).
    ready_since: Instant,
    /// The first byte read since then, if any: a request's headers are on their way.
    first_byte: Option<Instant>,
}

/// When a connection's watchdog closes it, and why.
struct Deadline {
    at: Instant,
    kind: HttpTimeout,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: 0,
            ready_since: Instant::now(),
            first_byte: None,
        }
    }

    fn deadline(&self, limits: &ConnectionLimits) -> Deadline {
        match (self.in_flight, self.first_byte) {
            // A request is being answered: its own bound is the store timeout; look again later.
            (1.., _) => Deadline {
                at: Instant::now() + limits.idle_timeout,
                kind: HttpTimeout::Idle,
            },
            (0, Some(first)) => Deadline {
                at: first + limits.header_timeout,
                kind: HttpTimeout::Header,
            },
            (0, None) => Deadline {
                at: self.ready_since + limits.idle_timeout,
                kind: HttpTimeout::Idle,
            },
        }
    }
}

/// A connection's [`Activity`], and a wake-up for its watchdog when it changes.
struct Watch {
    state: Mutex<Activity>,
    changed: Notify,
}

impl Watch {
    fn lock(&self) -> std::sync::MutexGuard<'_, Activity> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A request in flight on a connection; dropping it (the response is produced, or the request abandoned) makes
/// the connection ready for the next one.
struct InFlight(Arc<Watch>);

impl InFlight {
    fn begin(watch: &Arc<Watch>) -> Self {
        let mut state = watch.lock();
        state.in_flight += 1;
        state.first_byte = None;
        drop(state);
        watch.changed.notify_one();
        Self(Arc::clone(watch))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        state.ready_since = Instant::now();
        state.first_byte = None;
        drop(state);
        self.0.changed.notify_one();
    }
}

/// A response body that keeps its request in flight until hyper has sent it or dropped it.
struct Tracked {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The connection's socket, noting when the first byte of a request arrives.
struct WatchedStream {
    stream: TcpStream,
    activity: Arc<Watch>,
}

impl AsyncRead for WatchedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            let mut state = self.activity.lock();
            if state.in_flight == 0 && state.first_byte.is_none() {
                state.first_byte = Some(Instant::now());
                drop(state);
                self.activity.changed.notify_one();
            }
        }
        result
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
