//! `ThreadView`: every relevant event of one thread, deduplicated by delivery key and kept in projection order,
//! plus whether it is known to hold everything the store holds (`Complete`) or only what arrived live (`Partial`).
//!
//! A view keeps the events of all displays, hidden ones included: a hidden display becomes visible when a
//! `UserAgent` HITL answer lands on it later, and its earlier events must then appear.
//!
//! While tracing is on, a view also keeps the publisher's trace context of each live event whose message carried
//! one ([`PublisherContext`]), beside the events rather than in them: explain shows its trace id, and the spans of
//! hydrations and fills link to it ([design 3.3](../docs/design.md#3.3)). Store rows carry none (nothing is
//! persisted), so a view never built from live events with a context holds no table at all.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::sync::LazyLock;

use hashbrown::HashTable;

mod footprint;
mod publisher;

pub use footprint::Footprint;
pub use publisher::PublisherContext;

use crate::coverage::Epoch;
use crate::decode::ViewEvent;
use crate::memory::allocated;
use crate::project::{self, Identity, Projection, Trace};
use crate::subject::DeliveryKey;

/// Whether a view can answer a read on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ViewState {
    /// May miss events (it holds only what arrived live, or a gap happened since it was hydrated); a read must
    /// hydrate it from the store first.
    Partial,
    /// Holds everything the store held when it was hydrated plus every live event since, with no gap.
    Complete,
}

/// What inserting one event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Added,
    /// The view already held an event with this delivery key; the first one stays.
    Duplicate,
    /// A live event the view's last store read should have returned and did not: it arrived before the read's
    /// cut ([`ThreadView::hydrated`]), so the store had it and no longer has it. Dropped, as that read would have
    /// dropped it had it arrived first (a JetStream replay still delivering a deleted thread's events).
    Orphaned,
}

/// Per-event bookkeeping beyond the event itself, for a store read's byte budget: its slot in the key index (with
/// the table's spare capacity) and in the projection order.
const BOOKKEEPING_BYTES: usize = 20;
/// Marks a slot of [`ThreadView::index`] as a position in `rejected` rather than in `events`.
const REJECTED: u32 = 1 << 31;
/// One row of [`ThreadView::publishers`]: an event's slot and its publisher's context (60 bytes with padding).
const PUBLISHER_ROW_BYTES: usize = std::mem::size_of::<(u32, PublisherContext)>();
/// The key hasher: keyed per process, so that colliding delivery keys cannot be prepared in advance.
static KEY_HASHER: LazyLock<foldhash::quality::RandomState> =
    LazyLock::new(foldhash::quality::RandomState::default);

/// One thread's events in compact form.
///
/// Every operation on the live path is amortised O(1) whatever the arrival order and however often a key repeats:
/// events are stored in arrival order (positions never change), an exact hash index over the keys finds duplicates,
/// and the projection order is a permutation of positions that is sorted lazily, when the view is projected (the
/// part already sorted is one run, so an in-order thread costs O(n) and k late events O(n + k log k)).
#[derive(Debug, Clone)]
pub struct ThreadView {
    /// Events that passed ordering validation, in arrival order, unique keys.
    events: Vec<ViewEvent>,
    /// Positions in `events` in projection order `(created_at, key)` up to `sorted`; those after it were appended
    /// since the last projection and are sorted in by the next one.
    order: Vec<u32>,
    sorted: usize,
    /// Every key held, as its position in `events` (or in `rejected`, tagged with [`REJECTED`]) in the low 32 bits
    /// and 32 bits of its key's hash in the high ones ([`indexed`]): duplicate checks compare keys exactly, in O(1),
    /// and the table grows without hashing a key again.
    index: HashTable<u64>,
    /// The heap bytes of the events and displays held, as allocated ([`crate::memory::allocated`]); the
    /// containers' are counted from their capacities ([`ThreadView::bytes`]).
    heap: usize,
    /// The coverage epoch the view became complete at; `None` while partial. A later gap, or a removal in the
    /// thread's bucket, changes the current epoch and so makes the view partial without visiting it.
    complete_at: Option<Epoch>,
    /// What few views hold, allocated with the first of it: a view streamed in live without rejected events,
    /// publisher contexts or covered displays (most views) carries one pointer for them.
    extra: Option<Box<Extra>>,
    /// Whether the view was built by a hydration (so `covered` means something).
    hydrated: bool,
    /// The last hydration's cut in whole seconds since the Unix epoch (its `stored_before`, rounded down): a live
    /// event that arrived a whole second before it and is not held is [`Inserted::Orphaned`]. 0: none.
    stored_before_secs: u32,
    /// Set when an insert made a display uncovered while the view was complete: the cache fills it (see
    /// [`ThreadView::take_fill_due`]).
    fill_due: bool,
    /// Bumped on every change; with the read's query it identifies a response body (the ETag).
    version: u64,
}

/// The parts of a view that few views hold ([`ThreadView::extra`]).
#[derive(Debug, Clone, Default)]
struct Extra {
    /// Events that failed ordering validation: never projected, but they count for visibility and are warned
    /// about once visible. Unique keys.
    rejected: Vec<ViewEvent>,
    /// The publisher contexts of the live events whose message carried one while tracing was on, by slot (as in
    /// `index`; slots never change), in arrival order. Empty while tracing is off, and for store rows. Charged to
    /// `bytes` by capacity.
    publishers: Vec<(u32, PublisherContext)>,
    /// Displays whose stored events the view has read (those visible at the last hydration, and those filled
    /// since). A marker landing live on any other display may reveal events persisted before, which the view never
    /// fetched.
    covered: HashSet<Box<str>>,
    /// Displays with a marker held but not covered: until they are filled (or hydrated), the view is not complete.
    /// Tracked only once the view has been hydrated (before that it is partial anyway, and most views streamed in
    /// live are never read, so they carry no such set).
    uncovered: HashSet<Box<str>>,
}

