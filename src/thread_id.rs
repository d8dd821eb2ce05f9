//! The thread id rule: what a thread id from outside (a read's path, a handed-over hot set) must be to name a
//! thread, beside the subject rules it keeps ([`crate::subject`]: a thread id is one token of a display-event
//! subject).

/// Which rule a thread id breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the thread id {0}")]
pub struct InvalidThreadId(pub &'static str);

/// Longest accepted thread id, in bytes.
pub const MAX_THREAD_ID_BYTES: usize = 256;

/// A thread id that can be a NATS subject token: non-empty, at most 256 bytes, no `.`, `*`, `>`, whitespace or
/// control characters (`%00` included).
/// It is otherwise opaque and goes into store queries only as a string value, never as query syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadId(String);

impl ThreadId {
    /// # Errors
    /// [`InvalidThreadId`] saying which rule the id breaks.
    pub fn parse(id: String) -> Result<Self, InvalidThreadId> {
        if id.is_empty() {
            return Err(InvalidThreadId("must not be empty"));
        }
        if id.len() > MAX_THREAD_ID_BYTES {
            return Err(InvalidThreadId("must be at most 256 bytes"));
        }
        if id.contains(['.', '*', '>']) || id.contains(char::is_whitespace) {
            return Err(InvalidThreadId(
                "must not contain '.', '*', '>' or whitespace",
            ));
        }
        if id.contains(char::is_control) {
            return Err(InvalidThreadId("must not contain control characters"));
        }
        Ok(Self(id))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}
