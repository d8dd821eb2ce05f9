//! What operators install, checked against real servers: a real Prometheus scrapes three workers (two Core
//! replicas and a JetStream worker) under a short live workload and loads the chart's alert rules; every dashboard
//! panel's expression must return data and every alert's must evaluate; every metric is exported; `promtool check
//! metrics` accepts a worker's `/metrics`; and the replicas answer every thread alike.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::helpers::publish_rows;
use crate::jetstream::classes;
use crate::scene::{Scene, read_until_cache};
use test_support::class_streams::create_class_streams;
use test_support::servers::{PrometheusServer, promtool};
use test_support::turns::Conversation;
use test_support::wait::{eventually_within, when};

const CHART_FILES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/helm/chat-history-view/files");

/// Every `expr` of the dashboard's panels, with Grafana's variables as a test can give them: the rate interval a
/// minute (the scrape interval here is a second), every pod.
fn panel_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(Path::new(CHART_FILES).join("dashboard.json"))
        .expect("files/dashboard.json");
    let dashboard: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    while let Some(panel) = panels.pop() {
        // Rows may nest their panels.
        panels.extend(panel["panels"].as_array().into_iter().flatten());
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                let title = panel["title"].as_str().unwrap_or("?").to_owned();
                exprs.push((title, grafana_variables(expr)));
            }
        }
    }
    exprs
}

fn grafana_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("${pod}", ".*")
        .replace("$pod", ".*")
}

