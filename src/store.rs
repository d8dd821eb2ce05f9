//! The store path: aihub's two-stage query over the existing `agent_events` collection ([contract section
//! 4](../docs/contract.md#4)), with standard MongoDB commands only, rows decoded by the shared decoder. It reads; it
//! never writes, creates collections or builds indexes.
//!
//! Stage 1 finds the client-visible displays (the distinct displays of `UserAgent` display markers); stage 2 fetches
//! the projectable families on those displays, sorted, with a projection of only what the decoder reads. Both stages
//! name the index with a hint ([design 2b](../docs/design.md#2b)); when the store says the index does not exist, they
//! run again without it, and that is logged once per process and counted.
//!
//! The view cache reads through [`StoreReads`] (the two stages and a fill), so its unit tests can run on an in-memory
//! fake. Every query and ping reports its outcome to [`Coverage`] in one place ([`Store::bounded`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use mongodb::bson::oid::ObjectId;
use mongodb::bson::raw::RawBsonRef;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc};
use mongodb::error::{Error as MongoError, ErrorKind};
use mongodb::options::{ClientOptions, ConnectionString, Hint};
use mongodb::{Client, Collection, Database};

use crate::coverage::Coverage;
use crate::decode::{
    DISPLAY_EVENT, Decoded, EVENT_DATA_FIELDS, Family, USER_AGENT, ViewEvent, decode_row, row_key,
};
use crate::explain::RowMeta;
use crate::metrics::Metrics;
use crate::shadow::StoredRow;
use crate::subject::KEY_FIELDS;
use crate::telemetry::RateLimit;
use crate::view::{display_bytes, event_bytes};

mod metrics;
mod settings;
pub use metrics::StoreMetrics;
pub use settings::{DEFAULT_FILL_INDEX_HINT, DEFAULT_INDEX_HINT, StoreBounds, StoreSettings};

/// Parents that make a `UserAgent` display event a visibility marker.
const MARKER_PARENTS: [&str; 2] = Family::parents(Family::MARKERS);
/// The five projectable families.
const FAMILY_PARENTS: [&str; 5] = Family::parents(Family::ALL);

/// Connections of the fills' own pool: fills run one batch at a time, so a few suffice.
const FILL_POOL_SIZE: u32 = 2;

/// Why the worker read the store: a hydration on a read, or one in the background once the persister-lag bound
/// has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hydration {
    OnRead,
    Reread,
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
    pub const ALL: [QueryKind; 8] = [
        QueryKind::Markers(Hydration::OnRead),
        QueryKind::Events(Hydration::OnRead),
        QueryKind::Markers(Hydration::Reread),
        QueryKind::Events(Hydration::Reread),
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
            QueryKind::Markers(Hydration::Shadow) => "shadow_markers",
            QueryKind::Events(Hydration::Shadow) => "shadow_events",
            QueryKind::Fill => "fill",
            QueryKind::Explain => "explain",
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

/// Why a store query failed. A read never answers a partial history: it answers 503, or 507 for `TooLarge`, or
/// 500 for `Rejected`.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the store query failed")]
    Query(#[source] MongoError),
    /// The store refused the query itself (a command error other than a missing index): retrying cannot help.
    #[error("the store rejected the query")]
    Rejected(#[source] MongoError),
    /// The thread's events exceed `HISTORY_VIEW_MAX_THREAD_BYTES`: the read stopped there rather than hold them.
    #[error(
        "the thread's events exceed the per-thread limit of {limit} bytes (HISTORY_VIEW_MAX_THREAD_BYTES)"
    )]
    TooLarge { limit: usize },
}

impl StoreError {
    /// The `kind` labels of `history_view_store_errors_total`.
    pub const KINDS: [&'static str; 4] = ["timeout", "unavailable", "failed", "rejected"];

    /// Its `kind` label; `None` for a thread over the per-thread limit (the store answered; counted by
    /// `history_view_thread_limit_exceeded_total`).
    pub fn kind(&self) -> Option<&'static str> {
        match self {
            StoreError::Timeout(_) => Some(Self::KINDS[0]),
            StoreError::Query(_) if self.is_outage() => Some(Self::KINDS[1]),
            StoreError::Query(_) => Some(Self::KINDS[2]),
            StoreError::Rejected(_) => Some(Self::KINDS[3]),
            StoreError::TooLarge { .. } => None,
        }
    }

