//! What each store query sends and how its rows are read ([contract section 4](../../docs/contract.md#4), [design
//! 2b](../../docs/design.md#2b)): the documents (stage 1's pipeline, stage 2's and a fill's filters, the sort, the
//! projections), pure functions the benchmark and the store tests run too; and the loops that read the rows a
//! query yields, decoded by the shared decoder, within the query's [`Bounds`].
//!
//! A thread id or display id reaches these documents only as a string value (`Bson::String`), never as query
//! syntax: an id like `{"$ne": 1}` matches only itself.

use std::time::Duration;

use mongodb::Collection;
use mongodb::bson::oid::ObjectId;
use mongodb::bson::raw::RawBsonRef;
use mongodb::bson::{Bson, Document, RawDocumentBuf, doc};
use mongodb::options::Hint;

use super::{Bounds, Hydration, Store, StoreError, VisibleDisplays};
use crate::decode::{
    DISPLAY_EVENT, Decoded, EVENT_DATA_FIELDS, Family, USER_AGENT, ViewEvent, decode_row, row_key,
};
use crate::explain::RowMeta;
use crate::subject::KEY_FIELDS;
use crate::view::{display_bytes, event_bytes};

/// Parents that make a `UserAgent` display event a visibility marker.
const MARKER_PARENTS: [&str; 2] = Family::parents(Family::MARKERS);
/// The five projectable families.
const FAMILY_PARENTS: [&str; 5] = Family::parents(Family::ALL);

/// Stage 1's pipeline: the thread's `UserAgent` display markers, grouped by display.
pub fn markers_pipeline(thread_id: &str) -> [Document; 2] {
    let filter = doc! {
        "thread_id": thread_id,
        "event_type": DISPLAY_EVENT,
        "agent_class": USER_AGENT,
        "event_parents": {"$in": MARKER_PARENTS.as_slice()},
    };
    [
        doc! {"$match": filter},
        doc! {"$group": {"_id": "$display_id"}},
    ]
}

/// Stage 2's filter: the projectable families on the visible displays, from any agent.
pub fn events_filter(thread_id: &str, displays: &[Bson]) -> Document {
    doc! {
        "thread_id": thread_id,
        "event_type": DISPLAY_EVENT,
        "display_id": {"$in": displays},
        "event_parents": {"$in": FAMILY_PARENTS.as_slice()},
    }
}

/// A fill's filter: stage 2's, for the newly visible displays of a batch of threads.
pub fn fill_filter(threads: &[&str], displays: &[Bson]) -> Document {
    doc! {
        "thread_id": {"$in": threads},
        "event_type": DISPLAY_EVENT,
        "display_id": {"$in": displays},
        "event_parents": {"$in": FAMILY_PARENTS.as_slice()},
    }
}

/// Stage 2's order: aihub's sort; ties beyond `event_id` are settled in memory by the full delivery key.
pub fn events_sort() -> Document {
    doc! {"event_data.created_at": 1, "event_id": 1}
}

/// Only the fields the decoder reads, and `_id` (its time measures the persister's lag).
pub fn projection() -> Document {
    let mut projection = doc! {"_id": 1};
    for field in KEY_FIELDS.iter().chain(&["event_parents"]) {
        projection.insert(*field, 1);
    }
    for field in EVENT_DATA_FIELDS {
        projection.insert(format!("event_data.{field}"), 1);
    }
    projection
}

impl Store {
    /// Stage 1: the distinct string `display_id`s of the thread's `UserAgent` display markers, and how many
    /// distinct values of another type were skipped.
    ///
    /// Chosen: an aggregation (`$match`, then `$group` on `display_id`) rather than the `distinct` command, because
    /// `distinct` accepts a hint only from MongoDB 7.1 while `aggregate` has accepted one since 3.6 (FerretDB 2
    /// speaks the 7.0 wire version). Same filter, same values; displays that are missing or null are dropped, as
    /// they cannot be a display a client sees.
    pub(super) async fn find_displays(
        &self,
        thread_id: &str,
        hydration: Hydration,
        hint: Option<&str>,
        bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        let mut action = self
            .clients()
            .await?
            .for_query(hydration == Hydration::Shadow, false)
            .aggregate(markers_pipeline(thread_id))
            .max_time(bounds.max_time());
        if let Some(hint) = hint {
            action = action.hint(Hint::Name(hint.to_owned()));
        }
        let mut cursor = action.await?;
        let mut displays = Vec::new();
        let mut skipped = 0;
        let mut spent = bounds.spend();
        while cursor.advance().await? {
            match cursor.current().get("_id") {
                Ok(Some(RawBsonRef::String(display))) => {
                    spent.add(display_bytes(display))?;
                    displays.push(display.to_owned());
                }
                // Missing or null: no display a client sees.
                Ok(None | Some(RawBsonRef::Null)) => {}
                // Any other type cannot be part of a delivery key ([contract 6](../../docs/contract.md#6)), so no
                // event of it is projected; it must not reach stage 2's `$in` either, where a document like
                // `{"$ne": 1}` is an error.
                _ => skipped += 1,
            }
        }
        Ok(VisibleDisplays {
            displays,
            skipped_markers: skipped,
        })
    }