impl Default for ThreadView {
    fn default() -> Self {
        Self {
            events: Vec::new(),
            order: Vec::new(),
            sorted: 0,
            index: HashTable::new(),
            extra: None,
            heap: 0,
            complete_at: None,
            hydrated: false,
            stored_before_secs: 0,
            fill_due: false,
            version: 0,
        }
    }
}

/// 32 bits of a key's hash: what the index keeps of it.
fn key_hash(key: &DeliveryKey) -> u32 {
    (KEY_HASHER.hash_one(key) >> 32) as u32
}

/// The hash the index's table uses for a key hash: the 32 bits in both halves (the table takes its bucket from
/// the low bits and its control byte from the top ones).
fn table_hash(hash: u32) -> u64 {
    u64::from(hash) * 0x0000_0001_0000_0001
}

/// An index entry: `slot` with its key's hash.
fn indexed(slot: u32, hash: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(slot)
}

/// The projection order of a validated event.
fn sort_key(event: &ViewEvent) -> (i64, &DeliveryKey) {
    (event.created_at.unwrap_or(i64::MIN), &event.key)
}

/// A covered display's bytes as a view holds it (its string and its slot in a set), for a store read's budget.
pub fn display_bytes(display: &str) -> usize {
    allocated(display.len()) + 32
}

/// An event's bytes as a view holds it (for the cache's budget and the per-thread limit).
pub fn event_bytes(event: &ViewEvent) -> usize {
    std::mem::size_of::<ViewEvent>() + event.heap_bytes() + BOOKKEEPING_BYTES
}

/// Makes room for one more event. A full vector grows by half its length (at least 4), to the end of the
/// allocator's size class, instead of doubling: its spare room is a sixth of its events on average rather than
/// about a third, for one more copy of the events per three appended (a memcpy), still amortised O(1).
fn reserve_one(events: &mut Vec<ViewEvent>) {
    if events.len() == events.capacity() {
        let size = std::mem::size_of::<ViewEvent>();
        let wanted = events.len() + (events.len() / 2).max(4);
        events.reserve_exact(allocated(wanted * size) / size - events.len());
    }
}

/// A position as stored in the index and the order. A view would need 2^31 events (hundreds of GiB) to overflow
/// it, far beyond any cache budget.
fn position(len: usize) -> u32 {
    u32::try_from(len)
        .ok()
        .filter(|p| p & REJECTED == 0)
        .expect("a view holds fewer than 2^31 events")
}

/// The key of the event an index slot names.
fn slot_key<'a>(events: &'a [ViewEvent], rejected: &'a [ViewEvent], slot: u32) -> &'a DeliveryKey {
    if slot & REJECTED == 0 {
        &events[slot as usize].key
    } else {
        &rejected[(slot & !REJECTED) as usize].key
    }
}

impl ThreadView {
    /// A partial view holding nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A view from the store's rows (in store order) for the `covered` displays, merged with the live events of
    /// `live` (moved in), which the store may not have yet. Duplicates across the two count once. It is partial
    /// until the caller marks it complete (it alone knows whether the store read may count, see
    /// [`crate::coverage`]).
    ///
    /// When the store holds nothing of the thread (no row, no visible display), an event of `live` that arrived
    /// before `stored_before` (milliseconds since the Unix epoch: the first query's start less the persister-lag
    /// bound and the clock margin), or was a stored row, on a covered display or a marker, is dropped: the store
    /// had it, as far as the bound goes, and no longer has the thread (it was deleted). A thread the store still
    /// holds keeps every live event: one its rows lack may be one a persister behind the bound has not written
    /// yet, and dropping it would lose it for good. 0 drops nothing.
    ///
    /// # Returns
    /// The view, and how many live events it dropped.
    pub fn hydrated(
        store_events: impl IntoIterator<Item = ViewEvent>,
        covered: impl IntoIterator<Item = String>,
        live: ThreadView,
        stored_before: u64,
    ) -> (Self, usize) {
        let mut view = ThreadView::new();
        view.hydrated = true;
        let covered: HashSet<Box<str>> = covered.into_iter().map(String::into_boxed_str).collect();
        if !covered.is_empty() {
            view.heap += covered.iter().map(|d| allocated(d.len())).sum::<usize>();
            view.extra_mut().covered = covered;
        }
        for event in store_events {
            view.insert(event);
        }
        let gone = view.is_empty()
            && view
                .extra
                .as_ref()
                .is_none_or(|extra| extra.covered.is_empty());
        let stored_before = if gone { stored_before } else { 0 };
        view.stored_before_secs = u32::try_from(stored_before / 1000).unwrap_or(u32::MAX);
        let version = live.version + 1;
        let dropped = view.merge(live, stored_before);
        view.version = version;
        (view, dropped)
    }

    /// Whether `event` is one the store no longer has: valid, arrived before `before` (its whole second ended by
    /// then) or a stored row, not held (the rows were inserted first), and a marker or on a display the rows
    /// covered.
    fn orphaned(&self, event: &ViewEvent, before: u64) -> bool {
        (u64::from(event.arrived) + 1) * 1000 <= before
            && project::validate(event).is_ok()
            && (event.is_marker()
                || self
                    .extra
                    .as_ref()
                    .is_some_and(|extra| extra.covered.contains(event.key.display_id())))
            && self.find(event, key_hash(&event.key), true).is_none()
    }

