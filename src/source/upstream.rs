//! Partitioned workers: what is known of one class stream upstream of the partitioned stream ([design
//! 2.1.5](../../docs/design.md#2.1.5)), on plain values: how far its source has passed it with what it passed applied
//! ([`Upstream::copied`]), whether it removed messages its source had not copied yet (a gap), and up to when every
//! message it stored is applied (its part of the covered-through instant, [`crate::freshness::Part::Upstream`]).
//!
//! A source copies a class stream in order but passes silently over messages the class stream removed before it
//! got to them. So a sequence passed proves a message copied only if the message was still there when it was
//! passed: a pass known before a reading of the class stream was asked covers the messages that reading found held,
//! and every removal between two readings is judged against what was passed before the earlier one. Pure: the
//! discovery rounds (`partitioned.rs`) and the consumer loop (`consumer.rs`) feed it.

use std::collections::VecDeque;

use crate::coverage::Stamp;

/// How many readings are kept (one a round).
const MAX_READINGS: usize = 64;

/// One reading of the class stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reading {
    asked: Stamp,
    returned: Stamp,
    first: u64,
    last: u64,
    /// [`Upstream::copied`] as known before it was asked.
    copied_before: u64,
}

/// What is known of one class stream upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Upstream {
    /// Every message of the class stream up to this sequence was passed by its source, and those it copied that
    /// belong to this worker's partition are applied.
    copied: u64,
    readings: VecDeque<Reading>,
}

/// What a reading of the class stream decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judged {
    /// It removed messages its source may not have copied: a gap.
    pub lost: bool,
    /// Every message it stored before this moment is applied, or its loss judged.
    pub covered: Option<Stamp>,
}

impl Upstream {
    /// A class stream whose source starts after `last` (what it held before was never to be copied).
    pub fn starting_after(last: u64) -> Self {
        Self {
            copied: last,
            readings: VecDeque::new(),
        }
    }

    /// How far its source is known to have passed it, with what it copied applied.
    pub fn copied(&self) -> u64 {
        self.copied
    }

    /// A message copied from it (its origin sequence `seq`) was applied: its source had passed everything before.
    pub fn applied(&mut self, seq: u64) {
        self.copied = self.copied.max(seq);
    }

    /// Its source had nothing left to copy when nats-server last heard from it, no earlier than `contact`, and what
    /// the partitioned stream held then is applied: every message a reading that returned before `contact` found
    /// was passed.
    pub fn caught_up_at(&mut self, contact: Stamp) {
        if let Some(reading) = self
            .readings
            .iter()
            .rev()
            .find(|reading| reading.returned <= contact)
        {
            self.copied = self.copied.max(reading.last);
        }
    }

    /// A reading asked at `asked` (with [`Upstream::copied`] `copied_before` as it was then) that returned at
    /// `returned` with the class stream holding `first..=last`.
    pub fn read(
        &mut self,
        copied_before: u64,
        asked: Stamp,
        returned: Stamp,
        first: u64,
        last: u64,
    ) -> Judged {
        // Messages removed since the last reading were there at it (or stored after it): copied only if passed
        // before it was asked.
        let lost = self.readings.back().is_some_and(|previous| {
            first > previous.first && first > previous.copied_before.saturating_add(1)
        });
        if self.readings.len() == MAX_READINGS {
            self.readings.pop_front();
        }
        self.readings.push_back(Reading {
            asked,
            returned,
            first,
            last,
            copied_before,
        });
        // The newest reading judged every removal before it was asked; a message passed before that was there
        // when passed, so copied. Every message stored before a reading whose last sequence it covers is applied.
        let newest = copied_before;
        let covered = self
            .readings
            .iter()
            .rev()
            .find(|reading| reading.last <= newest)
            .map(|reading| reading.asked);
        if lost {
            // What was lost is judged: nothing before this reading counts against later ones.
            self.copied = self.copied.max(first.saturating_sub(1));
        }
        Judged { lost, covered }
    }
}