    /// Stage 2 (sorted, in projection order) or a fill (unsorted: the view orders what it holds): the rows that
    /// `filter` selects, decoded as the cursor yields them, stopped with [`StoreError::TooLarge`] (its `limit` is
    /// the budget here; callers name their own) as soon as the compact events exceed `bounds.budget` bytes.
    pub(super) async fn find_events<T>(
        &self,
        collection: &Collection<RawDocumentBuf>,
        filter: Document,
        sort: Option<Document>,
        hint: Option<&str>,
        bounds: Bounds,
        keep: fn(ViewEvent, Option<ObjectId>) -> T,
    ) -> Result<Vec<T>, StoreError> {
        let mut action = collection
            .find(filter)
            .projection(projection())
            .max_time(bounds.max_time());
        if let Some(sort) = sort {
            action = action.sort(sort);
        }
        if let Some(hint) = hint {
            action = action.hint(Hint::Name(hint.to_owned()));
        }
        let mut cursor = action.await?;
        let mut events = Vec::new();
        let mut spent = bounds.spend();
        while cursor.advance().await? {
            let row = cursor.current();
            if let Decoded::Event(event) = decode_row(row) {
                spent.add(event_bytes(&event))?;
                let id = row.get_object_id("_id").ok();
                if let (Some(id), Ok(created_at)) = (id, event.created_at) {
                    self.observe_persister_lag(id, created_at, &event);
                }
                events.push(keep(event, id));
            }
        }
        Ok(events)
    }

    /// Measures how long after its `created_at` a row was persisted (its `_id` time, whole seconds, so the figure
    /// is at most one second low and never high), and warns (rate-limited) when that exceeds the bound the
    /// completeness rule assumes.
    fn observe_persister_lag(&self, id: ObjectId, created_at_ns: i64, event: &ViewEvent) {
        let persisted_ns = i128::from(id.timestamp().timestamp_millis()) * 1_000_000;
        let lag_ns = persisted_ns - i128::from(created_at_ns);
        let bound = self.inner.bounds.persist_lag;
        if self.inner.metrics.persister_lag(lag_ns, bound) && self.inner.lag_warnings.allow() {
            let lag = Duration::from_nanos(u64::try_from(lag_ns).unwrap_or(u64::MAX));
            let key = &event.key;
            tracing::warn!(
                thread_id = key.thread_id(),
                display_id = key.display_id(),
                event_id = key.event_id(),
                lag_ms = u64::try_from(lag.as_millis()).unwrap_or(u64::MAX),
                bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
                "A stored event was persisted later than HISTORY_VIEW_PERSIST_LAG_MS after it was created; \
                 views may be served as complete without such events: raise the bound"
            );
        }
    }
}

/// [`Store::row_metadata`]'s query.
pub(super) async fn find_row_metadata(
    collection: &Collection<RawDocumentBuf>,
    thread_id: &str,
    hint: Option<&str>,
    bounds: Bounds,
) -> Result<Vec<RowMeta>, StoreError> {
    let mut action = collection
        .find(doc! {"thread_id": thread_id})
        .projection(row_metadata_projection())
        .sort(events_sort())
        .max_time(bounds.max_time());
    if let Some(hint) = hint {
        action = action.hint(Hint::Name(hint.to_owned()));
    }
    let mut cursor = action.await?;
    let mut rows = Vec::new();
    let mut spent = bounds.spend();
    while cursor.advance().await? {
        let row = metadata_of(cursor.current());
        spent.add(row.bytes())?;
        rows.push(row);
    }
    Ok(rows)
}

/// [`find_row_metadata`]'s projection: the eight key fields, `event_parents` and `event_data.created_at`, no `_id`
/// and no payload.
fn row_metadata_projection() -> Document {
    let mut projection = doc! {"_id": 0, "event_parents": 1, "event_data.created_at": 1};
    for field in KEY_FIELDS {
        projection.insert(field, 1);
    }
    projection
}

