//! The soak's verdict: a pure function of what the soak observed, so its rules are unit-tested here rather than
//! only exercised by a minute of faults.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::{Fault, RECOVERY, RSS_LIMIT_KIB};

/// What a soak observed, as the verdict needs it.
#[derive(Default)]
pub struct Observations {
    pub cycles: usize,
    /// The quiet points' divergences (a worker's answer against a cold read and the reference).
    pub divergences: Vec<String>,
    /// Every reader's answer judged against the persister's commits: how many, and those that broke the promise.
    pub judged_reads: usize,
    /// Of those, the answers compared whole with the reference (their thread quiet past the bound).
    pub judged_whole: usize,
    pub judged_violations: Vec<String>,
    /// `history_view_shadow_checks_total` by result.
    pub shadow: BTreeMap<String, f64>,
    /// `history_view_shadow_events_total{result="missing"}`.
    pub missing_events_total: f64,
    /// The event ids the shadow checks' warnings name missing.
    pub named_missing: Vec<String>,
    /// `history_view_persister_lag_exceeded_total`: rows the worker read beyond the bound.
    pub lag_exceeded: f64,
    /// The events the persister committed beyond the bound.
    pub late_events: HashSet<Arc<str>>,
    /// The worker's shadow-check warnings (metadata only), printed with their failure.
    pub warnings: Vec<String>,
    /// Dead links the worker did not notice in time.
    pub unnoticed: Vec<String>,
    pub injected: BTreeMap<Fault, usize>,
    pub recoveries: Vec<(Fault, Option<Duration>)>,
    /// Reads between faults: all, and those from memory.
    pub calm_total: u64,
    pub calm_cache: u64,
    pub rss_peak_kib: u64,
}

impl Observations {
    fn shadow(&self, result: &str) -> f64 {
        self.shadow.get(result).copied().unwrap_or(0.0)
    }

    /// How many of the missing events the shadow checks found are explained: all of them named (the warnings
    /// name every one) and each committed beyond the bound; otherwise none.
    pub fn missing_explained(&self) -> usize {
        if self.named_missing.len() as f64 != self.missing_events_total {
            return 0;
        }
        self.named_missing
            .iter()
            .filter(|id| self.late_events.contains(id.as_str()))
            .count()
    }
}

/// The soak's failures, empty when it passed.
///
/// - A quiet point's divergence, or an answer that broke the promise (the judge exempts rows committed late).
/// - A shadow check that found a row `missing` or `differs`, or `late`. `late` says the persister broke the bound
///   for an event the live path missed: this soak's persister does when its faults pile events up, which the
///   worker measures on the rows it reads (`lag_exceeded`); a `late` without such a row is unexplained. A `missing`
///   row is explained only when every missing event is named and each was committed beyond the bound: the driver
///   sets `_id` when the insert is sent, so a row committed late looks stored in time.
/// - A dead link not noticed, a fault injected fewer times than there were cycles, readiness not back within
///   [`RECOVERY`], fewer than half the reads between faults from memory, RSS above [`RSS_LIMIT_KIB`].
pub fn verdict(o: &Observations) -> Vec<String> {
    let mut failures = o.divergences.clone();
    if !o.judged_violations.is_empty() {
        failures.push(format!(
            "{} of {} answers broke the promise",
            o.judged_violations.len(),
            o.judged_reads
        ));
        failures.extend(o.judged_violations.iter().take(10).cloned());
    }
    let missing_explained = o.missing_explained() as f64 == o.missing_events_total;
    let mut shadow_failed = false;
    for result in ["missing", "late", "differs"] {
        let explained = (result == "late" && o.lag_exceeded > 0.0)
            || (result == "missing" && missing_explained);
        if o.shadow(result) > 0.0 && !explained {
            failures.push(format!(
                "{} shadow checks found {result} rows",
                o.shadow(result)
            ));
            shadow_failed = true;
        }
    }
    if shadow_failed {
        failures.extend(o.warnings.iter().take(10).cloned());
    }
    failures.extend(o.unnoticed.iter().cloned());
    for (fault, count) in &o.injected {
        if *count < o.cycles {
            failures.push(format!(
                "{fault:?} injected {count} times, fewer than {}",
                o.cycles
            ));
        }
    }
    for (fault, took) in &o.recoveries {
        if took.is_none() {
            failures.push(format!(
                "readiness not back within {RECOVERY:?} after {fault:?}"
            ));
        }
    }
    if (o.calm_cache as f64) < 0.5 * o.calm_total.max(1) as f64 {
        failures.push(format!(
            "{} of {} reads between faults served from memory (< 50%)",
            o.calm_cache, o.calm_total
        ));
    }
    if o.rss_peak_kib > RSS_LIMIT_KIB {
        failures.push(format!(
            "RSS peaked at {} MiB, above {} MiB",
            o.rss_peak_kib / 1024,
            RSS_LIMIT_KIB / 1024
        ));
    }
    failures
}

