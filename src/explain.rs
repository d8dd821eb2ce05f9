//! `explain` ([design 3.3](../docs/design.md#3.3)): every event of a thread with what became of it, metadata only.
//!
//! Two inputs, joined by delivery key. The view's side ([`ViewFates`]) is what the projector recorded while it
//! projected the answer ([`crate::project::Fate`]): the same decoder and projector as every read, so it cannot
//! disagree with the history. The store's side ([`RowMeta`]) is the thread's rows without their payloads, because
//! the view never holds what it drops: events of other families (dropped by the decoder) and repeated deliveries
//! (dropped on insert). Pure: no I/O.
//!
//! An event of the view whose message carried a publisher's trace context while tracing was on also shows the
//! publisher's trace id (`publisher_trace_id`), kept beside it by the view ([`crate::view::PublisherContext`]);
//! a stored row has none, as nothing is persisted.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use opentelemetry::trace::TraceId;

use crate::decode::{Body, ViewEvent};
use crate::project::{Fate, Projection, Role, Rule, StopFate, Trace};
use crate::subject::{DeliveryKey, KEY_FIELDS};
use crate::view::{PublisherContext, ThreadView};

/// One stored row as `explain` reads it: its delivery key, `created_at` and what the decoder's family filter made
/// of it, from a projection without payloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowMeta {
    pub key: DeliveryKey,
    /// `event_data.created_at` when it is an integer.
    pub created_at: Option<i64>,
    /// Whether the decoder keeps it (a display event of the five families).
    pub relevant: bool,
    /// Whether it is a visibility marker (a `UserAgent` user message or HITL answer).
    pub marker: bool,
}

impl RowMeta {
    /// Bytes held, for the per-thread limit.
    pub fn bytes(&self) -> usize {
        self.key.heap_bytes() + std::mem::size_of::<Self>()
    }
}

/// One event of the view with its fate.
#[derive(Debug)]
struct ViewFate {
    key: DeliveryKey,
    created_at: Option<i64>,
    fate: Fate,
    marker: bool,
    /// Formats of audio blocks dropped as unsupported (the event's other parts counted).
    unsupported_audio: Vec<Box<str>>,
    /// The trace id of the publisher's context its message carried, if the view kept a valid one.
    publisher_trace_id: Option<TraceId>,
}

/// The view's side of an explanation: each event's fate as the projector recorded it, and the messages' ids.
#[derive(Debug)]
pub struct ViewFates {
    events: Vec<ViewFate>,
    messages: Vec<(String, Role)>,
}

impl ViewFates {
    /// From a traced projection of `view`.
    pub fn new(view: &ThreadView, projection: &Projection, trace: &Trace<'_>) -> Self {
        // The trace names the view's own events, so an event is found by its address (a key can be held twice,
        // once valid and once failing validation, each with its own context). Built only when there are any.
        let publishers: HashMap<*const ViewEvent, &PublisherContext> = view
            .publishers()
            .map(|(event, publisher)| (std::ptr::from_ref(event), publisher))
            .collect();
        let events = trace
            .iter()
            .map(|&(event, fate)| ViewFate {
                publisher_trace_id: publishers
                    .get(&std::ptr::from_ref(event))
                    .and_then(|publisher| publisher.span_context())
                    .map(|context| context.trace_id()),
                key: event.key.clone(),
                created_at: event.created_at.ok(),
                fate,
                marker: event.is_marker(),
                unsupported_audio: match &event.body {
                    Body::UserMessage(content) => content.unsupported_audio.clone(),
                    _ => Vec::new(),
                },
            })
            .collect();
        let messages = projection
            .provenance
            .iter()
            .zip(&projection.history.messages)
            .map(|(provenance, message)| (provenance.id(), message.role))
            .collect();
        Self { events, messages }
    }

