//! The resume and retention rule on plain values ([design 2.1.3](../../docs/design.md#2.1.3), "The JetStream source,
//! case by case"): what the worker has read of one stream ([`Position`]), whether a reading of the stream's state
//! shows that something it had not read is gone ([`Position::judge`]), what a check proves applied
//! ([`Position::covered`]), whether the stream can take and keep display events at all ([`refusal`]), and which of
//! what the source's loops see is a gap of the stream's views ([`gap`]), whether a check may prove anything
//! ([`proves`]). Pure: the loops (`consumer.rs`, `discovery.rs`, `partitioned.rs`, the tracker in `mod.rs`) take
//! the readings and record what this decides.

use std::collections::{BTreeSet, VecDeque};
use std::time::SystemTime;

use async_nats::jetstream::stream::DiscardPolicy;

use super::api::{ConsumerState, Start, StreamState};
use super::{GapCause, Refusal, filter_subjects};
use crate::coverage::Stamp;

/// What a loop of the JetStream source saw that may have passed events of a stream unread ([`gap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen<'a> {
    /// The stream was deleted while it was consumed.
    Deleted,
    /// A stream found by a listing; `after_start`: not by the first one (what it held before is not replayed).
    Found { after_start: bool },
    /// A check read the stream's display-event subjects `now` while it is consumed on `consumed_on`.
    Subjects {
        consumed_on: &'a [String],
        now: &'a [String],
    },
    /// A stream's refusal of display events changed from `was` to `now`.
    Refusing {
        was: Option<Refusal>,
        now: Option<Refusal>,
    },
    /// Partitioned: a class stream's source is known to have lost something it had not copied, or the class
    /// streams upstream changed (recreated, a new leader, deleted, newly sourced).
    Upstream { lost: bool },
}

/// Whether what was seen is a gap of the stream's views, and its cause ([design 2.1.3](../../docs/design.md#2.1.3)):
/// a deleted stream (its events are gone); a stream found after the start (what it held is not replayed); subjects
/// that changed while consumed (messages on the ones the old filters left out were passed unread); a refusal that
/// ended (what it refused is not in the stream); a loss upstream of the partitioned stream. A removal, a deletion
/// or a new leader inside a stream is judged from its readings ([`Position::judge`]).
pub fn gap(seen: Seen<'_>) -> Option<GapCause> {
    match seen {
        Seen::Deleted => Some(GapCause::StreamDeleted),
        Seen::Found { after_start } => after_start.then_some(GapCause::NewStream),
        Seen::Subjects { consumed_on, now } => {
            (!now.is_empty() && now != consumed_on).then_some(GapCause::Subjects)
        }
        Seen::Refusing { was, now } => {
            (was.is_some() && was != now && now.is_none()).then_some(GapCause::Refused)
        }
        Seen::Upstream { lost } => lost.then_some(GapCause::Upstream),
    }
}

/// Whether a check's reading may prove anything applied: not while the stream's leader has not heard from a quorum
/// of its replicas lately (it may be storing nothing, so the stream's part of the covered-through instant stays
/// behind).
pub fn proves(state: &StreamState) -> bool {
    state.quorum
}

/// Past this many deleted messages inside a stream, a reading does not ask for their list: a deletion the count
/// cannot tell apart from the front passing older ones is a (needless) gap instead ([`Position::judge`]).
pub const MAX_LISTED_HOLES: u64 = 10_000;

/// How many earlier checks' readings a position keeps to prove an instant once the consumer has applied through
/// them (one a check: more than a consumer behind by a minute of checks needs).
const MAX_MARKS: usize = 256;

/// A check's first reading: when it was asked, the stream's last sequence then, and (the partitioned stream) the
/// sources that had nothing left to copy, each with the earliest moment nats-server last heard from it. Once
/// everything up to that sequence is applied, everything the stream stored before that moment is, and so is what
/// those sources had copied by then.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mark {
    asked: Stamp,
    last_seq: u64,
    caught_up: Vec<(String, Stamp)>,
}

/// What a check proves ([`Position::covered`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Proved {
    /// Every message the stream stored before this moment is applied, or its loss was judged a gap.
    pub covered: Option<Stamp>,
    /// Partitioned: sources with nothing left to copy when last heard from, no earlier than each moment, whose
    /// copies up to then are applied ([`super::upstream::Upstream::caught_up_at`]).
    pub caught_up: Vec<(String, Stamp)>,
}

