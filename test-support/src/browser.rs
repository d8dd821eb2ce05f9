//! A real browser for the tests: Debian's headless Chromium (`.tools/venv/bin/chromium-headless-shell`, installed by
//! `scripts/services.sh install`, or `CHROMIUM_BIN`), driven over the DevTools protocol through
//! `--remote-debugging-pipe`: commands are JSON objects, each followed by a NUL byte, written to the browser's fd 3;
//! replies and events come back the same way on its fd 4. Nothing is downloaded and no WebSocket is needed.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, PipeReader, PipeWriter, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::process::temp_dir;

/// How long one DevTools command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The launcher `scripts/services.sh install` writes (or `CHROMIUM_BIN`).
pub fn chromium() -> PathBuf {
    if let Ok(path) = std::env::var("CHROMIUM_BIN") {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.tools/venv/bin"))
        .join("chromium-headless-shell");
    assert!(
        path.exists(),
        "{} not found: run `scripts/services.sh install` (or set CHROMIUM_BIN)",
        path.display()
    );
    path
}

/// A headless Chromium with one page, killed on drop.
pub struct Browser {
    child: Child,
    commands: PipeWriter,
    replies: Arc<Mutex<HashMap<u64, Sender<Value>>>>,
    next_id: u64,
    session: String,
    profile: PathBuf,
}

impl Browser {
    /// Starts the browser and opens a blank page.
    ///
    /// # Panics
    /// When the browser cannot start or does not answer.
    pub fn start() -> Self {
        let (to_browser, commands) = std::io::pipe().expect("a pipe");
        let (from_browser, replies_in) = std::io::pipe().expect("a pipe");
        let profile = temp_dir("chromium");
        let (read_fd, write_fd) = (to_browser.as_raw_fd(), replies_in.as_raw_fd());
        let mut command = Command::new(chromium());
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                // The machine's network is closed: no background connections, updates or sync attempts.
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-quic",
                "--remote-debugging-pipe",
                "--window-size=1280,900",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec only async-signal-safe calls are made (fcntl, dup2), on fds this process owns.
        unsafe {
            command.pre_exec(move || {
                // Copies above 4 first, so that neither end is closed by the other's dup2.
                let read = libc::fcntl(read_fd, libc::F_DUPFD, 10);
                let write = libc::fcntl(write_fd, libc::F_DUPFD, 10);
                if read < 0 || write < 0 || libc::dup2(read, 3) < 0 || libc::dup2(write, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("chromium starts");
        drop((to_browser, replies_in));
        let replies: Arc<Mutex<HashMap<u64, Sender<Value>>>> = Arc::default();
        let pending = Arc::clone(&replies);
        std::thread::spawn(move || read_replies(from_browser, &pending));
        let mut browser = Self {
            child,
            commands,
            replies,
            next_id: 0,
            session: String::new(),
            profile,
        };
        let target = browser.call("Target.createTarget", json!({"url": "about:blank"}), None);
        let target_id = target["targetId"].as_str().expect("a target id").to_owned();
        let attached = browser.call(
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
            None,
        );
        browser.session = attached["sessionId"]
            .as_str()
            .expect("a session id")
            .to_owned();
        browser.page("Page.enable", json!({}));
        browser.page("Runtime.enable", json!({}));
        browser
    }

    /// Sends `method` with `params` (to the page's session when `session` is set) and returns its result.
    fn call(&mut self, method: &str, params: Value, session: Option<String>) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let (tx, rx): (Sender<Value>, Receiver<Value>) = channel();
        self.replies.lock().expect("replies").insert(id, tx);
        let mut message = json!({"id": id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = session.into();
        }
        let mut bytes = serde_json::to_vec(&message).expect("a command serializes");
        bytes.push(0);
        self.commands.write_all(&bytes).expect("the browser reads");
        match rx.recv_timeout(COMMAND_TIMEOUT) {
            Ok(reply) => {
                assert!(reply["error"].is_null(), "{method}: {}", reply["error"]);
                reply["result"].clone()
            }
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                panic!("{method}: no answer from the browser")
            }
        }
    }

    fn page(&mut self, method: &str, params: Value) -> Value {
        let session = Some(self.session.clone());
        self.call(method, params, session)
    }

    /// Loads `url` in the page and waits until its document has loaded.
    pub fn navigate(&mut self, url: &str) {
        let result = self.page("Page.navigate", json!({"url": url}));
        assert!(
            result["errorText"].is_null(),
            "{url}: {}",
            result["errorText"]
        );
        let loaded = self.eval_until(
            "[location.href, document.readyState]",
            COMMAND_TIMEOUT,
            |state| state[0] == url && state[1] == "complete",
        );
        assert_eq!(loaded[1], "complete", "{url} did not load: {loaded}");
    }

    /// Evaluates `expression` in the page (awaiting a promise) and returns its value as JSON.
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.page(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            result["exceptionDetails"].is_null(),
            "{expression}: {}",
            result["exceptionDetails"]
        );
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until `done` holds for its value or `limit` passes; returns the last value.
    pub fn eval_until(
        &mut self,
        expression: &str,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.eval(expression);
            if done(&value) || Instant::now() > deadline {
                return value;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A PNG screenshot of the whole page.
    pub fn screenshot(&mut self) -> Vec<u8> {
        let result = self.page(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true}),
        );
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(result["data"].as_str().expect("image data"))
            .expect("base64 image data")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Hands each reply to the command waiting for it; events (no `id`) are dropped.
fn read_replies(from_browser: PipeReader, pending: &Mutex<HashMap<u64, Sender<Value>>>) {
    let mut reader = BufReader::new(from_browser);
    let mut message = Vec::new();
    loop {
        message.clear();
        match reader.read_until(0, &mut message) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if message.last() == Some(&0) {
            message.pop();
        }
        let Ok(value) = serde_json::from_slice::<Value>(&message) else {
            continue;
        };
        if let Some(id) = value["id"].as_u64()
            && let Some(tx) = pending.lock().expect("replies").remove(&id)
        {
            let _ = tx.send(value);
        }
    }
}
