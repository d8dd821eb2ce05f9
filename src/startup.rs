//! `Application`: connects, binds and spawns everything (`build`), then runs until a shutdown signal
//! (`run_until_stopped`): answer unready and go on serving for the shutdown delay, then stop intake, let in-flight
//! reads finish, exit within the drain deadline.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use axum::body::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{CacheSetup, ViewCache};
use crate::config::{Config, Source};
use crate::coverage::Coverage;
use crate::freshness::Freshness;
use crate::http::{
    ApiTokens, AppState, ConnectionLimits, Peers, RESERVED_CONNECTIONS, accept_loop, probe_router,
    reserve_router, router,
};
use crate::ingest::Ingest;
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::source::api::NatsApi;
use crate::source::connect::{self, ConnectionLog, NatsAccess};
use crate::source::core::{self, ProbeSubscription};
use crate::source::{JetStreamSource, Timing, Tracker, Witness};
use crate::store::Store;
use crate::warm_up::{self, Handover};

/// The OpenAPI description of the HTTP API, served as JSON at `/openapi.json`.
pub const OPENAPI_YAML: &str = include_str!("../docs/openapi.yaml");

/// How long the stop waits for the store's clients to shut down after the drain.
const STORE_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(1);

/// A built, not yet running service.
pub struct Application {
    config: Config,
    listener: TcpListener,
    /// `HISTORY_VIEW_PROBE_LISTEN`: the probes' own listener, if any.
    probe_listener: Option<TcpListener>,
    state: AppState,
    store: Store,
    nats: async_nats::Client,
    /// Core NATS: the subscription and its confirmation probe; `None` with the JetStream source.
    core: Option<(async_nats::Subscriber, ProbeSubscription)>,
    /// JetStream with `HISTORY_VIEW_JETSTREAM_WITNESS`: the Core witness's subscription.
    witness: Option<async_nats::Subscriber>,
    connection_events: mpsc::Receiver<async_nats::Event>,
    /// How the connection's events are logged: the address and the login, without credentials.
    connection_log: ConnectionLog,
    coverage: Coverage,
    freshness: Freshness,
    /// The hot set's hand-over ([`crate::warm_up`]), on a NATS connection of its own; `None` when it is off.
    handover: Option<Handover>,
}

/// Converts the OpenAPI YAML into the JSON served.
///
/// # Errors
/// The embedded document is not valid YAML.
pub fn openapi_json() -> anyhow::Result<Bytes> {
    let document: serde_json::Value =
        serde_norway::from_str(OPENAPI_YAML).context("docs/openapi.yaml is not valid YAML")?;
    Ok(Bytes::from(serde_json::to_vec(&document)?))
}