/// What the worker has read of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The stream's identity when it was first read.
    pub created: SystemTime,
    pub leader: Option<String>,
    /// The read-through position: every message up to this sequence that may match the filter was applied, or is
    /// older than the coverage start (so in the store by the bound after it), or its loss was recorded as a gap. A
    /// message beyond it that the stream no longer holds is a gap.
    pub through: u64,
    /// The stream sequence of the last message applied; `None` before the first.
    pub applied: Option<u64>,
    /// The stream's count of deleted messages (between its first and last) at the last reading.
    pub deleted: u64,
    /// The stream's first sequence at the last reading.
    pub first: u64,
    /// The deleted sequences at or after the first, as far as known (`None`: not known; the count decides).
    holes: Option<BTreeSet<u64>>,
    /// Earlier checks' first readings not yet applied through, oldest first.
    marks: VecDeque<Mark>,
}

/// What a reading of the stream says about a [`Position`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// Nothing unread is gone (or its loss is listed: each cause a gap to record).
    Continues(Vec<GapCause>),
    /// Another stream under the same name: a gap, and everything it holds is new.
    Recreated,
}

impl Position {
    /// A stream read for the first time: what it no longer holds (before its first sequence) was never delivered
    /// to the worker, which the caller accounts for (coverage starts after it, or it is a gap).
    pub fn new(state: &StreamState) -> Self {
        Self {
            created: state.created,
            leader: state.leader.clone(),
            through: state.first_seq.saturating_sub(1),
            applied: None,
            deleted: state.deleted,
            first: state.first_seq,
            holes: (state.deleted == 0).then(BTreeSet::new),
            marks: VecDeque::new(),
        }
    }

    /// Whether a reading must be taken again with the list of deleted sequences before it is judged: the count
    /// changed in a way the front's move does not explain (a deletion may hide behind the front passing older
    /// holes), and the list is short enough to ask for ([`MAX_LISTED_HOLES`]).
    pub fn needs_deleted_list(&self, state: &StreamState) -> bool {
        if state.deleted == 0 || state.deleted > MAX_LISTED_HOLES || state.deleted_list.is_some() {
            return false;
        }
        match &self.holes {
            // Holes the front has not passed, as known: any more is a new deletion.
            Some(known) => state.deleted > known.range(state.first_seq..).count() as u64,
            None => state.deleted > self.deleted || state.first_seq != self.first,
        }
    }

    /// Where a consumer created now starts: after the last message applied; `first` before any.
    pub fn next_start(&self, first: Start) -> Start {
        match self.applied {
            Some(last) => Start::Sequence(last + 1),
            None => first,
        }
    }

    /// Judges a reading of the stream taken now against what was read: a recreated stream, a new leader (Core
    /// publishes made during the election were captured by no replica), messages removed from the front beyond
    /// the read-through position (age, `max_msgs`, `max_bytes`, `max_msgs_per_subject`, a purge), or deleted
    /// while something was unread. Moves the position past what the listed losses took.
    pub fn judge(&mut self, state: &StreamState) -> Judgement {
        if state.created != self.created {
            return Judgement::Recreated;
        }
        let mut lost = Vec::new();
        if state.leader != self.leader {
            lost.push(GapCause::NewLeader);
            self.leader.clone_from(&state.leader);
        }
        if state.first_seq > self.through + 1 {
            lost.push(GapCause::Removed);
            self.through = state.first_seq - 1;
        }
        if self.deleted_unread(state) {
            lost.push(GapCause::Deleted);
        }
        self.deleted = state.deleted;
        self.first = state.first_seq;
        Judgement::Continues(lost)
    }