    /// Bytes held, for the cache's weigher.
    pub fn bytes(&self) -> usize {
        let events: usize = self
            .events
            .iter()
            .map(|e| {
                std::mem::size_of::<ViewFate>()
                    + e.key.heap_bytes()
                    + e.unsupported_audio
                        .iter()
                        .map(|f| f.len() + 16)
                        .sum::<usize>()
            })
            .sum();
        events + self.messages.len() * 72 + 64
    }
}

/// An explanation: `GET /v1/threads/{thread_id}/history/explain`'s body.
#[derive(Debug, Serialize)]
pub struct Explanation<'a> {
    pub thread_id: &'a str,
    /// The history's messages in order, each with the events that make it up (indices into `events`).
    pub messages: Vec<MessageJson>,
    /// Every display seen, with the markers that made it visible (indices into `events`).
    pub displays: Vec<DisplayJson<'a>>,
    /// Every event of the view and every stored row, in projection order (`created_at`, then delivery key).
    pub events: Vec<EventJson<'a>>,
    /// How many events had each fate.
    pub counts: BTreeMap<&'static str, usize>,
}

#[derive(Debug, Serialize)]
pub struct MessageJson {
    pub id: String,
    pub role: Role,
    pub events: Vec<usize>,
}

#[derive(Debug, Serialize)]
pub struct DisplayJson<'a> {
    pub display_id: &'a str,
    pub visible: bool,
    pub markers: Vec<usize>,
}

/// One event: its delivery key, where it was found, and its fate with the fate's details.
#[derive(Debug, Serialize)]
pub struct EventJson<'a> {
    #[serde(flatten)]
    pub key: BTreeMap<&'static str, &'a str>,
    pub created_at: Option<i64>,
    /// In the worker's view of the thread (decoded live or by a hydration).
    pub in_view: bool,
    /// Among the store's rows when `explain` read them.
    pub stored: bool,
    pub fate: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// For stop events: what the prefix rule did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix_rule: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_type: Option<&'static str>,
    /// For malformed events: the rule broken (`key_field`, `created_at`, `field`) and the field it is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<&'static str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unsupported_audio: Vec<&'a str>,
    /// For a repeated delivery: the event whose first delivery counted instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicate_of: Option<usize>,
    /// The trace id (32 lowercase hex digits) of the publisher's span, for an event of the view whose message
    /// carried a valid `traceparent` while tracing was on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publisher_trace_id: Option<String>,
}

/// The fates `explain` names, in the order `counts` lists them.
pub const FATES: [&str; 8] = [
    "counted",
    "stop",
    "display_not_visible",
    "family_not_projectable",
    "no_branch",
    "duplicate",
    "malformed",
    "not_in_view",
];

/// One row of the explanation before it is numbered.
struct Entry<'a> {
    key: &'a DeliveryKey,
    created_at: Option<i64>,
    view: Option<&'a ViewFate>,
    stored: bool,
    /// Found in the store only: relevant (and a marker) or not.
    relevant: bool,
    marker: bool,
    /// A later delivery of a key already listed.
    repeated: bool,
}