impl Application {
    /// Connects to NATS and subscribes, prepares the store client, binds the listener. The only place start-up can
    /// fail. NATS is connected with retries on the first connect, so a NATS that comes up later is picked up
    /// (readiness reports it meanwhile).
    ///
    /// # Errors
    /// A setting the clients reject (a NATS login or TLS file among them), or the listen address cannot be bound.
    pub async fn build(config: Config) -> anyhow::Result<Self> {
        let metrics = Metrics::new();
        let coverage = Coverage::new(config.bounds.persist_lag);
        let readiness = Readiness::new(coverage.clone());
        let store = Store::connect(
            &config.store,
            config.bounds,
            config.shadow.enabled(),
            metrics.clone(),
            coverage.clone(),
        )
        .await
        .context("invalid --mongodb-uri (HISTORY_VIEW_MONGODB_URI)")?;
        let freshness = Freshness::new(
            coverage.clone(),
            crate::source::Timing::for_lag(config.bounds.persist_lag).silence,
        );
        let views = ViewCache::new(
            store.clone(),
            metrics.clone(),
            coverage.clone(),
            freshness.clone(),
            CacheSetup {
                settings: config.cache.clone(),
                shadow: config.shadow.clone(),
                bounds: config.bounds,
                gap_window: config.nats.gap_window(),
            },
        );

        let access = NatsAccess::from_settings(&config.nats)?;
        let connection_log =
            ConnectionLog::new(config.nats.url_for_display(), access.login_identity());
        let (events_tx, connection_events) = core::connection_events();
        let callback_coverage = coverage.clone();
        let source = config.nats.source;
        let witness = config.witness();
        let nats = connect::connect(&config.nats, &access, move |event| {
            core::on_connection_event(&callback_coverage, source, witness, &events_tx, event);
        })
        .await
        .with_context(|| {
            format!(
                "cannot connect to NATS at {} (--nats-url)",
                access.display()
            )
        })?;
        let handover = if config.warm.enabled() {
            // A connection of its own: a request refused for want of a permission is a server error on the
            // connection that made it, which on the live one would count as a gap.
            let client = connect::connect(&config.nats, &access, |_| {})
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to NATS at {} (--nats-url) for the hot set",
                        access.display()
                    )
                })?;
            readiness.set_warming();
            Some(Handover {
                client,
                settings: config.warm.clone(),
                partitioning: config.jetstream.partitioning(),
                cache_idle: config.cache.idle,
            })
        } else {
            None
        };
        let core = match config.nats.source {
            Source::Core => {
                let subscriber = nats
                    .subscribe(config.nats.subject.clone())
                    .await
                    .with_context(|| {
                        format!("cannot subscribe to {} (--subject)", config.nats.subject)
                    })?;
                let probe = ProbeSubscription::new(&nats)
                    .await
                    .context("cannot subscribe to the subscription confirmation probe")?;
                Some((subscriber, probe))
            }
            Source::JetStream => None,
        };
        let witness = if config.witness() {
            Some(
                nats.subscribe(config.nats.subject.clone())
                    .await
                    .with_context(|| {
                        format!(
                            "cannot subscribe to {} (--subject) for the Core witness (HISTORY_VIEW_JETSTREAM_WITNESS)",
                            config.nats.subject
                        )
                    })?,
            )
        } else {
            None
        };

        let listener = TcpListener::bind(config.http.listen)
            .await
            .with_context(|| format!("cannot listen on {} (--listen)", config.http.listen))?;
        let probe_listener = match config.http.probe_listen {
            Some(address) => Some(TcpListener::bind(address).await.with_context(|| {
                format!("cannot listen on {address} (--probe-listen, HISTORY_VIEW_PROBE_LISTEN)")
            })?),
            None => None,
        };
        let state = AppState {
            views,
            metrics,
            readiness,
            api_token: config.http.tokens().as_deref().map(ApiTokens::new),
            inspector: config
                .http
                .inspector
                .enabled(config.http.tokens().is_some()),
            reads: Arc::new(Semaphore::new(config.http.max_in_flight)),
            waiting: Arc::new(Semaphore::new(config.http.max_waiting)),
            streams: Arc::new(Semaphore::new(config.http.max_streams)),
            openapi: openapi_json()?,
            peers: config.jetstream.partitioning().map(|partitioning| {
                Peers::new(
                    partitioning,
                    config.jetstream.peer_url.clone().unwrap_or_default(),
                    config.bounds.store_timeout,
                )
            }),
        };
        Ok(Self {
            config,
            listener,
            probe_listener,
            state,
            store,
            nats,
            core,
            witness,
            connection_events,
            connection_log,
            coverage,
            freshness,
            handover,
        })
    }

    /// The port the HTTP API listens on (useful with port 0).
    pub fn port(&self) -> u16 {
        self.listener.local_addr().map_or(0, |a| a.port())
    }

    /// Runs until `shutdown` completes, then serves on for the shutdown delay with `/readyz` answering 503, then
    /// stops consuming and accepting, finishes in-flight requests and returns within the configured drain time
    /// ([design 3.4](../docs/design.md#3.4)).
    ///
    /// # Errors
    /// The HTTP server failed or the NATS subscription ended on its own.
    pub async fn run_until_stopped(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Application {
            config,
            listener,
            probe_listener,
            state,
            store,
            nats,
            core,
            witness,
            connection_events,
            connection_log,
            coverage,
            freshness,
            handover,
        } = self;
        let address = listener
            .local_addr()
            .context("the listener has no local address")?;
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let ingest = Ingest::new(
            state.views.clone(),
            state.metrics.clone(),
            state.readiness.clone(),
            coverage.clone(),
            freshness,
        );
        if nats.connection_state() == async_nats::connection::State::Connected {
            state.readiness.set_connected(true);
        }
        let (subscriber, probe) = core.unzip();
        let (watcher_probe, probes) = probe.map(ProbeSubscription::split).unzip();
        tracker.spawn(ingest.clone().watch_connection(
            nats.clone(),
            watcher_probe,
            connection_events,
            connection_log,
            stop.clone(),
        ));
        tracker.spawn(
            state
                .readiness
                .clone()
                .ping_store_until(store.clone(), stop.clone()),
        );
        if let Some(handover) = handover {
            // Writes the hot set once more when `stop` is cancelled: within the drain.
            tracker.spawn(warm_up::run(
                handover,
                state.views.clone(),
                state.readiness.clone(),
                stop.clone(),
            ));
        }
        if let (Some(tokens), Some(path)) = (&state.api_token, &config.http.api_token_file) {
            tracker.spawn(tokens.clone().watch_file(path.clone(), stop.clone()));
        }
        let mut ingest_task = match subscriber {
            Some(subscriber) => {
                let run = ingest.run(subscriber, probes, stop.clone());
                tracker.spawn(async move {
                    run.await
                        .map_err(|()| anyhow::anyhow!("the NATS subscription ended"))
                })
            }
            None => {
                state.readiness.set_subscribed(true);
                let witness = witness.map(|subscriber| {
                    let witness = Witness::new(
                        coverage.clone(),
                        ingest.freshness().clone(),
                        state.metrics.clone(),
                        config.jetstream.partitioning(),
                    );
                    tracker.spawn(witness.clone().run(subscriber, stop.clone()));
                    witness
                });
                let events = Tracker::new(
                    coverage,
                    ingest.freshness().clone(),
                    state.metrics.clone(),
                    Timing::for_lag(config.bounds.persist_lag),
                    witness,
                );
                let source = JetStreamSource::new(
                    NatsApi::new(nats.clone()),
                    ingest,
                    events,
                    config
                        .jetstream
                        .settings(&config.nats.subject, config.bounds),
                );
                let stop = stop.clone();
                tracker.spawn(source.run(stop))
            }
        };
        let state_views = state.views.clone();
        let reads = state.clone();
        let connections = TaskTracker::new();
        let mut server_task = tokio::spawn(accept_loop(
            listener,
            router(state.clone()),
            reserve_router(state.clone()),
            config.http.connection_limits(),
            state.metrics.clone(),
            connections.clone(),
            stop.clone(),
        ));
        if let Some(probe_listener) = probe_listener {
            // The probes' own listener: nothing but the probes and /metrics, so API clients cannot fill it.
            let limits = ConnectionLimits {
                max_connections: RESERVED_CONNECTIONS,
                ..config.http.connection_limits()
            };
            tracker.spawn(accept_loop(
                probe_listener,
                probe_router(state.clone()),
                probe_router(state.clone()),
                limits,
                state.metrics.clone(),
                connections.clone(),
                stop.clone(),
            ));
        }
        tracing::info!(address = %address, probe_address = ?config.http.probe_listen, subject = %config.nats.subject, source = ?config.nats.source, "chat-history-view started");

        let outcome = tokio::select! {
            () = shutdown => Ok(()),
            result = &mut ingest_task => Err(ingest_ended(result)),
            result = &mut server_task => Err(server_ended(result)),
        };

        let outcome = match outcome {
            Ok(()) => {
                keep_serving(
                    &state,
                    config.http.shutdown_delay,
                    &mut ingest_task,
                    &mut server_task,
                )
                .await
            }
            failed => failed,
        };

        tracing::info!(drain = ?config.http.shutdown_drain, "stopping: no new events or connections; draining");
        stop.cancel();
        state_views.stop_background();
        tracker.close();
        let drained = tokio::time::timeout(config.http.shutdown_drain, async {
            // A server task that already ended (its error is the outcome) has given its output: polling its handle
            // again would panic.
            if !server_task.is_finished() {
                let _ = (&mut server_task).await;
            }
            // Idle keep-alive connections close at once; the others after their request.
            connections.close();
            connections.wait().await;
            tracker.wait().await;
        })
        .await;
        if drained.is_err() {
            let in_flight = reads.reads_in_flight(config.http.max_in_flight);
            if in_flight > 0 {
                tracing::warn!(
                    reads_in_flight = in_flight,
                    "drain deadline passed; exiting with reads in flight"
                );
            } else {
                tracing::info!(
                    connections = connections.len(),
                    "drain deadline passed; closing connections that sent no complete request"
                );
            }
            server_task.abort();
        }
        // Flush nothing (the worker publishes nothing); just close the connection.
        drop(nats);
        store.shut_down(STORE_SHUTDOWN).await;
        tracing::info!("stopped");
        outcome
    }
}

