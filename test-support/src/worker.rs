//! The worker binary as a guarded child process, configured by environment as it is deployed: none of this
//! process's own `HISTORY_VIEW_*` and `OTEL_*` variables leak in, it listens on a free port of 127.0.0.1, logs JSON
//! to a file in its temp dir, stops at once on SIGTERM (no shutdown delay unless a test sets one), hands over no hot
//! set (unless a test turns it on), and counts as started once `/healthz` answers. Killed (SIGKILL) on drop.

use std::ffi::OsString;
use std::process::ExitStatus;

use crate::process::{Process, Spec, answers_get, free_port, temp_dir};

/// A running worker process.
pub struct WorkerProcess {
    process: Process,
}

impl WorkerProcess {
    /// Starts `program` with `args`: the worker binary, or a wrapper that sets up its environment and then
    /// executes it. `env` comes after the defaults (JSON logs at `info`), so it may override them. The wait runs
    /// off the runtime's threads, so the caller's tasks (a proxy in front of NATS, say) keep running meanwhile.
    ///
    /// # Panics
    /// When the worker exits or does not answer `/healthz` in time (with its log's tail).
    pub async fn start(
        program: impl Into<OsString>,
        args: Vec<OsString>,
        env: Vec<(String, String)>,
    ) -> Self {
        Self::start_on(free_port(), program, args, env).await
    }

    /// [`WorkerProcess::start`] listening on `port` (partitioned workers' ports are known to their peers).
    pub async fn start_on(
        port: u16,
        program: impl Into<OsString>,
        args: Vec<OsString>,
        env: Vec<(String, String)>,
    ) -> Self {
        let program = program.into();
        tokio::task::spawn_blocking(move || Self::start_blocking(port, program, args, env))
            .await
            .expect("the worker starts")
    }

    fn start_blocking(
        port: u16,
        program: OsString,
        args: Vec<OsString>,
        env: Vec<(String, String)>,
    ) -> Self {
        let defaults = [
            ("HISTORY_VIEW_LISTEN", format!("127.0.0.1:{port}")),
            ("HISTORY_VIEW_LOG_FORMAT", "json".to_owned()),
            ("RUST_LOG", "info".to_owned()),
            // A test's SIGTERM stops the worker at once: no orchestrator removes endpoints here. The tests of the
            // shutdown delay set it themselves.
            ("HISTORY_VIEW_SHUTDOWN_DELAY_SECS", "0".to_owned()),
            // No hot set handed over (no key-value bucket, no second NATS connection, no warm-up holding
            // readiness): the tests and benchmark targets of the warm restart turn it on.
            ("HISTORY_VIEW_WARM_MAX_THREADS", "0".to_owned()),
        ];
        let env = defaults
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value))
            .chain(env)
            .map(|(name, value)| (OsString::from(name), OsString::from(value)))
            .collect();
        let spec = Spec {
            name: "worker",
            program,
            args,
            env,
            // The OpenTelemetry variables too: a test's own environment (an OTEL_EXPORTER_OTLP_ENDPOINT, say)
            // must not turn tracing on in a worker, nor a test of tracing depend on it.
            scrub_env_prefixes: &["HISTORY_VIEW_", "OTEL_"],
        };
        Self {
            process: Process::start(spec, temp_dir("worker"), port, answers_healthz),
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.process.port)
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The last lines the worker logged.
    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }

    /// Every line the worker logged that contains `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.process.log_lines(needle)
    }

    /// Its exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.process.try_wait()
    }

    /// Sends SIGTERM, as Kubernetes does.
    pub fn terminate(&self) {
        self.process.signal("-TERM");
    }

    /// Freezes the process (SIGSTOP): its sockets stay open, nothing is read.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Lets a paused process go on (SIGCONT).
    pub fn resume(&self) {
        self.process.resume();
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // Nothing of the worker's state outlives it.
        self.process.kill();
    }
}

/// Whether `GET /healthz` on `port` answers 200.
fn answers_healthz(port: u16) -> bool {
    answers_get(port, "/healthz")
}
