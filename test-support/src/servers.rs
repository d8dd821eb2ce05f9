//! Real servers as child processes behind guards: `NatsServer` (nats-server with JetStream), `MongoServer`
//! (SecantusDB, a MongoDB-wire server) and `PrometheusServer` (Debian's Prometheus). Each picks a free port, waits until the server itself answers, can be
//! stopped and restarted on the same port, and is killed in `Drop`. Binaries come from the project's
//! `.tools/venv/bin` (installed by `scripts/services.sh install`) unless `NATS_SERVER_BIN` / `SECANTUSD_BIN` /
//! `PROMETHEUS_BIN` / `PROMTOOL_BIN` name them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::process::{Process, Spec, answers_get, free_port, temp_dir};

fn tool(env: &str, name: &str) -> PathBuf {
    if let Ok(path) = std::env::var(env) {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.tools/venv/bin")).join(name);
    assert!(
        path.exists(),
        "{} not found: run `scripts/services.sh install` (or set {env})",
        path.display()
    );
    path
}

/// A server's spec: `program` (a tool of `.tools/venv/bin`) with `args`.
fn spec(name: &'static str, program: PathBuf, args: Vec<String>) -> Spec {
    Spec {
        name,
        program: program.into(),
        args: args.into_iter().map(Into::into).collect(),
        env: Vec::new(),
        scrub_env_prefixes: &[],
    }
}

/// A nats-server with JetStream on 127.0.0.1.
pub struct NatsServer {
    process: Process,
}

impl NatsServer {
    pub fn start() -> Self {
        Self::start_with(Vec::new())
    }

    /// A nats-server without JetStream (Core NATS only): a JetStream worker fails closed against it.
    pub fn start_without_jetstream() -> Self {
        Self::start_args(false, Vec::new())
    }

    /// A nats-server (Core NATS only) run with `config`, the text of a nats-server configuration file (TLS,
    /// authorization, operator mode; file paths in it absolute). It listens on 127.0.0.1 on a free port whatever
    /// `config` says, and counts as started once it greets with INFO (sent before any TLS handshake).
    pub fn start_with_config(config: &str) -> Self {
        let dir = temp_dir("nats");
        let file = dir.join("nats.conf");
        std::fs::write(&file, config).expect("write nats.conf");
        Self::start_in(dir, false, vec!["-c".into(), file.display().to_string()])
    }

    /// A server with `extra` arguments (a cluster's name and routes).
    fn start_with(extra: Vec<String>) -> Self {
        Self::start_args(true, extra)
    }

    fn start_args(jetstream: bool, extra: Vec<String>) -> Self {
        Self::start_in(temp_dir("nats"), jetstream, extra)
    }

    fn start_in(dir: PathBuf, jetstream: bool, extra: Vec<String>) -> Self {
        let port = free_port();
        let mut args = vec![
            "-a".into(),
            "127.0.0.1".into(),
            "-p".into(),
            port.to_string(),
        ];
        if jetstream {
            args.extend([
                "-js".into(),
                "-sd".into(),
                dir.join("js").display().to_string(),
            ]);
        }
        args.extend(extra);
        Self {
            process: Process::start(
                spec("nats-server", tool("NATS_SERVER_BIN", "nats-server"), args),
                dir,
                port,
                greets_with_info,
            ),
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.process.port)
    }

    /// The client port, for a proxy in front of the server.
    pub fn address(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.process.port))
    }

    /// Its process id (its CPU time is in `/proc/<pid>/stat`).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// SIGKILL at once, as a crashed node: no goodbye to its routes, no leadership handed over.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// Starts the server again on the same port (after `stop`).
    pub fn restart(&mut self) {
        self.process.restart();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered, not even a ping.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        self.process.resume();
    }
}

/// nats-servers with JetStream in one cluster on 127.0.0.1, routed to each other, so that a stream of several
/// replicas has a leader that can change.
pub struct NatsCluster {
    pub servers: Vec<NatsServer>,
}

impl NatsCluster {
    pub fn start(size: usize) -> Self {
        let cluster_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let routes = cluster_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let servers = cluster_ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                NatsServer::start_with(vec![
                    "--server_name".into(),
                    format!("n{i}"),
                    "--cluster_name".into(),
                    "chv".into(),
                    "--cluster".into(),
                    format!("nats://127.0.0.1:{port}"),
                    "--routes".into(),
                    routes.clone(),
                ])
            })
            .collect();
        Self { servers }
    }
}

