//! chat-history-view: a materialized view of aihub chat histories.
//!
//! aihub agents publish display events on NATS; aihub persists every event in MongoDB (`agent_events`). This
//! service rebuilds a thread's client-visible chat history from those events exactly as aihub's projector does,
//! keeps it current in memory as events stream in, and serves it over HTTP.
//!
//! # Layout (the data flow)
//!
//! - [`subject`]: a NATS subject becomes the event's [`subject::DeliveryKey`]; [`thread_id`]: what a thread id
//!   from outside must be to name a thread (one subject token).
//! - [`decode`]: the family filter, then a payload (JSON) or a store row (BSON) becomes a compact
//!   [`decode::ViewEvent`]; one decoder for both paths.
//! - [`view`]: a thread's events, deduplicated and in projection order; `Complete` or `Partial`.
//! - [`project`]: the pure projector: events and the read's primary identity become the history and warnings.
//! - [`run`]: the run model: each assistant message's parts and the latest run's state, from a traced projection.
//! - [`source`]: where events come from: Core NATS (the subscription loop and the connection watcher) or JetStream
//!   (class streams or the partitioned stream, one consumer loop each, resumed by sequence and checked against the
//!   stream's retention); one tracker turns what they report into gaps, catch-up and freshness; the ingest path
//!   (subject → decode → view for one event, whatever source delivered it) is the sink they all deliver to.
//! - [`store`]: the MongoDB queries (the two stages and a fill) behind `StoreReads`, decoded by the same decoder.
//! - [`cache`]: the moka cache of views; reads answer from complete views or hydrate from the store (one explicit
//!   state per entry for what its store side is doing).
//! - [`warm_up`]: the hot set (the threads read last) handed over to the next worker through a NATS key-value bucket,
//!   and warmed up before it turns ready.
//! - [`catch_up`]: whether the resumable source (JetStream) has what its streams hold: lanes that fall behind.
//! - [`coverage`]: since when the live stream has covered a thread, so whether a store read may complete a view.
//! - [`freshness`]: up to when the live stream has been applied (the covered-through instant of an answer).
//! - [`explain`]: every event of a thread with its fate, joining what the projector recorded with the stored rows'
//!   metadata (`GET /v1/threads/{id}/history/explain`, and the inspector page over it).
//! - [`shadow`]: the shadow checks' rules: what a sampled read held, compared with the store (run by [`cache`]).
//! - [`http`]: the read API, health, readiness, metrics and the OpenAPI document.
//! - [`config`]: every component's settings group (each declared beside its code, with its help heading) flattened
//!   into one command; [`setting`]: the value parsers they share (durations with units, byte sizes).
//! - [`metrics`]: the ground floor of the metrics: the Registrar every wing registers its set through (beside its
//!   code, with its outcome enums) and the exposition; [`startup`] registers them all and pins their names.
//! - [`bounds`]: the store timeout and the persister-lag bound every wing reads.
//! - [`telemetry`], [`readiness`], [`startup`], [`shutdown`]: the service around them.

pub mod bounds;
pub mod cache;
pub mod catch_up;
pub mod config;
pub mod coverage;
pub mod decode;
pub mod explain;
pub mod freshness;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod partition;
pub mod project;
pub mod readiness;
pub mod run;
pub mod setting;
pub mod shadow;
pub mod shutdown;
pub mod source;
pub mod startup;
pub mod store;
pub mod subject;
pub mod telemetry;
pub mod thread_id;
pub mod view;
pub mod warm_up;
