//! The fuzz targets' checks (`fuzz/checks.rs`) over the committed corpus (`fuzz/corpus/<target>/`), so what
//! `make fuzz` found stays found in `make test`; and the seeds the corpus grew from, written from the
//! conformance cases by an ignored test.

use std::path::{Path, PathBuf};

use arbitrary::{Arbitrary, Unstructured};
use chat_history_view::subject::{DeliveryKey, KEY_FIELDS};
use serde_json::Value;

// Also the persister's row mapping for the soak (`checks::stored_row`).
#[path = "../../fuzz/checks.rs"]
pub mod checks;

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Runs `check` over every input of `target`'s corpus on a thread with the main thread's stack size (libFuzzer runs
/// the targets on its main thread; a test thread's 2 MiB stack is too small for the deepest generated inputs).
fn replay(target: &str, check: fn(&[u8])) {
    let inputs = inputs(target);
    std::thread::Builder::new()
        .stack_size(8 << 20)
        .spawn(move || inputs.iter().for_each(|input| check(input)))
        .expect("replay thread")
        .join()
        .expect("every corpus input passes its check");
}

/// Every input of `target`'s corpus; fails if the corpus is missing or empty.
fn inputs(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus(target);
    let inputs: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| std::fs::read(entry.expect("corpus entry").path()).expect("corpus input"))
        .collect();
    assert!(!inputs.is_empty(), "{} is empty", dir.display());
    inputs
}

#[test]
fn the_subject_corpus_passes_its_checks() {
    replay("subject", checks::subject);
}

#[test]
fn the_payload_corpus_passes_its_checks() {
    replay("payload", checks::payload);
}

#[test]
fn the_row_corpus_passes_its_checks() {
    replay("row", checks::row);
}

#[test]
fn the_same_event_corpus_passes_its_checks() {
    replay("same_event", |input| {
        // libFuzzer's own decoding of an input into the target's argument.
        if let Ok(event) = checks::Event::arbitrary_take_rest(Unstructured::new(input)) {
            checks::same_event(&event);
        }
    });
}

/// Writes the seeds of the subject, payload and row corpora from the conformance cases' rows:
/// `cargo test --test api fuzz_corpus::write_seeds -- --ignored`.
#[test]
#[ignore = "writes the fuzz seed corpus"]
fn write_seeds() {
    let cases = crate::cases::load("projector");
    for (n, row) in cases.iter().flat_map(|case| &case.rows).enumerate() {
        let text = |name: &str| row.get(name).and_then(Value::as_str).unwrap_or("x");
        let key = DeliveryKey::from_fields(KEY_FIELDS.map(text));
        write(&corpus("subject"), n, key.to_subject().as_bytes());
        let mut payload = vec![u8::try_from(n % 256).expect("fits")];
        payload.extend(serde_json::to_vec(&row["event_data"]).expect("JSON"));
        write(&corpus("payload"), n, &payload);
        if let Ok(bson) = mongodb::bson::to_raw_document_buf(row) {
            write(&corpus("row"), n, bson.as_bytes());
        }
    }
}

fn write(dir: &Path, n: usize, bytes: &[u8]) {
    std::fs::create_dir_all(dir).expect("corpus directory");
    std::fs::write(dir.join(format!("seed-{n:04}")), bytes).expect("seed written");
}
