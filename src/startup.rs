//! `Application`: connects, binds and spawns everything (`build`), then runs until a shutdown signal
//! (`run_until_stopped`): answer unready and go on serving for the shutdown delay, then stop intake, let in-flight
//! reads finish, exit within the drain deadline.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use axum::body::Bytes;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{CacheSetup, ViewCache};
use crate::config::Config;
use crate::coverage::Coverage;
use crate::freshness::Freshness;
use crate::http::{AppState, Listeners, Peers};
use crate::readiness::Readiness;
use crate::source::{Ingest, LiveSource, Parts, Timing};
use crate::store::Store;
use crate::warm_up::{self, Handover};

mod metrics;

pub use metrics::Metrics;

/// The OpenAPI description of the HTTP API, served as JSON at `/openapi.json`.
pub const OPENAPI_YAML: &str = include_str!("../docs/openapi.yaml");

/// How long the stop waits for the store's clients to shut down after the drain.
const STORE_SHUTDOWN: std::time::Duration = std::time::Duration::from_secs(1);

/// A built, not yet running service: its parts, connected and bound.
pub struct Application {
    config: Config,
    metrics: Metrics,
    coverage: Coverage,
    freshness: Freshness,
    store: Store,
    views: ViewCache,
    source: LiveSource,
    /// The hot set's hand-over ([`crate::warm_up`]), on a NATS connection of its own; `None` when it is off.
    handover: Option<Handover>,
    listeners: Listeners,
    state: AppState,
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
    /// Connects to NATS and subscribes, prepares the store client, binds the listeners: the only place start-up can
    /// fail. NATS is connected with retries on the first connect, so a NATS that comes up later is picked up
    /// (readiness reports it meanwhile).
    ///
    /// # Errors
    /// A setting the clients reject (a NATS login or TLS file among them), or a listen address cannot be bound.
    pub async fn build(config: Config) -> anyhow::Result<Self> {
        let metrics = Metrics::new();
        let coverage = Coverage::new(config.bounds.persist_lag);
        let readiness = Readiness::new(coverage.clone());
        let store = Store::connect(
            &config.store,
            config.bounds,
            config.shadow.enabled(),
            Arc::clone(&metrics.store),
            coverage.clone(),
        )
        .await
        .context("invalid --mongodb-uri (HISTORY_VIEW_MONGODB_URI)")?;
        let freshness = Freshness::new(
            coverage.clone(),
            Timing::for_lag(config.bounds.persist_lag).silence,
        );
        let views = ViewCache::new(
            store.clone(),
            metrics.views(),
            coverage.clone(),
            freshness.clone(),
            CacheSetup {
                settings: config.cache.clone(),
                shadow: config.shadow.clone(),
                bounds: config.bounds,
                gap_window: config.nats.gap_window(),
            },
        );
        let source = LiveSource::connect(&config.nats, &config.jetstream, &coverage).await?;
        let handover = if config.warm.enabled() {
            let client = source.connect_another("the hot set").await?;
            readiness.set_warming();
            Some(Handover {
                client,
                settings: config.warm.clone(),
                partitioning: config.jetstream.partitioning(),
                cache_idle: config.cache.idle,
                metrics: Arc::clone(&metrics.warm),
            })
        } else {
            None
        };
        let listeners = Listeners::bind(&config.http).await?;
        let peers = config.jetstream.partitioning().map(|partitioning| {
            Peers::new(
                partitioning,
                config.jetstream.peer_url.clone().unwrap_or_default(),
                config.bounds.store_timeout,
            )
        });
        let state = AppState::new(
            &config.http,
            views.clone(),
            Arc::clone(&metrics.http),
            metrics.exposition.clone(),
            readiness,
            peers,
            openapi_json()?,
        );
        Ok(Self {
            config,
            metrics,
            coverage,
            freshness,
            store,
            views,
            source,
            handover,
            listeners,
            state,
        })
    }

