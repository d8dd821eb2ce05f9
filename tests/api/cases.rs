//! The shared conformance cases (`tests/conformance/cases`), loaded for every path that runs them.

use std::path::PathBuf;

use chat_history_view::project::Identity;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
pub struct Case {
    pub name: String,
    /// The thread the rows belong to; the store and live paths read it.
    pub thread_id: String,
    pub primary: Option<Primary>,
    pub paths: Vec<String>,
    pub rows: Vec<Value>,
    pub expected: Expected,
    /// Metadata-only warnings the projector must emit; absent means not checked, empty means none.
    pub warnings: Option<Vec<ExpectedWarning>>,
}

#[derive(Debug, Deserialize)]
pub struct Primary {
    pub agent_class: String,
    pub agent_id: String,
}

#[derive(Debug, Deserialize)]
pub struct Expected {
    pub messages: Value,
}

#[derive(Debug, Deserialize, PartialEq)]
pub struct ExpectedWarning {
    pub event_id: String,
    pub error_type: String,
    #[serde(default)]
    pub audio_format: Option<String>,
}

impl Case {
    /// The case moved to `thread`, so that cases can share one store or stream: rows of the case's thread move to
    /// it, rows of its other threads to threads of their own beside it.
    pub fn on_thread(mut self, thread: String) -> Self {
        for row in &mut self.rows {
            let original = row["thread_id"].as_str().unwrap_or_default().to_owned();
            row["thread_id"] = Value::String(if original == self.thread_id {
                thread.clone()
            } else {
                format!("{thread}-{original}")
            });
        }
        self.thread_id = thread;
        self
    }

    pub fn identity(&self) -> Option<Identity> {
        self.primary.as_ref().map(|p| Identity {
            agent_class: p.agent_class.clone(),
            agent_id: p.agent_id.clone(),
        })
    }
}

pub fn cases_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/conformance")
}

/// Every case whose `paths` include `path`, in file order. Fails loudly if the directory holds none.
pub fn load(path: &str) -> Vec<Case> {
    let dir = cases_dir().join("cases");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let cases: Vec<Case> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).expect("case file");
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        })
        .filter(|c: &Case| c.paths.iter().any(|p| p == path))
        .collect();
    assert!(
        !cases.is_empty(),
        "no conformance case names the {path} path"
    );
    cases
}
