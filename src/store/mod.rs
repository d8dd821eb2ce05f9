//! The store path: aihub's two-stage query over the existing `agent_events` collection ([contract section
//! 4](../../docs/contract.md#4)), with standard MongoDB commands only, rows decoded by the shared decoder. It reads;
//! it never writes, creates collections or builds indexes.
//!
//! Stage 1 finds the client-visible displays (the distinct displays of `UserAgent` display markers); stage 2 fetches
//! the projectable families on those displays, sorted, with a projection of only what the decoder reads. Both stages
//! name the index with a hint ([design 2b](../../docs/design.md#2b)); when the store says the index does not exist,
//! they run again without it, and that is logged once per process and counted.
//!
//! The view cache reads through [`StoreReads`] (the two stages, a fill, a shadow check's rows and explain's row
//! metadata), so its unit tests can run on an in-memory fake. Every query and ping reports its outcome to [`Coverage`] in one place ([`Store::bounded`]);
//! every query is counted and traced (a client span by the database semantic conventions) in one place
//! ([`Store::query`]).
//!
//! One job a file: this one holds the [`Store`] handle (its clients and connection pools, the outcome of each
//! query); `reads.rs` the [`StoreReads`] it implements; [`query`] what each query sends and how its rows are read; [`deadline`] a
//! query's deadline (`maxTimeMS`) and byte budget; [`hint`] the index hints and their fallback; [`error`] the
//! [`StoreError`] a query fails with and how a driver error is sorted into it; [`settings`] its settings and the
//! bounds every component shares; [`metrics`] its metrics.

mod deadline;
mod error;
mod hint;
mod metrics;
mod query;
mod reads;
mod settings;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use mongodb::bson::oid::ObjectId;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc};
use mongodb::error::{Error as MongoError, ErrorKind};
use mongodb::options::{ClientOptions, ConnectionString};
use mongodb::{Client, Collection, Database};

pub use deadline::Bounds;
pub use error::StoreError;
pub use metrics::StoreMetrics;
pub use query::{events_filter, events_sort, fill_filter, markers_pipeline, projection};
pub use settings::{DEFAULT_FILL_INDEX_HINT, DEFAULT_INDEX_HINT, StoreSettings};

use crate::bounds::StoreBounds;

use crate::coverage::Coverage;
use crate::decode::ViewEvent;
use crate::explain::RowMeta;
use crate::shadow::StoredRow;
use crate::telemetry::RateLimit;
use hint::IndexHint;
use query::find_row_metadata;

/// Connections of the fills' own pool: fills run one batch at a time, so a few suffice.
const FILL_POOL_SIZE: u32 = 2;

/// Why the worker read the store: a hydration on a read, or one in the background once the persister-lag bound
/// has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hydration {
    OnRead,
    Reread,
    /// A starting worker's warm-up of the hot set its predecessor handed over ([`crate::warm_up`]), off the read path.
    Warm,
    /// A shadow check's read ([`crate::shadow`]), on a connection pool of its own.
    Shadow,
}

/// The store queries, by what they are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryKind {
    /// Stage 1 of a hydration: displays with a `UserAgent` marker.
    Markers(Hydration),
    /// Stage 2 of a hydration: the projectable events on those displays.
    Events(Hydration),
    /// The stored events of displays a live marker made visible (off the read path).
    Fill,
    /// Every row of a thread, without payloads, for `explain`.
    Explain,
}

impl QueryKind {
    pub const ALL: [QueryKind; 10] = [
        QueryKind::Markers(Hydration::OnRead),
        QueryKind::Events(Hydration::OnRead),
        QueryKind::Markers(Hydration::Reread),
        QueryKind::Events(Hydration::Reread),
        QueryKind::Markers(Hydration::Warm),
        QueryKind::Events(Hydration::Warm),
        QueryKind::Markers(Hydration::Shadow),
        QueryKind::Events(Hydration::Shadow),
        QueryKind::Fill,
        QueryKind::Explain,
    ];

    /// The `kind` label of `history_view_store_queries_total`.
    pub fn label(self) -> &'static str {
        match self {
            QueryKind::Markers(Hydration::OnRead) => "hydration_markers",
            QueryKind::Events(Hydration::OnRead) => "hydration_events",
            QueryKind::Markers(Hydration::Reread) => "reread_markers",
            QueryKind::Events(Hydration::Reread) => "reread_events",
            QueryKind::Markers(Hydration::Warm) => "warm_markers",
            QueryKind::Events(Hydration::Warm) => "warm_events",
            QueryKind::Markers(Hydration::Shadow) => "shadow_markers",
            QueryKind::Events(Hydration::Shadow) => "shadow_events",
            QueryKind::Fill => "fill",
            QueryKind::Explain => "explain",
        }
    }

    /// The MongoDB command a query of this kind runs (a span's `db.operation.name`): stage 1 is an aggregation,
    /// the others are finds.
    pub fn operation(self) -> &'static str {
        match self {
            QueryKind::Markers(_) => "aggregate",
            QueryKind::Events(_) | QueryKind::Fill | QueryKind::Explain => "find",
        }
    }

    /// The `stage` label of `history_view_store_query_duration_seconds`.
    pub fn stage(self) -> &'static str {
        match self {
            QueryKind::Markers(_) => "markers",
            QueryKind::Events(_) => "events",
            QueryKind::Fill => "fill",
            QueryKind::Explain => "explain",
        }
    }
}