/// The shutdown delay: `/readyz` answers 503 at once while everything else goes on as before (the listener accepts,
/// reads and feeds are answered, events are consumed, so the views stay current) for `delay`, the time the
/// orchestrator takes to remove the worker from its endpoints; clients it still routes here meanwhile are served,
/// not refused. Ends early, with its error, if the ingest or the server fails meanwhile.
async fn keep_serving(
    state: &AppState,
    delay: std::time::Duration,
    ingest_task: &mut tokio::task::JoinHandle<anyhow::Result<()>>,
    server_task: &mut tokio::task::JoinHandle<()>,
) -> anyhow::Result<()> {
    state.readiness.set_stopping();
    if delay.is_zero() {
        return Ok(());
    }
    tracing::info!(delay = ?delay, "stop requested: /readyz answers 503; serving on while the endpoints are removed");
    tokio::select! {
        () = tokio::time::sleep(delay) => Ok(()),
        result = ingest_task => Err(ingest_ended(result)),
        result = server_task => Err(server_ended(result)),
    }
}

/// Why the ingest task ended before a stop was asked for: it runs until then.
fn ingest_ended(result: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Error {
    match result {
        Ok(Ok(())) => anyhow::anyhow!("the NATS subscription or the JetStream source ended"),
        Ok(Err(error)) => error,
        Err(join) => anyhow::Error::new(join).context("the ingest task failed"),
    }
}

/// Why the HTTP server ended before a stop was asked for: it runs until then.
fn server_ended(result: Result<(), tokio::task::JoinError>) -> anyhow::Error {
    match result {
        Ok(()) => anyhow::anyhow!("the HTTP server stopped"),
        Err(join) => anyhow::Error::new(join).context("the HTTP server task failed"),
    }
}
