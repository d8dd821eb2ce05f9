//! The ETag of a rendered body, shared by every form of an answer.

use std::hash::{DefaultHasher, Hash, Hasher};

/// A quoted strong validator of `bytes`.
pub fn etag_of(bytes: &[u8]) -> String {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    format!("\"{:016x}\"", hasher.finish())
}
