//! [`judge`]: one answer held to the promise against the [`Ledger`], and [`Report`], the tally of a scenario's.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::Ledger;

/// Where an answer came from, as far as the reader knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// `X-History-Source: cache`.
    Memory,
    /// `X-History-Source: store`.
    Store,
    /// Not said (a feed's event): judged by the weaker of the two.
    Either,
}

impl Source {
    /// The source an `X-History-Source` header names.
    pub fn from_header(value: Option<&str>) -> Option<Self> {
        match value {
            Some("cache") => Some(Self::Memory),
            Some("store") => Some(Self::Store),
            _ => None,
        }
    }
}

/// One answer: a read of `thread` (with `identity`) that started at `started`.
pub struct Answer<'a> {
    pub thread: &'a str,
    pub identity: Option<(&'a str, &'a str)>,
    pub started: Instant,
    pub status: u16,
    /// `None`: the answer named no source it could have (a violation for a 200).
    pub source: Option<Source>,
    /// The answer's messages (a 200), or its body (for the failure message).
    pub messages: &'a Value,
    pub body: &'a str,
}

/// What a scenario's answers showed.
#[derive(Default, Debug)]
pub struct Report {
    pub reads: usize,
    pub cache: usize,
    pub store: usize,
    /// Answers compared whole with the reference (the thread was quiet past the bound).
    pub whole: usize,
    /// 503 `store_unavailable`: no answer, so no breach of the promise (an overloaded store), but counted.
    pub unavailable: usize,
    pub slowest: Duration,
    pub violations: Vec<String>,
}

impl Report {
    pub fn add(&mut self, other: Report) {
        self.reads += other.reads;
        self.cache += other.cache;
        self.store += other.store;
        self.whole += other.whole;
        self.unavailable += other.unavailable;
        self.slowest = self.slowest.max(other.slowest);
        self.violations.extend(other.violations);
    }

    /// A report of one read that failed before it had an answer.
    pub fn failed(violation: String) -> Self {
        Self {
            reads: 1,
            violations: vec![violation],
            ..Self::default()
        }
    }

    /// Prints the tally and panics naming the first answers that broke the promise, if any did.
    ///
    /// # Panics
    /// When an answer broke the promise.
    pub fn assert_kept(&self, what: &str) {
        eprintln!(
            "{what}: {} reads ({} from memory, {} from the store, {} compared whole, {} store unavailable), slowest {:?}",
            self.reads, self.cache, self.store, self.whole, self.unavailable, self.slowest
        );
        assert!(
            self.violations.is_empty(),
            "{what}: {} of {} answers broke the promise:\n{}",
            self.violations.len(),
            self.reads,
            self.violations
                .iter()
                .take(10)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// One answer held to the promise:
/// - a 200 (a 503 `store_unavailable` without a source is counted, not failed);
/// - from memory, no token of a row stored more than the bound before the read started is missing; from the
///   store, none stored more than the store timeout before it (a read joins the thread's store read in flight);
///   a feed's event (source not said), none stored more than the longer of the two;
/// - when the thread was quiet for that long before the read, the answer equals the reference whole.
pub fn judge(ledger: &Ledger, answer: &Answer<'_>) -> Report {
    let Answer {
        thread,
        identity,
        started,
        status,
        source,
        messages,
        body,
    } = *answer;
    let mut report = Report {
        reads: 1,
        slowest: started.elapsed(),
        ..Report::default()
    };
    if status == 503 && body.contains("store_unavailable") && source.is_none() {
        report.unavailable += 1;
        return report;
    }
    if status != 200 {
        report
            .violations
            .push(format!("{thread}: {status} ({source:?}) {body}"));
        return report;
    }
    let bound = match source {
        Some(Source::Memory) => {
            report.cache += 1;
            ledger.lag
        }
        Some(Source::Store) => {
            report.store += 1;
            ledger.store_timeout
        }
        Some(Source::Either) => ledger.lag.max(ledger.store_timeout),
        None => {
            report
                .violations
                .push(format!("{thread}: no known source: {body}"));
            return report;
        }
    };
    let Some(cutoff) = started.checked_sub(bound) else {
        return report;
    };
    let shown = messages.to_string();
    let missing: Vec<String> = ledger
        .required(thread, identity, cutoff)
        .into_iter()
        .filter(|(token, _)| !shown.contains(token.as_str()))
        .map(|(token, before)| format!("{token} (stored {:?} before the read)", before + bound))
        .collect();
    if !missing.is_empty() {
        report.violations.push(format!(
            "{thread}: an answer from {source:?} ({:?} after the read started) lacks {}: {shown}",
            started.elapsed(),
            missing.join(", ")
        ));
    } else if ledger.quiet_before(thread, cutoff) {
        report.whole += 1;
        let reference = ledger.reference(thread, identity);
        if *messages != reference {
            report.violations.push(format!(
                "{thread}: an answer from {source:?} of a thread quiet past the bound differs from the reference:\n got {shown}\nwant {reference}"
            ));
        }
    }
    report
}