    /// Whether the failure means the store is unreachable or stalled (so aihub's persister most likely could not
    /// write either), as opposed to a command the store answered with an error.
    ///
    /// Chosen: a timeout and every driver error other than a command or write error count as an outage.
    pub fn is_outage(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Query(error) => !matches!(
                error.kind.as_ref(),
                ErrorKind::Command(_) | ErrorKind::Write(_)
            ),
            StoreError::Rejected(_) | StoreError::TooLarge { .. } => false,
        }
    }

    /// Sorts a driver error: a command error whose code says the query itself is wrong is a rejection (a
    /// missing hinted index never gets here, it is retried without the hint); anything else, transient command
    /// errors such as `MaxTimeMSExpired` included, a failure that a later read may not meet.
    fn from_driver(error: MongoError) -> Self {
        match error.kind.as_ref() {
            ErrorKind::Command(command) if is_rejection(command.code) => {
                StoreError::Rejected(error)
            }
            _ => StoreError::Query(error),
        }
    }

    /// Whether the store said that a hinted index does not exist.
    fn is_missing_index(&self) -> bool {
        match self {
            StoreError::Query(error) | StoreError::Rejected(error) => is_missing_index(error),
            _ => false,
        }
    }
}

impl From<MongoError> for StoreError {
    fn from(error: MongoError) -> Self {
        StoreError::from_driver(error)
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

/// What bounds one query: the read's deadline (its `maxTimeMS` is the time left) and the bytes of compact events
/// (or displays, for stage 1) it may hold before it stops with [`StoreError::TooLarge`].
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub deadline: Instant,
    pub budget: usize,
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
    metrics: Metrics,
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

/// How long a hinted index found missing is not named again: queries run unhinted meanwhile, then the hint is
/// tried again (the index may have been built since).
const MISSING_INDEX_RECHECK: Duration = Duration::from_secs(300);

/// One configured hint, whether its missing index was already logged (once per process and index), and until
/// when it is known to be missing.
struct IndexHint {
    name: Option<String>,
    missing_logged: AtomicBool,
    missing_until: std::sync::Mutex<Option<Instant>>,
}

impl IndexHint {
    fn new(name: Option<String>) -> Self {
        Self {
            name,
            missing_logged: AtomicBool::new(false),
            missing_until: std::sync::Mutex::new(None),
        }
    }

    /// The hint to name now: none while the index is known to be missing.
    fn current(&self) -> Option<&str> {
        let missing = self
            .missing_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until);
        if missing { None } else { self.name.as_deref() }
    }

    fn found_missing(&self) {
        *self
            .missing_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Instant::now() + MISSING_INDEX_RECHECK);
    }
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
        metrics: Metrics,
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
                    self.inner.metrics.store.error(kind);
                }
            }
        }
        result
    }

    fn record_query(&self, kind: QueryKind, elapsed: Duration) {
        self.inner.metrics.store.query(kind, elapsed);
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

    /// Stage 1: the distinct string `display_id`s of the thread's `UserAgent` display markers, and how many
    /// distinct values of another type were skipped.
    ///
    /// Chosen: an aggregation (`$match`, then `$group` on `display_id`) rather than the `distinct` command, because
    /// `distinct` accepts a hint only from MongoDB 7.1 while `aggregate` has accepted one since 3.6 (FerretDB 2
    /// speaks the 7.0 wire version). Same filter, same values; displays that are missing or null are dropped, as
    /// they cannot be a display a client sees.
    async fn find_displays(
        &self,
        thread_id: &str,
        hydration: Hydration,
        hint: Option<&str>,
        bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        let mut action = self
            .clients()
            .await?
            .for_query(hydration == Hydration::Shadow, false)
            .aggregate(markers_pipeline(thread_id))
            .max_time(time_left(bounds.deadline));
        if let Some(hint) = hint {
            action = action.hint(Hint::Name(hint.to_owned()));
        }
        let mut cursor = action.await?;
        let mut displays = Vec::new();
        let mut skipped = 0;
        let mut bytes = 0;
        while cursor.advance().await? {
            match cursor.current().get("_id") {
                Ok(Some(RawBsonRef::String(display))) => {
                    bytes += display_bytes(display);
                    if bytes > bounds.budget {
                        return Err(StoreError::TooLarge {
                            limit: bounds.budget,
                        });
                    }
                    displays.push(display.to_owned());
                }
                // Missing or null: no display a client sees.
                Ok(None | Some(RawBsonRef::Null)) => {}
                // Any other type cannot be part of a delivery key ([contract 6](../docs/contract.md#6)), so no event of
                // it is projected; it must not reach stage 2's `$in` either, where a document like `{"$ne": 1}` is an
                // error.
                _ => skipped += 1,
            }
        }
        Ok(VisibleDisplays {
            displays,
            skipped_markers: skipped,
        })
    }

    /// Stage 2 (sorted, in projection order) or a fill (unsorted: the view orders what it holds): the rows that
    /// `filter` selects, decoded as the cursor yields them, stopped with [`StoreError::TooLarge`] (its `limit` is
    /// the budget here; callers name their own) as soon as the compact events exceed `bounds.budget` bytes.
    async fn find_events<T>(
        &self,
        collection: &Collection<RawDocumentBuf>,
        filter: Document,
        sort: Option<Document>,
        hint: Option<&str>,
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let mut action = collection
            .find(filter)
            .projection(projection())
            .max_time(time_left(bounds.deadline));
        if let Some(sort) = sort {
            action = action.sort(sort);
        }
        if let Some(hint) = hint {
            action = action.hint(Hint::Name(hint.to_owned()));
        }
        let mut cursor = action.await?;
        let mut events = Vec::new();
        let mut bytes = 0;
        while cursor.advance().await? {
            let row = cursor.current();
            if let Decoded::Event(event) = decode_row(row) {
                bytes += event_bytes(&event);
                if bytes > bounds.budget {
                    return Err(StoreError::TooLarge {
                        limit: bounds.budget,
                    });
                }
                let id = row.get_object_id("_id").ok();
                if let (Some(id), Ok(created_at)) = (id, event.created_at) {
                    self.observe_persister_lag(id, created_at, &event);
                }
                events.push(keep(event, id));
            }
        }
        Ok(events)
    }

    /// Measures how long after its `created_at` a row was persisted (its `_id` time, whole seconds, so the figure
    /// is at most one second low and never high), and warns (rate-limited) when that exceeds the bound the
    /// completeness rule assumes.
    fn observe_persister_lag(&self, id: ObjectId, created_at_ns: i64, event: &ViewEvent) {
        let persisted_ns = i128::from(id.timestamp().timestamp_millis()) * 1_000_000;
        let lag_ns = persisted_ns - i128::from(created_at_ns);
        let bound = self.inner.bounds.persist_lag;
        if self.inner.metrics.store.persister_lag(lag_ns, bound) && self.inner.lag_warnings.allow()
        {
            let lag = Duration::from_nanos(u64::try_from(lag_ns).unwrap_or(u64::MAX));
            let key = &event.key;
            tracing::warn!(
                thread_id = key.thread_id(),
                display_id = key.display_id(),
                event_id = key.event_id(),
                lag_ms = u64::try_from(lag.as_millis()).unwrap_or(u64::MAX),
                bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
                "A stored event was persisted later than HISTORY_VIEW_PERSIST_LAG_MS after it was created; \
                 views may be served as complete without such events: raise the bound"
            );
        }
    }

    /// Runs `run` with `hint` (unless its index was found missing within the last few minutes); if the store
    /// rejects the hint because the index is missing, runs it again without one and remembers that.
    async fn with_hint_fallback<'a, T, F, Fut>(
        &'a self,
        hint: &'a IndexHint,
        run: F,
    ) -> Result<T, StoreError>
    where
        F: Fn(Option<&'a str>) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let name = hint.current();
        match run(name).await {
            Err(error) if name.is_some() && error.is_missing_index() => {
                self.inner.metrics.store.index_hint_fallback();
                hint.found_missing();
                if !hint.missing_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        index = name.unwrap_or_default(),
                        recheck_secs = MISSING_INDEX_RECHECK.as_secs(),
                        "The hinted index does not exist; history reads fall back to unhinted queries and will be \
                         slower (the hint is tried again every few minutes)"
                    );
                }
                run(None).await
            }
            other => other,
        }
    }
}

