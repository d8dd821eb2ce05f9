//! A client process driven by JSON lines (the SDK clients of `tests/clients/`): one command a line on its stdin,
//! each with an `id`, answered by one line on its stdout with that `id`, in any order.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

/// The answers waited for, by command id.
type Waiting = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

pub struct JsonLines {
    stdin: tokio::sync::Mutex<tokio::process::ChildStdin>,
    waiting: Waiting,
    next: AtomicU64,
    _child: tokio::process::Child,
}

impl JsonLines {
    /// Starts `command` (its stdin and stdout piped, killed when this is dropped).
    ///
    /// # Panics
    /// When it cannot start.
    pub fn start(mut command: tokio::process::Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{command:?}: {e} (scripts/services.sh install puts the clients in .tools)")
            });
        let waiting: Waiting = Arc::default();
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let answers = Arc::clone(&waiting);
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let reply: Value = serde_json::from_str(&line).expect("a JSON line");
                let id = reply["id"].as_u64().expect("its id");
                if let Some(sender) = answers.lock().unwrap().remove(&id) {
                    let _ = sender.send(reply);
                }
            }
        });
        Self {
            stdin: tokio::sync::Mutex::new(child.stdin.take().expect("stdin")),
            waiting,
            next: AtomicU64::new(0),
            _child: child,
        }
    }

    /// Sends `command` (given an `id`) and waits at most `limit` (scaled, [`crate::wait::within`]) for its answer.
    ///
    /// # Panics
    /// When no answer comes.
    pub async fn ask(&self, mut command: Value, limit: Duration) -> Value {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        command["id"] = json!(id);
        let (sender, answer) = oneshot::channel();
        self.waiting.lock().unwrap().insert(id, sender);
        let mut stdin = self.stdin.lock().await;
        stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .expect("write a command");
        stdin.flush().await.expect("flush");
        drop(stdin);
        crate::wait::within(&format!("an answer to {command}"), limit, answer)
            .await
            .expect("the client's answer")
    }
}
