//! The promise, as every test that reads over time holds each answer to it: **an answer served from memory never
//! lacks an event the store has held longer than the persister-lag bound** (design 2.1), and, where nothing was
//! published or stored for longer than the bound, it equals the reference (the naive builder of
//! [`crate::reference`] over the stored rows, which shares no code with the worker's projector).
//!
//! - [`Ledger`]: what a test stored (and when its insert returned) and published, per thread;
//! - [`judge`] and [`Report`]: one answer held to the promise, and the tally of many;
//! - [`Target`], [`read_history`], [`read_items`], [`settle`] and [`Reader`]: reads of the history (with or
//!   without an identity) and of the Conversations items (paged), each judged, once or all through a scenario;
//! - [`FeedClient`]: the live feed, with the transcript after every event judged.
//!
//! A row is judged by its *token*, the bracketed start of its text (`[c12]`), which any answer holding the row
//! shows: rows without one are judged only by the whole-answer comparison.

mod feed;
mod judge;
mod ledger;
mod readers;

pub use feed::FeedClient;
pub use judge::{Answer, Report, Source, judge};
pub use ledger::{Ledger, token};
pub use readers::{
    Kind, Read, Reader, Target, encode, item_to_message, read_history, read_items, settle,
};