impl StoreReads for Store {
    async fn visible_displays(
        &self,
        thread_id: &str,
        hydration: Hydration,
        bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        let started = Instant::now();
        let displays = self
            .bounded(
                bounds.deadline,
                self.with_hint_fallback(&self.inner.thread_hint, |hint| {
                    self.find_displays(thread_id, hydration, hint, bounds)
                }),
            )
            .await?;
        self.record_query(QueryKind::Markers(hydration), started.elapsed());
        Ok(displays)
    }

    async fn display_events(
        &self,
        thread_id: &str,
        displays: &[String],
        hydration: Hydration,
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        self.stage_two(hydration, thread_id, displays, bounds, |event, _| event)
            .await
    }

    async fn stored_rows(
        &self,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
    ) -> Result<Vec<StoredRow>, StoreError> {
        self.stage_two(
            Hydration::Shadow,
            thread_id,
            displays,
            bounds,
            |event, id| StoredRow {
                event,
                persisted_ms: id.map(|id| id.timestamp().timestamp_millis()),
            },
        )
        .await
    }

    async fn fill_events(
        &self,
        wanted: &[(&str, &[Box<str>])],
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        let threads: Vec<&str> = wanted.iter().map(|(thread, _)| *thread).collect();
        let displays: Vec<Bson> = wanted
            .iter()
            .flat_map(|(_, displays)| displays.iter().map(|d| Bson::from(&**d)))
            .collect();
        self.events_query(
            QueryKind::Fill,
            fill_filter(&threads, &displays),
            bounds,
            |event, _| event,
        )
        .await
    }
}