    /// Adds the stored events of `displays` (read by a fill) and counts those displays as covered. Whether the view
    /// stays complete is the caller's to decide (the fill must have started while the view was complete, with no
    /// gap or removal since).
    pub fn fill(
        &mut self,
        displays: &[Box<str>],
        store_events: impl IntoIterator<Item = ViewEvent>,
    ) {
        for display in displays {
            let extra = self.extra_mut();
            extra.uncovered.remove(display);
            if extra.covered.insert(display.clone()) {
                self.heap += allocated(display.len());
            }
        }
        for event in store_events {
            self.insert(event);
        }
        self.version += 1;
    }

    /// Inserts every event of `other` (dedup makes overlap harmless) but those [`ThreadView::orphaned`] drops for
    /// `stored_before`, with their publisher contexts: a live event already held as a store row (which
    /// has none) gives the row its context, since it is the same event. The view must hold no context of its own
    /// yet (a hydration's store rows), so no slot gets two. Returns how many it dropped.
    fn merge(&mut self, other: ThreadView, stored_before: u64) -> usize {
        let Extra {
            rejected,
            mut publishers,
            ..
        } = other.extra.map(|extra| *extra).unwrap_or_default();
        // Slot order is the order the events are taken below: `events` by position, then `rejected` (tagged).
        publishers.sort_unstable_by_key(|&(slot, _)| slot);
        let mut publishers = publishers.into_iter().peekable();
        let valid = other.events.into_iter().zip(0u32..);
        let rejected = rejected.into_iter().zip((0u32..).map(|at| at | REJECTED));
        let mut dropped = 0;
        for (event, old) in valid.chain(rejected) {
            let publisher = publishers.next_if(|&(at, _)| at == old);
            if self.orphaned(&event, stored_before) {
                dropped += 1;
                continue;
            }
            let (_, slot) = self.insert_slot(event);
            if let Some((_, publisher)) = publisher {
                self.attach(slot, publisher);
            }
        }
        dropped
    }

    /// The slot of the event held with `event`'s key (of hash `hash`) among those of the same validity, if any.
    fn find(&self, event: &ViewEvent, hash: u32, valid: bool) -> Option<u32> {
        let (events, rejected) = (&self.events, self.rejected());
        let held = |entry: &u64| {
            let slot = *entry as u32;
            (entry >> 32) as u32 == hash
                && (slot & REJECTED == 0) == valid
                && *slot_key(events, rejected, slot) == event.key
        };
        self.index
            .find(table_hash(hash), held)
            .map(|&entry| entry as u32)
    }

    /// Inserts one event in projection order. An event whose delivery key the view already holds (among events of
    /// the same validity) is a duplicate and is dropped: the first delivery wins, as in aihub's dedup.
    pub fn insert(&mut self, event: ViewEvent) -> Inserted {
        self.insert_slot(event).0
    }

    /// [`ThreadView::insert`] of a live event with its publisher's context, kept if the event is added (a duplicate
    /// keeps the first delivery's, or none).
    pub fn insert_live(
        &mut self,
        event: ViewEvent,
        publisher: Option<PublisherContext>,
    ) -> Inserted {
        if self.orphaned(&event, u64::from(self.stored_before_secs) * 1000) {
            return Inserted::Orphaned;
        }
        let (inserted, slot) = self.insert_slot(event);
        if let (Inserted::Added, Some(publisher)) = (inserted, publisher) {
            self.attach(slot, publisher);
        }
        inserted
    }

    /// Keeps `publisher` as the context of the event at `slot`.
    fn attach(&mut self, slot: u32, publisher: PublisherContext) {
        self.extra_mut().publishers.push((slot, publisher));
    }

    /// Inserts one event; returns what the insert did and the slot of the event held under its key (the new one,
    /// or the one it duplicates).
    fn insert_slot(&mut self, event: ViewEvent) -> (Inserted, u32) {
        if self.hydrated && event.is_marker() {
            let display = event.key.display_id();
            let extra = self.extra_mut();
            if !extra.covered.contains(display) && !extra.uncovered.contains(display) {
                extra.uncovered.insert(display.into());
                self.heap += allocated(display.len());
                self.fill_due |= self.complete_at.is_some();
            }
        }
        let hash = key_hash(&event.key);
        let valid = project::validate(&event).ok();
        if let Some(slot) = self.find(&event, hash, valid.is_some()) {
            return (Inserted::Duplicate, slot);
        }
        self.heap += event.heap_bytes();
        let slot = match valid {
            Some(created_at) => {
                let at = position(self.events.len());
                // Live events mostly arrive in order: the sorted run grows as long as nothing arrived late.
                let in_order = self.sorted == self.order.len()
                    && self.order.last().is_none_or(|&last| {
                        sort_key(&self.events[last as usize]) < (created_at, &event.key)
                    });
                reserve_one(&mut self.events);
                self.events.push(event);
                self.order.push(at);
                if in_order {
                    self.sorted = self.order.len();
                }
                at
            }
            None => {
                let rejected = &mut self.extra_mut().rejected;
                let at = position(rejected.len()) | REJECTED;
                rejected.push(event);
                at
            }
        };
        self.index
            .insert_unique(table_hash(hash), indexed(slot, hash), |entry| {
                table_hash((entry >> 32) as u32)
            });
        self.version += 1;
        (Inserted::Added, slot)
    }

