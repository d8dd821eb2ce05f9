//! P2's ceiling: the worker's own HTTP stack (accept loop, router, token and in-flight middleware, limits) with a
//! history handler that returns the same pre-serialized body and headers without touching the cache. It runs on a
//! runtime of its own (as many threads as the worker's), in the bench process, so the cached read can be compared
//! with what the HTTP layer alone achieves on the same machine in the same run.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderValue, header};
use axum::response::IntoResponse;
use axum::routing::get;
use chat_history_view::cache::{CacheSetup, ViewCache};
use chat_history_view::config::Config;
use chat_history_view::coverage::Coverage;
use chat_history_view::http::SOURCE_HEADER;
use chat_history_view::http::{AppState, accept_loop, reserve_router, router_with};
use chat_history_view::readiness::Readiness;
use chat_history_view::startup::Metrics;
use chat_history_view::startup::openapi_json;
use chat_history_view::store::Store;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A running ceiling server; dropping it stops it.
pub struct Ceiling {
    pub base_url: String,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ceiling {
    /// Serves `body` with `etag` at `/v1/threads/{any}/history` on 127.0.0.1, with the worker's default limits.
    pub fn start(mongo_uri: &str, body: Bytes, etag: String) -> Self {
        let config = Config::try_load_from([
            "ceiling",
            "--mongodb-uri",
            mongo_uri,
            "--listen",
            "127.0.0.1:0",
            "--shutdown-delay-secs",
            "0",
        ])
        .expect("the ceiling's settings parse");
        let stop = CancellationToken::new();
        let (address_tx, address_rx) = std::sync::mpsc::channel();
        let thread_stop = stop.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get()))
                .enable_all()
                .build()
                .expect("the ceiling's runtime");
            runtime.block_on(serve(config, body, etag, address_tx, thread_stop));
        });
        let address = address_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the ceiling listens");
        Self {
            base_url: format!("http://{address}"),
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Ceiling {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    config: Config,
    body: Bytes,
    etag: String,
    address: std::sync::mpsc::Sender<std::net::SocketAddr>,
    stop: CancellationToken,
) {
    let metrics = Metrics::new();
    let coverage = Coverage::new(config.bounds.persist_lag);
    // The store is never asked: the client connects lazily.
    let store = Store::connect(
        &config.store,
        config.bounds,
        config.shadow.enabled(),
        Arc::clone(&metrics.store),
        coverage.clone(),
    )
    .await
    .expect("a store client");
    // The live source proves what it applied every quarter of the window, as Core NATS's probes do.
    let freshness = chat_history_view::freshness::Freshness::new(
        coverage.clone(),
        chat_history_view::source::Timing::for_lag(config.bounds.persist_lag).silence,
    );
    tokio::spawn({
        let (coverage, freshness) = (coverage.clone(), freshness.clone());
        async move {
            loop {
                freshness.covered(chat_history_view::freshness::Part::Probe, coverage.now());
                tokio::time::sleep(freshness.prove_every()).await;
            }
        }
    });
    let views = ViewCache::new(
        store,
        metrics.views(),
        coverage.clone(),
        freshness,
        CacheSetup {
            settings: config.cache.clone(),
            shadow: config.shadow.clone(),
            bounds: config.bounds,
            gap_window: config.nats.gap_window(),
        },
    );
    let state = AppState {
        views,
        metrics: Arc::clone(&metrics.http),
        exposition: metrics.exposition.clone(),
        readiness: Readiness::new(coverage),
        api_token: None,
        inspector: false,
        openapi: openapi_json().expect("the OpenAPI document"),
        reads: Arc::new(tokio::sync::Semaphore::new(config.http.max_in_flight)),
        waiting: Arc::new(tokio::sync::Semaphore::new(config.http.max_waiting)),
        streams: Arc::new(tokio::sync::Semaphore::new(config.http.max_streams)),
        peers: None,
    };
    let etag = HeaderValue::from_str(&etag).expect("an ETag header value");
    let fixed = get(move || {
        let (body, etag) = (body.clone(), etag.clone());
        async move {
            (
                [
                    (
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    ),
                    (header::ETAG, etag),
                    (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
                    (
                        header::HeaderName::from_static(SOURCE_HEADER),
                        HeaderValue::from_static("cache"),
                    ),
                ],
                body,
            )
                .into_response()
        }
    });
    let listener = tokio::net::TcpListener::bind(config.http.listen)
        .await
        .expect("the ceiling binds");
    address
        .send(listener.local_addr().expect("a local address"))
        .expect("the bench waits for the address");
    accept_loop(
        listener,
        router_with(state.clone(), fixed),
        reserve_router(state),
        config.http.connection_limits(),
        metrics.http,
        TaskTracker::new(),
        stop,
    )
    .await;
}