impl Store {
    /// Every row of `thread_id` without its payload, in stage 2's order, for `explain`
    /// ([design 3.3](../docs/design.md#3.3)): its delivery key, `created_at`, and what the decoder's family filter
    /// makes of it. One query on the hydration index (its first field is `thread_id`), on the main pool, within
    /// `bounds` like a hydration (each row counts its key's bytes against the per-thread limit).
    ///
    /// # Errors
    /// [`StoreError`] as for stage 2.
    pub async fn row_metadata(
        &self,
        thread_id: &str,
        bounds: Bounds,
    ) -> Result<Vec<RowMeta>, StoreError> {
        let started = Instant::now();
        let rows = self
            .bounded(bounds.deadline, async {
                let clients = self.clients().await?;
                self.with_hint_fallback(&self.inner.thread_hint, |hint| {
                    find_row_metadata(&clients.collection, thread_id, hint, bounds)
                })
                .await
            })
            .await?;
        self.record_query(QueryKind::Explain, started.elapsed());
        Ok(rows)
    }
}

/// [`Store::row_metadata`]'s query.
async fn find_row_metadata(
    collection: &Collection<RawDocumentBuf>,
    thread_id: &str,
    hint: Option<&str>,
    bounds: Bounds,
) -> Result<Vec<RowMeta>, StoreError> {
    let mut projection = doc! {"_id": 0, "event_parents": 1, "event_data.created_at": 1};
    for field in KEY_FIELDS {
        projection.insert(field, 1);
    }
    let mut action = collection
        .find(doc! {"thread_id": thread_id})
        .projection(projection)
        .sort(events_sort())
        .max_time(time_left(bounds.deadline));
    if let Some(hint) = hint {
        action = action.hint(Hint::Name(hint.to_owned()));
    }
    let mut cursor = action.await?;
    let mut rows = Vec::new();
    let mut bytes = 0;
    while cursor.advance().await? {
        let row = metadata_of(cursor.current());
        bytes += row.bytes();
        if bytes > bounds.budget {
            return Err(StoreError::TooLarge {
                limit: bounds.budget,
            });
        }
        rows.push(row);
    }
    Ok(rows)
}

/// A row's metadata: its key and `created_at` as the decoder reads them, and whether the decoder keeps it. Its
/// payload fields were not fetched, so the decoded body is dropped.
fn metadata_of(row: &mongodb::bson::RawDocument) -> RowMeta {
    match decode_row(row) {
        Decoded::Event(event) => RowMeta {
            created_at: event.created_at.ok(),
            relevant: true,
            marker: event.is_marker(),
            key: event.key,
        },
        Decoded::Irrelevant => RowMeta {
            key: row_key(row),
            created_at: match row.get_document("event_data").map(|d| d.get("created_at")) {
                Ok(Ok(Some(RawBsonRef::Int64(n)))) => Some(n),
                Ok(Ok(Some(RawBsonRef::Int32(n)))) => Some(i64::from(n)),
                _ => None,
            },
            relevant: false,
            marker: false,
        },
    }
}

impl Clients {
    /// The collection through the client a query runs on: the shadow checks' (when on), the fills', or the main one.
    fn for_query(&self, shadow: bool, fill: bool) -> &Collection<RawDocumentBuf> {
        match (&self.shadow_collection, fill) {
            (Some(collection), _) if shadow => collection,
            _ if shadow || fill => &self.fill_collection,
            _ => &self.collection,
        }
    }
}

