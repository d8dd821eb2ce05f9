//! The view cache's settings (help heading "Cache"): its byte budget, how long an unused view stays, the store
//! reads of whole threads at once, and the most one thread may hold. The store timeout and the persister-lag bound
//! it reads are [`crate::bounds::StoreBounds`].

use std::time::Duration;

use crate::setting::{self, DAY, POSITIVE, Unit};

/// 256 MiB: enough for tens of thousands of active threads; beyond it the least useful views are evicted (and
/// hydrated again on their next read).
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// What the view cache is configured with.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Cache")]
#[deny(missing_docs)]
pub struct CacheSettings {
    /// Byte budget of the view cache, a plain number or with a KiB/MiB/GiB (or KB/MB/GB) suffix.
    #[arg(id = "cache_max_bytes", value_name = "CACHE_MAX_BYTES", long = "cache-max-bytes", env = "HISTORY_VIEW_CACHE_MAX_BYTES", default_value = "256MiB", value_parser = setting::bytes)]
    pub max_bytes: u64,

    /// Seconds (or a duration with a unit) a thread view may go unused before it is dropped.
    #[arg(id = "cache_idle_secs", value_name = "CACHE_IDLE_SECS", long = "cache-idle-secs", env = "HISTORY_VIEW_CACHE_IDLE_SECS", default_value = "3600", value_parser = idle)]
    pub idle: Duration,

    /// Most store reads of whole threads (hydrations and background re-reads) at once, 1 to 1024; a read beyond it
    /// waits for one to finish within its store timeout, then answers 503. Each may hold up to a thread's events in
    /// memory. The default is the MongoDB driver's connection pool size. Explains hold at most half of them (at least
    /// one), so history reads keep the rest.
    #[arg(id = "max_concurrent_hydrations", value_name = "MAX_CONCURRENT_HYDRATIONS", long = "max-concurrent-hydrations", env = "HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS", default_value = "10", value_parser = hydrations)]
    pub concurrent_hydrations: usize,

    /// Most bytes of a thread's events (as held in memory, a plain number or with a unit as for the cache budget, at
    /// least 64KiB) one view or store read may hold; a read of a larger thread answers 507 thread_too_large, and a
    /// live view that grows past it leaves the cache. The default is hundreds of times a long chat.
    #[arg(id = "max_thread_bytes", value_name = "MAX_THREAD_BYTES", long = "max-thread-bytes", env = "HISTORY_VIEW_MAX_THREAD_BYTES", default_value = "64MiB", value_parser = thread_bytes)]
    pub max_thread_bytes: usize,
}

fn idle(value: &str) -> Result<Duration, String> {
    setting::duration(value, Unit::Secs, POSITIVE, DAY * 365)
}

fn hydrations(value: &str) -> Result<usize, String> {
    setting::count(value, 1024).map(|n| n as usize)
}

/// A byte size for the per-thread limit: at least 64 KiB (less would refuse ordinary chats).
fn thread_bytes(value: &str) -> Result<usize, String> {
    match setting::bytes(value)? {
        n if n < 64 << 10 => Err("must be at least 64KiB".into()),
        n => usize::try_from(n).map_err(|_| "is too large".to_owned()),
    }
}