/// The event ids a shadow-check warning names `missing` (its `events` field: `missing:<name>/<event id>`).
pub fn missing_events(line: &str) -> Vec<String> {
    let Ok(line) = serde_json::from_str::<Value>(line) else {
        return Vec::new();
    };
    let events: Vec<String> = line["events"]
        .as_str()
        .and_then(|events| serde_json::from_str(events).ok())
        .unwrap_or_default();
    events
        .iter()
        .filter_map(|event| event.strip_prefix("missing:"))
        .filter_map(|event| event.rsplit_once('/'))
        .map(|(_, id)| id.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A soak that went well: one cycle, every fault once and recovered, most calm reads from memory.
    fn passed() -> Observations {
        let faults = [
            Fault::LinkCut,
            Fault::LinkHalfOpen,
            Fault::NatsFrozen,
            Fault::NatsRestarted,
            Fault::MongoFrozen,
            Fault::MongoRestarted,
        ];
        Observations {
            cycles: 1,
            judged_reads: 1_000,
            shadow: [("match".to_owned(), 40.0)].into(),
            injected: faults.iter().map(|f| (*f, 1)).collect(),
            recoveries: faults
                .iter()
                .map(|f| (*f, Some(Duration::from_secs(2))))
                .collect(),
            calm_total: 100,
            calm_cache: 90,
            rss_peak_kib: 64 * 1024,
            ..Observations::default()
        }
    }

    #[test]
    fn a_soak_that_went_well_passes() {
        assert_eq!(verdict(&passed()), Vec::<String>::new());
    }

    #[test]
    fn an_answer_that_broke_the_promise_fails_it() {
        let observed = Observations {
            judged_violations: vec!["t: an answer from memory lacks [a1.0]".into()],
            ..passed()
        };
        let failures = verdict(&observed);
        assert_eq!(failures[0], "1 of 1000 answers broke the promise");
        assert!(failures[1].contains("lacks [a1.0]"));
    }

    #[test]
    fn missing_rows_fail_it_unless_every_one_was_committed_late() {
        let missing = |late: &[&str]| Observations {
            shadow: [("missing".to_owned(), 1.0)].into(),
            missing_events_total: 2.0,
            named_missing: vec!["e1".into(), "e2".into()],
            late_events: late.iter().map(|id| Arc::from(*id)).collect(),
            warnings: vec!["A shadow check found ...".into()],
            ..passed()
        };
        assert_eq!(verdict(&missing(&["e1", "e2"])), Vec::<String>::new());
        let failures = verdict(&missing(&["e1"]));
        assert_eq!(
            failures,
            [
                "1 shadow checks found missing rows",
                "A shadow check found ..."
            ]
        );
        // Named in fewer warnings than counted: not explained.
        let unnamed = Observations {
            missing_events_total: 3.0,
            ..missing(&["e1", "e2"])
        };
        assert_eq!(verdict(&unnamed).len(), 2);
    }

    #[test]
    fn late_rows_fail_it_unless_the_worker_measured_a_row_beyond_the_bound() {
        let late = |lag_exceeded| Observations {
            shadow: [("late".to_owned(), 1.0)].into(),
            lag_exceeded,
            ..passed()
        };
        assert_eq!(verdict(&late(1.0)), Vec::<String>::new());
        assert_eq!(verdict(&late(0.0)), ["1 shadow checks found late rows"]);
        let differs = Observations {
            shadow: [("differs".to_owned(), 2.0)].into(),
            lag_exceeded: 5.0,
            ..passed()
        };
        assert_eq!(verdict(&differs), ["2 shadow checks found differs rows"]);
    }

    #[test]
    fn faults_unnoticed_missed_or_unrecovered_and_a_cold_cache_or_a_large_rss_fail_it() {
        let mut observed = passed();
        observed.unnoticed.push("LinkHalfOpen not noticed".into());
        observed.cycles = 2;
        observed.recoveries[0].1 = None;
        observed.calm_cache = 49;
        observed.rss_peak_kib = RSS_LIMIT_KIB + 1;
        observed.divergences.push("quiet point 0: t differs".into());
        let failures = verdict(&observed);
        assert_eq!(failures[0], "quiet point 0: t differs");
        assert_eq!(failures[1], "LinkHalfOpen not noticed");
        assert_eq!(
            failures
                .iter()
                .filter(|f| f.contains("fewer than 2"))
                .count(),
            6
        );
        assert!(failures.iter().any(|f| f.contains("readiness not back")));
        assert!(failures.iter().any(|f| f.contains("49 of 100 reads")));
        assert!(failures.iter().any(|f| f.contains("RSS peaked")));
    }

    #[test]
    fn the_missing_events_of_a_warning_are_its_missing_entries() {
        let line = serde_json::json!({"events": r#"["missing:ChunkEvent/e1","late:ChunkEvent/e2","missing:StopEvent/e3"]"#});
        assert_eq!(missing_events(&line.to_string()), ["e1", "e3"]);
        assert_eq!(missing_events("not json"), Vec::<String>::new());
    }
}