/// What stage 1 found: the thread's visible displays.
#[derive(Debug, Default)]
pub struct VisibleDisplays {
    /// The displays with a `UserAgent` marker: what stage 2 covers.
    pub displays: Vec<String>,
    /// Marker rows whose `display_id` is not a string, skipped (no delivery key can hold one).
    pub skipped_markers: u64,
}

/// The store reads the view cache makes: the two stages of a hydration and a fill. [`Store`] runs them on MongoDB;
/// the cache's unit tests run them on an in-memory fake, so every race the cache handles is tested without servers.
pub trait StoreReads: Send + Sync + 'static {
    /// Stage 1: the distinct string display ids of the thread's `UserAgent` display markers.
    ///
    /// # Errors
    /// [`StoreError`] when the store fails, does not answer by the deadline, or the displays exceed the budget.
    fn visible_displays(
        &self,
        thread_id: &str,
        hydration: Hydration,
        bounds: Bounds,
    ) -> impl Future<Output = Result<VisibleDisplays, StoreError>> + Send;

    /// Stage 2: the projectable events on `displays`, decoded, in store order (`created_at`, `event_id`).
    ///
    /// # Errors
    /// As for stage 1; `TooLarge` as soon as the events exceed the budget.
    fn display_events(
        &self,
        thread_id: &str,
        displays: &[String],
        hydration: Hydration,
        bounds: Bounds,
    ) -> impl Future<Output = Result<Vec<ViewEvent>, StoreError>> + Send;

    /// A shadow check's stage 2: the projectable rows on `displays` in store order, each with its `_id` time, on the
    /// shadow checks' own connection pool.
    ///
    /// # Errors
    /// As for stage 2.
    fn stored_rows(
        &self,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
    ) -> impl Future<Output = Result<Vec<StoredRow>, StoreError>> + Send;

    /// A fill: the projectable events of the given displays of a batch of threads, in one query, unsorted. A
    /// display id of one thread may also occur in another: the caller keeps each view's rows.
    ///
    /// # Errors
    /// As for stage 2.
    fn fill_events(
        &self,
        wanted: &[(&str, &[Box<str>])],
        bounds: Bounds,
    ) -> impl Future<Output = Result<Vec<ViewEvent>, StoreError>> + Send;

    /// `explain`'s read: every row of the thread without its payload, in stage 2's order
    /// ([design 3.3](../../docs/design.md#3.3)).
    ///
    /// # Errors
    /// As for stage 2.
    fn row_metadata(
        &self,
        thread_id: &str,
        bounds: Bounds,
    ) -> impl Future<Output = Result<Vec<RowMeta>, StoreError>> + Send;
}

/// Read access to the event collection. Cloning is cheap.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    /// `HISTORY_VIEW_MONGODB_URI`, already checked by [`ConnectionString::parse`]; never logged (it may hold a
    /// password).
    uri: String,
    database_name: String,
    collection_name: String,
    /// The driver's clients, made once the URI resolves: a `mongodb+srv://` URI needs its SRV (and TXT) records
    /// first, so a DNS failure leaves this empty and every store call tries again (the readiness ping every second).
    clients: tokio::sync::OnceCell<Clients>,
    /// The index both hydration stages name.
    thread_hint: IndexHint,
    /// The index a fill names.
    display_hint: IndexHint,
    /// The store timeout bounds a ping and connecting (a read's queries are bounded by its own deadline); rows
    /// persisted later than the persister-lag bound after their `created_at` are warned about.
    bounds: StoreBounds,
    /// Whether shadow checks run (their client is made with the others).
    shadow: bool,
    metrics: Arc<StoreMetrics>,
    /// Told the outcome of every query and ping, in one place ([`Store::bounded`]): an outage ends coverage, the
    /// first answer after one starts it again.
    coverage: Coverage,
    /// Rate limit of the warning about rows persisted later than the bound.
    lag_warnings: RateLimit,
}

/// The collection through the driver's clients.
struct Clients {
    database: Database,
    collection: Collection<RawDocumentBuf>,
    /// The same collection through the fills' own client.
    fill_collection: Collection<RawDocumentBuf>,
    /// The same collection through the shadow checks' own client, when they are on.
    shadow_collection: Option<Collection<RawDocumentBuf>>,
}