    /// The event a slot names.
    fn at_slot(&self, slot: u32) -> &ViewEvent {
        if slot & REJECTED == 0 {
            &self.events[slot as usize]
        } else {
            &self.rejected()[(slot & !REJECTED) as usize]
        }
    }

    /// The parts few views hold, allocated with the first of them.
    fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    /// The events that failed ordering validation.
    fn rejected(&self) -> &[ViewEvent] {
        self.extra.as_ref().map_or(&[], |extra| &extra.rejected)
    }

    /// The publisher contexts by slot.
    fn publisher_table(&self) -> &[(u32, PublisherContext)] {
        self.extra.as_ref().map_or(&[], |extra| &extra.publishers)
    }

    /// The displays a marker made visible whose stored events were not read yet.
    fn uncovered(&self) -> Option<&HashSet<Box<str>>> {
        self.extra.as_ref().map(|extra| &extra.uncovered)
    }

    /// Every event held with a publisher context, and that context, in the order the contexts arrived.
    pub fn publishers(&self) -> impl DoubleEndedIterator<Item = (&ViewEvent, &PublisherContext)> {
        self.publisher_table()
            .iter()
            .map(|(slot, publisher)| (self.at_slot(*slot), publisher))
    }

    /// The valid publisher contexts of the events held (only live events have any), the latest first, at most
    /// `limit`, copied out (so that the caller links them after letting go of the view): what the span of a
    /// hydration that merged them links to. An invalid `traceparent` is skipped, not counted.
    pub fn recent_publishers(&self, limit: usize) -> Vec<PublisherContext> {
        self.publisher_table()
            .iter()
            .rev()
            .map(|(_, publisher)| *publisher)
            .filter(|publisher| publisher.span_context().is_some())
            .take(limit)
            .collect()
    }

    /// [`ThreadView::recent_publishers`] of the events on `displays` only: what a fill of those displays saw.
    pub fn recent_publishers_on(
        &self,
        displays: &[Box<str>],
        limit: usize,
    ) -> Vec<PublisherContext> {
        self.publishers()
            .rev()
            .filter(|(event, _)| displays.iter().any(|d| **d == *event.key.display_id()))
            .map(|(_, publisher)| *publisher)
            .filter(|publisher| publisher.span_context().is_some())
            .take(limit)
            .collect()
    }

    /// Projects the view for a read (see [`project::project_view`]), first sorting in the events that arrived out
    /// of order since the last projection.
    pub fn project(&mut self, primary: Option<&Identity>) -> Projection {
        self.sort_order();
        self.project_sorted(primary)
    }

    /// [`ThreadView::project`] of a view sorted ([`ThreadView::sort_order`]) since its last change.
    pub fn project_sorted(&self, primary: Option<&Identity>) -> Projection {
        debug_assert_eq!(self.sorted, self.order.len(), "sorted before projecting");
        let events = &self.events;
        let ordered = self.order.iter().map(|&at| &events[at as usize]);
        project::project_view(ordered, self.rejected(), primary)
    }

    /// [`ThreadView::project`] with every event's fate ([`project::project_view_traced`]); the view must be sorted
    /// ([`ThreadView::sort_order`]) since its last change.
    pub fn project_traced(&self, primary: Option<&Identity>) -> (Projection, Trace<'_>) {
        debug_assert_eq!(self.sorted, self.order.len(), "sorted before projecting");
        let events = &self.events;
        let ordered = self.order.iter().map(|&at| &events[at as usize]);
        project::project_view_traced(ordered, self.rejected(), primary)
    }

    /// Sorts the projection order. The sorted part is one run, so the sort costs O(n + k log k) for k events
    /// appended out of order (keys are unique, so no two events compare equal).
    pub fn sort_order(&mut self) {
        if self.sorted < self.order.len() {
            let events = &self.events;
            self.order.sort_by(|&a, &b| {
                sort_key(&events[a as usize]).cmp(&sort_key(&events[b as usize]))
            });
        }
        self.sorted = self.order.len();
    }

    /// The view's state when the thread's coverage epoch is `current`: complete only if it was completed at that
    /// epoch and every display a marker made visible has been read.
    pub fn state(&self, current: Epoch) -> ViewState {
        if self.complete_at == Some(current) && self.uncovered().is_none_or(HashSet::is_empty) {
            ViewState::Complete
        } else {
            ViewState::Partial
        }
    }

    /// Marks the view complete as of coverage epoch `at` (the caller knows it holds everything the store held and
    /// every live event since). It is served from memory once no display is left to fill.
    pub fn mark_complete(&mut self, at: Epoch) {
        self.complete_at = Some(at);
        self.fill_due = false;
    }

    /// Whether the view is complete as of `current` but for displays a marker made visible that were not read
    /// yet: a fill of [`ThreadView::uncovered_displays`] completes it.
    pub fn needs_fill(&self, current: Epoch) -> bool {
        self.complete_at == Some(current) && self.uncovered().is_some_and(|u| !u.is_empty())
    }

    /// The displays a marker made visible whose stored events were not read yet.
    pub fn uncovered_displays(&self) -> Vec<Box<str>> {
        self.uncovered().into_iter().flatten().cloned().collect()
    }

    /// Whether an insert since the last call made a display uncovered while the view was complete (clears it).
    pub fn take_fill_due(&mut self) -> bool {
        std::mem::take(&mut self.fill_due)
    }

    /// Forgets that the view was complete. Returns whether it had been complete as of some epoch.
    pub fn downgrade(&mut self) -> bool {
        self.fill_due = false;
        self.complete_at.take().is_some()
    }