    /// Whether a message beyond the read-through position was deleted since the last reading. With the list of
    /// deleted sequences (or none deleted), exactly: a hole not known before, unread. Without it, by the count: it
    /// rises with every deletion and falls when the front passes holes, so a rise, or any change of the front while
    /// holes were there (a new hole may hide behind one passed), is a gap while something is unread (a needless
    /// one at worst, past [`MAX_LISTED_HOLES`]).
    fn deleted_unread(&mut self, state: &StreamState) -> bool {
        let unread = |seq: u64| seq > self.through && seq <= state.last_seq;
        if let Some(list) = &state.deleted_list {
            let new = match &self.holes {
                Some(known) => list.iter().any(|seq| !known.contains(seq) && unread(*seq)),
                None => list.iter().any(|seq| unread(*seq)),
            };
            self.holes = Some(list.iter().copied().collect());
            return new;
        }
        if let Some(known) = &mut self.holes {
            *known = known.split_off(&state.first_seq);
            if state.deleted == known.len() as u64 {
                return false;
            }
            // Holes not located (the list not asked for: too long): the count decides from now on.
            let rose = state.deleted > known.len() as u64;
            self.holes = None;
            return rose && self.through < state.last_seq;
        }
        if state.deleted == 0 {
            self.holes = Some(BTreeSet::new());
            return false;
        }
        let changed =
            state.deleted > self.deleted || (self.deleted > 0 && state.first_seq != self.first);
        changed && self.through < state.last_seq
    }

    /// A check's conclusion, after [`Position::judge`] of a reading `after` taken after the consumer's state
    /// `consumer`, itself asked after a reading `before`, with `delivered` deliveries applied (the last at
    /// [`Position::applied`]): the read-through position rises to the last message applied (nothing beyond the
    /// position was gone at `after`, so every message before it that was not delivered is one the filter left
    /// out, or its loss was just judged a gap), and, when the consumer had nothing pending and every delivery was
    /// applied, to `before`'s last sequence. Returns whether the consumer was drained: everything `before` held
    /// is applied.
    pub fn confirm(
        &mut self,
        before: &StreamState,
        consumer: &ConsumerState,
        delivered: u64,
    ) -> bool {
        if let Some(applied) = self.applied {
            self.through = self.through.max(applied);
        }
        let drained = consumer.pending == 0 && delivered >= consumer.delivered;
        if drained {
            self.through = self.through.max(before.last_seq);
        }
        drained
    }

    /// What a confirmed check ([`Position::confirm`]) proves applied, asked at `asked` (the worker's clock) with
    /// its first reading `before`: the moment of the latest check, this one included, whose reading's last sequence
    /// the read-through position has reached (everything stored before that check asked has a sequence up to its
    /// reading's last; a drained check has raised the position to its own). No server timestamp is compared with
    /// the worker's clock.
    pub fn covered(&mut self, asked: Stamp, before: &StreamState) -> Proved {
        if self.marks.len() == MAX_MARKS {
            self.marks.pop_front();
        }
        self.marks.push_back(Mark {
            asked,
            last_seq: before.last_seq,
            caught_up: before
                .sources
                .iter()
                .filter(|source| source.lag == 0)
                .filter_map(|source| Some((source.name.clone(), asked.minus(source.active?))))
                .collect(),
        });
        let mut proved = Proved::default();
        while let Some(mark) = self.marks.front().filter(|m| m.last_seq <= self.through) {
            proved.covered = proved.covered.max(Some(mark.asked));
            proved.caught_up.extend(mark.caught_up.iter().cloned());
            self.marks.pop_front();
        }
        proved
    }
}

/// Whether a stream can take and keep display events: not sealed, not full with `discard: new` (at `max_msgs`,
/// or within its largest message of `max_bytes`), and, for a class stream consumed on `consumed` (the filters it
/// was first consumed on), still capturing them ([design 2.1.3](../../docs/design.md#2.1.3)). A per-subject limit
/// with `discard_new_per_subject` refuses only a second message on a subject, and each display event has a subject
/// of its own (its event id): only a retry of an event stored already, which is no loss.
pub fn refusal(state: &StreamState, consumed: Option<(&[String], &str)>) -> Option<Refusal> {
    let config = &state.config;
    if config.sealed {
        return Some(Refusal::Sealed);
    }
    if let Some((consumed, subject)) = consumed {
        let now = filter_subjects(&state.subjects, subject);
        if !consumed.iter().all(|f| now.iter().any(|g| covers(g, f))) {
            return Some(Refusal::Subjects);
        }
    }
    let limit = |limit: i64| u64::try_from(limit).ok().filter(|l| *l > 0);
    let full = limit(config.max_messages).is_some_and(|max| state.messages >= max)
        || limit(config.max_bytes)
            .is_some_and(|max| state.bytes.saturating_add(state.max_message) > max);
    (config.discard == DiscardPolicy::New && full).then_some(Refusal::Full)
}