/// A SecantusDB server (MongoDB wire protocol) on 127.0.0.1.
pub struct MongoServer {
    process: Process,
}

impl MongoServer {
    /// A server keeping its data in memory (gone on restart).
    pub fn start() -> Self {
        Self::start_with_storage(None)
    }

    /// A server keeping its data in files of its own directory, so a restart keeps it.
    pub fn start_on_disk() -> Self {
        Self::start_with_storage(Some("data"))
    }

    fn start_with_storage(directory: Option<&str>) -> Self {
        let port = free_port();
        let dir = temp_dir("mongo");
        let storage = directory.map_or(":memory:".into(), |d| dir.join(d).display().to_string());
        // An explicit, empty config file keeps the server from picking up a secantusd.toml of the machine.
        std::fs::write(dir.join("secantusd.toml"), "").expect("empty server config");
        let args = vec![
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--storage-path".into(),
            storage,
            "--log-level".into(),
            "WARNING".into(),
            "--config".into(),
            dir.join("secantusd.toml").display().to_string(),
        ];
        Self {
            process: Process::start(
                spec("secantusd-py", tool("SECANTUSD_BIN", "secantusd-py"), args),
                dir,
                port,
                answers_hello,
            ),
        }
    }

    pub fn uri(&self) -> String {
        format!(
            "mongodb://127.0.0.1:{}/?directConnection=true",
            self.process.port
        )
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.process.port
    }

    pub fn stop(&mut self) {
        self.process.stop();
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.process.pause();
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        self.process.resume();
    }

    /// Starts the server again on the same port (after `stop`); in-memory data is gone, on-disk data stays.
    pub fn restart(&mut self) {
        self.process.restart();
    }
}

/// Ready when the server itself greets a client with its INFO line.
/// A Prometheus server on 127.0.0.1 with the configuration `config` (YAML), its data in its own temp dir.
pub struct PrometheusServer {
    process: Process,
}

impl PrometheusServer {
    pub fn start(config: &str) -> Self {
        let port = free_port();
        let dir = temp_dir("prometheus");
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).expect("prometheus.yml");
        let args = vec![
            format!("--config.file={}", file.display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
            "--log.level=warn".into(),
        ];
        Self {
            process: Process::start(
                spec("prometheus", tool("PROMETHEUS_BIN", "prometheus"), args),
                dir,
                port,
                answers_ready,
            ),
        }
    }

    /// The base URL of its HTTP API.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.process.port)
    }

    pub fn log_tail(&self) -> String {
        self.process.log_tail()
    }
}

/// The tools venv's Python, which has the official client SDKs (`openai`, `httpx-sse`) the tests drive the API with.
pub fn python() -> PathBuf {
    tool("CHV_PYTHON", "python")
}

/// promtool, from the same package as Prometheus.
pub fn promtool() -> PathBuf {
    tool("PROMTOOL_BIN", "promtool")
}

/// `GET /-/ready` answers 200.
fn answers_ready(port: u16) -> bool {
    answers_get(port, "/-/ready")
}

fn greets_with_info(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port))
        .ok()
        .and_then(|stream| {
            stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
            let mut line = String::new();
            BufReader::new(stream).read_line(&mut line).ok()?;
            Some(line.starts_with("INFO"))
        })
        .unwrap_or(false)
}

/// Sends an OP_MSG `{hello: 1, $db: "admin"}` and checks the server replies with an OP_MSG.
fn answers_hello(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let doc = mongodb::bson::doc! {"hello": 1, "$db": "admin"};
    let mut body = Vec::new();
    if doc.to_writer(&mut body).is_err() {
        return false;
    }
    let length = 16 + 4 + 1 + body.len();
    let mut message = Vec::with_capacity(length);
    message.extend_from_slice(&(length as i32).to_le_bytes());
    message.extend_from_slice(&1i32.to_le_bytes()); // request id
    message.extend_from_slice(&0i32.to_le_bytes()); // response to
    message.extend_from_slice(&2013i32.to_le_bytes()); // OP_MSG
    message.extend_from_slice(&0u32.to_le_bytes()); // flags
    message.push(0); // section kind 0: body
    message.extend_from_slice(&body);
    if stream.write_all(&message).is_err() {
        return false;
    }
    let mut header = [0u8; 16];
    stream.read_exact(&mut header).is_ok()
        && i32::from_le_bytes([header[12], header[13], header[14], header[15]]) == 2013
}