/// A row's metadata: its key and `created_at` as the decoder reads them, and whether the decoder keeps it. Its
/// payload fields were not fetched, so the decoded body is dropped.
fn metadata_of(row: &mongodb::bson::RawDocument) -> RowMeta {
    match decode_row(row) {
        Decoded::Event(event) => RowMeta {
            created_at: event.created_at.ok(),
            relevant: true,
            marker: event.is_marker(),
            key: event.key,
        },
        Decoded::Irrelevant => RowMeta {
            key: row_key(row),
            created_at: match row.get_document("event_data").map(|d| d.get("created_at")) {
                Ok(Ok(Some(RawBsonRef::Int64(n)))) => Some(n),
                Ok(Ok(Some(RawBsonRef::Int32(n)))) => Some(i64::from(n)),
                _ => None,
            },
            relevant: false,
            marker: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use mongodb::bson::RawDocumentBuf;

    use super::*;

    /// A document's keys in order (equality of documents ignores it; a sort does not).
    fn keys(document: &Document) -> Vec<&str> {
        document.keys().map(String::as_str).collect()
    }

    #[test]
    fn stage_one_matches_the_threads_user_agent_markers_and_groups_them_by_display() {
        let [matched, grouped] = markers_pipeline("t1");
        assert_eq!(
            matched,
            doc! {"$match": {
                "thread_id": "t1",
                "event_type": "display_event",
                "agent_class": "UserAgent",
                "event_parents": {"$in": ["UserMessageEvent", "HumanInTheLoopResponseEvent"]},
            }}
        );
        assert_eq!(grouped, doc! {"$group": {"_id": "$display_id"}});
        // The hinted index is thread_id, event_type, event_parents: the filter leads with its fields.
        assert_eq!(
            keys(matched.get_document("$match").unwrap()),
            ["thread_id", "event_type", "agent_class", "event_parents"]
        );
    }

    #[test]
    fn stage_two_and_a_fill_select_the_five_families_on_the_given_displays() {
        let families = [
            "UserMessageEvent",
            "HumanInTheLoopResponseEvent",
            "ChunkEvent",
        ]
        .into_iter()
        .chain(["HumanInTheLoopRequestEvent", "StopEvent"])
        .collect::<Vec<_>>();
        let displays = [Bson::from("d1"), Bson::from("d2")];
        assert_eq!(
            events_filter("t1", &displays),
            doc! {
                "thread_id": "t1",
                "event_type": "display_event",
                "display_id": {"$in": ["d1", "d2"]},
                "event_parents": {"$in": &families},
            }
        );
        assert_eq!(
            fill_filter(&["t1", "t2"], &displays[..1]),
            doc! {
                "thread_id": {"$in": ["t1", "t2"]},
                "event_type": "display_event",
                "display_id": {"$in": ["d1"]},
                "event_parents": {"$in": &families},
            }
        );
    }

    #[test]
    fn ids_that_look_like_operators_stay_string_values() {
        let sneaky = r#"{"$ne": 1}"#;
        let filter = events_filter(sneaky, &[Bson::from("$gt")]);
        assert_eq!(filter.get("thread_id"), Some(&Bson::from(sneaky)));
        assert_eq!(
            filter.get_document("display_id").unwrap(),
            &doc! {"$in": ["$gt"]}
        );
        let [matched, _] = markers_pipeline("$where");
        let matched = matched.get_document("$match").unwrap();
        assert_eq!(matched.get("thread_id"), Some(&Bson::from("$where")));
    }

    #[test]
    fn stage_two_sorts_as_aihub_does_and_fetches_only_what_the_decoder_reads() {
        let sort = events_sort();
        assert_eq!(sort, doc! {"event_data.created_at": 1, "event_id": 1});
        assert_eq!(keys(&sort), ["event_data.created_at", "event_id"]);
        assert_eq!(
            keys(&projection()),
            [
                "_id",
                "agent_class",
                "agent_id",
                "thread_id",
                "display_id",
                "run_id",
                "event_type",
                "event_name",
                "event_id",
                "event_parents",
                "event_data.created_at",
                "event_data.messages",
                "event_data.response",
                "event_data.content",
                "event_data.question",
                "event_data.output_messages",
            ]
        );
        assert!(projection().values().all(|v| v == &Bson::Int32(1)));
        let metadata = row_metadata_projection();
        assert_eq!(metadata.get("_id"), Some(&Bson::Int32(0)));
        assert_eq!(metadata.len(), 1 + 8 + 2);
        assert!(metadata.contains_key("event_data.created_at"));
        assert!(
            !metadata
                .keys()
                .any(|k| k.starts_with("event_data.") && k != "event_data.created_at")
        );
    }

    fn row(agent_class: &str, parent: &str, created_at: Bson) -> RawDocumentBuf {
        RawDocumentBuf::from_document(&doc! {
            "agent_class": agent_class, "agent_id": "a", "thread_id": "t", "display_id": "d", "run_id": "r",
            "event_type": "display_event", "event_name": parent, "event_id": "e1",
            "event_parents": [parent], "event_data": {"created_at": created_at},
        })
        .unwrap()
    }

    #[test]
    fn a_rows_metadata_says_whether_the_decoder_keeps_it_and_when_it_was_created() {
        let chunk = metadata_of(&row("A", "ChunkEvent", Bson::Int64(5)));
        assert!(chunk.relevant);
        assert!(!chunk.marker);
        assert_eq!(chunk.created_at, Some(5));
        assert_eq!(chunk.key.event_id(), "e1");
        let marker = metadata_of(&row("UserAgent", "UserMessageEvent", Bson::Int64(6)));
        assert!(marker.relevant && marker.marker);
        // Another family: dropped by the decoder, its key and an integer created_at still read.
        let tool = metadata_of(&row("A", "ToolCallEvent", Bson::Int32(7)));
        assert!(!tool.relevant && !tool.marker);
        assert_eq!(tool.created_at, Some(7));
        assert_eq!(tool.key.thread_id(), "t");
        let untimed = metadata_of(&row("A", "ToolCallEvent", Bson::from("soon")));
        assert_eq!(untimed.created_at, None);
    }
}