/// Joins the view's fates with the stored rows (in store order) of `thread_id`.
///
/// A stored row whose key the view holds is that event (the first such row; any later one is a repeated delivery,
/// `duplicate`, or `display_not_visible` on a hidden display). Any other row is `display_not_visible` on a hidden
/// display (visibility is decided first, as in aihub's two stages), `family_not_projectable` when the decoder drops
/// it, and otherwise `not_in_view`: persisted after the view read the store, or missed by it (the shadow checks'
/// concern).
pub fn explain<'a>(
    thread_id: &'a str,
    view: &'a ViewFates,
    rows: &'a [RowMeta],
) -> Explanation<'a> {
    let mut entries: Vec<Entry<'a>> = view
        .events
        .iter()
        .map(|event| Entry {
            key: &event.key,
            created_at: event.created_at,
            view: Some(event),
            stored: false,
            relevant: true,
            marker: event.marker,
            repeated: false,
        })
        .collect();
    // The view's events by key (a key can be held twice: once valid and once failing validation).
    let mut held: HashMap<&DeliveryKey, Vec<usize>> = HashMap::new();
    for (at, entry) in entries.iter().enumerate() {
        held.entry(entry.key).or_default().push(at);
    }
    let mut listed: HashSet<&DeliveryKey> = HashSet::new();
    for row in rows {
        let view_event = held
            .get(&row.key)
            .and_then(|ats| ats.iter().copied().find(|&at| !entries[at].stored));
        if let Some(at) = view_event {
            entries[at].stored = true;
            continue;
        }
        let repeated = held.contains_key(&row.key) || !listed.insert(&row.key);
        entries.push(Entry {
            key: &row.key,
            created_at: row.created_at,
            view: None,
            stored: true,
            relevant: row.relevant,
            marker: row.marker,
            repeated,
        });
    }
    // Projection order; for equal keys the view's event first, then the rows in store order (the sort is stable).
    entries.sort_by(|a, b| {
        (a.created_at.unwrap_or(i64::MAX), a.key, a.repeated).cmp(&(
            b.created_at.unwrap_or(i64::MAX),
            b.key,
            b.repeated,
        ))
    });

    let mut visible: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    // Displays in order of first appearance (a set beside, so a thread of many displays stays linear).
    let mut seen_displays: Vec<&str> = Vec::new();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut first: HashMap<&DeliveryKey, usize> = HashMap::new();
    for (at, entry) in entries.iter().enumerate() {
        let display = entry.key.display_id();
        if seen.insert(display) {
            seen_displays.push(display);
        }
        if entry.marker && entry.relevant {
            visible.entry(display).or_default().push(at);
        }
        first.entry(entry.key).or_insert(at);
    }

    let mut messages: Vec<MessageJson> = view
        .messages
        .iter()
        .map(|(id, role)| MessageJson {
            id: id.clone(),
            role: *role,
            events: Vec::new(),
        })
        .collect();
    let mut counts: BTreeMap<&'static str, usize> = FATES.iter().map(|f| (*f, 0)).collect();
    let mut events = Vec::with_capacity(entries.len());
    for (at, entry) in entries.iter().enumerate() {
        let shown = visible.contains_key(entry.key.display_id());
        let mut json = EventJson {
            key: KEY_FIELDS.into_iter().zip(entry.key.fields()).collect(),
            created_at: entry.created_at,
            in_view: entry.view.is_some(),
            stored: entry.stored,
            fate: "",
            message: None,
            message_id: None,
            prefix_rule: None,
            error_type: None,
            rule: None,
            field: None,
            unsupported_audio: Vec::new(),
            duplicate_of: None,
            publisher_trace_id: None,
        };
        if entry.repeated {
            json.duplicate_of = first.get(entry.key).copied();
            json.fate = if shown {
                "duplicate"
            } else {
                "display_not_visible"
            };
        } else if let Some(event) = entry.view {
            json.unsupported_audio = event.unsupported_audio.iter().map(|f| &**f).collect();
            json.publisher_trace_id = event.publisher_trace_id.map(|id| id.to_string());
            describe(&mut json, event.fate);
        } else if !shown {
            json.fate = "display_not_visible";
        } else if !entry.relevant {
            json.fate = "family_not_projectable";
        } else {
            json.fate = "not_in_view";
        }
        if let Some(message) = json.message {
            if let Some(joined) = messages.get_mut(message) {
                joined.events.push(at);
                json.message_id = Some(joined.id.clone());
            }
        }
        *counts.entry(json.fate).or_default() += 1;
        events.push(json);
    }
    let displays = seen_displays
        .into_iter()
        .map(|display_id| DisplayJson {
            display_id,
            visible: visible.contains_key(display_id),
            markers: visible.get(display_id).cloned().unwrap_or_default(),
        })
        .collect();
    Explanation {
        thread_id,
        messages,
        displays,
        events,
        counts,
    }
}

