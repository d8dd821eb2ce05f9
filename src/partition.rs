//! Partitioned workers ([design 8](../docs/design.md#8)): which worker owns a thread, and the one JetStream stream
//! that routes each thread's display events to its owner.
//!
//! The stream (`HISTORY_VIEW_JETSTREAM_STREAM`) has no subjects of its own: it **sources** every class stream, each
//! through a subject transform that prefixes the original subject with the partition of its thread token,
//! `<prefix>.{{partition(N,3)}}.agent.…`. Worker `k` consumes `<prefix>.k.>`. nats-server computes the partition as
//! FNV-1a 32 over the token's bytes, mod N ([`owner`] does the same, so any worker knows the owner of any thread).

use std::time::SystemTime;

use async_nats::jetstream::stream::{Config, Source, StorageType, SubjectTransform};

/// The display-event subject the transform reads: `agent.<class>.<id>.<thread>.<display>.<run>.display_event.<name>.<event_id>`.
/// The thread is its third wildcard.
pub const DISPLAY_EVENTS: &str = "agent.*.*.*.*.*.display_event.*.*";

/// What partitioning is configured with (`HISTORY_VIEW_PARTITIONS` > 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// `HISTORY_VIEW_PARTITIONS`.
    pub partitions: u32,
    /// This worker's partition (`HISTORY_VIEW_PARTITION`, or the StatefulSet ordinal).
    pub partition: u32,
    /// `HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX`: one subject token.
    pub prefix: String,
}

impl Partitioning {
    /// Whether this worker owns `thread_id`.
    pub fn owns(&self, thread_id: &str) -> bool {
        owner(thread_id, self.partitions) == self.partition
    }

    /// The subjects this worker consumes: `<prefix>.<k>.>`.
    pub fn filter_subject(&self) -> String {
        format!("{}.{}.>", self.prefix, self.partition)
    }

    /// The original display-event subject of a message of the partitioned stream (`<prefix>.<k>.` taken off);
    /// `None` for a subject of another shape.
    pub fn original_subject<'a>(&self, subject: &'a str) -> Option<&'a str> {
        let rest = subject
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix('.')?;
        let (partition, original) = rest.split_once('.')?;
        (partition.parse::<u32>().ok()? == self.partition).then_some(original)
    }

    /// The transform of every source: the display events, prefixed with their thread's partition.
    pub fn transform(&self) -> SubjectTransform {
        SubjectTransform {
            source: DISPLAY_EVENTS.to_owned(),
            destination: format!(
                "{}.{{{{partition({},3)}}}}.agent.{{{{wildcard(1)}}}}.{{{{wildcard(2)}}}}.{{{{wildcard(3)}}}}.\
                 {{{{wildcard(4)}}}}.{{{{wildcard(5)}}}}.display_event.{{{{wildcard(6)}}}}.{{{{wildcard(7)}}}}",
                self.prefix, self.partitions
            ),
        }
    }

    /// The source of one class stream from its message `next_sequence` on (its last sequence plus one, read before
    /// `since` was taken), with `since` as the instant coverage may start from (what the class stream held before
    /// is covered by the store, [design 2.1.5](../docs/design.md#2.1.5)).
    ///
    /// Chosen: a start *sequence*, not a start time alone. A source started by time is set up by nats-server at the
    /// later of that time and the partitioned stream's last message time (`trySetupSourceConsumer`,
    /// nats-io/nats-server#8387); a stream creating many sources one by one while another source already stored
    /// messages starts the later ones after their first messages, which are never copied, with no gap to see
    /// (every source then reports lag 0). A start sequence is used as it is.
    pub fn source(&self, class_stream: &str, since: SystemTime, next_sequence: u64) -> Source {
        Source {
            name: class_stream.to_owned(),
            start_sequence: Some(next_sequence),
            start_time: Some(since.into()),
            subject_transforms: vec![self.transform()],
            ..Source::default()
        }
    }

    /// Refuses a stream made for another partition count or prefix (or not made of sources at all): its workers
    /// would read other partitions' events, or none.
    ///
    /// # Errors
    /// What differs, for the start-up error.
    pub fn check(&self, name: &str, config: &Config) -> Result<(), String> {
        if !config.subjects.is_empty() {
            return Err(format!(
                "the stream {name} has subjects of its own ({}); the partitioned stream only sources the class streams",
                config.subjects.join(", ")
            ));
        }
        let expected = self.transform();
        for source in config.sources.iter().flatten() {
            if source.subject_transforms != [expected.clone()] {
                let found = source
                    .subject_transforms
                    .first()
                    .map_or("no subject transform", |t| t.destination.as_str());
                return Err(format!(
                    "the stream {name} sources {} as {found}, not as {} (HISTORY_VIEW_PARTITIONS={}, \
                     HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX={}): another partitioned deployment's stream, or one \
                     made with other settings; delete it or change the settings",
                    source.name, expected.destination, self.partitions, self.prefix
                ));
            }
        }
        Ok(())
    }
}