    /// Forgets that the view was complete if it was complete as of an epoch other than `current` (a gap or a
    /// removal happened since). Returns whether it did (so a caller can count views found downgraded).
    pub fn downgrade_if_stale(&mut self, current: Epoch) -> bool {
        match self.complete_at {
            Some(at) if at != current => self.downgrade(),
            _ => false,
        }
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every event held, in no particular order (the rejected ones included: they count for visibility).
    pub fn events(&self) -> impl Iterator<Item = &ViewEvent> + Clone {
        self.events.iter().chain(self.rejected())
    }

    /// Number of distinct events held.
    pub fn len(&self) -> usize {
        self.events.len() + self.rejected().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes held, for the cache's weigher: the view's struct, its containers by capacity and its events'
    /// and displays' heap, each allocation as the allocator rounds it. O(1): what P5's breakdown measures
    /// ([`ThreadView::footprint`]), without visiting the events.
    pub fn bytes(&self) -> usize {
        self.heap + self.containers().total()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Decoded, decode_payload};
    use serde_json::json;

    fn chunk(event_id: &str, created_at: serde_json::Value, content: &str) -> ViewEvent {
        let key = DeliveryKey::from_fields([
            "A",
            "a",
            "t",
            "d",
            "r",
            "display_event",
            "ChunkEvent",
            event_id,
        ]);
        let payload = json!({"_parent_event_names": ["ChunkEvent"], "created_at": created_at, "content": content});
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(e) => e,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    /// The event ids of the valid events in projection order.
    fn projection_order(view: &mut ThreadView) -> Vec<String> {
        view.sort_order();
        view.order
            .iter()
            .map(|&at| view.events[at as usize].key.event_id().to_owned())
            .collect()
    }

    #[test]
    fn events_are_kept_in_projection_order_and_duplicates_count_once() {
        let mut view = ThreadView::new();
        assert_eq!(view.insert(chunk("b", json!(2), "B")), Inserted::Added);
        assert_eq!(view.insert(chunk("a", json!(2), "A")), Inserted::Added);
        assert_eq!(view.insert(chunk("c", json!(1), "C")), Inserted::Added);
        assert_eq!(view.insert(chunk("a", json!(2), "A")), Inserted::Duplicate);
        assert_eq!(
            view.insert(chunk("a", json!(9), "other payload")),
            Inserted::Duplicate
        );
        assert_eq!(projection_order(&mut view), ["c", "a", "b"]);
        assert_eq!(view.len(), 3);
    }

    #[test]
    fn a_views_bytes_are_its_parts_by_capacity_as_allocated() {
        let mut view = ThreadView::new();
        assert_eq!(view.bytes(), std::mem::size_of::<ThreadView>());
        assert_eq!(view.footprint().total(), view.bytes());
        for i in 0..37 {
            view.insert(chunk(&format!("e{i}"), json!(i), &"x".repeat(i)));
        }
        view.insert(chunk("bad", json!("bad"), "B"));
        let footprint = view.footprint();
        assert_eq!(footprint.total(), view.bytes());
        // Capacities, not lengths: 37 events sit in a vector grown by half each time to its size class, where
        // doubling would have made it 64; the rejected one in a vector of 4.
        let size = std::mem::size_of::<ViewEvent>();
        assert_eq!(view.events.capacity(), allocated(51 * size) / size);
        assert!(view.events.capacity() < 64);
        assert_eq!(
            footprint.events,
            allocated(view.events.capacity() * size) + allocated(4 * size)
        );
        // Each key is one allocation, rounded to its size class.
        let keys: usize = view.events().map(|e| allocated(e.key.heap_bytes())).sum();
        assert_eq!(footprint.keys, keys);
        // A hydration's covered displays and a marker's uncovered one count too.
        let mut view = ThreadView::hydrated([], ["d".to_owned(), "e".repeat(40)], view, 0).0;
        assert_eq!(view.footprint().total(), view.bytes());
        let before = view.bytes();
        view.fill(&["f".into()], []);
        assert!(view.bytes() > before);
        assert_eq!(view.footprint().total(), view.bytes());
    }

    #[test]
    fn malformed_ordering_metadata_is_held_apart_and_deduplicated() {
        let mut view = ThreadView::new();
        assert_eq!(view.insert(chunk("x", json!("bad"), "X")), Inserted::Added);
        assert_eq!(
            view.insert(chunk("x", json!("bad"), "X")),
            Inserted::Duplicate
        );
        assert_eq!(view.rejected().len(), 1);
        assert!(view.events.is_empty());
    }

    #[test]
    fn the_weight_grows_with_what_is_held_and_versions_change_only_on_additions() {
        let mut view = ThreadView::new();
        let empty = view.bytes();
        view.insert(chunk("a", json!(1), &"x".repeat(1000)));
        assert!(view.bytes() >= empty + 1000);
        let version = view.version();
        view.insert(chunk("a", json!(1), &"x".repeat(1000)));
        assert_eq!(view.version(), version);
    }

    #[test]
    fn hydration_merges_live_events_and_completes_the_view() {
        let mut live = ThreadView::new();
        live.insert(chunk("b", json!(2), "B"));
        live.insert(chunk("c", json!(3), "C"));
        let mut view = ThreadView::hydrated(
            [chunk("a", json!(1), "A"), chunk("b", json!(2), "B")],
            ["d".to_owned()],
            live.clone(),
            0,
        )
        .0;
        assert_eq!(view.state(Epoch::at_gap(0)), ViewState::Partial);
        view.mark_complete(Epoch::at_gap(0));
        assert_eq!(view.state(Epoch::at_gap(0)), ViewState::Complete);
        assert_eq!(view.len(), 3);
        assert!(view.version() > live.version());
    }

    fn marker(event_id: &str, display: &str) -> ViewEvent {
        let key = DeliveryKey::from_fields([
            "UserAgent",
            "u",
            "t",
            display,
            "r",
            "display_event",
            "UserMessageEvent",
            event_id,
        ]);
        let payload = json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 5,
            "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "hi"}]}]});
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(e) => e,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    #[test]
    fn a_marker_on_a_display_not_covered_holds_the_view_partial_until_filled() {
        let epoch = Epoch::at_gap(3);
        let mut view = ThreadView::hydrated([], ["d".to_owned()], ThreadView::new(), 0).0;
        view.mark_complete(epoch);
        view.insert(marker("m1", "d"));
        assert_eq!(view.state(epoch), ViewState::Complete);
        view.insert(chunk("c1", json!(6), "on a hidden display"));
        assert_eq!(view.state(epoch), ViewState::Complete);
        assert!(!view.take_fill_due());
        view.insert(marker("m2", "elsewhere"));
        assert_eq!(view.state(epoch), ViewState::Partial);
        assert!(view.needs_fill(epoch));
        assert!(view.take_fill_due(), "the cache is told once");
        assert!(!view.take_fill_due());
        assert_eq!(
            view.uncovered_displays(),
            vec![Box::<str>::from("elsewhere")]
        );

        let older = chunk("c0", json!(1), "stored before the hydration");
        view.fill(&view.uncovered_displays(), [older]);
        assert_eq!(view.state(epoch), ViewState::Complete);
        assert!(!view.needs_fill(epoch));
        assert_eq!(view.len(), 4);
    }

    #[test]
    fn a_hydration_drops_events_of_a_thread_the_store_no_longer_has_and_keeps_a_stored_threads() {
        let arrived = |mut event: ViewEvent, at: u32| {
            event.arrived = at;
            event
        };
        let mut live = ThreadView::new();
        // Arrived at 10 s (before the cut at 50 s), not stored: the marker goes once the thread is gone.
        live.insert(arrived(marker("m1", "d"), 10));
        // A row an earlier hydration read, no longer stored: goes too.
        live.insert(marker("old-row", "d"));
        // Arrived within the second of the cut: the store may not have it yet.
        live.insert(arrived(marker("m2", "d"), 50));
        // An old chunk: its display is visible no more (no marker stored), so nothing says whether it is stored.
        live.insert(arrived(chunk("x", json!(5), "X"), 5));
        // Invalid: never judged.
        live.insert(arrived(chunk("bad", json!("not-a-number"), "?"), 5));
        let (view, dropped) = ThreadView::hydrated([], Vec::<String>::new(), live.clone(), 50_000);
        let ids: Vec<&str> = view.events().map(|e| e.key.event_id()).collect();
        assert_eq!(dropped, 2, "{ids:?}");
        assert_eq!(view.len(), 3, "{ids:?}");
        assert!(!ids.contains(&"m1") && !ids.contains(&"old-row"), "{ids:?}");
        // Without a cut nothing goes.
        let (view, dropped) = ThreadView::hydrated([], Vec::<String>::new(), live.clone(), 0);
        assert_eq!((view.len(), dropped), (5, 0));
        // A thread the store still holds keeps every live event, even one that arrived long before the cut: the
        // persister may be behind the bound (a store outage's backlog), and a dropped event would be lost for good.
        let rows = || [chunk("a", json!(20), "A")];
        let (view, dropped) = ThreadView::hydrated(rows(), ["d".to_owned()], live.clone(), 50_000);
        assert_eq!((view.len(), dropped), (6, 0));
        // A live event that arrives after the hydration of a gone thread is judged by the same cut (a replay still
        // delivering).
        let (mut view, _) =
            ThreadView::hydrated([], Vec::<String>::new(), ThreadView::new(), 50_000);
        assert_eq!(
            view.insert_live(arrived(marker("late", "d"), 10), None),
            Inserted::Orphaned
        );
        assert_eq!(
            view.insert_live(arrived(marker("new", "d"), 50), None),
            Inserted::Added
        );
        // Of a stored thread, never.
        let (mut view, _) =
            ThreadView::hydrated(rows(), ["d".to_owned()], ThreadView::new(), 50_000);
        assert_eq!(
            view.insert_live(arrived(chunk("late", json!(30), "L"), 10), None),
            Inserted::Added
        );
    }

    #[test]
    fn a_view_with_a_marker_the_hydration_did_not_cover_is_partial_until_filled() {
        let mut live = ThreadView::new();
        live.insert(marker("m1", "new-display"));
        let mut view = ThreadView::hydrated([], ["d".to_owned()], live.clone(), 0).0;
        view.mark_complete(Epoch::at_gap(0));
        assert_eq!(view.state(Epoch::at_gap(0)), ViewState::Partial);
        assert!(view.needs_fill(Epoch::at_gap(0)));
        let mut view =
            ThreadView::hydrated([], ["d".to_owned(), "new-display".to_owned()], live, 0).0;
        view.mark_complete(Epoch::at_gap(0));
        assert_eq!(view.state(Epoch::at_gap(0)), ViewState::Complete);
    }

    #[test]
    fn a_partial_view_is_not_filled_and_a_stale_one_is_downgraded() {
        let mut view = ThreadView::hydrated([], ["d".to_owned()], ThreadView::new(), 0).0;
        view.insert(marker("m1", "elsewhere"));
        assert!(
            !view.take_fill_due(),
            "partial: the next read hydrates instead"
        );
        assert!(!view.needs_fill(Epoch::at_gap(0)));
        view.mark_complete(Epoch::at_gap(0));
        assert!(!view.downgrade_if_stale(Epoch::at_gap(0)));
        assert!(view.needs_fill(Epoch::at_gap(0)));
        assert!(view.downgrade_if_stale(Epoch::at_gap(1)));
        assert!(!view.needs_fill(Epoch::at_gap(1)));
    }

    #[test]
    fn a_gap_after_completion_makes_the_view_partial() {
        let mut view = ThreadView::hydrated([], Vec::<String>::new(), ThreadView::new(), 0).0;
        view.mark_complete(Epoch::at_gap(7));
        assert_eq!(view.state(Epoch::at_gap(7)), ViewState::Complete);
        assert_eq!(view.state(Epoch::at_gap(8)), ViewState::Partial);
        assert!(view.downgrade());
        assert!(!view.downgrade());
        assert_eq!(view.state(Epoch::at_gap(7)), ViewState::Partial);
    }

    #[test]
    fn out_of_order_events_are_inserted_in_place_and_in_order_ones_appended() {
        let mut view = ThreadView::new();
        for (id, at) in [("a", 1), ("c", 3), ("b", 2), ("d", 3), ("e", 0)] {
            view.insert(chunk(id, json!(at), id));
        }
        assert_eq!(projection_order(&mut view), ["e", "a", "b", "c", "d"]);
    }

    /// A message's headers carrying `traceparent` (under `name`) with `value`.
    fn headers(name: &str, value: &str) -> async_nats::HeaderMap {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(name, value);
        headers
    }

    /// The context a message with trace and span ids of `n` repeated carries, as kept.
    fn publisher(n: u8) -> PublisherContext {
        let value = format!(
            "00-{}-{}-01",
            format!("{n:02x}").repeat(16),
            format!("{n:02x}").repeat(8)
        );
        PublisherContext::from_headers(&headers("traceparent", &value)).expect("a traceparent")
    }

    #[test]
    fn a_traceparent_is_kept_as_received_and_read_by_the_propagator_only_when_asked() {
        let aihub = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03";
        for name in ["traceparent", "Traceparent", "TRACEPARENT"] {
            let kept = PublisherContext::from_headers(&headers(name, aihub)).expect(name);
            assert_eq!(kept.0, aihub.as_bytes());
            let context = kept.span_context().expect("valid");
            assert_eq!(
                kept.trace_id().as_deref(),
                Some("0af7651916cd43dd8448eb211c80319c")
            );
            assert_eq!(
                context.span_id(),
                opentelemetry::trace::SpanId::from_hex("b7ad6b7169203331").unwrap()
            );
            assert!(context.is_sampled() && context.is_remote());
        }
        // Kept unread, then refused by the propagator: no trace id, no link.
        let invalid = "00-00000000000000000000000000000000-b7ad6b7169203331-01";
        let kept = PublisherContext::from_headers(&headers("traceparent", invalid)).expect("kept");
        assert_eq!((kept.span_context(), kept.trace_id()), (None, None));
        let upper = "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01";
        let kept = PublisherContext::from_headers(&headers("traceparent", upper)).expect("kept");
        assert_eq!(kept.trace_id(), None);
        // Another length is read at once: a later version's extra fields are dropped, a bad value is not kept.
        let later = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra";
        let kept = PublisherContext::from_headers(&headers("traceparent", later)).expect("valid");
        assert_eq!(
            kept.trace_id().as_deref(),
            Some("0af7651916cd43dd8448eb211c80319c")
        );
        assert_eq!(
            PublisherContext::from_headers(&headers("traceparent", "not a traceparent")),
            None
        );
        assert_eq!(
            PublisherContext::from_headers(&headers("tracestate", "a=b")),
            None
        );
    }

    /// Each held event's id with its publisher's trace id.
    fn publishers_of(view: &ThreadView) -> Vec<(String, String)> {
        let mut held: Vec<_> = view
            .publishers()
            .map(|(event, p)| (event.key.event_id().to_owned(), p.trace_id().unwrap()))
            .collect();
        held.sort();
        held
    }

    #[test]
    fn a_live_events_publisher_context_is_kept_and_a_duplicate_keeps_the_first_deliverys() {
        let mut view = ThreadView::new();
        assert_eq!(
            view.insert_live(chunk("a", json!(1), "A"), Some(publisher(1))),
            Inserted::Added
        );
        assert_eq!(
            view.insert_live(chunk("a", json!(1), "A"), Some(publisher(2))),
            Inserted::Duplicate
        );
        // A first delivery without a context keeps none, whatever a repeat carries.
        view.insert_live(chunk("b", json!(2), "B"), None);
        view.insert_live(chunk("b", json!(2), "B"), Some(publisher(3)));
        // One failing validation is kept too (explain lists it).
        view.insert_live(chunk("x", json!("bad"), "X"), Some(publisher(4)));
        assert_eq!(
            publishers_of(&view),
            [
                ("a".to_owned(), "01".repeat(16)),
                ("x".to_owned(), "04".repeat(16))
            ]
        );
    }

    #[test]
    fn without_contexts_a_view_allocates_no_table_and_weighs_the_same() {
        let mut plain = ThreadView::new();
        let mut live = ThreadView::new();
        for (id, at) in [("a", 1), ("b", 2), ("c", 3)] {
            plain.insert(chunk(id, json!(at), id));
            live.insert_live(chunk(id, json!(at), id), None);
        }
        assert_eq!(live.publisher_table().len(), 0);
        assert_eq!(live.bytes(), plain.bytes());
        let hydrated =
            ThreadView::hydrated([chunk("d", json!(4), "d")], ["d".to_owned()], live, 0).0;
        assert_eq!(hydrated.publisher_table().len(), 0);
    }

    #[test]
    fn the_contexts_are_charged_to_the_views_bytes_as_the_table_grows() {
        let mut plain = ThreadView::new();
        let mut traced = ThreadView::new();
        for i in 0..100 {
            let id = format!("e{i}");
            plain.insert(chunk(&id, json!(i), "x"));
            traced.insert_live(chunk(&id, json!(i), "x"), Some(publisher(1)));
        }
        let capacity = traced.extra.as_ref().unwrap().publishers.capacity();
        assert!(capacity >= 100);
        // The table and the box it lives in (the plain view has none).
        let table =
            allocated(capacity * PUBLISHER_ROW_BYTES) + allocated(std::mem::size_of::<Extra>());
        assert_eq!(traced.bytes(), plain.bytes() + table);
        assert_eq!(traced.footprint().total(), traced.bytes());
    }

    #[test]
    fn the_live_events_contexts_survive_a_hydration_and_a_fill() {
        let live = |traced: bool| {
            let context = |n| traced.then(|| publisher(n));
            let mut live = ThreadView::new();
            // `a` is also a store row (which carries none): the row gets the live delivery's context.
            live.insert_live(chunk("a", json!(1), "A"), context(1));
            live.insert_live(chunk("b", json!(2), "B"), None);
            live.insert_live(chunk("c", json!(3), "C"), context(3));
            live.insert_live(chunk("x", json!("bad"), "X"), context(4));
            live
        };
        let hydrate = |live| {
            ThreadView::hydrated(
                [chunk("s", json!(0), "S"), chunk("a", json!(1), "A")],
                ["d".to_owned()],
                live,
                0,
            )
            .0
        };
        let mut view = hydrate(live(true));
        let expected = [
            ("a".to_owned(), "01".repeat(16)),
            ("c".to_owned(), "03".repeat(16)),
            ("x".to_owned(), "04".repeat(16)),
        ];
        assert_eq!(publishers_of(&view), expected);
        let plain = hydrate(live(false));
        assert_eq!(
            view.bytes(),
            plain.bytes()
                + allocated(
                    view.extra.as_ref().unwrap().publishers.capacity() * PUBLISHER_ROW_BYTES
                ),
            "the rebuilt table is charged"
        );
        // A fill adds store rows after the events held: every slot stays, and so does every context.
        view.fill(&["other".into()], [chunk("f", json!(0), "F")]);
        assert_eq!(publishers_of(&view), expected);
        assert_eq!(projection_order(&mut view), ["f", "s", "a", "b", "c"]);
    }

    #[test]
    fn the_links_are_the_latest_contexts_within_the_bound() {
        let mut view = ThreadView::new();
        for i in 0..40u8 {
            let display = if i % 2 == 0 { "d" } else { "other" };
            let key = DeliveryKey::from_fields([
                "A",
                "a",
                "t",
                display,
                "r",
                "display_event",
                "ChunkEvent",
                &format!("e{i}"),
            ]);
            let payload =
                json!({"_parent_event_names": ["ChunkEvent"], "created_at": i, "content": "x"});
            let Ok(Decoded::Event(event)) = decode_payload(key, payload.to_string().as_bytes())
            else {
                unreachable!()
            };
            view.insert_live(event, Some(publisher(i + 1)));
        }
        let links = view.recent_publishers(32);
        assert_eq!(links.len(), 32);
        assert_eq!(links[0], publisher(40), "the latest first");
        assert_eq!(links[31], publisher(9));
        let on_d = view.recent_publishers_on(&["d".into()], 32);
        assert_eq!(on_d.len(), 20);
        assert_eq!(on_d[0], publisher(39));
        assert_eq!(view.recent_publishers_on(&["d".into()], 5).len(), 5);
        assert!(view.recent_publishers_on(&["none".into()], 32).is_empty());
        assert!(ThreadView::new().recent_publishers(32).is_empty());
    }

    proptest::proptest! {
        /// Whatever the arrival order, however often a key repeats (with the same or another `created_at`) and
        /// wherever reads fall, the view holds the first delivery of each key, in projection order.
        #[test]
        fn any_arrival_order_gives_first_deliveries_in_projection_order(
            deliveries in proptest::collection::vec((0u8..40, 0i64..20, proptest::bool::weighted(0.1)), 0..200)
        ) {
            let mut view = ThreadView::new();
            let mut first: Vec<(i64, String)> = Vec::new();
            for (id, at, read_now) in deliveries {
                let id = format!("e{id}");
                let expected = if first.iter().any(|(_, held)| *held == id) {
                    Inserted::Duplicate
                } else {
                    first.push((at, id.clone()));
                    Inserted::Added
                };
                proptest::prop_assert_eq!(view.insert(chunk(&id, json!(at), "x")), expected);
                if read_now {
                    let mut sorted = first.clone();
                    sorted.sort();
                    let ids: Vec<String> = sorted.into_iter().map(|(_, id)| id).collect();
                    proptest::prop_assert_eq!(projection_order(&mut view), ids);
                }
            }
            first.sort();
            let ids: Vec<String> = first.into_iter().map(|(_, id)| id).collect();
            proptest::prop_assert_eq!(projection_order(&mut view), ids);
        }
    }
}
