//! The JetStream source's orchestration without servers: the source over a fake JetStream ([`Fake`]: streams
//! holding messages, ephemeral consumers delivering them in order, the state readings the source asks for), whose
//! streams a test can age, purge, delete from, recreate, hand to a new leader, or silence, on tokio's paused clock.
//! One test per case of [design 2.1.3](../../docs/design.md#2.1.3)'s table; the black-box tests (`tests/api/`) prove
//! the same against real servers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::stream::Config;
use bytes::Bytes;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::api::{
    Api, Consumer, ConsumerState, Delivery, JsApiError, SourceState, Start, StreamState,
};
use super::{JetStreamSettings, JetStreamSource, Lane, Sink, SourceMetrics, Timing, Tracker};
use crate::coverage::Coverage;
use crate::freshness::Freshness;
use crate::partition::{Partitioning, StreamSettings};

const LAG: Duration = Duration::from_millis(2_000);
const DISPLAY: &str = "agent.*.*.*.*.*.display_event.*.*";

fn display_subject(class: &str, n: u64) -> String {
    format!("agent.{class}.a1.t1.d1.r1.display_event.agent_stream_chunk.e{n}")
}

fn control_subject(class: &str, n: u64) -> String {
    format!("agent.{class}.a1.t1.d1.r1.control.ping.c{n}")
}

#[derive(Debug, Clone)]
struct Stored {
    subject: String,
    headers: Option<async_nats::HeaderMap>,
    time: SystemTime,
}

#[derive(Debug)]
struct FakeStream {
    created: SystemTime,
    leader: Option<String>,
    quorum: bool,
    subjects: Vec<String>,
    messages: BTreeMap<u64, Stored>,
    last_seq: u64,
    /// Sequences deleted from inside (a hole stays until the front passes it).
    holes: BTreeSet<u64>,
    sources: Vec<SourceState>,
    config: Config,
}

impl FakeStream {
    fn new(name: &str, subjects: Vec<String>) -> Self {
        Self {
            created: SystemTime::now(),
            leader: None,
            quorum: true,
            subjects,
            messages: BTreeMap::new(),
            last_seq: 0,
            holes: BTreeSet::new(),
            sources: Vec::new(),
            config: Config {
                name: name.to_owned(),
                ..Config::default()
            },
        }
    }

    fn first_seq(&self) -> u64 {
        self.messages
            .keys()
            .next()
            .copied()
            .unwrap_or(self.last_seq + 1)
    }
}

#[derive(Default)]
struct World {
    streams: BTreeMap<String, FakeStream>,
    /// Listing the streams fails with this.
    listing: Option<JsApiError>,
    /// Stream-state requests never answer (a leaderless stream, a cut link).
    silent: bool,
    /// Consumers deliver nothing (the worker is frozen, or the link is slow).
    held: bool,
    consumers_created: Vec<(String, Start)>,
    /// Readings that asked for the deleted sequences.
    deleted_lists: usize,
}

/// A fake JetStream. Cloning is cheap.
#[derive(Clone, Default)]
struct Fake {
    world: Arc<Mutex<World>>,
    changed: Arc<Notify>,
}

impl Fake {
    fn with<T>(&self, change: impl FnOnce(&mut World) -> T) -> T {
        let out = change(&mut self.world.lock().unwrap());
        self.changed.notify_waiters();
        out
    }

    fn stream<T>(&self, name: &str, change: impl FnOnce(&mut FakeStream) -> T) -> T {
        self.with(|w| change(w.streams.get_mut(name).expect("a fake stream")))
    }

    fn create(&self, class: &str) -> String {
        let name = format!("agent_{class}_stream");
        let subjects = vec![format!("agent.{class}.>")];
        self.with(|w| {
            w.streams
                .insert(name.clone(), FakeStream::new(&name, subjects))
        });
        name
    }

    fn publish(&self, stream: &str, subject: String) -> u64 {
        self.publish_with(stream, subject, None)
    }

    fn publish_with(
        &self,
        stream: &str,
        subject: String,
        headers: Option<async_nats::HeaderMap>,
    ) -> u64 {
        self.stream(stream, |s| {
            s.last_seq += 1;
            s.messages.insert(
                s.last_seq,
                Stored {
                    subject,
                    headers,
                    time: SystemTime::now(),
                },
            );
            s.last_seq
        })
    }

    /// Removes every message before `first` from the front (age, limits, a purge up to it).
    fn remove_before(&self, stream: &str, first: u64) {
        self.stream(stream, |s| {
            let kept = s.messages.split_off(&first);
            s.messages = kept;
            s.holes = s.holes.split_off(&s.first_seq());
            if s.messages.is_empty() {
                s.last_seq = s.last_seq.max(first - 1);
            }
        });
    }