/// Whether one stream refuses display events, as its readings show, and the display-event filters it was first
/// consumed (or seen) on, which its subjects must keep covering.
#[derive(Debug, Default)]
pub struct Refusals {
    pub consumed_on: Option<Vec<String>>,
    pub now: Option<Refusal>,
}

impl Refusals {
    /// Judges a reading ([`refusal`]); with `subject` (the display-event subjects), its subjects too, against the
    /// filters it was first seen with. Returns what it was before when that changed.
    pub fn judge(&mut self, state: &StreamState, subject: Option<&str>) -> Option<Option<Refusal>> {
        let consumed = subject.map(|subject| {
            let filters = self
                .consumed_on
                .get_or_insert_with(|| filter_subjects(&state.subjects, subject));
            (filters.as_slice(), subject)
        });
        let now = refusal(state, consumed);
        (now != self.now).then(|| std::mem::replace(&mut self.now, now))
    }
}

/// Whether every subject `inner` matches, `outer` matches too (NATS wildcards: `*` one token, `>` the rest).
pub fn covers(outer: &str, inner: &str) -> bool {
    let (mut o, mut i) = (outer.split('.'), inner.split('.'));
    loop {
        match (o.next(), i.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(t)) if t != ">" => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_thing_seen_is_a_gap_only_when_events_may_have_passed_unread() {
        let a = ["agent.a.>".to_owned()];
        let b = ["agent.b.>".to_owned()];
        assert_eq!(gap(Seen::Deleted), Some(GapCause::StreamDeleted));
        assert_eq!(gap(Seen::Found { after_start: false }), None);
        assert_eq!(
            gap(Seen::Found { after_start: true }),
            Some(GapCause::NewStream)
        );
        let subjects =
            |consumed_on: &[String], now: &[String]| gap(Seen::Subjects { consumed_on, now });
        assert_eq!(subjects(&a, &a), None);
        assert_eq!(subjects(&a, &b), Some(GapCause::Subjects));
        // Capturing none now: a refusal, judged as such, not a consumer on no subjects.
        assert_eq!(subjects(&a, &[]), None);
        let refusing = |was, now| gap(Seen::Refusing { was, now });
        assert_eq!(refusing(Some(Refusal::Full), None), Some(GapCause::Refused));
        assert_eq!(refusing(Some(Refusal::Full), Some(Refusal::Sealed)), None);
        assert_eq!(refusing(None, Some(Refusal::Full)), None);
        assert_eq!(refusing(None, None), None);
        assert_eq!(gap(Seen::Upstream { lost: true }), Some(GapCause::Upstream));
        assert_eq!(gap(Seen::Upstream { lost: false }), None);
    }

    fn state(first_seq: u64, last_seq: u64) -> StreamState {
        StreamState {
            name: "s".into(),
            created: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000),
            leader: Some("n1".into()),
            quorum: true,
            first_seq,
            last_seq,
            first_time: SystemTime::UNIX_EPOCH,
            deleted: 0,
            deleted_list: None,
            messages: 0,
            bytes: 0,
            max_message: 1_024,
            subjects: Vec::new(),
            sources: Vec::new(),
            config: Default::default(),
        }
    }

    fn read_through(through: u64) -> Position {
        Position {
            through,
            applied: Some(through),
            ..Position::new(&state(1, through))
        }
    }

    #[test]
    fn the_same_stream_holding_everything_unread_continues() {
        let mut position = read_through(41);
        assert_eq!(position.judge(&state(1, 50)), Judgement::Continues(vec![]));
        assert_eq!(
            position.judge(&state(42, 50)),
            Judgement::Continues(vec![]),
            "the next message is still held"
        );
        assert_eq!(position.next_start(Start::All), Start::Sequence(42));
    }

    #[test]
    fn messages_removed_beyond_the_position_are_a_gap_and_move_it() {
        let mut position = read_through(41);
        assert_eq!(
            position.judge(&state(43, 50)),
            Judgement::Continues(vec![GapCause::Removed]),
            "message 42 was removed unread"
        );
        assert_eq!(position.through, 42);
        assert_eq!(
            position.judge(&state(43, 50)),
            Judgement::Continues(vec![]),
            "counted once"
        );
        // A purge leaves the stream empty: its first sequence is one past its last.
        assert_eq!(
            position.judge(&state(51, 50)),
            Judgement::Continues(vec![GapCause::Removed])
        );
    }

    #[test]
    fn a_recreated_stream_or_a_new_leader_is_a_gap() {
        let mut position = read_through(41);
        let recreated = StreamState {
            created: position.created + Duration::from_secs(1),
            ..state(1, 1)
        };
        assert_eq!(position.judge(&recreated), Judgement::Recreated);
        let elected = StreamState {
            leader: Some("n2".into()),
            ..state(1, 50)
        };
        assert_eq!(
            position.judge(&elected),
            Judgement::Continues(vec![GapCause::NewLeader])
        );
        assert_eq!(
            position.judge(&elected),
            Judgement::Continues(vec![]),
            "the new leader is the one read"
        );
    }

    #[test]
    fn a_deletion_is_a_gap_only_while_something_is_unread() {
        let mut position = read_through(41);
        let deleted = |n| StreamState {
            deleted: n,
            ..state(1, 50)
        };
        assert_eq!(
            position.judge(&deleted(1)),
            Judgement::Continues(vec![GapCause::Deleted])
        );
        let mut caught_up = read_through(50);
        assert_eq!(caught_up.judge(&deleted(1)), Judgement::Continues(vec![]));
        assert_eq!(
            caught_up.judge(&deleted(0)),
            Judgement::Continues(vec![]),
            "the front passed the deleted one"
        );
    }

    #[test]
    fn pending_zero_raises_the_position_only_through_a_confirmed_check() {
        // Read through 10; the consumer delivered 20 and 30 (the rest filtered out), and had nothing pending when
        // the stream's last was 60.
        let mut position = read_through(10);
        position.applied = Some(30);
        let before = state(1, 60);
        let drained = ConsumerState {
            pending: 0,
            delivered: 2,
        };
        assert_eq!(position.judge(&state(5, 60)), Judgement::Continues(vec![]));
        assert!(position.confirm(&before, &drained, 2));
        assert_eq!(position.through, 60);
        // Filtered-out messages it read through may age out.
        assert_eq!(position.judge(&state(61, 60)), Judgement::Continues(vec![]));

        // The same consumer, but messages 11..=40 were gone by the reading after its state: 20 and 30 came, the
        // others matching may have been removed before the server reached them.
        let mut position = read_through(10);
        position.applied = Some(30);
        assert_eq!(
            position.judge(&state(41, 60)),
            Judgement::Continues(vec![GapCause::Removed])
        );
        assert!(position.confirm(&before, &drained, 2));
        assert_eq!(position.through, 60);
    }

    #[test]
    fn a_consumer_with_deliveries_not_applied_is_not_drained() {
        let mut position = read_through(10);
        position.applied = Some(12);
        let behind = ConsumerState {
            pending: 0,
            delivered: 3,
        };
        assert!(!position.confirm(&state(1, 60), &behind, 2));
        assert_eq!(position.through, 12, "only what was applied");
        let pending = ConsumerState {
            pending: 4,
            delivered: 2,
        };
        assert!(!position.confirm(&state(1, 60), &pending, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_proves_what_was_stored_before_an_earlier_check_once_applied_through_its_reading()
     {
        let clock = crate::coverage::Coverage::new(Duration::from_secs(2));
        let mut position = read_through(10);
        let behind = ConsumerState {
            pending: 5,
            delivered: 10,
        };
        // Check 1: the stream holds up to 20, the consumer has applied through 10.
        let t1 = clock.now();
        assert!(!position.confirm(&state(1, 20), &behind, 10));
        assert_eq!(
            position.covered(t1, &state(1, 20)).covered,
            None,
            "pending: nothing proved"
        );
        // Check 2: applied through 25 meanwhile (the stream at 30 now): everything stored before check 1 is applied.
        tokio::time::advance(Duration::from_millis(500)).await;
        let t2 = clock.now();
        position.applied = Some(25);
        assert!(!position.confirm(&state(1, 30), &behind, 20));
        assert_eq!(position.covered(t2, &state(1, 30)).covered, Some(t1));
        // Check 3: drained: everything stored before it asked.
        tokio::time::advance(Duration::from_millis(500)).await;
        let t3 = clock.now();
        position.applied = Some(30);
        let drained = ConsumerState {
            pending: 0,
            delivered: 25,
        };
        assert!(position.confirm(&state(1, 30), &drained, 25));
        assert_eq!(position.covered(t3, &state(1, 30)).covered, Some(t3));
    }

    fn configured(change: impl FnOnce(&mut StreamState)) -> StreamState {
        let mut state = state(1, 100);
        state.messages = 100;
        state.bytes = 10_000;
        change(&mut state);
        state
    }

    #[test]
    fn a_stream_refuses_display_events_full_with_discard_new_sealed_or_no_longer_capturing_them() {
        use async_nats::jetstream::stream::DiscardPolicy;
        let display = "agent.*.*.*.*.*.display_event.*.*";
        let consumed = vec!["agent.A.*.*.*.*.display_event.*.*".to_owned()];
        let class = |s: &mut StreamState| s.subjects = vec!["agent.A.>".into()];
        let consumed_on = Some((consumed.as_slice(), display));
        assert_eq!(refusal(&configured(class), consumed_on), None);
        let full = configured(|s| {
            class(s);
            s.config.discard = DiscardPolicy::New;
            s.config.max_messages = 100;
        });
        assert_eq!(refusal(&full, consumed_on), Some(Refusal::Full));
        let discard_old = StreamState {
            config: async_nats::jetstream::stream::Config {
                discard: DiscardPolicy::Old,
                ..full.config.clone()
            },
            ..full.clone()
        };
        assert_eq!(
            refusal(&discard_old, consumed_on),
            None,
            "discard old keeps taking"
        );
        // max_bytes: full once the largest message may not fit.
        let bytes = |max_bytes| {
            configured(|s| {
                class(s);
                s.config.discard = DiscardPolicy::New;
                s.config.max_bytes = max_bytes;
            })
        };
        assert_eq!(refusal(&bytes(11_024), consumed_on), None);
        assert_eq!(refusal(&bytes(11_023), consumed_on), Some(Refusal::Full));
        let sealed = configured(|s| {
            class(s);
            s.config.sealed = true;
        });
        assert_eq!(refusal(&sealed, consumed_on), Some(Refusal::Sealed));
        let edited = configured(|s| s.subjects = vec!["agent.A.*.*.*.*.control.*.*".into()]);
        assert_eq!(refusal(&edited, consumed_on), Some(Refusal::Subjects));
        let narrower = configured(|s| s.subjects = vec!["agent.A.x.>".into()]);
        assert_eq!(refusal(&narrower, consumed_on), Some(Refusal::Subjects));
        let wider = configured(|s| s.subjects = vec!["agent.>".into()]);
        assert_eq!(refusal(&wider, consumed_on), None);
    }

    #[test]
    fn subjects_cover_by_nats_wildcards() {
        assert!(covers("agent.>", "agent.A.*.x"));
        assert!(covers("agent.*.b", "agent.A.b"));
        assert!(covers("agent.*.b", "agent.*.b"));
        assert!(!covers("agent.A.b", "agent.*.b"));
        assert!(!covers("agent.*", "agent.>"));
        assert!(!covers("agent.*", "agent.a.b"));
        assert!(covers("a.>", "a.>"));
    }

    #[test]
    fn past_the_listed_bound_a_front_that_moves_over_holes_while_something_is_unread_is_a_needless_gap()
     {
        let many = StreamState {
            deleted: MAX_LISTED_HOLES + 1,
            ..state(1, 100_000)
        };
        let mut position = Position::new(&many);
        position.through = 50;
        assert!(!position.needs_deleted_list(&many), "too many to list");
        let moved = StreamState {
            first_seq: 10,
            ..many.clone()
        };
        assert_eq!(
            position.judge(&moved),
            Judgement::Continues(vec![GapCause::Deleted])
        );
        assert_eq!(
            position.judge(&moved),
            Judgement::Continues(vec![]),
            "nothing changed"
        );
    }

    proptest::proptest! {
        /// Whatever the readings, a message beyond the read-through position that the stream no longer holds is
        /// a gap: the position never passes a sequence that is gone unless the judgement listed a loss.
        #[test]
        fn no_reading_passes_a_removed_message_silently(
            through in 0u64..1_000,
            first in 0u64..2_000,
            last_extra in 0u64..500,
        ) {
            let mut position = read_through(through);
            let last = first.max(through) + last_extra;
            let judged = position.judge(&state(first, last));
            let lost = matches!(&judged, Judgement::Continues(causes) if causes.contains(&GapCause::Removed));
            proptest::prop_assert_eq!(lost, first > through + 1);
            proptest::prop_assert!(position.through + 1 >= first);
        }
    }
}
