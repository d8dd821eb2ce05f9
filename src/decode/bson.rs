//! The store input: one persisted `agent_events` row (BSON), read field by field without converting the whole
//! document; the family's one field is converted to the JSON model the shared field rules read.

use mongodb::bson::RawDocument;
use mongodb::bson::raw::{RawArray, RawBsonRef};
use serde_json::Value;

use super::family::{Branch, Families, Family};
use super::{Decoded, ErrorType, STORED, ViewEvent, body, created_at};
use crate::subject::{DeliveryKey, KEY_FIELDS};

/// The `event_data` fields the decoder may read: `created_at` and each family's field. The store projects only
/// these, the delivery key's fields ([`KEY_FIELDS`]) and `event_parents`.
pub const EVENT_DATA_FIELDS: [&str; 1 + Family::ALL.len()] = {
    let mut fields = ["created_at"; 1 + Family::ALL.len()];
    let mut i = 0;
    while i < Family::ALL.len() {
        fields[i + 1] = Family::ALL[i].field();
        i += 1;
    }
    fields
};

/// Decodes one persisted row. The delivery key comes from the row's top-level fields (`event_id` is the row's, which
/// aihub takes from the payload); a missing or non-string field is kept empty and reported by the projector.
pub fn decode_row(row: &RawDocument) -> Decoded {
    // A row whose `display_id` is not a string is in no visible display and makes none visible (visible displays
    // are strings, [contract 5.1](../../docs/contract.md#5.1)): irrelevant, like a row of a hidden display, and
    // never warned about.
    if !matches!(row.get("display_id"), Ok(Some(RawBsonRef::String(_)))) {
        return Decoded::Irrelevant;
    }
    let key = row_key(row);
    let mut families = Families::default();
    if let Ok(Some(RawBsonRef::Array(parents))) = row.get("event_parents") {
        for parent in parents.into_iter().flatten() {
            if let RawBsonRef::String(p) = parent {
                families.add(p);
            }
        }
    }
    let Some(branch) = Branch::classify(&key, families) else {
        return Decoded::Irrelevant;
    };
    let (created_at, field) = match row.get("event_data") {
        Ok(Some(RawBsonRef::Document(data))) => {
            let get = |name: &str| data.get(name).ok().flatten().map(bson_to_json);
            (
                created_at(get("created_at").as_ref()),
                branch.field().and_then(get),
            )
        }
        // event_data is not a mapping: aihub's ordering validation raises TypeError before any branch runs.
        _ => (Err(ErrorType::TypeError), None),
    };
    Decoded::Event(ViewEvent {
        key,
        created_at,
        body: body(branch, field.as_ref()),
        arrived: STORED,
    })
}

/// A row's delivery key, from its top-level fields; a missing or non-string field is kept empty.
pub fn row_key(row: &RawDocument) -> DeliveryKey {
    let text = |name: &str| match row.get(name) {
        Ok(Some(RawBsonRef::String(s))) => s,
        _ => "",
    };
    DeliveryKey::from_fields(KEY_FIELDS.map(text))
}

