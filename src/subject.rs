//! NATS subject → [`DeliveryKey`]: the 9-token grammar of aihub display events (contract sections
//! [1](../docs/contract.md#1) and [6](../docs/contract.md#6)).
//!
//! `agent.<agent_class>.<agent_id>.<thread_id>.<display_id>.<run_id>.<event_type>.<event_name>.<event_id>`
//!
//! The delivery key is the 8-tuple after the literal `agent`. It identifies one delivery of one event: aihub's
//! persister writes one row per API replica, so equal keys are the same event and count once.

use std::cmp::Ordering;
use std::fmt;

/// The fields of a delivery key, in the order of the subject and of the contract's dedup tuple ([contract
/// 6](../docs/contract.md#6)).
pub const KEY_FIELDS: [&str; 8] = [
    "agent_class",
    "agent_id",
    "thread_id",
    "display_id",
    "run_id",
    "event_type",
    "event_name",
    "event_id",
];

const AGENT_CLASS: usize = 0;
const AGENT_ID: usize = 1;
const THREAD_ID: usize = 2;
const DISPLAY_ID: usize = 3;
const RUN_ID: usize = 4;
const EVENT_TYPE: usize = 5;
const EVENT_NAME: usize = 6;
const EVENT_ID: usize = 7;

/// The 8-field identity of one event delivery, stored compactly: one string holding the fields back to back and
/// the end offset of each. A view holds one per event, so this is the dominant per-event cost after the payload.
///
/// Fields read from a store row may be empty (the row lacked them or they were not strings);
/// [`DeliveryKey::missing_field`] reports the first such field, which the projector turns into a warning.
/// Keys parsed from a subject are always complete.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct DeliveryKey {
    buf: Box<str>,
    ends: [u32; 8],
}

/// Why a subject is not a display-event subject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    #[error("subject has {0} tokens, expected 9")]
    TokenCount(usize),
    #[error("subject does not start with `agent`")]
    NotAgent,
    #[error("subject token {0} ({1}) is empty")]
    EmptyToken(usize, &'static str),
    #[error("subject is too long")]
    TooLong,
}

impl DeliveryKey {
    /// Builds a key from its 8 fields, in [`KEY_FIELDS`] order. Empty fields are kept (see `missing_field`).
    pub fn from_fields(fields: [&str; 8]) -> Self {
        let len: usize = fields.iter().map(|f| f.len()).sum();
        let mut buf = String::with_capacity(len);
        let mut ends = [0u32; 8];
        for (end, field) in ends.iter_mut().zip(fields) {
            buf.push_str(field);
            // A key longer than 4 GiB cannot arrive: NATS payload and subject limits are far below it.
            *end = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        }
        Self {
            buf: buf.into_boxed_str(),
            ends,
        }
    }

    /// Parses a display-event subject. Exactly 9 non-empty dot-separated tokens, the first `agent`.
    ///
    /// # Errors
    /// [`SubjectError`] naming what is wrong; the subject itself is not echoed (it is caller data).
    pub fn parse_subject(subject: &str) -> Result<Self, SubjectError> {
        if subject.len() > u32::MAX as usize {
            return Err(SubjectError::TooLong);
        }
        let mut tokens = [""; 9];
        let mut count = 0;
        for token in subject.split('.') {
            if count < 9 {
                tokens[count] = token;
            }
            count += 1;
        }
        if count != 9 {
            return Err(SubjectError::TokenCount(count));
        }
        if tokens[0] != "agent" {
            return Err(SubjectError::NotAgent);
        }
        let fields: [&str; 8] = [
            tokens[1], tokens[2], tokens[3], tokens[4], tokens[5], tokens[6], tokens[7], tokens[8],
        ];
        if let Some(i) = fields.iter().position(|f| f.is_empty()) {
            return Err(SubjectError::EmptyToken(i + 2, KEY_FIELDS[i]));
        }
        Ok(Self::from_fields(fields))
    }

    /// The subject this key was delivered on: the inverse of [`DeliveryKey::parse_subject`] for a complete key.
    pub fn to_subject(&self) -> String {
        let mut subject = String::with_capacity(self.buf.len() + 14);
        subject.push_str("agent");
        for field in self.fields() {
            subject.push('.');
            subject.push_str(field);
        }
        subject
    }

    fn field(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.buf[start..self.ends[i] as usize]
    }

