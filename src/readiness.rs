//! `Readiness`: whether the worker can serve correct reads now: its NATS subscription is live (confirmed by a
//! round trip, see [`Coverage`]) and the store answered a ping recently, and whether it should be sent any: not
//! once it is shutting down, nor while it warms up its cache. The ingest loop reports the subscription; a background
//! task pings the store (the store itself tells [`Coverage`] of outages, as for every query); the warm-up holds
//! readiness until it is done ([`crate::warm_up`]); the shutdown marks the worker stopping.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::coverage::Coverage;
use crate::store::Store;

/// How often the store is pinged.
pub const STORE_PING_INTERVAL: Duration = Duration::from_secs(1);
/// A successful ping older than this no longer counts: three missed pings make the worker unready.
pub const STORE_PING_FRESHNESS: Duration = Duration::from_secs(3);

/// Shared readiness state. Cloning is cheap.
#[derive(Clone)]
pub struct Readiness {
    inner: Arc<Inner>,
}

struct Inner {
    started: Instant,
    /// Whether the subscription is confirmed live.
    coverage: Coverage,
    /// The NATS connection is up.
    connected: AtomicBool,
    /// The display-event subscription exists and its stream has not ended.
    subscribed: AtomicBool,
    /// Milliseconds since `started` of the last successful store ping, plus one (0: never).
    store_ok_at_ms: AtomicU64,
    /// A stop signal came: `/readyz` answers 503 from then on, while the worker still serves for the shutdown delay
    /// (so the orchestrator takes it out of the endpoints before it stops accepting). Never cleared.
    stopping: AtomicBool,
    /// The warm-up of the hot set handed over runs: `/readyz` answers 503 until it is done or
    /// HISTORY_VIEW_WARM_MAX_SECS passed ([`crate::warm_up`]). Set once at the start, cleared once.
    warming: AtomicBool,
}

/// One dependency's state, for the `/readyz` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub ok: bool,
    pub detail: Cow<'static, str>,
}

impl Readiness {
    pub fn new(coverage: Coverage) -> Self {
        Self {
            inner: Arc::new(Inner {
                started: Instant::now(),
                coverage,
                connected: AtomicBool::new(false),
                subscribed: AtomicBool::new(false),
                store_ok_at_ms: AtomicU64::new(0),
                stopping: AtomicBool::new(false),
                warming: AtomicBool::new(false),
            }),
        }
    }

    /// Records whether the NATS connection is up.
    pub fn set_connected(&self, connected: bool) {
        self.inner.connected.store(connected, Ordering::Release);
    }

    /// Whether the NATS connection is up.
    pub fn nats_connected(&self) -> bool {
        self.inner.connected.load(Ordering::Acquire)
    }

    /// Records whether the display-event subscription exists.
    pub fn set_subscribed(&self, subscribed: bool) {
        self.inner.subscribed.store(subscribed, Ordering::Release);
    }

    /// Marks the worker as shutting down: from now on it is not ready, whatever its dependencies say.
    pub fn set_stopping(&self) {
        self.inner.stopping.store(true, Ordering::Release);
    }

    /// Whether the worker is shutting down (the shutdown delay, then the drain).
    pub fn stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::Acquire)
    }

    /// The warm-up starts: not ready until [`Readiness::set_warmed`].
    pub fn set_warming(&self) {
        self.inner.warming.store(true, Ordering::Release);
    }

    /// The warm-up is done, or ran out of time, or cannot run.
    pub fn set_warmed(&self) {
        self.inner.warming.store(false, Ordering::Release);
    }

    /// Whether the warm-up is over (or never ran).
    pub fn warm_up(&self) -> Check {
        if self.inner.warming.load(Ordering::Acquire) {
            Check {
                ok: false,
                detail: "warm-up: hydrating the threads the previous worker read last (at most HISTORY_VIEW_WARM_MAX_SECS)".into(),
            }
        } else {
            Check {
                ok: true,
                detail: "warm-up done, or none".into(),
            }
        }
    }

    /// Whether the worker still takes new clients: false once it is shutting down.
    pub fn shutdown(&self) -> Check {
        if self.stopping() {
            Check {
                ok: false,
                detail: "shutting down: still serving for HISTORY_VIEW_SHUTDOWN_DELAY_SECS while the endpoints are removed, then draining".into(),
            }
        } else {
            Check {
                ok: true,
                detail: "not shutting down".into(),
            }
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records a successful store ping.
    pub fn store_answered(&self) {
        self.inner
            .store_ok_at_ms
            .store(self.now_ms() + 1, Ordering::Release);
    }

    pub fn nats(&self) -> Check {
        if !self.inner.subscribed.load(Ordering::Acquire) {
            Check {
                ok: false,
                detail: "not subscribed to display events".into(),
            }
        } else if !self.inner.connected.load(Ordering::Acquire) {
            Check {
                ok: false,
                detail: "not connected to NATS".into(),
            }
        } else if self.inner.coverage.catch_up().no_stream() {
            Check {
                ok: false,
                detail: "JetStream: no stream matches HISTORY_VIEW_JETSTREAM_STREAMS, or JetStream is unavailable or refused (see the ERROR log)".into(),
            }
        } else if let refusing = self.inner.coverage.catch_up().refusing()
            && !refusing.is_empty()
        {
            let streams: Vec<String> = refusing
                .iter()
                .map(|(stream, why)| format!("stream {stream} {}", why.describe()))
                .collect();
            Check {
                ok: false,
                detail: format!(
                    "JetStream: {} (see the ERROR log); reads go to the store",
                    streams.join("; ")
                )
                .into(),
            }
        } else if !self.inner.coverage.is_live() {
            Check {
                ok: false,
                detail: "subscription not yet confirmed by a round trip to NATS".into(),
            }
        } else if !self.inner.coverage.catch_up().lanes_caught_up() {
            Check {
                ok: false,
                detail: "JetStream consumers are catching up with their streams".into(),
            }
        } else {
            Check {
                ok: true,
                detail: "subscribed".into(),
            }
        }
    }

    pub fn store(&self) -> Check {
        let last = self.inner.store_ok_at_ms.load(Ordering::Acquire);
        if last == 0 {
            return Check {
                ok: false,
                detail: "store has not answered a ping yet".into(),
            };
        }
        let age = Duration::from_millis(self.now_ms().saturating_sub(last - 1));
        if age <= STORE_PING_FRESHNESS {
            Check {
                ok: true,
                detail: "store answered a ping recently".into(),
            }
        } else {
            Check {
                ok: false,
                detail: "store has not answered a ping recently".into(),
            }
        }
    }

    /// Pings the store every [`STORE_PING_INTERVAL`] until `stop` is cancelled.
    pub async fn ping_store_until(self, store: Store, stop: CancellationToken) {
        let mut was_ok = None;
        loop {
            let result = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                result = store.ping() => result,
            };
            let ok = result.is_ok();
            if ok {
                self.store_answered();
            }
            if was_ok != Some(ok) {
                match &result {
                    Ok(()) => tracing::info!("store answers pings"),
                    Err(error) => {
                        tracing::warn!(error = %error, cause = ?std::error::Error::source(error).map(ToString::to_string), "store does not answer pings")
                    }
                }
                was_ok = Some(ok);
            }
            tokio::select! {
                biased;
                () = stop.cancelled() => return,
                () = tokio::time::sleep(STORE_PING_INTERVAL) => {}
            }
        }
    }
}