/// Converts a BSON value into the JSON model the field rules read.
///
/// Chosen: binary data becomes a list of byte values, which the byte-field rules treat exactly like the legacy
/// int-list form (both become bytes in llama-index). Types JSON cannot express (ObjectId, dates, decimals, ...)
/// become an object `{"$bsonType": ...}`, so they fail every string, number and list check as pydantic would.
fn bson_to_json(value: RawBsonRef<'_>) -> Value {
    match value {
        RawBsonRef::Double(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
        RawBsonRef::String(s) => Value::String(s.to_owned()),
        RawBsonRef::Array(items) => Value::Array(array_to_json(items)),
        RawBsonRef::Document(doc) => Value::Object(
            doc.into_iter()
                .flatten()
                .map(|(k, v)| (k.to_owned(), bson_to_json(v)))
                .collect(),
        ),
        RawBsonRef::Boolean(b) => Value::Bool(b),
        RawBsonRef::Null | RawBsonRef::Undefined => Value::Null,
        RawBsonRef::Int32(i) => Value::from(i),
        RawBsonRef::Int64(i) => Value::from(i),
        RawBsonRef::Binary(bin) => {
            Value::Array(bin.bytes.iter().map(|&b| Value::from(b)).collect())
        }
        other => serde_json::json!({ "$bsonType": format!("{:?}", other.element_type()) }),
    }
}

fn array_to_json(items: &RawArray) -> Vec<Value> {
    items.into_iter().flatten().map(bson_to_json).collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::decode::testing::{key, payload};
    use crate::decode::{Body, Decoded, ErrorType, Part, USER_AGENT};

    #[test]
    fn store_rows_decode_like_payloads() {
        let row = json!({"agent_class": "A", "agent_id": "id", "thread_id": "t", "display_id": "d", "run_id": "r",
            "event_id": "e1", "event_type": "display_event", "event_name": "ChunkEvent",
            "event_parents": ["ChunkEvent", "DisplayEvent"],
            "event_data": {"created_at": 7, "content": "Hel", "_parent_event_names": ["ignored"]}});
        let doc = mongodb::bson::to_raw_document_buf(&row).unwrap();
        let from_row = decode_row(&doc);
        let from_payload = payload(
            key("A", "ChunkEvent"),
            json!({"_parent_event_names": ["ChunkEvent", "DisplayEvent"], "created_at": 7, "content": "Hel"}),
        );
        assert_eq!(from_row, from_payload);
    }

    #[test]
    fn bson_binary_audio_is_treated_as_bytes() {
        use mongodb::bson::{Binary, doc, spec::BinarySubtype};
        let row = doc! {"agent_class": USER_AGENT, "agent_id": "id", "thread_id": "t", "display_id": "d",
        "run_id": "r", "event_id": "e1", "event_type": "display_event", "event_name": "UserMessageEvent",
        "event_parents": ["UserMessageEvent"],
        "event_data": {"created_at": 1_i64, "messages": [{"role": "user", "blocks": [
            {"block_type": "audio", "format": "wav",
             "audio": Binary { subtype: BinarySubtype::Generic, bytes: b"encoded-audio".to_vec() }}]}]}};
        let doc = mongodb::bson::RawDocumentBuf::from_document(&row).unwrap();
        let Decoded::Event(event) = decode_row(&doc) else {
            panic!()
        };
        let Body::UserMessage(content) = event.body else {
            panic!()
        };
        assert!(
            matches!(&content.parts.unwrap()[0], Part::InputAudio { input_audio } if input_audio.data == "ZW5jb2RlZC1hdWRpbw==")
        );
    }

    #[test]
    fn rows_with_missing_key_fields_keep_them_empty() {
        let row = json!({"agent_class": "A", "thread_id": "t", "display_id": "d", "run_id": 5,
            "event_id": "e1", "event_type": "display_event", "event_name": "ChunkEvent",
            "event_parents": ["ChunkEvent"], "event_data": "not a mapping"});
        let doc = mongodb::bson::to_raw_document_buf(&row).unwrap();
        let Decoded::Event(event) = decode_row(&doc) else {
            panic!()
        };
        assert_eq!(event.key.missing_field(), Some("agent_id"));
        assert_eq!(event.created_at, Err(ErrorType::TypeError));
    }

    #[test]
    fn a_row_whose_display_id_is_not_a_string_is_irrelevant_even_as_a_marker() {
        for display_id in [json!(5), json!(null), json!(["d"])] {
            let row = json!({"agent_class": USER_AGENT, "agent_id": "id", "thread_id": "t", "display_id": display_id,
                "run_id": "r", "event_id": "e1", "event_type": "display_event", "event_name": "UserMessageEvent",
                "event_parents": ["UserMessageEvent"], "event_data": "not a mapping"});
            let doc = mongodb::bson::to_raw_document_buf(&row).unwrap();
            assert_eq!(decode_row(&doc), Decoded::Irrelevant, "{display_id}");
        }
        let mut row = mongodb::bson::to_document(&json!({"agent_class": "A", "agent_id": "id", "thread_id": "t",
            "run_id": "r", "event_id": "e1", "event_type": "display_event", "event_name": "ChunkEvent",
            "event_parents": ["ChunkEvent"], "event_data": {"created_at": 1, "content": "x"}}))
        .unwrap();
        assert_eq!(
            decode_row(&mongodb::bson::RawDocumentBuf::from_document(&row).unwrap()),
            Decoded::Irrelevant,
            "no display_id"
        );
        row.insert("display_id", "d");
        assert!(matches!(
            decode_row(&mongodb::bson::RawDocumentBuf::from_document(&row).unwrap()),
            Decoded::Event(_)
        ));
    }
}