    /// The port the HTTP API listens on (useful with port 0).
    pub fn port(&self) -> u16 {
        self.listeners.local_addr().map_or(0, |a| a.port())
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
            metrics,
            coverage,
            freshness,
            store,
            views,
            source,
            handover,
            listeners,
            state,
        } = self;
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let connections = TaskTracker::new();
        let parts = Parts {
            ingest: Ingest::new(views.clone(), Arc::clone(&metrics.ingest)),
            readiness: state.readiness.clone(),
            coverage,
            freshness,
            metrics: Arc::clone(&metrics.source),
            ingest_metrics: Arc::clone(&metrics.ingest),
            bounds: config.bounds,
        };
        let nats = source.client();
        let mut ingest_task = source.start(parts, &tracker, &stop);
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
                views.clone(),
                state.readiness.clone(),
                stop.clone(),
            ));
        }
        if let (Some(tokens), Some(path)) = (&state.api_token, &config.http.api_token_file) {
            tracker.spawn(tokens.clone().watch_file(path.clone(), stop.clone()));
        }
        let address = listeners
            .local_addr()
            .context("the listener has no local address")?;
        let mut server_task = listeners.start(&config.http, &state, &connections, &tracker, &stop);
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
        views.stop_background();
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
            let in_flight = state.reads_in_flight(config.http.max_in_flight);
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
        // Flush nothing (the worker publishes nothing); just close the connection, now that the drain is over.
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use clap::CommandFactory;

    use super::metrics::Metrics;
    use crate::config::Config;
    use crate::metrics::{Kind, sample};

    #[test]
    fn labelled_counters_are_exported_at_zero_from_the_start() {
        let metrics = Metrics::new();
        let rendered = metrics.render();
        for series in [
            "history_view_http_refused_total{reason=\"connections\"}",
            "history_view_http_refused_total{reason=\"in_flight\"}",
            "history_view_http_timeouts_total{kind=\"header\"}",
            "history_view_read_errors_total{code=\"503\"}",
            "history_view_hydrations_total{result=\"error\"}",
            "history_view_shadow_checks_total{result=\"missing\"}",
            "history_view_store_queries_total{kind=\"explain\"}",
            "history_view_nats_connection_events_total{event=\"slow_consumer\"}",
            "history_view_ready{component=\"store\"}",
        ] {
            assert_eq!(sample(&rendered, series), Some(0.0), "{series}");
        }
        // The JetStream source's series only on a JetStream worker.
        assert!(!rendered.contains("history_view_jetstream_gaps_total{"));
        metrics.source.preset_jetstream();
        let rendered = metrics.render();
        assert_eq!(
            sample(
                &rendered,
                "history_view_jetstream_gaps_total{cause=\"new_leader\"}"
            ),
            Some(0.0)
        );
        metrics.http.read_error(503);
        metrics.http.read_error(418);
        let rendered = metrics.render();
        assert_eq!(
            sample(&rendered, "history_view_read_errors_total{code=\"503\"}"),
            Some(1.0)
        );
        assert_eq!(
            sample(&rendered, "history_view_read_errors_total{code=\"418\"}"),
            Some(1.0)
        );
    }

    /// Dashboards and alerts name these metrics and labels: a rename here is a breaking change for operators. The
    /// order is not pinned (the exposition sorts by name).
    #[test]
    fn metric_names_and_labels_are_pinned() {
        let pinned: [(&str, &[&str]); 55] = [
            ("history_view_build_info", &["version"]),
            ("history_view_events_total", &["outcome"]),
            ("history_view_shadow_checks_total", &["result"]),
            ("history_view_cache_hits_total", &[]),
            ("history_view_cache_misses_total", &[]),
            ("history_view_hydrations_total", &["result"]),
            ("history_view_views_downgraded_total", &[]),
            ("history_view_unproven_reads_total", &[]),
            ("history_view_cache_entries", &[]),
            ("history_view_cache_weighted_bytes", &[]),
            ("history_view_store_query_duration_seconds", &["stage"]),
            ("history_view_store_queries_total", &["kind"]),
            ("history_view_fills_total", &["outcome"]),
            ("history_view_read_duration_seconds", &["source"]),
            ("history_view_ingest_lag_seconds", &[]),
            ("history_view_nats_connection_events_total", &["event"]),
            ("history_view_hydration_slot_timeouts_total", &[]),
            ("history_view_http_connections", &[]),
            ("history_view_http_refused_total", &["reason"]),
            ("history_view_http_timeouts_total", &["kind"]),
            ("history_view_thread_limit_exceeded_total", &["path"]),
            ("history_view_markers_skipped_total", &[]),
            ("history_view_orphaned_events_total", &[]),
            ("history_view_index_hint_fallbacks_total", &[]),
            ("history_view_malformed_event_warnings_total", &[]),
            ("history_view_background_rereads_total", &["result"]),
            ("history_view_persister_lag_seconds", &[]),
            ("history_view_persister_lag_exceeded_total", &[]),
            ("history_view_jetstream_last_sequence", &["stream"]),
            ("history_view_jetstream_pending", &["stream"]),
            ("history_view_jetstream_refusing", &["stream", "cause"]),
            ("history_view_jetstream_resumes_total", &["outcome"]),
            ("history_view_jetstream_gaps_total", &["cause"]),
            ("history_view_jetstream_streams", &[]),
            ("history_view_jetstream_witnessed_total", &["result"]),
            ("history_view_jetstream_behind", &[]),
            ("history_view_read_routes_total", &["route"]),
            ("history_view_shadow_events_total", &["result"]),
            ("history_view_shadow_check_delay_seconds", &[]),
            ("history_view_shadow_heals_total", &[]),
            ("history_view_covered_through_age_seconds", &[]),
            ("history_view_ready", &["component"]),
            ("history_view_nats_connected", &[]),
            ("history_view_read_errors_total", &["code"]),
            ("history_view_store_errors_total", &["kind"]),
            ("history_view_persister_lag_out_of_range_total", &["side"]),
            ("history_view_cache_budget_bytes", &[]),
            ("history_view_http_waiting_reads", &[]),
            ("history_view_feed_streams", &[]),
            ("history_view_feed_events_total", &["kind"]),
            ("history_view_feed_resumes_total", &["outcome"]),
            ("history_view_feed_coalesced_changes_total", &[]),
            (
                "history_view_resume_requests_total",
                &["dialect", "outcome"],
            ),
            ("history_view_warm_threads", &["state"]),
            ("history_view_trace_spans_dropped_total", &[]),
        ];
        let metrics = Metrics::new();
        let mut described: Vec<(&str, Vec<&str>)> = metrics
            .described()
            .iter()
            .map(|(name, labels)| (name.as_str(), labels.iter().map(String::as_str).collect()))
            .collect();
        let mut pinned: Vec<(&str, Vec<&str>)> = pinned
            .iter()
            .map(|(name, labels)| (*name, labels.to_vec()))
            .collect();
        described.sort();
        pinned.sort();
        assert_eq!(described, pinned);
    }

    /// Words that open a help saying what the code does rather than what the metric counts.
    const VERBS: [&str; 14] = [
        "Count",
        "Counts",
        "Counted",
        "Record",
        "Records",
        "Recorded",
        "Track",
        "Tracks",
        "Increment",
        "Increments",
        "Incremented",
        "Measure",
        "Measures",
        "Observe",
    ];

    /// The `# HELP` line is all an operator reading `/metrics` has: it must name what the metric counts or
    /// measures, with its unit, every label, and every label value exported from the start (so a value added to
    /// an enum and not explained fails here), and name only settings and metrics that exist.
    #[test]
    fn every_help_text_names_what_its_metric_counts() {
        let metrics = Metrics::new();
        metrics.source.preset_jetstream();
        let mut exported: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for family in metrics.exposition.gather() {
            for metric in family.get_metric() {
                for pair in metric.get_label() {
                    exported
                        .entry(family.name().to_owned())
                        .or_default()
                        .insert(pair.value().to_owned());
                }
            }
        }
        let settings: BTreeSet<String> = Config::command()
            .get_arguments()
            .filter_map(|argument| argument.get_env())
            .map(|env| env.to_string_lossy().into_owned())
            .collect();
        let names: BTreeSet<&str> = metrics.registered().iter().map(|d| d.name).collect();
        let mut failures = Vec::new();
        for metric in metrics.registered() {
            let help = metric.help;
            let words: BTreeSet<&str> = help
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|word| !word.is_empty())
                .collect();
            let mut fail = |why: String| failures.push(format!("{}: {why}", metric.name));
            if !help.starts_with(|c: char| c.is_ascii_uppercase()) {
                fail("starts with no capital".into());
            }
            if !help.ends_with('.') {
                fail("does not end with a period".into());
            }
            let first = help.split_whitespace().next().unwrap_or_default();
            if metric.kind == Kind::Counter && VERBS.contains(&first) {
                fail(format!(
                    "opens with the verb {first:?}: name what it counts"
                ));
            }
            if (metric.kind == Kind::Counter) != metric.name.ends_with("_total") {
                fail("a counter's name ends in _total, and only a counter's".into());
            }
            let unit = ["seconds", "bytes"]
                .into_iter()
                .find(|unit| metric.name.ends_with(&format!("_{unit}")));
            match unit {
                Some(unit) if !words.iter().any(|word| word.eq_ignore_ascii_case(unit)) => {
                    fail(format!("does not say {unit}"));
                }
                None if metric.kind == Kind::Histogram => {
                    fail("a histogram's name ends in its unit".into());
                }
                _ => {}
            }
            for label in metric.labels {
                if !words.contains(label) {
                    fail(format!("does not name its label {label}"));
                }
            }
            // The version is the one label value from no closed set: one per process, said by its help.
            let values = exported
                .get(metric.name)
                .filter(|_| metric.name != "history_view_build_info");
            for value in values.into_iter().flatten() {
                if !words.contains(value.as_str()) {
                    fail(format!("does not explain the label value {value}"));
                }
            }
            for word in &words {
                if word.starts_with("HISTORY_VIEW_") && !settings.contains(*word) {
                    fail(format!("names {word}, which is no setting"));
                }
                if word.starts_with("history_view_") && !names.contains(word) {
                    fail(format!("names {word}, which is no metric"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