/// Writes what the projector recorded for an event of the view.
fn describe(json: &mut EventJson<'_>, fate: Fate) {
    match fate {
        Fate::Counted { message } => {
            json.fate = "counted";
            json.message = Some(message);
        }
        Fate::DisplayNotVisible => json.fate = "display_not_visible",
        Fate::NoBranch => json.fate = "no_branch",
        Fate::Malformed { error_type, rule } => {
            json.fate = "malformed";
            json.error_type = Some(error_type.as_str());
            let (rule, field) = match rule {
                Rule::KeyField(field) => ("key_field", Some(field)),
                Rule::CreatedAt => ("created_at", None),
                Rule::Field(field) => ("field", Some(field)),
            };
            json.rule = Some(rule);
            json.field = field;
        }
        Fate::Stop(stop) => {
            json.fate = "stop";
            json.prefix_rule = Some(match stop {
                StopFate::Supplied { message, .. } => {
                    json.message = Some(message);
                    "supplied"
                }
                StopFate::NothingToAdd => "nothing_to_add",
                StopFate::Diverged => "diverged",
                StopFate::NotPrimary => "not_primary",
                StopFate::NoIdentity => "no_identity",
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::decode::{Decoded, decode_payload};
    use crate::project::Identity;
    use crate::view::ThreadView;

    fn key(class: &str, display: &str, name: &str, event_id: &str) -> DeliveryKey {
        DeliveryKey::from_fields([
            class,
            "id",
            "t",
            display,
            "r1",
            "display_event",
            name,
            event_id,
        ])
    }

    fn event(key: DeliveryKey, payload: serde_json::Value) -> crate::decode::ViewEvent {
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(event) => event,
            Decoded::Irrelevant => panic!("relevant"),
        }
    }

    fn row(key: DeliveryKey, created_at: i64, relevant: bool, marker: bool) -> RowMeta {
        RowMeta {
            key,
            created_at: Some(created_at),
            relevant,
            marker,
        }
    }

    #[test]
    fn every_event_and_row_gets_the_fate_the_projector_gave_it() {
        let marker = key("UserAgent", "d1", "UserMessageEvent", "e1");
        let hel = key("A", "d1", "ChunkEvent", "e2");
        let stop = key("A", "d1", "StopEvent", "e3");
        let hidden = key("A", "d2", "ChunkEvent", "e4");
        let empty = key("A", "d1", "ChunkEvent", "e5");
        let other = key("A", "d1", "ToolEvent", "e6");
        let user = json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1,
            "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "Q"}]}]});
        let chunk = |at: i64, text: &str| json!({"_parent_event_names": ["ChunkEvent"], "created_at": at, "content": text});
        let mut view = ThreadView::new();
        view.insert(event(marker.clone(), user));
        view.insert(event(hel.clone(), chunk(2, "Hel")));
        view.insert(event(
            stop.clone(),
            json!({"_parent_event_names": ["StopEvent"], "created_at": 3,
                   "output_messages": [{"role": "assistant", "contents": [{"type": "text", "text": "Hello"}]}]}),
        ));
        view.insert(event(hidden.clone(), chunk(4, "secret")));
        view.insert(event(empty.clone(), chunk(5, "")));
        view.sort_order();
        let primary = Identity {
            agent_class: "A".into(),
            agent_id: "id".into(),
        };
        let (projection, trace) = view.project_traced(Some(&primary));
        let fates = ViewFates::new(&view, &projection, &trace);
        let rows = [
            row(marker, 1, true, true),
            row(hel.clone(), 2, true, false),
            row(hel, 2, true, false),
            row(stop, 3, true, false),
            row(hidden, 4, true, false),
            row(empty, 5, true, false),
            row(other, 6, false, false),
        ];
        let explanation = serde_json::to_value(explain("t", &fates, &rows)).unwrap();
        let fate_of = |event_id: &str| -> Vec<String> {
            explanation["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["event_id"] == event_id)
                .map(|e| {
                    let detail = e["prefix_rule"]
                        .as_str()
                        .or(e["rule"].as_str())
                        .unwrap_or("");
                    format!(
                        "{}{}{detail}",
                        e["fate"].as_str().unwrap(),
                        if detail.is_empty() { "" } else { ":" }
                    )
                })
                .collect()
        };
        assert_eq!(fate_of("e1"), ["counted"]);
        assert_eq!(fate_of("e2"), ["counted", "duplicate"]);
        assert_eq!(fate_of("e3"), ["stop:supplied"]);
        assert_eq!(fate_of("e4"), ["display_not_visible"]);
        assert_eq!(fate_of("e5"), ["malformed:field"]);
        assert_eq!(fate_of("e6"), ["family_not_projectable"]);
        let messages = explanation["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[1]["role"], "assistant");
        let joined: Vec<&str> = messages[1]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|at| {
                explanation["events"][at.as_u64().unwrap() as usize]["event_id"]
                    .as_str()
                    .unwrap()
            })
            .collect();
        assert_eq!(joined, ["e2", "e3"]);
        assert_eq!(explanation["events"][2]["duplicate_of"], 1);
        assert_eq!(explanation["displays"][0]["markers"], json!([0]));
        assert_eq!(explanation["displays"][1]["visible"], false);
        assert_eq!(explanation["counts"]["duplicate"], 1);
        // Metadata only: no text of any event.
        let text = explanation.to_string();
        for payload in ["Hel", "Hello", "secret", "\"Q\""] {
            assert!(!text.contains(payload), "{payload} in {text}");
        }
    }

    #[test]
    fn an_event_whose_message_carried_a_context_lists_its_publishers_trace_id_and_no_other_does() {
        let context = |trace: u128| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(
                "traceparent",
                format!("00-{trace:032x}-00f067aa0ba902b7-01").as_str(),
            );
            PublisherContext::from_headers(&headers).expect("a traceparent")
        };
        let marker = key("UserAgent", "d1", "UserMessageEvent", "e1");
        let traced = key("A", "d1", "ChunkEvent", "e2");
        let plain = key("A", "d1", "ChunkEvent", "e3");
        let bad = key("A", "d1", "ChunkEvent", "e4");
        let stored_only = key("A", "d1", "ChunkEvent", "e5");
        let chunk = |at: serde_json::Value| json!({"_parent_event_names": ["ChunkEvent"], "created_at": at, "content": "x"});
        let mut view = ThreadView::new();
        view.insert_live(
            event(
                marker.clone(),
                json!({"_parent_event_names": ["UserMessageEvent"], "created_at": 1,
                    "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "Q"}]}]}),
            ),
            None,
        );
        view.insert_live(event(traced.clone(), chunk(json!(2))), Some(context(0xab)));
        view.insert_live(event(plain, chunk(json!(3))), None);
        // A repeat with a context of its own: the first delivery (and its context) stays.
        view.insert_live(event(traced.clone(), chunk(json!(2))), Some(context(0xcd)));
        view.insert_live(event(bad, chunk(json!("late"))), Some(context(0xef)));
        view.sort_order();
        let (projection, trace) = view.project_traced(None);
        let fates = ViewFates::new(&view, &projection, &trace);
        let rows = [
            row(marker, 1, true, true),
            row(traced.clone(), 2, true, false),
            row(traced, 2, true, false),
            row(stored_only, 6, true, false),
        ];
        let explanation = serde_json::to_value(explain("t", &fates, &rows)).unwrap();
        let listed: Vec<(&str, Option<&str>)> = explanation["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["event_id"].as_str().unwrap(),
                    e.get("publisher_trace_id").map(|t| t.as_str().unwrap()),
                )
            })
            .collect();
        let ab = format!("{:032x}", 0xab);
        let ef = format!("{:032x}", 0xef);
        assert_eq!(
            listed,
            [
                ("e1", None),
                ("e2", Some(ab.as_str())),
                // The stored repeat of e2 is a row, not the event: nothing is persisted with it.
                ("e2", None),
                ("e3", None),
                ("e5", None),
                // Without an integer created_at: last.
                ("e4", Some(ef.as_str())),
            ]
        );
    }
}
