//! An OTLP/HTTP endpoint that accepts spans and discards them, for P1's runs with tracing on: `POST /v1/traces`
//! answers 200 with an empty `application/x-protobuf` body (an empty `ExportTraceServiceResponse`, full success), so
//! the worker's exporter runs as it would against a collector while the bench spends next to nothing on it. It counts
//! what it was sent, so a run shows that its worker exported.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::routing::post;
use bytes::Bytes;

/// What the sink received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exported {
    /// Export requests (each a batch of spans).
    pub requests: u64,
    /// Their bodies' bytes (protobuf, uncompressed).
    pub bytes: u64,
}

impl Exported {
    /// What arrived after `earlier`.
    pub fn since(self, earlier: Exported) -> Exported {
        Exported {
            requests: self.requests - earlier.requests,
            bytes: self.bytes - earlier.bytes,
        }
    }
}

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// The running sink, on a free port of 127.0.0.1 in the bench's runtime; stopped on drop.
pub struct OtlpSink {
    endpoint: String,
    counts: Arc<Counts>,
    server: tokio::task::JoinHandle<()>,
}

impl OtlpSink {
    pub async fn start() -> Self {
        let counts = Arc::new(Counts::default());
        let router = Router::new()
            .route("/v1/traces", post(traces))
            // A batch of spans may exceed axum's default 2 MB limit; the worker's exporter would count a refusal as
            // a failed export.
            .layer(DefaultBodyLimit::disable())
            .with_state(Arc::clone(&counts));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("the OTLP sink binds a port of 127.0.0.1");
        let endpoint = format!(
            "http://{}",
            listener.local_addr().expect("the sink's address")
        );
        let server = tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the OTLP sink serves");
        });
        Self {
            endpoint,
            counts,
            server,
        }
    }

    /// The base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// What arrived so far.
    pub fn received(&self) -> Exported {
        Exported {
            requests: self.counts.requests.load(Ordering::Relaxed),
            bytes: self.counts.bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn traces(
    State(counts): State<Arc<Counts>>,
    body: Bytes,
) -> ([(axum::http::HeaderName, &'static str); 1], Bytes) {
    counts.requests.fetch_add(1, Ordering::Relaxed);
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    ([(CONTENT_TYPE, "application/x-protobuf")], Bytes::new())
}
