//! The soak's report: the table it prints and `target/soak.json`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};

use super::verdict::Observations;

/// What the report shows beyond the verdict's observations.
pub struct Extra {
    pub secs: u64,
    pub threads: usize,
    /// (source, status) -> count.
    pub reads: BTreeMap<(String, u16), u64>,
    pub quiet_points: Vec<Value>,
    /// (seconds since start, KiB).
    pub rss: Vec<(u64, u64)>,
    pub late_committed: usize,
    pub commit_lag_max: Duration,
}

/// The shadow checks' results, as `history_view_shadow_checks_total` labels them.
pub const SHADOW_RESULTS: [&str; 9] = [
    "match",
    "ahead",
    "uncertain",
    "window",
    "missing",
    "late",
    "differs",
    "dropped",
    "error",
];

/// Prints the table and writes `target/soak.json`.
pub fn report(o: &Observations, extra: &Extra, failures: &[String]) {
    let shadow: Vec<String> = SHADOW_RESULTS
        .iter()
        .map(|r| format!("{r}={}", o.shadow.get(*r).copied().unwrap_or(0.0)))
        .collect();
    eprintln!(
        "rows read beyond the persister-lag bound: {}",
        o.lag_exceeded
    );
    eprintln!(
        "events committed beyond the bound: {} (largest commit lag {:.1} s); missing events explained by them: {} of {}",
        extra.late_committed,
        extra.commit_lag_max.as_secs_f64(),
        o.missing_explained(),
        o.missing_events_total,
    );
    eprintln!(
        "soak: {} cycles, {} threads, {} s",
        o.cycles, extra.threads, extra.secs
    );
    eprintln!("{:<16} {:>6}", "fault", "count");
    for (fault, count) in &o.injected {
        eprintln!("{:<16} {count:>6}", format!("{fault:?}"));
    }
    eprintln!("{:<16} {:>12}", "recovery", "readiness");
    for (fault, took) in &o.recoveries {
        eprintln!(
            "{:<16} {:>12}",
            format!("{fault:?}"),
            took.map_or("none".into(), |d| format!("{:.2} s", d.as_secs_f64()))
        );
    }
    eprintln!("{:<16} {:>6} {:>10}", "reads: source", "status", "count");
    for ((source, status), count) in &extra.reads {
        eprintln!("{source:<16} {status:>6} {count:>10}");
    }
    eprintln!(
        "judged: {} answers ({} compared whole), {} broke the promise",
        o.judged_reads,
        o.judged_whole,
        o.judged_violations.len()
    );
    eprintln!(
        "between faults: {} of {} reads from memory ({:.0}%)",
        o.calm_cache,
        o.calm_total,
        100.0 * o.calm_cache as f64 / o.calm_total.max(1) as f64
    );
    eprintln!("shadow checks: {}", shadow.join(" "));
    eprintln!(
        "quiet points: {}",
        extra
            .quiet_points
            .iter()
            .map(|q| format!("{}", q["divergences"]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    eprintln!(
        "RSS MiB over time: {}",
        extra
            .rss
            .iter()
            .step_by(10)
            .map(|(t, kib)| format!("{t}s:{}", kib / 1024))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let report = json!({
        "secs": extra.secs, "cycles": o.cycles, "threads": extra.threads,
        "faults": o.injected.iter().map(|(f, n)| (format!("{f:?}"), json!(n))).collect::<serde_json::Map<_, _>>(),
        "recoveries_ms": o.recoveries.iter().map(|(f, d)| json!({"fault": format!("{f:?}"), "ms": d.map(|d| d.as_millis() as u64)})).collect::<Vec<_>>(),
        "reads": extra.reads.iter().map(|((s, st), n)| json!({"source": s, "status": st, "count": n})).collect::<Vec<_>>(),
        "judged": {"answers": o.judged_reads, "whole": o.judged_whole, "broke_the_promise": o.judged_violations.len()},
        "between_faults": {"total": o.calm_total, "cache": o.calm_cache},
        "quiet_points": extra.quiet_points,
        "rss_kib": extra.rss,
        "shadow_checks": shadow,
        "late_commits": {"events": extra.late_committed, "max_ms": extra.commit_lag_max.as_millis() as u64,
            "missing_explained": o.missing_explained()},
        "failures": failures,
    });
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/soak.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("JSON"))
        .expect("target/soak.json");
}
