//! Every `projector` conformance case through the pure projector: messages and warnings compared exactly.

use chat_history_view::decode::{Decoded, ViewEvent, decode_row};
use chat_history_view::project::{Projection, project};
use serde_json::Value;

use crate::cases::{self, ExpectedWarning};

/// Rows in the persisted JSON shape, decoded as the store path decodes what MongoDB returns.
pub fn decode_rows(rows: &[Value]) -> Vec<ViewEvent> {
    rows.iter()
        .filter_map(|row| {
            let doc = mongodb::bson::to_raw_document_buf(row).expect("row converts to BSON");
            match decode_row(&doc) {
                Decoded::Event(event) => Some(event),
                Decoded::Irrelevant => None,
            }
        })
        .collect()
}

/// The worker's warnings as the cases state them.
pub fn warnings(projection: &Projection) -> Vec<ExpectedWarning> {
    projection
        .warnings
        .iter()
        .map(|w| ExpectedWarning {
            event_id: w.event_id.clone(),
            error_type: w.error_type().to_owned(),
            audio_format: match &w.kind {
                chat_history_view::project::WarningKind::UnsupportedAudio { format } => {
                    Some(format.to_string())
                }
                _ => None,
            },
        })
        .collect()
}

#[test]
fn every_projector_case_matches_messages_and_warnings() {
    let cases = cases::load("projector");
    let mut failures = Vec::new();
    for case in &cases {
        let events = decode_rows(&case.rows);
        let projection = project(&events, case.identity().as_ref());
        let messages = serde_json::to_value(&projection.history.messages).unwrap();
        if messages != case.expected.messages {
            failures.push(format!(
                "{}: messages\n  expected {}\n  actual   {}",
                case.name, case.expected.messages, messages
            ));
        }
        if let Some(expected) = &case.warnings {
            let actual = warnings(&projection);
            if &actual != expected {
                failures.push(format!(
                    "{}: warnings\n  expected {:?}\n  actual   {:?}",
                    case.name, expected, actual
                ));
            }
        }
    }
    println!("{} projector cases run", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}
