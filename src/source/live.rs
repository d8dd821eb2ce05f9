//! The source wing's start, in two steps: [`LiveSource::connect`] connects to NATS and subscribes as the source
//! needs (Core NATS: the display events and the round-trip probe; JetStream with the Core witness: the witness's
//! subscription), where start-up may still fail; [`LiveSource::start`] spawns its tasks (the connection watcher,
//! then the Core loop or the JetStream source), all delivering to the ingest path.

use std::sync::Arc;

use anyhow::Context;
use async_nats::{Client, Event, Subscriber};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::access::NatsAccess;
use super::api::NatsApi;
use super::connect::{self, ConnectionLog};
use super::core::{self, ProbeSubscription, Watcher};
use super::settings::{JetStreamArgs, NatsSettings};
use super::{
    Ingest, IngestMetrics, JetStreamSource, Source, SourceMetrics, Timing, Tracker, Witness,
};
use crate::bounds::StoreBounds;
use crate::coverage::Coverage;
use crate::freshness::Freshness;
use crate::readiness::Readiness;

/// A connected source, subscribed and not yet consuming.
pub struct LiveSource {
    nats: NatsSettings,
    jetstream: JetStreamArgs,
    access: NatsAccess,
    client: Client,
    /// Core NATS: the subscription and its confirmation probe.
    core: Option<(Subscriber, ProbeSubscription)>,
    /// JetStream with `HISTORY_VIEW_JETSTREAM_WITNESS`: the Core witness's subscription.
    witness: Option<Subscriber>,
    events: mpsc::Receiver<Event>,
    /// How the connection's events are logged: the address and the login, without credentials.
    log: ConnectionLog,
}

/// What the source's tasks work with besides the connection.
pub struct Parts {
    pub ingest: Ingest,
    pub readiness: Readiness,
    pub coverage: Coverage,
    pub freshness: Freshness,
    pub metrics: Arc<SourceMetrics>,
    pub ingest_metrics: Arc<IngestMetrics>,
    pub bounds: StoreBounds,
}

impl LiveSource {
    /// Connects (retrying the first connect, so a NATS that comes up later is picked up) and subscribes. Possible
    /// losses the connection reports are recorded in `coverage` as they happen.
    ///
    /// # Errors
    /// A setting the client rejects (a NATS login or TLS file among them), or a subscription it cannot send.
    pub async fn connect(
        nats: &NatsSettings,
        jetstream: &JetStreamArgs,
        coverage: &Coverage,
    ) -> anyhow::Result<Self> {
        let access = NatsAccess::from_settings(nats)?;
        let log = ConnectionLog::new(nats.url_for_display(), access.login_identity());
        let (events_tx, events) = core::connection_events();
        let callback_coverage = coverage.clone();
        let source = nats.source;
        let witness = source == Source::JetStream && jetstream.witness;
        let client = connect::connect(nats, &access, move |event| {
            core::on_connection_event(&callback_coverage, source, witness, &events_tx, event);
        })
        .await
        .with_context(|| {
            format!(
                "cannot connect to NATS at {} (--nats-url)",
                access.display()
            )
        })?;
        let subscribe = |why: &'static str| {
            let client = client.clone();
            let subject = nats.subject.clone();
            async move {
                client
                    .subscribe(subject.clone())
                    .await
                    .with_context(|| format!("cannot subscribe to {subject} (--subject){why}"))
            }
        };
        let core = match source {
            Source::Core => {
                let subscriber = subscribe("").await?;
                let probe = ProbeSubscription::new(&client)
                    .await
                    .context("cannot subscribe to the subscription confirmation probe")?;
                Some((subscriber, probe))
            }
            Source::JetStream => None,
        };
        let witness = if witness {
            Some(subscribe(" for the Core witness (HISTORY_VIEW_JETSTREAM_WITNESS)").await?)
        } else {
            None
        };
        Ok(Self {
            nats: nats.clone(),
            jetstream: jetstream.clone(),
            access,
            client,
            core,
            witness,
            events,
            log,
        })
    }

    /// Another connection with the same login, for `purpose` (the hot set's bucket: a request refused for want of a
    /// permission is a server error on the connection that made it, which on the live one would count as a gap).
    ///
    /// # Errors
    /// The client cannot connect.
    pub async fn connect_another(&self, purpose: &str) -> anyhow::Result<Client> {
        connect::connect(&self.nats, &self.access, |_| {})
            .await
            .with_context(|| {
                format!(
                    "cannot connect to NATS at {} (--nats-url) for {purpose}",
                    self.access.display()
                )
            })
    }

    /// The connection, to hold until the drain has ended: the source's tasks end with `stop`, and were theirs the
    /// last handles, the connection would close then, and its close is a gap of every view (the hot set written in
    /// the drain would leave out nothing as known absent).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Spawns the source's tasks on `tracker`: the connection watcher, and the Core loop or the JetStream source,
    /// whose handle it returns (it ends only on `stop`, or with the error that ended the source).
    pub fn start(
        self,
        parts: Parts,
        tracker: &TaskTracker,
        stop: &CancellationToken,
    ) -> JoinHandle<anyhow::Result<()>> {
        let Parts {
            ingest,
            readiness,
            coverage,
            freshness,
            metrics,
            ingest_metrics,
            bounds,
        } = parts;
        if self.client.connection_state() == async_nats::connection::State::Connected {
            readiness.set_connected(true);
        }
        let (subscriber, probe) = self.core.unzip();
        let (watcher_probe, probes) = probe.map(ProbeSubscription::split).unzip();
        let watcher = Watcher::new(
            readiness.clone(),
            coverage.clone(),
            freshness.clone(),
            Arc::clone(&metrics),
            ingest_metrics,
        );
        tracker.spawn(watcher.watch_connection(
            self.client.clone(),
            watcher_probe,
            self.events,
            self.log,
            stop.clone(),
        ));
        if let Some(subscriber) = subscriber {
            let run = core::run(ingest, readiness, subscriber, probes, stop.clone());
            return tracker.spawn(async move {
                run.await
                    .map_err(|()| anyhow::anyhow!("the NATS subscription ended"))
            });
        }
        readiness.set_subscribed(true);
        let partitioning = self.jetstream.partitioning();
        let witness = self.witness.map(|subscriber| {
            let witness = Witness::new(
                coverage.clone(),
                freshness.clone(),
                Arc::clone(&metrics),
                partitioning,
            );
            tracker.spawn(witness.clone().run(subscriber, stop.clone()));
            witness
        });
        let events = Tracker::new(
            coverage,
            freshness,
            metrics,
            Timing::for_lag(bounds.persist_lag),
            witness,
        );
        let source = JetStreamSource::new(
            NatsApi::new(self.client),
            ingest,
            events,
            self.jetstream.settings(&self.nats.subject, bounds),
        );
        tracker.spawn(source.run(stop.clone()))
    }
}
