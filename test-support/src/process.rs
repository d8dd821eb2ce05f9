//! Child processes behind guards: a free local port, a temp dir of their own, their log in it, and [`Process`],
//! which starts a program, waits until it answers, can signal, stop and restart it, and kills it on drop.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a process may take to answer after it was started.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where [`free_port`] looks: below Linux's ephemeral range (32768-60999) and the partitioned tests' ports (from
/// 20000). A port the system handed out for `bind(0)` is soon handed out again, to the local end of some outgoing
/// connection, and a server started on it then fails with "address already in use" (seen: a Mongo-wire server of
/// one test, while another test's clients were connecting); no outgoing connection takes a port from here.
const PORTS: std::ops::Range<u16> = 10_000..20_000;

/// Whether `GET path` on 127.0.0.1:`port` answers 200 (a readiness test for a server's HTTP endpoint).
pub fn answers_get(port: u16, path: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut status = [0u8; 12];
    stream.read_exact(&mut status).is_ok() && status.ends_with(b" 200")
}

/// A port of 127.0.0.1 that nothing listens on now, outside the ephemeral range, and not handed out before by this
/// process (so two servers of concurrent tests never get the same one).
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let span = u64::from(PORTS.end - PORTS.start);
    // Each test binary starts at its own place, so binaries run one after the other rarely meet a lingering port.
    let start = u64::from(std::process::id()) * 7919;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = PORTS.start + u16::try_from(offset).expect("below the span");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free local port in {PORTS:?}");
}

/// A digit prefix `p` such that ports `p0`, `p1`, … (one per partition) are free on 127.0.0.1: a peer URL
/// template `http://127.0.0.1:p{partition}` reaches every worker, as `http://chv-{partition}.chv-headless:8080`
/// does in Kubernetes. The ports lie between `free_port`'s range and Linux's ephemeral one (so no outgoing
/// connection takes one), and a prefix is handed out once per process: two deployments of concurrent tests never
/// share one (a worker that cannot bind its port while another test's worker answers on it would otherwise look
/// ready).
pub fn port_prefix(partitions: u16) -> u16 {
    const PREFIXES: std::ops::Range<u16> = 2000..3276;
    static TAKEN: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    assert!(partitions <= 10, "one digit per partition");
    let span = PREFIXES.end - PREFIXES.start;
    let start = u16::try_from(std::process::id() % u32::from(span)).expect("below the span");
    let mut taken = TAKEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let prefix = (0..span)
        .map(|i| PREFIXES.start + (start + i * 7) % span)
        .find(|prefix| {
            !taken.contains(prefix)
                && (0..partitions)
                    .all(|k| TcpListener::bind(("127.0.0.1", prefix * 10 + k)).is_ok())
        })
        .expect("free ports");
    taken.insert(prefix);
    prefix
}

/// A new directory under the system's temp dir, named after `prefix`, this process and a count of the directories
/// it made. (A free port named them before: the system hands a released port out again, so two tests running at
/// once could get one directory, and the first to finish removed the other's log and data under it.)
pub fn temp_dir(prefix: &str) -> PathBuf {
    static MADE: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "chv-{prefix}-{}-{}",
        std::process::id(),
        MADE.fetch_add(1, Ordering::Relaxed)
    ));
    // A directory left by an earlier process with the same pid is stale: start empty.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The last 20 lines of a log file.
pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// What to run: a program, its arguments and environment.
pub struct Spec {
    pub name: &'static str,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    /// Variables of this process's environment that start with one of these prefixes are not passed on.
    pub scrub_env_prefixes: &'static [&'static str],
}

/// A guarded child process. Its temp dir (log, data, the program's own TMPDIR) is removed on drop.
pub struct Process {
    spec: Spec,
    dir: PathBuf,
    log: PathBuf,
    pub port: u16,
    /// Asks the process itself whether it answers on `port`.
    ready: fn(u16) -> bool,
    child: Option<Child>,
}

impl Process {
    /// Starts `spec` with `dir` as its temp dir and waits until `ready(port)` holds.
    ///
    /// # Panics
    /// When it cannot start, exits, or does not answer within [`READY_TIMEOUT`] (with its log's tail).
    pub fn start(spec: Spec, dir: PathBuf, port: u16, ready: fn(u16) -> bool) -> Self {
        let log = dir.join(format!("{}.log", spec.name));
        let mut process = Self {
            spec,
            dir,
            log,
            port,
            ready,
            child: None,
        };
        process.run();
        process
    }

    /// Spawns the program and waits until it answers.
    fn run(&mut self) {
        self.spawn();
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if (self.ready)(self.port) {
                return;
            }
            if let Some(status) = self.try_wait() {
                panic!(
                    "{} exited with {status}:\n{}",
                    self.spec.name,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{} did not answer within {READY_TIMEOUT:?}:\n{}",
            self.spec.name,
            self.log_tail()
        );
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log file");
        let mut command = Command::new(&self.spec.program);
        for (name, _) in std::env::vars_os() {
            let text = name.to_string_lossy();
            if self
                .spec
                .scrub_env_prefixes
                .iter()
                .any(|p| text.starts_with(p))
            {
                command.env_remove(name);
            }
        }
        let child = command
            .args(&self.spec.args)
            .envs(self.spec.env.iter().map(|(k, v)| (k, v)))
            .env("TMPDIR", &self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start {}: {e} ({:?})",
                    self.spec.name, self.spec.program
                )
            });
        self.child = Some(child);
    }

    /// The last lines the process logged.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// Every line the process logged that contains `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    /// The process id (0 when it is not running).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Sends a signal (`-STOP`, `-CONT`, `-TERM`, ...).
    pub fn signal(&self, signal: &str) {
        if let Some(child) = &self.child {
            let _ = Command::new("kill")
                .arg(signal)
                .arg(child.id().to_string())
                .status();
        }
    }

    /// Freezes the process (SIGSTOP) and returns once every one of its threads is stopped. `kill` returns when the
    /// signal is queued; until the kernel has scheduled the thread that handles it, the other threads run on (on a
    /// loaded machine, for milliseconds: long enough to answer a request that should find the process frozen).
    ///
    /// # Panics
    /// When the threads are not all stopped within five seconds.
    pub fn pause(&self) {
        self.signal("-STOP");
        let pid = self.pid();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(pid) {
            assert!(Instant::now() < deadline, "process {pid} did not stop");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// SIGTERM (so the program cleans up after itself), SIGKILL if it is still there after two seconds.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGKILL at once: nothing of the process's state is kept.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the program again on the same port (after [`Process::stop`]).
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether every thread of process `pid` is stopped by a signal (state `T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next())
                == Some('T')
        })
    })
}
