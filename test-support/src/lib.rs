//! What chat-history-view's integration tests, benchmark and demo share, written once:
//!
//! - [`process`]: free ports, temp dirs, log tails and the guard of a child process;
//! - [`servers`]: nats-server and the Mongo-wire server as guarded child processes;
//! - [`worker`]: the worker binary as a guarded child process, configured by environment;
//! - [`rows`]: aihub's display events as persisted rows, their NATS subjects and payloads;
//! - [`scrape`] and [`memory`]: reading `/metrics` and a process's memory and CPU time;
//! - [`turns`] and [`hot_thread`]: the multi-turn read pattern and the hot-thread scenario (tests and P7, P8).

pub mod hot_thread;
pub mod memory;
pub mod process;
pub mod rows;
pub mod scrape;
pub mod servers;
pub mod turns;
pub mod worker;
