//! The live input: a NATS display-event payload (JSON bytes) read as far as its family needs. Only the parents
//! list, `created_at` and the family's one field are borrowed from the text; every other key is skipped unparsed.

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use super::family::{Branch, Families, Family};
use super::{DecodeError, Decoded, ViewEvent, body, created_at};
use crate::subject::DeliveryKey;

/// The fields of a payload the decoder may read, borrowed unparsed. Every other key is skipped without being
/// parsed into values. A repeated key keeps its last value, as Python's `json.loads` does.
#[derive(Default)]
struct PayloadHead<'a> {
    parents: Option<&'a RawValue>,
    created_at: Option<&'a RawValue>,
    /// Each family's field, in [`Family::ALL`] order.
    fields: [Option<&'a RawValue>; Family::ALL.len()],
    /// False when the payload is JSON but not an object.
    is_object: bool,
}

impl<'a> PayloadHead<'a> {
    fn field(&self, family: Family) -> Option<&'a RawValue> {
        self.fields[family as usize]
    }
}

impl<'de> serde::Deserialize<'de> for PayloadHead<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HeadVisitor;
        impl<'de> Visitor<'de> for HeadVisitor {
            type Value = PayloadHead<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an event payload")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut head = PayloadHead {
                    is_object: true,
                    ..PayloadHead::default()
                };
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    let slot = match key.as_ref() {
                        "_parent_event_names" => &mut head.parents,
                        "created_at" => &mut head.created_at,
                        name => match Family::from_field(name) {
                            Some(family) => &mut head.fields[family as usize],
                            None => {
                                map.next_value::<IgnoredAny>()?;
                                continue;
                            }
                        },
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(head)
            }
            // Any other JSON value is a payload that is not an object: no parents, so no family.
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(PayloadHead::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(PayloadHead::default())
            }
        }
        deserializer.deserialize_any(HeadVisitor)
    }
}

/// Families named by a raw `_parent_event_names` value; non-string elements are ignored, a non-list names none.
fn json_families(raw: &RawValue) -> Families {
    let mut families = Families::default();
    if let Ok(list) = serde_json::from_str::<Vec<Cow<'_, str>>>(raw.get()) {
        list.iter().for_each(|p| families.add(p));
    } else if let Ok(Value::Array(list)) = serde_json::from_str::<Value>(raw.get()) {
        list.iter()
            .filter_map(Value::as_str)
            .for_each(|p| families.add(p));
    }
    families
}

/// The deepest document MongoDB stores: 100 levels, each document or array adding one, the row itself the first
/// and its `event_data` (the payload) the second. aihub's persister cannot store a payload nested deeper, so no
/// history ever holds such an event, and the live path drops it too (else a view would hold an event the store
/// can never have). Chosen: MongoDB's documented limit; FerretDB, aihub's production backend, documents none, and
/// a lower limit there would only drop fewer events than the store does for payloads no agent produces.
pub const MAX_STORED_DEPTH: usize = 100;

/// How deeply a JSON text nests arrays and objects (the payload object itself is 1); brackets inside strings do
/// not count.
fn nesting_depth(json: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &byte in json {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

fn parse_raw(raw: Option<&RawValue>) -> Option<Value> {
    // A RawValue is already valid JSON, so this only fails past serde_json's nesting limit; treat that as absent.
    raw.and_then(|r| serde_json::from_str(r.get()).ok())
}

/// Decodes a NATS display-event payload delivered under `key` (parsed from the subject).
///
/// Chosen: when the payload has no `_parent_event_names` list, the subject's `event_name` stands in for it. aihub's
/// persister computes the parents of a known class itself, so a base-family event without the list is still
/// stored as that family; unknown events without the list stay irrelevant either way.
///
/// # Errors
/// [`DecodeError`] when the payload is not JSON at all.
pub fn decode_payload(key: DeliveryKey, payload: &[u8]) -> Result<Decoded, DecodeError> {
    let head: PayloadHead<'_> = match serde_json::from_slice(payload) {
        Ok(head) => head,
        Err(source) => return Err(DecodeError { key, source }),
    };
    let families = match head.parents {
        Some(raw) => json_families(raw),
        None if head.is_object => {
            let mut families = Families::default();
            families.add(key.event_name());
            families
        }
        None => Families::default(),
    };
    let Some(branch) = Branch::classify(&key, families) else {
        return Ok(Decoded::Irrelevant);
    };
    if nesting_depth(payload) + 1 > MAX_STORED_DEPTH {
        return Ok(Decoded::Irrelevant);
    }
    let field = match branch {
        Branch::Reads(family) => parse_raw(head.field(family)),
        Branch::Inert => None,
    };
    let created_at = created_at(parse_raw(head.created_at).as_ref());
    Ok(Decoded::Event(ViewEvent {
        key,
        created_at,
        body: body(branch, field.as_ref()),
        arrived: super::STORED,
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::decode::testing::{body, key, payload};
    use crate::decode::{Body, Decoded, MAX_STORED_DEPTH};

    #[test]
    fn a_payload_nested_deeper_than_the_store_keeps_is_dropped() {
        // `k` nested arrays under output_messages: the payload nests k + 1 deep, its row k + 2.
        let stop = |k: usize| {
            let field = format!("{}{}", "[".repeat(k), "]".repeat(k));
            format!(
                r#"{{"_parent_event_names": ["StopEvent"], "created_at": 1, "note": "[[[[{{", "output_messages": {field}}}"#
            )
        };
        let decode = |k: usize| decode_payload(key("A", "StopEvent"), stop(k).as_bytes()).unwrap();
        assert!(matches!(decode(MAX_STORED_DEPTH - 2), Decoded::Event(_)));
        assert_eq!(decode(MAX_STORED_DEPTH - 1), Decoded::Irrelevant);
        assert_eq!(nesting_depth(br#"{"a": "[{\"[", "b": [{}]}"#), 3);
    }

    #[test]
    fn a_payload_that_is_not_json_is_an_error() {
        assert!(decode_payload(key("A", "ChunkEvent"), b"{nope").is_err());
    }

    #[test]
    fn a_repeated_key_keeps_its_last_value() {
        let raw =
            br#"{"_parent_event_names":["ChunkEvent"],"created_at":1,"content":"a","content":"b"}"#;
        let body = body(decode_payload(key("A", "ChunkEvent"), raw).unwrap());
        assert_eq!(body, Body::Chunk(Ok("b".into())));
    }

    #[test]
    fn missing_parents_fall_back_to_the_subject_event_name() {
        let b = body(payload(
            key("A", "ChunkEvent"),
            json!({"created_at": 1, "content": "x"}),
        ));
        assert_eq!(b, Body::Chunk(Ok("x".into())));
        let d = payload(
            key("A", "CustomEvent"),
            json!({"created_at": 1, "content": "x"}),
        );
        assert_eq!(d, Decoded::Irrelevant);
    }
}