/// The class stream and origin sequence of a message copied by a source: nats-server's `Nats-Stream-Source`
/// header, `<stream>[:<hash>] <seq> <filter> <transform> <subject> [<identity>]`.
pub fn copied_from(header: &str) -> Option<(&str, u64)> {
    let mut parts = header.split(' ');
    let stream = parts.next()?.split(':').next()?;
    let seq = parts.next()?.parse().ok()?;
    (!stream.is_empty()).then_some((stream, seq))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::coverage::Coverage;

    #[tokio::test(start_paused = true)]
    async fn an_idle_class_stream_is_covered_through_each_reading_once_passed() {
        let clock = Coverage::new(Duration::from_secs(2));
        let mut upstream = Upstream::starting_after(10);
        let t0 = clock.now();
        let judged = upstream.read(upstream.copied(), t0, t0, 1, 10);
        assert_eq!(
            judged,
            Judged {
                lost: false,
                covered: Some(t0)
            },
            "nothing after its source's start"
        );
        // Two messages stored, copied, and one of them applied; its source heard from after the next reading.
        tokio::time::advance(Duration::from_millis(500)).await;
        let t1 = clock.now();
        assert_eq!(
            upstream.read(upstream.copied(), t1, t1, 1, 12).covered,
            Some(t0)
        );
        upstream.caught_up_at(t1.plus(Duration::from_millis(100)));
        assert_eq!(upstream.copied(), 12);
        tokio::time::advance(Duration::from_millis(500)).await;
        let t2 = clock.now();
        assert_eq!(
            upstream.read(upstream.copied(), t2, t2, 1, 12).covered,
            Some(t2)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn messages_removed_before_their_source_passed_them_are_a_gap() {
        let clock = Coverage::new(Duration::from_secs(2));
        let mut upstream = Upstream::starting_after(100);
        let t = clock.now();
        assert!(!upstream.read(100, t, t, 1, 100).lost);
        // 500 stored; the source passes 150 (headers of applied copies), then the class stream keeps its last 200.
        assert!(!upstream.read(100, t, t, 1, 600).lost);
        upstream.applied(150);
        let judged = upstream.read(upstream.copied(), t, t, 401, 600);
        assert!(
            judged.lost,
            "151..=400 were removed before their source passed them"
        );
        // The front moving over what was passed before the last reading is no loss.
        upstream.applied(600);
        assert!(!upstream.read(upstream.copied(), t, t, 401, 600).lost);
        assert!(!upstream.read(upstream.copied(), t, t, 450, 600).lost);
        assert!(
            !upstream.read(upstream.copied(), t, t, 601, 600).lost,
            "all passed before the last reading was asked"
        );
    }

    #[test]
    fn a_pass_learnt_after_a_reading_was_asked_covers_it_only_from_the_next_reading() {
        let clock = Coverage::new(Duration::from_secs(2));
        let t = clock.now();
        let mut upstream = Upstream::starting_after(0);
        assert_eq!(upstream.read(0, t, t, 1, 5).covered, None);
        // Passed through 5 while the next reading was under way: message 3 may have been skipped, removed after
        // the first reading; only the reading asked after the pass may judge that.
        upstream.applied(5);
        let later = t.plus(Duration::from_millis(10));
        let judged = upstream.read(upstream.copied(), later, later, 1, 5);
        assert_eq!(judged.covered, Some(later));
    }

    #[test]
    fn the_source_header_names_the_class_stream_and_sequence() {
        assert_eq!(
            copied_from("agent_A_stream 42 > > agent.A.x.t.d.r.display_event.chunk.e1"),
            Some(("agent_A_stream", 42))
        );
        assert_eq!(
            copied_from("agent_A_stream:3f2a 7 > >"),
            Some(("agent_A_stream", 7))
        );
        assert_eq!(copied_from("garbage"), None);
        assert_eq!(copied_from(" 7"), None);
    }
}