/// How the partitioned stream is made when the worker creates it.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// `HISTORY_VIEW_JETSTREAM_STREAM`.
    pub name: String,
    /// `HISTORY_VIEW_JETSTREAM_CREATE_STREAM`: create it, and keep its sources current; otherwise only bind.
    pub create: bool,
    /// `HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS`.
    pub max_age: std::time::Duration,
    /// `HISTORY_VIEW_JETSTREAM_MAX_BYTES`; `None`: no limit.
    pub max_bytes: Option<u64>,
    /// `HISTORY_VIEW_JETSTREAM_REPLICAS`.
    pub replicas: usize,
}

impl StreamSettings {
    /// The stream's configuration, sourcing `sources`.
    pub fn config(&self, sources: Vec<Source>) -> Config {
        Config {
            name: self.name.clone(),
            sources: Some(sources),
            storage: StorageType::File,
            max_age: self.max_age,
            max_bytes: self
                .max_bytes
                .map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX)),
            num_replicas: self.replicas,
            ..Config::default()
        }
    }
}

/// The partition of `thread_id` among `partitions`, as nats-server's `partition()` transform computes it: FNV-1a
/// 32 over the token's bytes, mod N.
pub fn owner(thread_id: &str, partitions: u32) -> u32 {
    fnv1a_32(thread_id.as_bytes()) % partitions.max(1)
}

fn fnv1a_32(bytes: &[u8]) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    bytes.iter().fold(OFFSET, |hash, &byte| {
        (hash ^ u32::from(byte)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partitioning(partition: u32) -> Partitioning {
        Partitioning {
            partitions: 3,
            partition,
            prefix: "chv".into(),
        }
    }

    #[test]
    fn fnv1a_32_matches_its_published_test_vectors() {
        // From the FNV reference (Landon Curt Noll's test suite): "" and "a" and "foobar".
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
        assert_eq!(owner("foobar", 7), 0xbf9c_f968 % 7);
        assert_eq!(owner("any", 1), 0);
    }

    #[test]
    fn the_original_subject_is_recovered_only_from_this_workers_partition() {
        let p = partitioning(1);
        assert_eq!(
            p.original_subject("chv.1.agent.A.a.t.d.r.display_event.n.e"),
            Some("agent.A.a.t.d.r.display_event.n.e")
        );
        assert_eq!(
            p.original_subject("chv.2.agent.A.a.t.d.r.display_event.n.e"),
            None
        );
        assert_eq!(p.original_subject("chvx.1.agent.A"), None);
        assert_eq!(
            p.original_subject("agent.A.a.t.d.r.display_event.n.e"),
            None
        );
        assert_eq!(p.filter_subject(), "chv.1.>");
    }

    #[test]
    fn a_stream_made_for_another_count_or_prefix_is_refused() {
        let p = partitioning(0);
        let settings = StreamSettings {
            name: "CHAT_HISTORY_VIEW".into(),
            create: true,
            max_age: std::time::Duration::from_secs(300),
            max_bytes: None,
            replicas: 1,
        };
        let now = SystemTime::now();
        let ours = settings.config(vec![p.source("agent_A_stream", now, 1)]);
        assert!(p.check("S", &ours).is_ok());
        for other in [
            Partitioning {
                partitions: 4,
                ..p.clone()
            },
            Partitioning {
                prefix: "other".into(),
                ..p.clone()
            },
        ] {
            let theirs = settings.config(vec![other.source("agent_A_stream", now, 1)]);
            let error = p.check("S", &theirs).unwrap_err();
            assert!(error.contains("HISTORY_VIEW_PARTITIONS=3"), "{error}");
        }
        let with_subjects = Config {
            subjects: vec!["agent.>".into()],
            ..ours
        };
        assert!(p.check("S", &with_subjects).is_err());
        assert!(
            p.transform()
                .destination
                .starts_with("chv.{{partition(3,3)}}.agent.{{wildcard(1)}}.")
        );
    }
}
