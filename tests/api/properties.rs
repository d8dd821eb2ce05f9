//! Property tests of the pure core: for random threads the projection depends neither on delivery order nor on
//! duplicates, the live decoder and the store decoder agree, a view gives what the projector gives, and nothing
//! panics.

use chat_history_view::decode::{Decoded, ViewEvent, decode_payload};
use chat_history_view::project::{Identity, Projection, project};
use chat_history_view::subject::DeliveryKey;
use chat_history_view::view::ThreadView;
use proptest::prelude::*;
use serde_json::Value;

use crate::projector::decode_rows;
use crate::threads::{self, PRIMARY};

fn live_events(rows: &[Value]) -> Vec<ViewEvent> {
    rows.iter()
        .filter_map(|row| {
            let key = DeliveryKey::parse_subject(&threads::subject(row))
                .expect("generated subject parses");
            let payload = serde_json::to_vec(&row["event_data"]).unwrap();
            match decode_payload(key, &payload).expect("generated payload is JSON") {
                Decoded::Event(e) => Some(e),
                Decoded::Irrelevant => None,
            }
        })
        .collect()
}

/// Warnings as a set: aihub warns once per malformed delivery, a view once per malformed event.
fn warning_set(p: &Projection) -> Vec<(String, String)> {
    let mut set: Vec<_> = p
        .warnings
        .iter()
        .map(|w| (w.event_id.clone(), w.error_type().to_owned()))
        .collect();
    set.sort();
    set.dedup();
    set
}

fn primary(with: bool) -> Option<Identity> {
    with.then(|| Identity {
        agent_class: PRIMARY.0.into(),
        agent_id: PRIMARY.1.into(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn projection_ignores_delivery_order_and_duplicates(thread in threads::thread("t1".into()), with_primary in any::<bool>()) {
        let primary = primary(with_primary);
        let canonical = project(&decode_rows(&thread.rows), primary.as_ref());
        let delivered = project(&decode_rows(&thread.delivered), primary.as_ref());
        prop_assert_eq!(&canonical.history, &delivered.history);
        prop_assert_eq!(warning_set(&canonical), warning_set(&delivered));
    }

    #[test]
    fn live_and_store_decoders_agree(thread in threads::thread("t1".into())) {
        prop_assert_eq!(live_events(&thread.delivered), decode_rows(&thread.delivered));
    }

    #[test]
    fn a_view_fed_in_any_order_projects_like_the_store_path(thread in threads::thread("t1".into()), with_primary in any::<bool>()) {
        let primary = primary(with_primary);
        let expected = project(&decode_rows(&thread.rows), primary.as_ref());
        let mut view = ThreadView::new();
        for event in live_events(&thread.delivered) {
            view.insert(event);
        }
        let actual = view.project(primary.as_ref());
        prop_assert_eq!(
            serde_json::to_string(&actual.history).unwrap(),
            serde_json::to_string(&expected.history).unwrap()
        );
        prop_assert_eq!(warning_set(&actual), warning_set(&expected));
    }

    #[test]
    fn arbitrary_payloads_never_panic(payload in prop::collection::vec(any::<u8>(), 0..200), name in "[A-Za-z]{1,12}") {
        let key = DeliveryKey::parse_subject(&format!("agent.UserAgent.u.t.d.r.display_event.{name}.e")).unwrap();
        let _ = decode_payload(key, &payload);
    }

    #[test]
    fn arbitrary_json_payloads_never_panic(value in json_value(), parents in prop::sample::subsequence(
        vec!["UserMessageEvent", "HumanInTheLoopResponseEvent", "ChunkEvent", "HumanInTheLoopRequestEvent", "StopEvent"], 0..3)) {
        let mut payload = serde_json::json!({"_parent_event_names": parents, "created_at": 1});
        for field in ["messages", "response", "content", "question", "output_messages"] {
            payload[field] = value.clone();
        }
        let key = DeliveryKey::parse_subject("agent.UserAgent.u.t.d.r.display_event.X.e").unwrap();
        let decoded = decode_payload(key, payload.to_string().as_bytes()).unwrap();
        if let Decoded::Event(event) = decoded {
            let _ = project(&[event], None);
        }
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (0u8..=255).prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "[a-z:/.=+ ]{0,12}".prop_map(Value::String),
        prop_oneof![
            Just("text"),
            Just("image"),
            Just("audio"),
            Just("wav"),
            Just("https://x.org/a")
        ]
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("block_type"),
                    Just("blocks"),
                    Just("text"),
                    Just("url"),
                    Just("audio"),
                    Just("image"),
                    Just("format"),
                    Just("role"),
                    Just("contents"),
                    Just("type")
                ]
                .prop_map(String::from),
                inner,
                0..5
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
