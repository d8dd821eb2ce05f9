//! The five projectable families: the parent class names that make a display event relevant, the one `event_data`
//! field each family's projector branch reads, and the branch an event takes
//! ([contract 5.1](../../docs/contract.md#5.1), [5.4](../../docs/contract.md#5.4)). The store's filters name the same
//! families through [`Family::parent`].

use super::{DISPLAY_EVENT, USER_AGENT};
use crate::subject::DeliveryKey;

/// A projectable family, in the order of the projector's branches (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// A user turn; from `UserAgent` only, and then a visibility marker.
    UserMessage,
    /// A HITL answer; from `UserAgent` only, and then a visibility marker.
    HitlResponse,
    /// A streamed piece of an agent's answer.
    Chunk,
    /// A HITL question asked by an agent.
    HitlRequest,
    /// The end of an agent's run; may supply the unstreamed end of its answer (the prefix rule).
    Stop,
}

impl Family {
    /// Every family, in branch order.
    pub const ALL: [Family; 5] = [
        Family::UserMessage,
        Family::HitlResponse,
        Family::Chunk,
        Family::HitlRequest,
        Family::Stop,
    ];
    /// The families whose `UserAgent` events make their display client-visible.
    pub const MARKERS: [Family; 2] = [Family::UserMessage, Family::HitlResponse];

    /// The class name in an event's parents list (`_parent_event_names`, `event_parents`).
    pub const fn parent(self) -> &'static str {
        match self {
            Family::UserMessage => "UserMessageEvent",
            Family::HitlResponse => "HumanInTheLoopResponseEvent",
            Family::Chunk => "ChunkEvent",
            Family::HitlRequest => "HumanInTheLoopRequestEvent",
            Family::Stop => "StopEvent",
        }
    }

    /// The one `event_data` field this family's branch reads.
    pub const fn field(self) -> &'static str {
        match self {
            Family::UserMessage => "messages",
            Family::HitlResponse => "response",
            Family::Chunk => "content",
            Family::HitlRequest => "question",
            Family::Stop => "output_messages",
        }
    }

    /// The family a parent class name names, if any (the inverse of [`Family::parent`]; a `match`, as this runs for
    /// every parent of every live event).
    pub fn from_parent(name: &str) -> Option<Family> {
        match name {
            "UserMessageEvent" => Some(Family::UserMessage),
            "HumanInTheLoopResponseEvent" => Some(Family::HitlResponse),
            "ChunkEvent" => Some(Family::Chunk),
            "HumanInTheLoopRequestEvent" => Some(Family::HitlRequest),
            "StopEvent" => Some(Family::Stop),
            _ => None,
        }
    }

    /// The family whose branch reads the `event_data` field `name`, if any (the inverse of [`Family::field`]; runs
    /// for every top-level key of every live payload).
    pub fn from_field(name: &str) -> Option<Family> {
        match name {
            "messages" => Some(Family::UserMessage),
            "response" => Some(Family::HitlResponse),
            "content" => Some(Family::Chunk),
            "question" => Some(Family::HitlRequest),
            "output_messages" => Some(Family::Stop),
            _ => None,
        }
    }

    /// The parent class names of `families`, for the store's filters.
    pub const fn parents<const N: usize>(families: [Family; N]) -> [&'static str; N] {
        let mut names = [""; N];
        let mut i = 0;
        while i < N {
            names[i] = families[i].parent();
            i += 1;
        }
        names
    }

    fn is_marker(self) -> bool {
        Family::MARKERS.contains(&self)
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The families a parents list names, as a bit set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Families(u8);

impl Families {
    /// Adds the family `parent` names; other class names are ignored.
    pub(super) fn add(&mut self, parent: &str) {
        if let Some(family) = Family::from_parent(parent) {
            self.0 |= family.bit();
        }
    }

    fn has(self, family: Family) -> bool {
        self.0 & family.bit() != 0
    }
}

/// The projector branch an event takes; decided from the key and the parents alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Branch {
    /// The branch of this family, which reads its field.
    Reads(Family),
    /// A family member no branch takes (a user message or HITL answer not from `UserAgent`).
    Inert,
}

impl Branch {
    /// The family filter and branch choice: a display event naming at least one family takes the first family's
    /// branch in [`Family::ALL`] order, the marker families counting only for `UserAgent` events.
    pub(super) fn classify(key: &DeliveryKey, families: Families) -> Option<Branch> {
        if families.0 == 0 || key.event_type() != DISPLAY_EVENT {
            return None;
        }
        let user = key.agent_class() == USER_AGENT;
        Some(
            Family::ALL
                .into_iter()
                .find(|&f| families.has(f) && (user || !f.is_marker()))
                .map_or(Branch::Inert, Branch::Reads),
        )
    }

    /// The one `event_data` field this branch reads.
    pub(super) fn field(self) -> Option<&'static str> {
        match self {
            Branch::Reads(family) => Some(family.field()),
            Branch::Inert => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `parent`/`from_parent` and `field`/`from_field` are written as two matches each: this keeps them inverse.
    #[test]
    fn names_and_fields_map_back_to_their_family() {
        for family in Family::ALL {
            assert_eq!(Family::from_parent(family.parent()), Some(family));
            assert_eq!(Family::from_field(family.field()), Some(family));
        }
        assert_eq!(Family::from_parent("DisplayEvent"), None);
        assert_eq!(Family::from_field("created_at"), None);
    }
}
