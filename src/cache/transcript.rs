//! The live feed's form of a history ([design 3.2](../../docs/design.md#3.2)): each message's JSON once, and a
//! digest of each (its provenance's id and its JSON), so that two answers compare message by message and an update
//! carries the messages from the first that changed.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::project::Projection;

/// A history's messages, each serialised on its own.
#[derive(Debug)]
pub struct Transcript {
    /// Every message's JSON, one after the other.
    json: Bytes,
    /// Where each message's JSON ends in `json`.
    ends: Vec<u32>,
    /// One digest per message (kept beside a few older versions' for resumes).
    pub digests: Arc<[u64]>,
}

impl Transcript {
    pub fn new(projection: &Projection) -> Self {
        let messages = &projection.history.messages;
        let mut json = Vec::with_capacity(messages.len() * 128);
        let mut ends = Vec::with_capacity(messages.len());
        let mut digests = Vec::with_capacity(messages.len());
        for (message, provenance) in messages.iter().zip(&projection.provenance) {
            let start = json.len();
            // Serialising strings and vectors of plain structs into a vector cannot fail.
            let _ = serde_json::to_writer(&mut json, message);
            let mut hasher = DefaultHasher::new();
            provenance.id_digest().hash(&mut hasher);
            json[start..].hash(&mut hasher);
            digests.push(hasher.finish());
            ends.push(u32::try_from(json.len()).unwrap_or(u32::MAX));
        }
        Self {
            json: Bytes::from(json),
            ends,
            digests: digests.into(),
        }
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Bytes held, for the cache's weigher.
    pub fn bytes(&self) -> usize {
        self.json.len() + self.ends.len() * 12 + 64
    }

    /// The first message that differs from a transcript with `older` digests (`len()` when none does and none
    /// was removed), or `None` when they are the same.
    pub fn first_change(&self, older: &[u64]) -> Option<usize> {
        let same = self
            .digests
            .iter()
            .zip(older)
            .take_while(|(a, b)| a == b)
            .count();
        (same < self.len() || older.len() != self.len()).then_some(same)
    }

    /// `{"thread_id": ..., "messages": [...]}`: the history's body.
    pub fn snapshot(&self, thread_id: &str) -> Bytes {
        let mut body = BytesMut::with_capacity(self.json.len() + thread_id.len() + 64);
        body.put_slice(br#"{"thread_id":"#);
        let _ = serde_json::to_writer((&mut body).writer(), thread_id);
        body.put_slice(br#","messages":"#);
        self.put_messages(&mut body, 0);
        body.put_u8(b'}');
        body.freeze()
    }

    /// `{"from": from, "messages": [<the messages from `from` on>]}`.
    pub fn update(&self, from: usize) -> Bytes {
        let start = self.start(from);
        let mut body = BytesMut::with_capacity(self.json.len() - start + 64);
        body.put_slice(format!(r#"{{"from":{from},"messages":"#).as_bytes());
        self.put_messages(&mut body, from);
        body.put_u8(b'}');
        body.freeze()
    }

    fn start(&self, at: usize) -> usize {
        match at {
            0 => 0,
            at => self
                .ends
                .get(at - 1)
                .map_or(self.json.len(), |&end| end as usize),
        }
    }

    fn put_messages(&self, body: &mut BytesMut, from: usize) {
        body.put_u8(b'[');
        for at in from..self.len() {
            if at > from {
                body.put_u8(b',');
            }
            body.put_slice(&self.json[self.start(at)..self.ends[at] as usize]);
        }
        body.put_u8(b']');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{Decoded, ViewEvent, decode_payload};
    use crate::project::project;
    use crate::subject::DeliveryKey;
    use serde_json::{Value, json};

    fn chunk(display: &str, id: &str, at: i64, text: &str) -> ViewEvent {
        let key = DeliveryKey::parse_subject(&format!(
            "agent.A.a.t.{display}.r.display_event.ChunkEvent.{id}"
        ))
        .unwrap();
        let payload =
            json!({"_parent_event_names": ["ChunkEvent"], "created_at": at, "content": text});
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(event) => event,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    fn marker(display: &str, id: &str, at: i64) -> ViewEvent {
        let key = DeliveryKey::parse_subject(&format!(
            "agent.UserAgent.u.t.{display}.r.display_event.UserMessageEvent.{id}"
        ))
        .unwrap();
        let payload = json!({"_parent_event_names": ["UserMessageEvent"], "created_at": at,
            "messages": [{"role": "user", "blocks": [{"block_type": "text", "text": "q"}]}]});
        match decode_payload(key, payload.to_string().as_bytes()).unwrap() {
            Decoded::Event(event) => event,
            Decoded::Irrelevant => unreachable!(),
        }
    }

    fn of(events: &[ViewEvent]) -> Transcript {
        Transcript::new(&project(events, None))
    }

    /// Applying an update to the older messages gives the newer snapshot, whatever changed.
    #[test]
    fn an_update_from_the_first_change_rebuilds_the_newer_snapshot() {
        let base = vec![marker("d1", "u1", 1), chunk("d1", "c1", 2, "a")];
        let mut grown = base.clone();
        grown.push(chunk("d1", "c2", 3, "b"));
        let mut turned = grown.clone();
        turned.push(marker("d2", "u2", 4));
        let mut earlier = turned.clone();
        earlier.push(chunk("d1", "c0", 0, "z"));
        for (older, newer) in [(&base, &grown), (&grown, &turned), (&turned, &earlier)] {
            let (older, newer) = (of(older), of(newer));
            let from = newer.first_change(&older.digests).expect("a change");
            let mut messages: Vec<Value> = serde_json::from_slice::<Value>(&older.snapshot("t"))
                .unwrap()["messages"]
                .as_array()
                .unwrap()
                .clone();
            let update: Value = serde_json::from_slice(&newer.update(from)).unwrap();
            assert_eq!(update["from"], from);
            messages.truncate(from);
            messages.extend(update["messages"].as_array().unwrap().iter().cloned());
            let snapshot: Value = serde_json::from_slice(&newer.snapshot("t")).unwrap();
            assert_eq!(Value::Array(messages), snapshot["messages"]);
        }
        let same = of(&base);
        assert_eq!(same.first_change(&of(&base).digests), None);
        // The snapshot is the history's body.
        let projection = project(&base, None);
        let history = json!({"thread_id": "t", "messages": projection.history.messages});
        assert_eq!(
            serde_json::from_slice::<Value>(&same.snapshot("t")).unwrap(),
            history
        );
    }
}
