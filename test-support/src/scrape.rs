//! Reading Prometheus text exposition: what the tests and the benchmark need of `/metrics`.

/// Sum of every sample of a metric family (all label sets).
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of one sample, e.g. `metric(text, "history_view_events_total{outcome=\"relevant\"}")`; 0 if absent.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(sample)
                .and_then(|rest| rest.trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0)
}

/// Signs of live events lost by the worker: slow-consumer events of its NATS client (each one a gap that
/// downgrades every view).
pub fn live_drops(text: &str) -> f64 {
    metric(
        text,
        "history_view_nats_connection_events_total{event=\"slow_consumer\"}",
    )
}
