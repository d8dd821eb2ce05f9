//! The hot set's format at rest: one JSON document per key, versioned, holding thread ids only (never message text
//! or identities: a view is keyed by its thread id, and the identity a read renders for applies from memory).
//!
//! ```json
//! {"version":1,"written_at_ms":1767225600000,"threads":["t-newest","t-older"]}
//! ```
//!
//! The most recently read thread comes first. A document is at most a given number of bytes (the server's
//! `max_payload`): the encoder keeps the newest ids that fit. A document of another version is refused as a whole,
//! so a future format never reaches an older worker half-understood; ids that could not be a thread id are
//! skipped.

use serde::Deserialize;

/// The format this worker writes and reads.
pub const VERSION: u64 = 1;

/// A hot set read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotSetSnapshot {
    /// When the writer wrote it, in milliseconds since the Unix epoch.
    pub written_at_ms: u64,
    /// Thread ids, the most recently read first.
    pub threads: Vec<String>,
    /// Entries skipped because they could not be a thread id, or repeated one listed before.
    pub skipped: usize,
}

/// Why a stored hot set is not used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the hot set is not a JSON document of the expected shape: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the hot set is of format version {0}; this worker reads version 1")]
    UnknownVersion(u64),
}

/// Encodes `threads` (the most recently read first) in at most `limit` bytes, keeping the newest that fit.
///
/// # Returns
/// The document and how many ids it holds.
pub fn encode<'a>(
    threads: impl IntoIterator<Item = &'a str>,
    written_at_ms: u64,
    limit: usize,
) -> (Vec<u8>, usize) {
    let mut document =
        format!("{{\"version\":{VERSION},\"written_at_ms\":{written_at_ms},\"threads\":[")
            .into_bytes();
    const END: &[u8] = b"]}";
    let mut kept = 0;
    for thread in threads {
        // A string always serializes.
        let Ok(id) = serde_json::to_vec(thread) else {
            continue;
        };
        let separator = usize::from(kept > 0);
        if document.len() + separator + id.len() + END.len() > limit {
            break;
        }
        if kept > 0 {
            document.push(b',');
        }
        document.extend_from_slice(&id);
        kept += 1;
    }
    document.extend_from_slice(END);
    (document, kept)
}

#[derive(Deserialize)]
struct Version {
    version: u64,
}

#[derive(Deserialize)]
struct V1 {
    written_at_ms: u64,
    threads: Vec<String>,
}

/// Decodes a stored hot set, keeping at most `max` ids that are thread ids, each once (its first place: the newest),
/// so that a set of copies of one id costs one warm-up read, not one per copy.
///
/// # Errors
/// [`SnapshotError`] when it is not a document of this format.
pub fn decode(bytes: &[u8], max: usize) -> Result<HotSetSnapshot, SnapshotError> {
    let Version { version } = serde_json::from_slice(bytes)?;
    if version != VERSION {
        return Err(SnapshotError::UnknownVersion(version));
    }
    let V1 {
        written_at_ms,
        threads,
    } = serde_json::from_slice(bytes)?;
    let listed = threads.len();
    let mut seen = std::collections::HashSet::new();
    let threads: Vec<String> = threads
        .into_iter()
        .filter(|id| {
            crate::thread_id::ThreadId::parse(id.clone()).is_ok() && seen.insert(id.clone())
        })
        .collect();
    let skipped = listed - threads.len();
    Ok(HotSetSnapshot {
        written_at_ms,
        threads: threads.into_iter().take(max).collect(),
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn an_id_listed_again_is_read_once_in_its_first_place() {
        let mut ids = vec!["b", "a"];
        ids.extend(std::iter::repeat_n("b", 10_000));
        ids.push("c");
        let (bytes, _) = encode(ids, 7, 1 << 20);
        let snapshot = decode(&bytes, 100).unwrap();
        assert_eq!(snapshot.threads, ["b", "a", "c"]);
        assert_eq!(snapshot.skipped, 10_000);
    }

    #[test]
    fn a_document_reads_back_newest_first() {
        let (bytes, kept) = encode(["b", "a"], 7, 1 << 20);
        assert_eq!(kept, 2);
        assert_eq!(
            std::str::from_utf8(&bytes).unwrap(),
            r#"{"version":1,"written_at_ms":7,"threads":["b","a"]}"#
        );
        let snapshot = decode(&bytes, 10).unwrap();
        assert_eq!(snapshot.threads, ["b", "a"]);
        assert_eq!(snapshot.written_at_ms, 7);
    }

    #[test]
    fn another_version_is_refused_as_a_whole() {
        let error = decode(br#"{"version":2,"threads":[["t",{"x":1}]]}"#, 10).unwrap_err();
        assert!(matches!(error, SnapshotError::UnknownVersion(2)), "{error}");
        assert!(decode(b"not json", 10).is_err());
        assert!(decode(br#"{"version":1,"threads":"t"}"#, 10).is_err());
    }

    #[test]
    fn ids_that_cannot_be_thread_ids_are_skipped_and_the_count_is_bounded() {
        let bytes = br#"{"version":1,"written_at_ms":0,"threads":["a","","b.c","d e","f","g"]}"#;
        let snapshot = decode(bytes, 2).unwrap();
        assert_eq!(snapshot.threads, ["a", "f"]);
        assert_eq!(snapshot.skipped, 3);
    }

    #[test]
    fn a_limit_too_small_for_any_id_gives_an_empty_set() {
        let (bytes, kept) = encode(["a-long-thread-id"], 0, 50);
        assert_eq!(kept, 0);
        assert!(bytes.len() <= 50);
        assert!(decode(&bytes, 10).unwrap().threads.is_empty());
    }

    fn thread_id() -> impl Strategy<Value = String> {
        // Thread ids as the HTTP API accepts them, quotes and backslashes and non-ASCII included.
        proptest::string::string_regex(r#"[a-zA-Z0-9_\-"\\é€😀]{1,40}"#).unwrap()
    }

    proptest! {
        /// Whatever the ids and the limit, the document fits the limit, holds the newest ids in order, and reads
        /// back as exactly those.
        #[test]
        fn the_encoding_round_trips_within_its_size_bound(
            ids in proptest::collection::vec(thread_id(), 0..200),
            limit in 100usize..4_000,
            at in any::<u64>(),
        ) {
            // The writer lists each cached thread once (a repeated id reads back once: tested above).
            let mut seen = std::collections::HashSet::new();
            let ids: Vec<String> = ids.into_iter().filter(|id| seen.insert(id.clone())).collect();
            let (bytes, kept) = encode(ids.iter().map(String::as_str), at, limit);
            prop_assert!(bytes.len() <= limit, "{} > {limit}", bytes.len());
            let snapshot = decode(&bytes, usize::MAX).unwrap();
            prop_assert_eq!(&snapshot.threads[..], &ids[..kept]);
            prop_assert_eq!(snapshot.written_at_ms, at);
            // The next id did not fit.
            if kept < ids.len() {
                let next = serde_json::to_vec(&ids[kept]).unwrap().len();
                prop_assert!(bytes.len() + usize::from(kept > 0) + next > limit);
            }
        }
    }
}
