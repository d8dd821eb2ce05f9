//! chat-history-view: a materialized view of aihub chat histories.
//!
//! aihub agents publish display events on NATS; aihub persists every event in MongoDB (`agent_events`). This
//! crate rebuilds a thread's client-visible chat history from those events exactly as aihub's projector does, and
//! keeps it current in memory as events stream in.
//!
//! # Layout (the data flow)
//!
//! - [`subject`]: a NATS subject becomes the event's [`subject::DeliveryKey`].
//! - [`decode`]: the family filter, then a payload (JSON) or a store row (BSON) becomes a compact
//!   [`decode::ViewEvent`]; one decoder for both paths.
//! - [`project`]: the pure projector: events and the read's primary identity become the history and its warnings.

pub mod decode;
pub mod project;
pub mod subject;
pub mod view;