/// Every alert of the chart's rule file: its name and expression.
fn alert_exprs() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(Path::new(CHART_FILES).join("alerts.yaml"))
        .expect("files/alerts.yaml");
    let rules: Value = serde_norway::from_str(&text).expect("the rule file is YAML");
    rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_array().into_iter().flatten())
        .filter_map(|rule| {
            Some((
                rule["alert"].as_str()?.to_owned(),
                rule["expr"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// Prometheus's answer to an instant query: `Ok(result)` or `Err(error)`.
async fn query(http: &reqwest::Client, prometheus: &str, expr: &str) -> Result<Vec<Value>, String> {
    let reply: Value = http
        .get(format!("{prometheus}/api/v1/query"))
        .query(&[("query", expr)])
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    if reply["status"] != "success" {
        return Err(format!("{}: {}", reply["errorType"], reply["error"]));
    }
    Ok(reply["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

/// Waits until Prometheus holds at least `scrapes` successful scrapes of each of `targets`.
async fn scraped(
    http: &reqwest::Client,
    prometheus: &PrometheusServer,
    targets: usize,
    scrapes: u32,
) {
    let expr = &format!("count_over_time(up[1m]) >= {scrapes} and up == 1");
    eventually_within(
        &format!("Prometheus to scrape {targets} workers {scrapes} times"),
        Duration::from_secs(60),
        || async move {
            match query(http, &prometheus.url(), expr).await {
                Ok(result) if result.len() == targets => Ok(()),
                seen => Err(format!("{seen:?}; its log:\n{}", prometheus.log_tail())),
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_workers_and_every_panel_and_alert_evaluates() {
    let scene = Scene::new().await;
    let mut conversations: Vec<Conversation> = (0..6)
        .map(|i| Conversation::new(format!("mon-{i}")))
        .collect();
    // The class streams exist before the JetStream worker starts (aihub creates them); a first turn names them.
    let first: Vec<Vec<Value>> = conversations
        .iter_mut()
        .map(Conversation::next_turn)
        .collect();
    let streams: BTreeSet<String> = first.iter().flat_map(|rows| classes(rows)).collect();
    create_class_streams(&scene.nats.url(), streams).await;
    let core = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_SHADOW_SAMPLE", "1")])
        .await;
    let replica = scene.worker(scene.nats.url(), &[]).await;
    let jetstream = scene
        .worker(scene.nats.url(), &[("HISTORY_VIEW_SOURCE", "jetstream")])
        .await;
    let workers = [&core.api, &replica.api, &jetstream.api];

    // A short live workload: every turn published and stored, threads read through every worker (from the store
    // first, then from memory), and a few bad requests.
    let mut turns = first;
    for round in 0..3 {
        for (conversation, rows) in conversations.iter().zip(&turns) {
            publish_rows(&scene.publisher, rows).await;
            scene.store.insert_rows(rows).await;
            for api in workers {
                let _ = api
                    .history(&conversation.thread, &Conversation::query())
                    .await;
            }
        }
        if round < 2 {
            turns = conversations
                .iter_mut()
                .map(Conversation::next_turn)
                .collect();
        }
    }
    for api in workers {
        assert_eq!(api.get("/v1/threads/no-such-path", &[]).await.status, 404);
        assert_eq!(api.history("mon-0", "agent_class=A").await.status, 400);
    }

    let targets: Vec<String> = workers
        .iter()
        .map(|api| format!("'{}'", api.address.trim_start_matches("http://")))
        .collect();
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: ['{CHART_FILES}/alerts.yaml']\n\
         scrape_configs:\n  - job_name: chat-history-view\n    static_configs:\n      - targets: [{}]\n",
        targets.join(", ")
    );
    let prometheus = PrometheusServer::start(&config);
    let http = reqwest::Client::new();
    // Reads from memory during the scrapes, so the read panels have recent samples.
    for conversation in &conversations {
        for api in workers {
            read_until_cache(api, &conversation.thread, &Conversation::query()).await;
        }
    }
    scraped(&http, &prometheus, workers.len(), 5).await;

    // Every metric the worker describes is exported (a histogram as its buckets).
    let names = query(
        &http,
        &prometheus.url(),
        "count by (__name__) ({__name__=~\"history_view_.+\"})",
    )
    .await
    .expect("series names");
    let exported: BTreeSet<String> = names
        .iter()
        .filter_map(|series| series["metric"]["__name__"].as_str().map(str::to_owned))
        .collect();
    let metrics = chat_history_view::startup::Metrics::new();
    let missing: Vec<&str> = metrics
        .described()
        .iter()
        .map(|(name, _)| name.as_str())
        .filter(|name| !exported.contains(*name) && !exported.contains(&format!("{name}_bucket")))
        .collect();
    assert!(missing.is_empty(), "not exported: {missing:?}");

    // Every worker exports the process collector's series and its build info; HistoryViewDown's condition is empty
    // while each is scraped (this scrape config's job is the chart's name, as the alert expects).
    let version = format!(
        "history_view_build_info{{version=\"{}\"}} == 1",
        env!("CARGO_PKG_VERSION")
    );
    let down = alert_exprs()
        .into_iter()
        .find(|(alert, _)| alert == "HistoryViewDown")
        .expect("the HistoryViewDown alert")
        .1;
    for (expr, series) in [
        ("process_resident_memory_bytes > 0", workers.len()),
        ("process_open_fds > 0", workers.len()),
        (version.as_str(), workers.len()),
        (down.as_str(), 0),
    ] {
        let result = query(&http, &prometheus.url(), expr).await.expect(expr);
        assert_eq!(result.len(), series, "{expr}: {result:?}");
    }

    // Every panel parses and returns data; every alert parses.
    let panels = panel_exprs();
    assert!(panels.len() >= 20, "only {} panel queries", panels.len());
    let mut failures = Vec::new();
    for (title, expr) in &panels {
        match query(&http, &prometheus.url(), expr).await {
            Ok(result) if result.is_empty() => {
                failures.push(format!("panel {title}: no data: {expr}"))
            }
            Ok(_) => {}
            Err(error) => failures.push(format!("panel {title}: {error}: {expr}")),
        }
    }
    let alerts = alert_exprs();
    assert!(alerts.len() >= 14, "only {} alerts", alerts.len());
    for (alert, expr) in &alerts {
        if let Err(error) = query(&http, &prometheus.url(), expr).await {
            failures.push(format!("alert {alert}: {error}: {expr}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Prometheus loaded the chart's rule file and evaluated every rule without an error.
    let (http, prometheus, alerts) = (&http, &prometheus, &alerts);
    eventually_within(
        "every rule loaded and healthy",
        Duration::from_secs(10),
        || async move {
            let rules: Value = http
                .get(format!("{}/api/v1/rules", prometheus.url()))
                .send()
                .await
                .expect("rules")
                .json()
                .await
                .expect("rules JSON");
            let loaded: Vec<&Value> = rules["data"]["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|group| group["rules"].as_array().into_iter().flatten())
                .collect();
            let healthy = loaded.iter().filter(|rule| rule["health"] == "ok").count();
            when(
                loaded.len() == alerts.len() && healthy == loaded.len(),
                || {
                    format!(
                        "rules loaded {} of {}, healthy {healthy}: {rules}",
                        loaded.len(),
                        alerts.len()
                    )
                },
            )
        },
    )
    .await;

    // promtool accepts the exposition.
    let exposition = core.api.metrics().await;
    let mut check = std::process::Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool starts");
    std::io::Write::write_all(
        &mut check.stdin.take().expect("stdin"),
        exposition.as_bytes(),
    )
    .expect("promtool reads the metrics");
    let checked = check.wait_with_output().expect("promtool ends");
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // Full replicas answer alike: every thread, both identities, the same body from each worker, as projected.
    for conversation in &conversations {
        for query in [String::new(), Conversation::query()] {
            let bodies: Vec<String> = futures_util::future::join_all(
                workers
                    .iter()
                    .map(|api| api.history(&conversation.thread, &query)),
            )
            .await
            .into_iter()
            .map(|reply| {
                assert_eq!(reply.status, 200, "{}", reply.body);
                reply.body
            })
            .collect();
            assert!(
                bodies.windows(2).all(|pair| pair[0] == pair[1]),
                "{} ?{query}: the workers differ: {bodies:?}",
                conversation.thread
            );
        }
        let answer: Value = serde_json::from_str(
            &read_until_cache(&replica.api, &conversation.thread, &Conversation::query())
                .await
                .body,
        )
        .expect("JSON");
        assert_eq!(answer, conversation.expected(), "{}", conversation.thread);
    }
}