impl Store {
    /// Prepares the store; it connects lazily, so a store that is down does not stop start-up (readiness shows
    /// it). A `mongodb+srv://` URI whose DNS records cannot be resolved now does not stop it either: the worker
    /// starts, its readiness names the store, and resolution is tried again on every store call.
    ///
    /// # Errors
    /// The URI cannot be parsed or names options the driver rejects.
    pub async fn connect(
        settings: &StoreSettings,
        bounds: StoreBounds,
        shadow: bool,
        metrics: Arc<StoreMetrics>,
        coverage: Coverage,
    ) -> Result<Self, MongoError> {
        let uri = settings.uri.expose();
        let timeout = bounds.store_timeout;
        // The syntax and the options are checked now, without DNS.
        ConnectionString::parse(uri)?;
        let store = Self {
            inner: Arc::new(Inner {
                uri: uri.to_owned(),
                database_name: settings.database.clone(),
                collection_name: settings.collection.clone(),
                clients: tokio::sync::OnceCell::new(),
                thread_hint: IndexHint::new(settings.thread_hint().map(str::to_owned)),
                display_hint: IndexHint::new(settings.display_hint().map(str::to_owned)),
                bounds,
                shadow,
                metrics,
                coverage,
                lag_warnings: RateLimit::default(),
            }),
        };
        match tokio::time::timeout(timeout, store.clients()).await {
            Ok(Ok(_)) => {}
            Ok(Err(StoreError::Query(error)))
                if !matches!(error.kind.as_ref(), ErrorKind::DnsResolve { .. }) =>
            {
                return Err(error);
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, cause = ?std::error::Error::source(&error).map(ToString::to_string),
                    "the store's address does not resolve yet; retrying (readiness names the store until it does)");
            }
            Err(_) => tracing::warn!(
                ?timeout,
                "the store's address did not resolve within the store timeout; retrying"
            ),
        }
        Ok(store)
    }

    /// Shuts the driver's clients down (within `limit`), so that none of their background tasks is still running
    /// when the runtime stops: left to the runtime's drop, a connection task could find its pool gone and panic
    /// after the worker said it stopped. Nothing is waited for beyond `limit`.
    pub async fn shut_down(&self, limit: Duration) {
        let Some(clients) = self.inner.clients.get() else {
            return;
        };
        // One driver client each: the reads', the fills' and the shadow checks'.
        let drivers = [
            Some(&clients.collection),
            Some(&clients.fill_collection),
            clients.shadow_collection.as_ref(),
        ];
        let all = futures_util::future::join_all(drivers.into_iter().flatten().map(|collection| {
            collection
                .client()
                .clone()
                .shutdown()
                .immediate(true)
                .into_future()
        }));
        if tokio::time::timeout(limit, all).await.is_err() {
            tracing::debug!("the store's clients did not shut down in time");
        }
    }

    /// The driver's clients, made on first use: resolving a `mongodb+srv://` URI needs DNS, which may fail now
    /// and succeed later (every caller bounds this by its own timeout).
    async fn clients(&self) -> Result<&Clients, StoreError> {
        self.inner
            .clients
            .get_or_try_init(|| async {
                let inner = &self.inner;
                let mut options = ClientOptions::parse(inner.uri.as_str())
                    .await
                    .map_err(StoreError::Query)?;
                options
                    .app_name
                    .get_or_insert_with(|| "chat-history-view".to_owned());
                // A store that is down must fail a read within the read timeout, not the driver's 30 s default.
                options.server_selection_timeout = Some(inner.bounds.store_timeout);
                options
                    .connect_timeout
                    .get_or_insert(inner.bounds.store_timeout);
                // Fills get a client (and so a connection pool) of their own: a fill holds up the reads of its
                // thread, so it must not queue behind other threads' hydrations for a connection.
                let mut fill_options = options.clone();
                fill_options.max_pool_size = Some(FILL_POOL_SIZE);
                let fill_client =
                    Client::with_options(fill_options.clone()).map_err(StoreError::Query)?;
                // Shadow checks likewise: they must never delay a read or a hydration.
                let shadow_collection = if inner.shadow {
                    let client = Client::with_options(fill_options).map_err(StoreError::Query)?;
                    Some(
                        client
                            .database(&inner.database_name)
                            .collection(&inner.collection_name),
                    )
                } else {
                    None
                };
                let client = Client::with_options(options).map_err(StoreError::Query)?;
                let database = client.database(&inner.database_name);
                Ok(Clients {
                    collection: database.collection(&inner.collection_name),
                    fill_collection: fill_client
                        .database(&inner.database_name)
                        .collection(&inner.collection_name),
                    shadow_collection,
                    database,
                })
            })
            .await
    }

    /// Runs `query` until `deadline`, and tells the coverage its outcome: the one place where the store's outages
    /// and answers are reported, for every query and ping.
    async fn bounded<T>(
        &self,
        deadline: Instant,
        query: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.inner.bounds.store_timeout;
        let result = tokio::time::timeout_at(deadline, query)
            .await
            .unwrap_or(Err(StoreError::Timeout(timeout)));
        let coverage = &self.inner.coverage;
        match &result {
            Ok(_) => coverage.store_answered(coverage.now()),
            Err(error) => {
                if error.is_outage() {
                    coverage.store_failed();
                }
                if let Some(kind) = error.kind() {
                    self.inner.metrics.error(kind);
                }
            }
        }
        result
    }

    /// Runs the store query `query` of `kind` until `deadline` ([`Store::bounded`]) inside its client span, and
    /// records its outcome: the one place every query is counted (`history_view_store_queries_total` when it
    /// answered; `history_view_store_errors_total`, in `bounded`, when it failed) and traced.
    async fn query<T>(
        &self,
        kind: QueryKind,
        deadline: Instant,
        query: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let span = query_span(kind, &self.inner.database_name, &self.inner.collection_name);
        let started = Instant::now();
        let result = self.bounded(deadline, query).instrument(span.clone()).await;
        match &result {
            Ok(_) => self.inner.metrics.query(kind, started.elapsed()),
            Err(error) => record_failure(&span, error),
        }
        result
    }

    /// Answers whether the store responds to `ping` within the timeout.
    ///
    /// # Errors
    /// [`StoreError`] when it does not.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(self.inner.bounds.store_deadline(), async {
            let clients = self.clients().await?;
            clients
                .database
                .run_command(doc! {"ping": 1})
                .await
                .map(|_| ())
                .map_err(StoreError::Query)
        })
        .await
    }
}