    pub fn agent_class(&self) -> &str {
        self.field(AGENT_CLASS)
    }
    pub fn agent_id(&self) -> &str {
        self.field(AGENT_ID)
    }
    pub fn thread_id(&self) -> &str {
        self.field(THREAD_ID)
    }
    pub fn display_id(&self) -> &str {
        self.field(DISPLAY_ID)
    }
    pub fn run_id(&self) -> &str {
        self.field(RUN_ID)
    }
    pub fn event_type(&self) -> &str {
        self.field(EVENT_TYPE)
    }
    pub fn event_name(&self) -> &str {
        self.field(EVENT_NAME)
    }
    pub fn event_id(&self) -> &str {
        self.field(EVENT_ID)
    }

    /// The fields in [`KEY_FIELDS`] order.
    pub fn fields(&self) -> [&str; 8] {
        std::array::from_fn(|i| self.field(i))
    }

    /// The first field that is empty, if any: the contract's `Missing <field>` (a ValueError in aihub).
    pub fn missing_field(&self) -> Option<&'static str> {
        (0..8)
            .find(|&i| self.field(i).is_empty())
            .map(|i| KEY_FIELDS[i])
    }

    /// Heap bytes held by this key, for the cache weigher.
    pub fn heap_bytes(&self) -> usize {
        crate::memory::allocated(self.buf.len())
    }
}

/// The contract's tie-break after `created_at`: `event_id` first, then the whole key in field order. Rust `str`
/// ordering is byte order on UTF-8, which equals Python's code-point order.
impl Ord for DeliveryKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.event_id()
            .cmp(other.event_id())
            .then_with(|| self.fields().cmp(&other.fields()))
    }
}

impl PartialOrd for DeliveryKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for DeliveryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.fields()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_display_event_subject_becomes_its_delivery_key() {
        let subject = "agent.myclass.myid.thread123.displayA.run45.display_event.some_event.789";
        let key = DeliveryKey::parse_subject(subject).unwrap();
        assert_eq!(key.to_subject(), subject);
        assert_eq!(
            key.fields(),
            [
                "myclass",
                "myid",
                "thread123",
                "displayA",
                "run45",
                "display_event",
                "some_event",
                "789"
            ]
        );
        assert_eq!(key.missing_field(), None);
    }

    #[test]
    fn subjects_that_are_not_nine_non_empty_agent_tokens_are_rejected() {
        assert_eq!(
            DeliveryKey::parse_subject("agent.a.b.c.d.e.display_event.n"),
            Err(SubjectError::TokenCount(8))
        );
        assert_eq!(
            DeliveryKey::parse_subject("agent.a.b.c.d.e.display_event.n.i.j"),
            Err(SubjectError::TokenCount(10))
        );
        assert_eq!(
            DeliveryKey::parse_subject("agents.a.b.c.d.e.display_event.n.i"),
            Err(SubjectError::NotAgent)
        );
        assert_eq!(
            DeliveryKey::parse_subject("agent.a.b..d.e.display_event.n.i"),
            Err(SubjectError::EmptyToken(4, "thread_id"))
        );
        assert_eq!(
            DeliveryKey::parse_subject("agent.a.b.c.d.e.display_event.n."),
            Err(SubjectError::EmptyToken(9, "event_id"))
        );
        assert_eq!(
            DeliveryKey::parse_subject(""),
            Err(SubjectError::TokenCount(1))
        );
    }

    #[test]
    fn keys_with_empty_fields_report_the_first_missing_one() {
        let key = DeliveryKey::from_fields(["A", "", "t", "d", "", "display_event", "n", "e"]);
        assert_eq!(key.missing_field(), Some("agent_id"));
        assert_eq!(key.agent_class(), "A");
        assert_eq!(key.thread_id(), "t");
        assert_eq!(key.event_id(), "e");
    }

    #[test]
    fn keys_order_by_event_id_before_the_other_fields() {
        let a = DeliveryKey::from_fields(["Z", "z", "t", "d", "r", "display_event", "n", "a"]);
        let b = DeliveryKey::from_fields(["A", "a", "t", "d", "r", "display_event", "n", "b"]);
        assert!(a < b);
        let c = DeliveryKey::from_fields(["A", "a", "t", "d", "r", "display_event", "n", "a"]);
        assert!(c < a);
    }

    #[test]
    fn field_boundaries_are_part_of_key_identity() {
        let a = DeliveryKey::from_fields(["ab", "c", "t", "d", "r", "x", "n", "e"]);
        let b = DeliveryKey::from_fields(["a", "bc", "t", "d", "r", "x", "n", "e"]);
        assert_ne!(a, b);
    }
}
