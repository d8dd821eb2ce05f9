//! What a view holds, part by part ([`ThreadView::footprint`], the benchmark's memory breakdown) and its
//! containers' bytes (the weigher's O(1) part).

use std::collections::HashSet;

use super::{Extra, PUBLISHER_ROW_BYTES, ThreadView};
use crate::decode::ViewEvent;
use crate::memory::allocated;

impl ThreadView {
    /// What the view holds, part by part, from its containers' capacities and its events' heap: what the
    /// benchmark's memory breakdown reports (P5, [design 7](../../docs/design.md#7)). O(events).
    pub fn footprint(&self) -> Footprint {
        let mut footprint = self.containers();
        for event in self.events() {
            let key = event.key.heap_bytes();
            footprint.keys += key;
            footprint.bodies += event.heap_bytes() - key;
        }
        if let Some(extra) = self.extra.as_deref() {
            footprint.displays += extra
                .covered
                .iter()
                .chain(&extra.uncovered)
                .map(|display| allocated(display.len()))
                .sum::<usize>();
        }
        footprint
    }

    /// The view's struct and containers by part (the heap of its events and displays left out).
    pub(super) fn containers(&self) -> Footprint {
        let vector = |len: usize, size: usize| allocated(len * size);
        let event = std::mem::size_of::<ViewEvent>();
        let mut parts = Footprint {
            fixed: std::mem::size_of::<Self>(),
            events: vector(self.events.capacity(), event),
            order: vector(self.order.capacity(), std::mem::size_of::<u32>()),
            index: allocated(self.index.allocation_size()),
            ..Footprint::default()
        };
        if let Some(extra) = self.extra.as_deref() {
            parts.fixed += allocated(std::mem::size_of::<Extra>());
            parts.events += vector(extra.rejected.capacity(), event);
            parts.displays = set_table(&extra.covered) + set_table(&extra.uncovered);
            parts.publishers = vector(extra.publishers.capacity(), PUBLISHER_ROW_BYTES);
        }
        parts
    }
}

/// The bytes of a set's table (its slots and control bytes), as hashbrown sizes it for its capacity.
fn set_table(set: &HashSet<Box<str>>) -> usize {
    match set.capacity() {
        0 => 0,
        capacity => {
            let buckets = (capacity * 8 / 7).next_power_of_two();
            allocated(buckets * (std::mem::size_of::<Box<str>>() + 1) + 16)
        }
    }
}

/// A view's bytes by part ([`ThreadView::footprint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// The view's own struct (inline in its cache entry).
    pub fixed: usize,
    /// The events' inline parts, by the capacity of their vectors.
    pub events: usize,
    /// The delivery keys' heap (the 8 fields back to back).
    pub keys: usize,
    /// The bodies' heap (texts, content parts).
    pub bodies: usize,
    /// The projection order.
    pub order: usize,
    /// The dedup index.
    pub index: usize,
    /// The covered and uncovered displays.
    pub displays: usize,
    /// The publishers' trace contexts.
    pub publishers: usize,
}

impl Footprint {
    pub fn total(&self) -> usize {
        self.fixed
            + self.events
            + self.keys
            + self.bodies
            + self.order
            + self.index
            + self.displays
            + self.publishers
    }
}