impl Store {
    /// Stage 2 of `thread_id` over `displays` for `hydration`, each row kept as `keep` makes it.
    async fn stage_two<T>(
        &self,
        hydration: Hydration,
        thread_id: &str,
        displays: &[String],
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let displays: Vec<Bson> = displays.iter().map(|d| Bson::from(d.as_str())).collect();
        self.events_query(
            QueryKind::Events(hydration),
            events_filter(thread_id, &displays),
            bounds,
            keep,
        )
        .await
    }

    /// Stage 2 (sorted, the hydration index, the main pool), a shadow check's stage 2 (sorted, its own pool) or a
    /// fill (unsorted, the display index, the fills' own pool): the rows `filter` selects, within `bounds`, recorded
    /// as `kind`, each kept as `keep` makes it.
    async fn events_query<T>(
        &self,
        kind: QueryKind,
        filter: Document,
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let fill = kind == QueryKind::Fill;
        let shadow = kind == QueryKind::Events(Hydration::Shadow);
        let hint = if fill {
            &self.inner.display_hint
        } else {
            &self.inner.thread_hint
        };
        let started = Instant::now();
        let events = self
            .bounded(bounds.deadline, async {
                let clients = self.clients().await?;
                let collection = clients.for_query(shadow, fill);
                self.with_hint_fallback(hint, |hint| {
                    let sort = (!fill).then(events_sort);
                    self.find_events(collection, filter.clone(), sort, hint, bounds, keep)
                })
                .await
            })
            .await?;
        self.record_query(kind, started.elapsed());
        Ok(events)
    }
}

/// A query's `maxTimeMS`: the read's time left (at least a millisecond, which the store reads as a limit; zero
/// would mean none).
fn time_left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Stage 1's pipeline: the thread's `UserAgent` display markers, grouped by display.
pub fn markers_pipeline(thread_id: &str) -> [Document; 2] {
    let filter = doc! {
        "thread_id": thread_id,
        "event_type": DISPLAY_EVENT,
        "agent_class": USER_AGENT,
        "event_parents": {"$in": MARKER_PARENTS.as_slice()},
    };
    [
        doc! {"$match": filter},
        doc! {"$group": {"_id": "$display_id"}},
    ]
}

/// Stage 2's filter: the projectable families on the visible displays, from any agent.
pub fn events_filter(thread_id: &str, displays: &[Bson]) -> Document {
    doc! {
        "thread_id": thread_id,
        "event_type": DISPLAY_EVENT,
        "display_id": {"$in": displays},
        "event_parents": {"$in": FAMILY_PARENTS.as_slice()},
    }
}

/// A fill's filter: stage 2's, for the newly visible displays of a batch of threads.
pub fn fill_filter(threads: &[&str], displays: &[Bson]) -> Document {
    doc! {
        "thread_id": {"$in": threads},
        "event_type": DISPLAY_EVENT,
        "display_id": {"$in": displays},
        "event_parents": {"$in": FAMILY_PARENTS.as_slice()},
    }
}

/// Stage 2's order: aihub's sort; ties beyond `event_id` are settled in memory by the full delivery key.
pub fn events_sort() -> Document {
    doc! {"event_data.created_at": 1, "event_id": 1}
}

/// Only the fields the decoder reads, and `_id` (its time measures the persister's lag).
pub fn projection() -> Document {
    let mut projection = doc! {"_id": 1};
    for field in KEY_FIELDS.iter().chain(&["event_parents"]) {
        projection.insert(*field, 1);
    }
    for field in EVENT_DATA_FIELDS {
        projection.insert(format!("event_data.{field}"), 1);
    }
    projection
}

/// Whether a command error code says the query cannot succeed as sent, whenever it is retried. Chosen: BadValue
/// (2), FailedToParse (9), TypeMismatch (14), InvalidOptions (72), InvalidNamespace (73), CommandNotSupportedOnView
/// (166) and InvalidPipelineOperator (168); every other code is treated as possibly transient.
fn is_rejection(code: i32) -> bool {
    matches!(code, 2 | 9 | 14 | 72 | 73 | 166 | 168)
}

/// Whether the store rejected the hint itself: MongoDB and SecantusDB answer a hint naming no index with BadValue
/// (code 2) "hint ... does not correspond to an existing index", other servers with IndexNotFound (27), and a server
/// that does not know the option at all names the `hint` field. All mean: retry without the hint.
fn is_missing_index(error: &MongoError) -> bool {
    match error.kind.as_ref() {
        ErrorKind::Command(command) => {
            command.code == 27
                || command.code_name == "IndexNotFound"
                || command.message.to_ascii_lowercase().contains("hint")
        }
        _ => false,
    }
}
