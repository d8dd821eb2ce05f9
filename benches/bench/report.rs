//! The result table (one [`Row`] per target), progress lines, the machine header, and small statistics and
//! formatting helpers shared by the measurements.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::setup::Settings;

/// Whether a row met its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    Fail,
    /// A supporting number without a target of its own.
    Info,
}

/// One line of the result table.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: &'static str,
    pub what: String,
    pub measured: String,
    pub target: String,
    pub verdict: Verdict,
}

impl Row {
    pub fn check(
        id: &'static str,
        what: impl Into<String>,
        measured: impl Into<String>,
        target: impl Into<String>,
        pass: bool,
    ) -> Self {
        Self {
            id,
            what: what.into(),
            measured: measured.into(),
            target: target.into(),
            verdict: if pass { Verdict::Pass } else { Verdict::Fail },
        }
    }

    pub fn info(id: &'static str, what: impl Into<String>, measured: impl Into<String>) -> Self {
        Self {
            id,
            what: what.into(),
            measured: measured.into(),
            target: "-".into(),
            verdict: Verdict::Info,
        }
    }

    /// The measurement could not finish (it panicked with `message`).
    pub fn failed(id: &'static str, message: &str) -> Self {
        let first_line = message.lines().next().unwrap_or_default();
        Self::check(
            id,
            "did not complete",
            format!("error: {first_line}"),
            "-",
            false,
        )
    }
}

fn started() -> Instant {
    static STARTED: OnceLock<Instant> = OnceLock::new();
    *STARTED.get_or_init(Instant::now)
}

/// A progress line on stderr, with the time since the run started.
pub fn progress(id: &str, message: &str) {
    eprintln!(
        "[{:>6.1}s] {id:<5} {message}",
        started().elapsed().as_secs_f64()
    );
}

/// The machine and the settings, so a table can be read later on its own.
pub fn print_header(settings: &Settings) {
    let _ = started();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map_or("unknown", |(_, model)| model.trim());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    println!("chat-history-view benchmark (docs/design.md section 7)");
    println!("machine: {cores} cores (nproc), {model}");
    println!(
        "worker:  {} (release, separate process)",
        settings.worker_bin.display()
    );
    println!(
        "events:  P1 {} (BENCH_EVENTS_P1) in {} rounds (BENCH_ROUNDS_P1), P5 {} (BENCH_EVENTS_P5); P4 sizes 1k, \
         10k{}",
        settings.events_p1,
        settings.rounds_p1,
        settings.events_p5,
        if settings.full {
            ", 100k (BENCH_FULL=1)"
        } else {
            " (BENCH_FULL=1 adds 100k)"
        }
    );
    println!(
        "note:    the bench (publishers, HTTP load), nats-server, SecantusDB and the worker share these {cores} cores"
    );
    println!(
        "store:   P3/P4 run with the index hint disabled (worker HISTORY_VIEW_MONGODB_INDEX_HINT=\"\", baseline \
         unhinted): SecantusDB walks the whole collection in Python for any hinted query"
    );
    println!();
}

pub fn print_table(rows: &[Row]) {
    let headers = ["id", "what", "measured", "target", "result"];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            let verdict = match r.verdict {
                Verdict::Pass => "pass",
                Verdict::Fail => "FAIL",
                Verdict::Info => "info",
            };
            [
                r.id.to_owned(),
                r.what.clone(),
                r.measured.clone(),
                r.target.clone(),
                verdict.to_owned(),
            ]
        })
        .collect();
    let mut widths = headers.map(str::len);
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 5]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", padded.join(" | ").trim_end());
    };
    println!();
    line(headers);
    println!("{}", widths.map(|w| "-".repeat(w)).join("-|-"));
    for row in &cells {
        line([&row[0], &row[1], &row[2], &row[3], &row[4]]);
    }
    let failed = rows.iter().filter(|r| r.verdict == Verdict::Fail).count();
    let checked = rows.iter().filter(|r| r.verdict != Verdict::Info).count();
    println!();
    println!("{} of {checked} targets met", checked - failed);
}

/// The value at quantile `q` (0..=1) of `sorted` (nearest rank); zero when empty.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of `samples`.
pub fn median(samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    quantile(&sorted, 0.5)
}

/// `1.23 s`, `45.6 ms`, `789 µs`.
pub fn fmt_duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs >= 1.0 {
        format!("{secs:.2} s")
    } else if secs >= 0.01 {
        format!("{:.1} ms", secs * 1e3)
    } else if secs >= 0.001 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{:.0} µs", secs * 1e6)
    }
}

/// `123.4k`, `1.20M`.
pub fn fmt_count(n: f64) -> String {
    if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// CPU time per event, in µs.
pub fn cpu_per_event(cpu: Duration, events: u64) -> f64 {
    cpu.as_secs_f64() * 1e6 / events.max(1) as f64
}

/// Events per second.
pub fn rate(events: u64, elapsed: Duration) -> f64 {
    events as f64 / elapsed.as_secs_f64().max(1e-9)
}
