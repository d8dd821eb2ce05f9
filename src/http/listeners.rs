//! The HTTP side's start, in two steps: [`Listeners::bind`] binds the API's port and the probes' own (where start-up
//! may still fail), [`Listeners::start`] spawns their accept loops; [`AppState::new`] gathers what every handler
//! uses from the settings and the other wings' handles.

use std::sync::Arc;

use anyhow::Context;
use axum::body::Bytes;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::settings::HttpSettings;
use super::{
    ApiTokens, AppState, ConnectionLimits, HttpMetrics, Peers, RESERVED_CONNECTIONS, accept_loop,
    probe_router, reserve_router, router,
};
use crate::cache::ViewCache;
use crate::metrics::Exposition;
use crate::readiness::Readiness;

impl AppState {
    /// What every handler uses, from the HTTP settings and the other wings' handles.
    pub fn new(
        settings: &HttpSettings,
        views: ViewCache,
        metrics: Arc<HttpMetrics>,
        exposition: Exposition,
        readiness: Readiness,
        peers: Option<Peers>,
        openapi: Bytes,
    ) -> Self {
        let tokens = settings.tokens();
        Self {
            views,
            metrics,
            exposition,
            readiness,
            api_token: tokens.as_deref().map(ApiTokens::new),
            inspector: settings.inspector.enabled(tokens.is_some()),
            reads: Arc::new(Semaphore::new(settings.max_in_flight)),
            waiting: Arc::new(Semaphore::new(settings.max_waiting)),
            streams: Arc::new(Semaphore::new(settings.max_streams)),
            openapi,
            peers,
        }
    }
}

/// The bound listeners: the API's, and the probes' own (`HISTORY_VIEW_PROBE_LISTEN`) if set.
pub struct Listeners {
    api: TcpListener,
    probes: Option<TcpListener>,
}

impl Listeners {
    /// Binds the listen addresses.
    ///
    /// # Errors
    /// An address cannot be bound.
    pub async fn bind(settings: &HttpSettings) -> anyhow::Result<Self> {
        let api = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("cannot listen on {} (--listen)", settings.listen))?;
        let probes = match settings.probe_listen {
            Some(address) => Some(TcpListener::bind(address).await.with_context(|| {
                format!("cannot listen on {address} (--probe-listen, HISTORY_VIEW_PROBE_LISTEN)")
            })?),
            None => None,
        };
        Ok(Self { api, probes })
    }

    /// The API's address.
    ///
    /// # Errors
    /// The listener has no local address.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.api.local_addr()
    }

    /// Spawns the accept loops; returns the API's (it ends only on `stop`). Connections are tracked on
    /// `connections`, the probes' loop on `tracker`.
    pub fn start(
        self,
        settings: &HttpSettings,
        state: &AppState,
        connections: &TaskTracker,
        tracker: &TaskTracker,
        stop: &CancellationToken,
    ) -> JoinHandle<()> {
        let api = tokio::spawn(accept_loop(
            self.api,
            router(state.clone()),
            reserve_router(state.clone()),
            settings.connection_limits(),
            Arc::clone(&state.metrics),
            connections.clone(),
            stop.clone(),
        ));
        if let Some(probes) = self.probes {
            // The probes' own listener: nothing but the probes and /metrics, so API clients cannot fill it.
            let limits = ConnectionLimits {
                max_connections: RESERVED_CONNECTIONS,
                ..settings.connection_limits()
            };
            tracker.spawn(accept_loop(
                probes,
                probe_router(state.clone()),
                probe_router(state.clone()),
                limits,
                Arc::clone(&state.metrics),
                connections.clone(),
                stop.clone(),
            ));
        }
        api
    }
}
