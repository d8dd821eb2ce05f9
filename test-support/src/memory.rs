//! Resident memory of a process, read from `/proc/<pid>/status`; shared by the tests and the benchmark.

/// VmRSS and VmHWM of a process.
#[derive(Debug, Clone, Copy, Default)]
pub struct Memory {
    /// VmRSS: resident now.
    pub rss_kib: u64,
    /// VmHWM: the peak resident size since the process started.
    pub hwm_kib: u64,
}

/// VmRSS and VmHWM of `pid` (zero once it has exited).
pub fn memory(pid: u32) -> Memory {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
    }
}