    fn delete(&self, stream: &str, seq: u64) {
        self.stream(stream, |s| {
            if s.messages.remove(&seq).is_some() && seq > s.first_seq() {
                s.holes.insert(seq);
            } else {
                s.holes = s.holes.split_off(&s.first_seq());
            }
        });
    }

    fn consumers(&self) -> Vec<(String, Start)> {
        self.with(|w| w.consumers_created.clone())
    }
}

fn filter_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

struct FakeConsumer {
    fake: Fake,
    stream: String,
    filters: Vec<String>,
    /// The next stream sequence to look at.
    next: u64,
    delivered: u64,
}

impl FakeConsumer {
    fn matching(&self, world: &World, from: u64) -> Vec<(u64, Stored)> {
        world
            .streams
            .get(&self.stream)
            .map(|s| {
                s.messages
                    .range(from..)
                    .filter(|(_, m)| self.filters.iter().any(|f| filter_matches(f, &m.subject)))
                    .map(|(seq, m)| (*seq, m.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Consumer for FakeConsumer {
    async fn state(&mut self) -> Result<ConsumerState, JsApiError> {
        let silent = self.fake.world.lock().unwrap().silent;
        if silent {
            std::future::pending::<()>().await;
        }
        let world = self.fake.world.lock().unwrap();
        let pending = self.matching(&world, self.next).len() as u64;
        Ok(ConsumerState {
            pending,
            delivered: self.delivered,
        })
    }

    async fn next(&mut self) -> Option<Result<Delivery, JsApiError>> {
        loop {
            let changed = self.fake.changed.notified();
            {
                let world = self.fake.world.lock().unwrap();
                if !world.streams.contains_key(&self.stream) {
                    return Some(Err(JsApiError::Other("stream deleted".into())));
                }
                let matching = if world.held {
                    Vec::new()
                } else {
                    self.matching(&world, self.next)
                };
                if let Some((seq, stored)) = matching.first() {
                    self.next = seq + 1;
                    self.delivered += 1;
                    return Some(Ok(Delivery {
                        subject: stored.subject.clone().into(),
                        payload: Bytes::from_static(b"{}"),
                        headers: stored.headers.clone(),
                        stream_seq: *seq,
                        consumer_seq: self.delivered,
                        pending: matching.len() as u64 - 1,
                        arrived: 1,
                    }));
                }
            }
            changed.await;
        }
    }
}

fn state_of(name: &str, stream: &FakeStream) -> StreamState {
    let holes = stream.holes.range(stream.first_seq()..);
    StreamState {
        name: name.to_owned(),
        created: stream.created,
        leader: stream.leader.clone(),
        quorum: stream.quorum,
        first_seq: stream.first_seq(),
        last_seq: stream.last_seq,
        first_time: stream
            .messages
            .values()
            .next()
            .map_or(SystemTime::UNIX_EPOCH, |m| m.time),
        deleted: holes.clone().count() as u64,
        deleted_list: None,
        messages: stream.messages.len() as u64,
        bytes: stream
            .messages
            .values()
            .map(|m| m.subject.len() as u64)
            .sum(),
        max_message: 1_024,
        subjects: stream.subjects.clone(),
        sources: stream.sources.clone(),
        config: stream.config.clone(),
    }
}

impl Api for Fake {
    type Consumer = FakeConsumer;

    async fn stream_names(&self) -> Result<Vec<String>, JsApiError> {
        let world = self.world.lock().unwrap();
        match &world.listing {
            Some(error) => Err(error.clone()),
            None => Ok(world.streams.keys().cloned().collect()),
        }
    }

    async fn stream_state(&self, name: &str) -> Result<StreamState, JsApiError> {
        let silent = self.world.lock().unwrap().silent;
        if silent {
            std::future::pending::<()>().await;
        }
        let world = self.world.lock().unwrap();
        world
            .streams
            .get(name)
            .map(|s| state_of(name, s))
            .ok_or(JsApiError::NotFound)
    }

    async fn stream_state_with_deleted(&self, name: &str) -> Result<StreamState, JsApiError> {
        let mut state = self.stream_state(name).await?;
        self.with(|w| {
            w.deleted_lists += 1;
            let stream = &w.streams[name];
            state.deleted_list = Some(stream.holes.range(stream.first_seq()..).copied().collect());
        });
        Ok(state)
    }

    async fn streams_capturing(&self, subject: &str) -> Result<Vec<String>, JsApiError> {
        let world = self.world.lock().unwrap();
        Ok(world
            .streams
            .iter()
            .filter(|(_, s)| !super::filter_subjects(&s.subjects, subject).is_empty())
            .map(|(name, _)| name.clone())
            .collect())
    }

    async fn create_consumer(
        &self,
        stream: &str,
        filters: Vec<String>,
        start: Start,
    ) -> Result<FakeConsumer, JsApiError> {
        let next = {
            let mut world = self.world.lock().unwrap();
            world.consumers_created.push((stream.to_owned(), start));
            let s = world.streams.get(stream).ok_or(JsApiError::NotFound)?;
            match start {
                Start::All => s.first_seq(),
                Start::Sequence(seq) => seq,
                Start::Time(at) => s
                    .messages
                    .iter()
                    .find(|(_, m)| m.time >= at)
                    .map_or(s.last_seq + 1, |(seq, _)| *seq),
            }
        };
        Ok(FakeConsumer {
            fake: self.clone(),
            stream: stream.to_owned(),
            filters,
            next,
            delivered: 0,
        })
    }

    async fn create_stream(&self, config: Config) -> Result<StreamState, JsApiError> {
        let name = config.name.clone();
        let mut stream = FakeStream::new(&name, Vec::new());
        stream.config = config;
        let state = state_of(&name, &stream);
        self.with(|w| w.streams.insert(name, stream));
        Ok(state)
    }

    async fn update_stream(&self, config: Config) -> Result<StreamState, JsApiError> {
        let name = config.name.clone();
        self.stream(&name, |s| {
            s.config = config;
            Ok(state_of(&name, s))
        })
    }
}

/// One message the source applied: its subject and its `traceparent` header.
type AppliedMessage = (String, Option<String>);

/// What the source applied, in order.
#[derive(Clone, Default)]
struct Applied(Arc<Mutex<Vec<AppliedMessage>>>);

impl Sink for Applied {
    async fn apply(
        &self,
        subject: &str,
        _payload: &[u8],
        headers: Option<&async_nats::HeaderMap>,
        _arrived: u32,
    ) {
        let traceparent = headers
            .and_then(|headers| headers.get("traceparent"))
            .map(|value| value.as_str().to_owned());
        self.0
            .lock()
            .unwrap()
            .push((subject.to_owned(), traceparent));
    }
}

impl Applied {
    fn subjects(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(subject, _)| subject.clone())
            .collect()
    }

    fn traceparents(&self) -> Vec<Option<String>> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|(_, traceparent)| traceparent.clone())
            .collect()
    }
}

struct Harness {
    fake: Fake,
    coverage: Coverage,
    freshness: Freshness,
    applied: Applied,
    source: JetStreamSource<Fake, Applied>,
    stop: CancellationToken,
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn settings(partitioned: Option<(Partitioning, StreamSettings)>) -> JetStreamSettings {
    JetStreamSettings {
        streams: "agent_*_stream".into(),
        replay: LAG + Duration::from_secs(3),
        subject: DISPLAY.into(),
        partitioned,
    }
}

fn harness(fake: Fake, partitioned: Option<(Partitioning, StreamSettings)>) -> Harness {
    let coverage = Coverage::new(LAG);
    let freshness = Freshness::new(coverage.clone(), Timing::for_lag(LAG).silence);
    let tracker = Tracker::new(
        coverage.clone(),
        freshness.clone(),
        Arc::new(SourceMetrics::register(
            &mut crate::metrics::Registrar::new(),
        )),
        Timing::for_lag(LAG),
        None,
    );
    let applied = Applied::default();
    let source = JetStreamSource::new(
        fake.clone(),
        applied.clone(),
        tracker,
        settings(partitioned),
    );
    Harness {
        fake,
        coverage,
        freshness,
        applied,
        source,
        stop: CancellationToken::new(),
    }
}

impl Harness {
    fn run(&self) {
        tokio::spawn(self.source.clone().run(self.stop.clone()));
    }

    /// Whether an answer may come from memory now (the rule).
    fn caught_up(&self) -> bool {
        self.freshness.serves()
    }

    /// Lets the source work for `d` of the paused clock.
    async fn pass(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    /// Started, caught up, with `n` display events of `stream` applied.
    async fn running(class: &str, n: u64) -> (Self, String) {
        let fake = Fake::default();
        let stream = fake.create(class);
        let h = harness(fake, None);
        h.run();
        h.pass(Duration::from_millis(100)).await;
        for i in 0..n {
            h.fake.publish(&stream, display_subject(class, i));
        }
        h.pass(Duration::from_secs(2)).await;
        assert!(h.coverage.is_live());
        assert!(h.caught_up());
        assert_eq!(h.applied.subjects().len() as u64, n);
        (h, stream)
    }
}

/// Runs `fault` and returns whether the gap generation moved.
async fn is_gap(h: &Harness, fault: impl FnOnce(&Fake)) -> bool {
    let before = h.coverage.gaps();
    fault(&h.fake);
    h.pass(Duration::from_secs(2)).await;
    h.coverage.gaps() != before
}

#[tokio::test(start_paused = true)]
async fn a_quiet_stream_is_no_gap_and_stays_caught_up() {
    let (h, stream) = Harness::running("A", 3).await;
    assert!(
        !is_gap(&h, |f| {
            f.publish(&stream, display_subject("A", 9));
        })
        .await
    );
    assert!(h.caught_up());
    assert!(h.freshness.covered_through().is_some());
}

#[tokio::test(start_paused = true)]
async fn messages_that_age_out_unread_while_the_worker_is_frozen_are_a_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    let gaps = h.coverage.gaps();
    // Frozen: nothing delivered, no check answers; meanwhile one event is stored and expires.
    h.fake.with(|w| {
        w.held = true;
        w.silent = true;
    });
    let seq = h.fake.publish(&stream, display_subject("A", 10));
    h.fake.remove_before(&stream, seq + 1);
    h.pass(Duration::from_secs(3)).await;
    assert!(
        !h.caught_up(),
        "silence is behind: nothing is served from memory"
    );
    h.fake.with(|w| {
        w.held = false;
        w.silent = false;
    });
    h.pass(Duration::from_secs(2)).await;
    assert_ne!(h.coverage.gaps(), gaps, "the expired event is a gap");
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_purge_of_unread_messages_is_a_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    assert!(
        is_gap(&h, |f| {
            f.with(|w| w.held = true);
            let last = f.publish(&stream, display_subject("A", 10));
            f.remove_before(&stream, last + 1);
            f.with(|w| w.held = false);
        })
        .await
    );
}

#[tokio::test(start_paused = true)]
async fn a_burst_past_max_msgs_is_a_gap_though_the_consumer_delivers_without_a_hole() {
    let (h, stream) = Harness::running("A", 1).await;
    assert!(
        is_gap(&h, |f| {
            f.with(|w| w.held = true);
            let mut last = 0;
            for i in 0..200 {
                last = f.publish(&stream, display_subject("A", 100 + i));
            }
            // max_msgs 100: the oldest half is gone before the consumer reached it.
            f.remove_before(&stream, last - 99);
            f.with(|w| w.held = false);
        })
        .await
    );
    assert_eq!(h.applied.subjects().len(), 101);
}

#[tokio::test(start_paused = true)]
async fn a_deleted_unread_message_is_a_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    assert!(
        is_gap(&h, |f| {
            f.with(|w| w.held = true);
            let seq = f.publish(&stream, display_subject("A", 10));
            f.publish(&stream, display_subject("A", 11));
            f.delete(&stream, seq);
            f.with(|w| w.held = false);
        })
        .await
    );
}

#[tokio::test(start_paused = true)]
async fn filtered_out_messages_read_through_may_age_out_without_a_gap() {
    let (h, stream) = Harness::running("A", 1).await;
    let mut last = 0;
    for i in 0..5 {
        last = h.fake.publish(&stream, control_subject("A", i));
    }
    // Read through by a check with nothing pending, then they age out.
    h.pass(Duration::from_secs(2)).await;
    assert!(!is_gap(&h, |f| f.remove_before(&stream, last + 1)).await);
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_new_leader_is_a_gap_and_the_consumer_continues() {
    let (h, stream) = Harness::running("A", 3).await;
    h.fake.stream(&stream, |s| s.leader = Some("n1".into()));
    h.pass(Duration::from_secs(2)).await;
    assert!(is_gap(&h, |f| f.stream(&stream, |s| s.leader = Some("n2".into()))).await);
    h.fake.publish(&stream, display_subject("A", 20));
    h.pass(Duration::from_secs(2)).await;
    assert_eq!(
        h.applied.subjects().len(),
        4,
        "nothing delivered twice or lost"
    );
}

#[tokio::test(start_paused = true)]
async fn a_recreated_stream_is_a_gap_and_is_consumed_from_its_start() {
    let (h, stream) = Harness::running("A", 3).await;
    assert!(
        is_gap(&h, |f| {
            f.create("A");
            f.stream(&stream, |s| s.created += Duration::from_secs(60));
            f.publish(&stream, display_subject("A", 30));
        })
        .await
    );
    assert_eq!(h.applied.subjects().last(), Some(&display_subject("A", 30)));
    assert!(
        h.fake
            .consumers()
            .iter()
            .any(|(_, start)| *start == Start::All)
    );
}

#[tokio::test(start_paused = true)]
async fn a_deleted_stream_is_a_gap_and_with_none_left_the_source_fails_closed() {
    let (h, stream) = Harness::running("A", 3).await;
    assert!(
        is_gap(&h, |f| {
            f.with(|w| w.streams.remove(&stream));
        })
        .await
    );
    assert!(h.coverage.catch_up().no_stream());
    assert!(!h.caught_up());
    h.fake.create("A");
    h.pass(Duration::from_secs(3)).await;
    assert!(!h.coverage.catch_up().no_stream());
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn no_matching_stream_or_no_jetstream_fails_closed_until_one_is_found() {
    let fake = Fake::default();
    fake.create("A");
    fake.with(|w| w.listing = Some(JsApiError::Unavailable("no responders".into())));
    let h = harness(fake, None);
    h.run();
    h.pass(Duration::from_secs(3)).await;
    assert!(h.coverage.catch_up().no_stream(), "JetStream unavailable");
    assert!(
        !h.coverage.is_live(),
        "nothing is complete: reads go to the store"
    );

    h.fake.with(|w| {
        w.listing = None;
        w.streams.clear();
        w.streams.insert(
            "OTHER".into(),
            FakeStream::new("OTHER", vec!["other.>".into()]),
        );
    });
    h.pass(Duration::from_secs(3)).await;
    assert!(h.coverage.catch_up().no_stream(), "no stream matches");
    assert!(!h.coverage.is_live());

    h.fake.create("A");
    h.pass(Duration::from_secs(3)).await;
    assert!(!h.coverage.catch_up().no_stream());
    assert!(h.coverage.is_live());
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_new_stream_is_a_gap_and_is_consumed_from_its_first_message() {
    let (h, _) = Harness::running("A", 1).await;
    assert!(
        is_gap(&h, |f| {
            let b = f.create("B");
            // Published before the worker's next listing.
            f.publish(&b, display_subject("B", 1));
            f.publish(&b, display_subject("B", 2));
        })
        .await
    );
    let applied = h.applied.subjects();
    assert!(applied.contains(&display_subject("B", 1)));
    assert!(applied.contains(&display_subject("B", 2)));
}

#[tokio::test(start_paused = true)]
async fn a_matching_stream_without_display_events_is_one_gap_not_one_a_listing() {
    let (h, _) = Harness::running("A", 1).await;
    let gaps = h.coverage.gaps();
    h.fake.with(|w| {
        w.streams.insert(
            "agent_X_stream".into(),
            FakeStream::new("agent_X_stream", vec!["other.>".into()]),
        )
    });
    h.pass(Duration::from_secs(2)).await;
    let after_first = h.coverage.gaps();
    assert_ne!(after_first, gaps, "found after the start: a gap");
    h.pass(Duration::from_secs(5)).await;
    assert_eq!(
        h.coverage.gaps(),
        after_first,
        "not taken for a new stream again"
    );
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_silent_stream_is_behind_within_the_bound_and_catches_up_after_a_new_consumer() {
    let (h, _) = Harness::running("A", 1).await;
    let consumers = h.fake.consumers().len();
    h.fake.with(|w| w.silent = true);
    h.pass(LAG).await;
    assert!(!h.caught_up(), "not confirmed for the bound: behind");
    h.fake.with(|w| w.silent = false);
    h.pass(Duration::from_secs(3)).await;
    assert!(h.caught_up());
    assert!(
        h.fake.consumers().len() > consumers,
        "resumed by a new consumer"
    );
}

#[tokio::test(start_paused = true)]
async fn a_leader_that_lost_its_quorum_is_behind_within_the_bound() {
    let (h, stream) = Harness::running("A", 1).await;
    h.fake.stream(&stream, |s| s.quorum = false);
    h.pass(LAG).await;
    assert!(!h.caught_up(), "it answers, but may store nothing: behind");
    h.fake.stream(&stream, |s| s.quorum = true);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_resumes_every_consumer_and_is_no_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    let gaps = h.coverage.gaps();
    h.coverage.catch_up().connection_lost();
    assert!(
        !h.coverage.catch_up().lanes_caught_up(),
        "behind (readiness) until a new consumer has caught up"
    );
    h.fake.publish(&stream, display_subject("A", 40));
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
    assert!(h.coverage.catch_up().lanes_caught_up());
    assert_eq!(h.coverage.gaps(), gaps);
    assert!(
        h.fake
            .consumers()
            .iter()
            .any(|(_, start)| *start == Start::Sequence(4)),
        "resumed after the last message applied"
    );
}

fn partitioned() -> (Partitioning, StreamSettings) {
    (
        Partitioning {
            partitions: 2,
            partition: 0,
            prefix: "chv".into(),
        },
        StreamSettings {
            name: "CHAT_HISTORY_VIEW".into(),
            create: true,
            max_age: Duration::from_secs(300),
            max_bytes: None,
            replicas: 1,
        },
    )
}

/// The start sequence of `class_stream`'s source in the partitioned stream.
fn source_start(fake: &Fake, class_stream: &str) -> Option<u64> {
    fake.with(|w| {
        w.streams["CHAT_HISTORY_VIEW"]
            .config
            .sources
            .iter()
            .flatten()
            .find(|s| s.name == class_stream)
            .and_then(|s| s.start_sequence)
    })
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_class_stream_created_after_the_start_is_sourced_from_its_first_message() {
    let fake = Fake::default();
    let a = fake.create("A");
    fake.publish(&a, display_subject("A", 1));
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    assert!(h.coverage.is_live());
    assert_eq!(
        source_start(&h.fake, &a),
        Some(2),
        "an older stream: from now on"
    );
    let gaps = h.coverage.gaps();
    let b = h.fake.create("B");
    h.fake.publish(&b, display_subject("B", 1));
    h.pass(Duration::from_secs(3)).await;
    assert_eq!(
        source_start(&h.fake, &b),
        Some(1),
        "a new stream: from its first message"
    );
    assert_ne!(
        h.coverage.gaps(),
        gaps,
        "its class before it existed: a gap"
    );
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_stalled_source_or_an_unsourced_class_stream_keeps_the_worker_behind() {
    let fake = Fake::default();
    let a = fake.create("A");
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    let healthy = SourceState {
        name: a.clone(),
        lag: 0,
        active: Some(Duration::from_millis(500)),
    };
    h.fake
        .stream("CHAT_HISTORY_VIEW", |s| s.sources = vec![healthy.clone()]);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
    h.fake.stream("CHAT_HISTORY_VIEW", |s| {
        s.sources = vec![SourceState {
            active: Some(Duration::from_secs(6)),
            ..healthy.clone()
        }];
    });
    h.pass(Duration::from_secs(2)).await;
    assert!(!h.caught_up(), "a stalled source");
    assert!(h.coverage.catch_up().is_behind(&Lane::Stalled(a.clone())));
    h.fake
        .stream("CHAT_HISTORY_VIEW", |s| s.sources = vec![healthy.clone()]);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up(), "recovered");
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_class_stream_without_a_quorum_keeps_the_worker_behind_until_it_has_one() {
    let fake = Fake::default();
    let a = fake.create("A");
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
    h.fake.stream(&a, |s| s.quorum = false);
    h.pass(Duration::from_secs(2)).await;
    assert!(!h.caught_up(), "upstream may store nothing: behind");
    h.fake.stream(&a, |s| s.quorum = true);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_class_stream_the_operator_has_not_sourced_keeps_the_worker_behind() {
    let fake = Fake::default();
    let a = fake.create("A");
    let (partitioning, mut settings) = partitioned();
    settings.create = false;
    fake.create_stream(settings.config(vec![partitioning.source(&a, SystemTime::now(), 1)]))
        .await
        .unwrap();
    let h = harness(fake, Some((partitioning.clone(), settings)));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
    let b = h.fake.create("B");
    h.pass(Duration::from_secs(2)).await;
    assert!(h.coverage.catch_up().is_behind(&Lane::Unsourced(b.clone())));
    assert!(!h.caught_up());
    assert!(
        h.coverage.catch_up().blocked(),
        "a read does not wait for it"
    );
    // The operator adds it.
    h.fake.stream("CHAT_HISTORY_VIEW", |s| {
        s.config
            .sources
            .get_or_insert_with(Vec::new)
            .push(partitioning.source(&b, SystemTime::now(), 1));
    });
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn partitioned_class_streams_not_read_because_the_listing_fails_keep_the_worker_behind() {
    let fake = Fake::default();
    fake.create("A");
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
    // The listing times out (a meta leader lost with the killed server): no round reads the class streams.
    h.fake
        .with(|w| w.listing = Some(JsApiError::Other("timed out".into())));
    h.pass(LAG).await;
    assert!(!h.caught_up(), "upstream unconfirmed for the bound: behind");
    h.fake.with(|w| w.listing = None);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_stored_message_reaches_the_sink_with_its_headers() {
    let (h, stream) = Harness::running("A", 1).await;
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", traceparent);
    h.fake
        .publish_with(&stream, display_subject("A", 1), Some(headers));
    h.pass(Duration::from_secs(1)).await;
    assert_eq!(
        h.applied.traceparents(),
        [None, Some(traceparent.to_owned())]
    );
}

// ---------------------------------------------------------------------------------------------------------------
// The serving rule: only what checks prove applied moves the covered-through instant ([design 2.1](../../docs/design.md#2.1)).

#[tokio::test(start_paused = true)]
async fn a_check_that_finds_messages_pending_proves_nothing_so_a_consumer_behind_serves_nothing_from_memory()
 {
    let (h, stream) = Harness::running("A", 3).await;
    let covered = h.freshness.covered_stamp();
    // The consumer falls behind (a burst, a slow worker): every check answers, but finds messages pending.
    h.fake.with(|w| w.held = true);
    h.fake.publish(&stream, display_subject("A", 10));
    h.pass(Duration::from_millis(1_500)).await;
    assert!(
        h.caught_up(),
        "within the window: what it lacks was stored less than the bound ago"
    );
    assert!(
        h.coverage.catch_up().lanes_caught_up(),
        "its checks answer: not a lane behind"
    );
    h.pass(Duration::from_secs(1)).await;
    assert!(
        !h.caught_up(),
        "checks that found the message pending renewed nothing: an answer now could lack it past the bound"
    );
    assert!(h.freshness.covered_stamp() <= covered.map(|c| c.plus(LAG)));
    // Caught up again: the next check proves it.
    h.fake.with(|w| w.held = false);
    h.pass(Duration::from_millis(600)).await;
    assert!(h.caught_up());
    assert_eq!(h.applied.subjects().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn the_covered_instant_is_what_the_serving_rule_judges() {
    let (h, _) = Harness::running("A", 1).await;
    // Idle and drained: every check proves the moment it asked, a quarter of the window apart.
    for _ in 0..8 {
        h.pass(Duration::from_millis(300)).await;
        let covered = h.freshness.covered_stamp().unwrap();
        let age = h.coverage.now().nanos() - covered.nanos();
        assert!(age <= h.freshness.prove_every().as_nanos() as u64 + 1_000_000);
        assert!(h.caught_up());
    }
}

/// A class stream with `discard: new` and room for `max_msgs` messages.
fn discard_new(h: &Harness, stream: &str, max_msgs: i64) {
    h.fake.stream(stream, |s| {
        s.config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
        s.config.max_messages = max_msgs;
    });
}

fn refusing(h: &Harness) -> Vec<(String, super::Refusal)> {
    h.coverage.catch_up().refusing()
}

#[tokio::test(start_paused = true)]
async fn a_stream_full_with_discard_new_is_refusing_until_it_has_room_again_then_a_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    discard_new(&h, &stream, 10);
    h.pass(Duration::from_secs(1)).await;
    assert!(refusing(&h).is_empty(), "room for 7 more");
    for i in 0..7 {
        h.fake.publish(&stream, display_subject("A", 100 + i));
    }
    let gaps = h.coverage.gaps();
    h.pass(Duration::from_secs(1)).await;
    assert_eq!(refusing(&h), vec![(stream.clone(), super::Refusal::Full)]);
    assert!(
        !h.caught_up(),
        "nothing from memory: its class's next events are refused"
    );
    assert!(
        h.coverage.catch_up().blocked(),
        "a read does not wait for it"
    );
    assert_eq!(
        h.coverage.gaps(),
        gaps,
        "no gap while it refuses: views are held instead"
    );
    // Its oldest messages age out: room again. What was refused meanwhile is in no stream: a gap.
    h.fake.remove_before(&stream, 6);
    h.pass(Duration::from_secs(1)).await;
    assert!(refusing(&h).is_empty());
    assert_ne!(h.coverage.gaps(), gaps);
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_sealed_stream_is_refusing() {
    let (h, stream) = Harness::running("A", 1).await;
    h.fake.stream(&stream, |s| s.config.sealed = true);
    h.pass(Duration::from_secs(1)).await;
    assert_eq!(refusing(&h), vec![(stream, super::Refusal::Sealed)]);
    assert!(!h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_stream_whose_subjects_no_longer_cover_its_display_events_is_refusing_and_widened_ones_a_gap()
 {
    let (h, stream) = Harness::running("A", 1).await;
    // Edited to capture only control events: display events of class A reach no stream.
    h.fake.stream(&stream, |s| {
        s.subjects = vec!["agent.A.*.*.*.*.control.*.*".into()]
    });
    h.pass(Duration::from_secs(1)).await;
    assert_eq!(
        refusing(&h),
        vec![(stream.clone(), super::Refusal::Subjects)]
    );
    assert!(!h.caught_up());
    // Edited back, wider than before.
    let gaps = h.coverage.gaps();
    h.fake
        .stream(&stream, |s| s.subjects = vec!["agent.>".into()]);
    h.pass(Duration::from_secs(2)).await;
    assert!(refusing(&h).is_empty());
    assert_ne!(
        h.coverage.gaps(),
        gaps,
        "what it refused meanwhile, and subjects passed unread"
    );
    h.fake.publish(&stream, display_subject("A", 7));
    h.pass(Duration::from_secs(1)).await;
    assert!(h.applied.subjects().contains(&display_subject("A", 7)));
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_stream_the_pattern_misses_that_captures_display_events_is_refusing() {
    let (h, _) = Harness::running("A", 1).await;
    h.fake.with(|w| {
        w.streams.insert(
            "events_B".into(),
            FakeStream::new("events_B", vec!["agent.B.>".into()]),
        )
    });
    h.pass(Duration::from_secs(2)).await;
    assert_eq!(
        refusing(&h),
        vec![("events_B".to_owned(), super::Refusal::Unmatched)]
    );
    assert!(!h.caught_up());
    h.fake.with(|w| w.streams.remove("events_B"));
    h.pass(Duration::from_secs(2)).await;
    assert!(refusing(&h).is_empty());
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn a_deletion_masked_by_the_front_passing_an_older_hole_is_a_gap() {
    let (h, stream) = Harness::running("A", 3).await;
    // An old hole right behind the front: 1, 2, (3 deleted), 4 -- all read.
    let four = h.fake.publish(&stream, display_subject("A", 4));
    h.fake.delete(&stream, four - 1);
    h.pass(Duration::from_secs(1)).await;
    let gaps = h.coverage.gaps();
    let lists = h.fake.with(|w| w.deleted_lists);
    // The consumer behind: an unread message is deleted while the front passes the old hole. The count of holes
    // stays 1.
    h.fake.with(|w| w.held = true);
    let unread = h.fake.publish(&stream, display_subject("A", 5));
    h.fake.publish(&stream, display_subject("A", 6));
    h.fake.delete(&stream, unread);
    h.fake.remove_before(&stream, four);
    let deleted = h
        .fake
        .with(|w| state_of(&stream, &w.streams[&stream]).deleted);
    assert_eq!(deleted, 1, "masked: the count did not change");
    h.pass(Duration::from_secs(1)).await;
    assert_ne!(
        h.coverage.gaps(),
        gaps,
        "found by the list of deleted sequences"
    );
    assert!(h.fake.with(|w| w.deleted_lists) > lists);
    // Nothing more deleted: no gap again, and no list asked while the count is explained.
    h.fake.with(|w| w.held = false);
    h.pass(Duration::from_secs(1)).await;
    let gaps = h.coverage.gaps();
    let lists = h.fake.with(|w| w.deleted_lists);
    h.pass(Duration::from_secs(3)).await;
    assert_eq!(h.coverage.gaps(), gaps);
    assert_eq!(h.fake.with(|w| w.deleted_lists), lists);
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_class_stream_that_removes_what_its_active_source_has_not_copied_is_a_gap() {
    let fake = Fake::default();
    let a = fake.create("A");
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    let source = |lag| SourceState {
        name: a.clone(),
        lag,
        active: Some(Duration::from_millis(200)),
    };
    h.fake
        .stream("CHAT_HISTORY_VIEW", |s| s.sources = vec![source(0)]);
    h.pass(Duration::from_secs(1)).await;
    assert!(h.caught_up());
    // A burst: the source is active but behind (lag), and nothing it would copy is proved applied.
    for i in 0..50 {
        h.fake.publish(&a, display_subject("A", i));
    }
    h.fake
        .stream("CHAT_HISTORY_VIEW", |s| s.sources = vec![source(50)]);
    let gaps = h.coverage.gaps();
    h.pass(Duration::from_secs(3)).await;
    assert!(
        !h.caught_up(),
        "what the class stream stored is not known copied: nothing from memory past the window"
    );
    assert_eq!(h.coverage.gaps(), gaps, "nothing lost yet");
    // Its max_msgs (20) removes the oldest 30 before the source copied them.
    h.fake.remove_before(&a, 31);
    h.pass(Duration::from_secs(1)).await;
    assert_ne!(h.coverage.gaps(), gaps, "removed before copied: a gap");
    // The source catches up: its class stream is covered again.
    h.fake
        .stream("CHAT_HISTORY_VIEW", |s| s.sources = vec![source(0)]);
    h.pass(Duration::from_secs(2)).await;
    assert!(h.caught_up());
}

#[tokio::test(start_paused = true)]
async fn partitioned_a_class_stream_whose_source_copies_in_time_loses_nothing() {
    let fake = Fake::default();
    let a = fake.create("A");
    let h = harness(fake, Some(partitioned()));
    h.run();
    h.pass(Duration::from_secs(2)).await;
    h.fake.stream("CHAT_HISTORY_VIEW", |s| {
        s.sources = vec![SourceState {
            name: a.clone(),
            lag: 0,
            active: Some(Duration::from_millis(200)),
        }];
    });
    let gaps = h.coverage.gaps();
    for round in 0..5 {
        for i in 0..10 {
            h.fake.publish(&a, display_subject("A", round * 10 + i));
        }
        // Copied (lag 0 at a contact after a round read them), and known so before the next round read the class
        // stream: their removal after that is no loss.
        h.pass(Duration::from_millis(2_500)).await;
        h.fake.remove_before(&a, round * 10 + 6);
        h.pass(Duration::from_millis(500)).await;
        assert!(h.caught_up());
    }
    assert_eq!(h.coverage.gaps(), gaps);
}