/// A query's client span ([design 5](../../docs/design.md#5), "Traces"), by the database semantic conventions: a
/// child of whatever span is current (a hydration, a fill, a shadow check, an explain's request).
fn query_span(kind: QueryKind, database: &str, collection: &str) -> tracing::Span {
    tracing::info_span!(
        "query",
        otel.name = %format!("{} {collection}", kind.operation()),
        otel.kind = "client",
        db.system.name = "mongodb",
        db.namespace = database,
        db.collection.name = collection,
        db.operation.name = kind.operation(),
        chat_history_view.query = kind.label(),
        otel.status_code = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Marks a failed query's span an error, of the `kind` `history_view_store_errors_total` counts it under. A
/// thread over the per-thread limit is no failure: the store answered, the read stopped.
fn record_failure(span: &tracing::Span, error: &StoreError) {
    if let Some(kind) = error.kind() {
        span.record("otel.status_code", "error");
        span.record("error.type", kind);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use opentelemetry::trace::{SpanKind, Status};

    use super::*;
    use crate::telemetry::testing::{attribute, record};

    #[test]
    fn a_query_span_follows_the_database_conventions_and_a_failure_names_its_kind() {
        let spans = record();
        for (kind, error) in [
            (QueryKind::Markers(Hydration::OnRead), None),
            (
                QueryKind::Fill,
                Some(StoreError::Timeout(Duration::from_secs(1))),
            ),
            (QueryKind::Explain, Some(StoreError::TooLarge { limit: 1 })),
        ] {
            let span = query_span(kind, "aihub", "agent_events");
            span.in_scope(|| {});
            if let Some(error) = error {
                record_failure(&span, &error);
            }
        }
        let text = |span: &opentelemetry_sdk::trace::SpanData, key: &str| {
            attribute(span, key).map(|v| v.to_string())
        };
        let markers = spans.one("aggregate agent_events");
        assert_eq!(markers.span_kind, SpanKind::Client);
        for (key, value) in [
            ("db.system.name", "mongodb"),
            ("db.namespace", "aihub"),
            ("db.collection.name", "agent_events"),
            ("db.operation.name", "aggregate"),
            ("chat_history_view.query", "hydration_markers"),
        ] {
            assert_eq!(text(&markers, key).as_deref(), Some(value), "{key}");
        }
        assert_eq!(markers.status, Status::Unset);
        let finds = spans.named("find agent_events");
        let fill = &finds[0];
        assert_eq!(
            text(fill, "chat_history_view.query").as_deref(),
            Some("fill")
        );
        assert!(matches!(fill.status, Status::Error { .. }));
        assert_eq!(text(fill, "error.type").as_deref(), Some("timeout"));
        let explain = &finds[1];
        assert_eq!(
            text(explain, "chat_history_view.query").as_deref(),
            Some("explain")
        );
        assert_eq!(
            explain.status,
            Status::Unset,
            "a thread over the limit is no failure"
        );
        assert_eq!(text(explain, "error.type"), None);
    }
}
