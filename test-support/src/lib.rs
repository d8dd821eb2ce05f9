//! What chat-history-view's integration tests and benchmark share, written once:
//!
//! - [`class_streams`]: aihub's JetStream class streams, created as aihub does;
//! - [`process`]: free ports, temp dirs, log tails and the guard of a child process;
//! - [`servers`]: nats-server and the Mongo-wire server as guarded child processes;
//! - [`proxy`]: a TCP proxy a test or the benchmark cuts or leaves half-open, to lose a link for certain;
//! - [`worker`]: the worker binary as a guarded child process, configured by environment;
//! - [`otlp`]: an OTLP/HTTP trace receiver that keeps the spans a worker exports;
//! - [`rows`]: aihub's display events as persisted rows, their NATS subjects and payloads (the `aihub-rows` crate,
//!   which the demo uses without the rest);
//! - [`scrape`] and [`memory`]: reading `/metrics` and a process's memory and CPU time;
//! - [`turns`] and [`hot_thread`]: the multi-turn read pattern and the hot-thread scenario (tests and P7, P8);
//! - [`promise`]: the promise's oracle: a ledger of stored rows, the judge, judged readers and the feed client;
//! - [`reference`]: a deliberately naive history builder from the contract's text, sharing no code with the worker:
//!   the expected answer of the end-to-end comparisons, and the projector's cross-check;
//! - [`wait`]: waits on state ([`wait::eventually`]) with limits scaled by `TEST_TIME_SCALE`.

pub mod browser;
pub mod class_streams;
pub mod hot_thread;
pub mod json_lines;
pub mod memory;
pub mod otlp;
pub mod process;
pub mod promise;
pub mod proxy;
pub mod reference;
pub mod scrape;
pub mod servers;
pub mod turns;
pub mod wait;
pub mod worker;

// A crate of its own, so the demo builds without the rest of test-support; every `test_support::rows` path stays.
pub use aihub_rows as rows;
