//! P5's breakdown: what a thread's view holds, part by part, against the bytes its events carried as published
//! (subject + JSON payload), for P5's mix (a marker and 9 chunks of about 100 bytes on one display) and for aihub's
//! realistic mix (P7's turns: markers, chunks of a few words, stops with output messages, HITL).
//!
//! In-process, on one OS thread of its own, with the bench's counting allocator (jemalloc, as the worker's:
//! [`crate::counting`]): the bytes each step leaves allocated are measured, not estimated. The steps, for `THREADS`
//! threads of each mix:
//! 1. the delivery keys alone (parsed from the subjects and kept);
//! 2. the decoded events (keys and bodies);
//! 3. the events inserted into views (the views' containers: event vectors, order, index), and once more into
//!    views as a hydration leaves them (covered displays);
//! 4. the events applied through the worker's own cache ([`ViewCache::apply`], no eviction): the entries and
//!    moka's share on top of the views; moka's share alone from a moka cache of the same shape holding a small
//!    value per thread.
//!
//! The split of the views' containers into parts comes from [`ThreadView::footprint`] (capacities), checked
//! against the allocator's total.

use std::sync::Arc;
use std::time::Duration;

use chat_history_view::cache::{CacheSetup, Form, HistoryBody, Transcript, ViewCache};
use chat_history_view::config::Config;
use chat_history_view::coverage::Coverage;
use chat_history_view::decode::{Decoded, ViewEvent, decode_payload};
use chat_history_view::freshness::Freshness;
use chat_history_view::project::Identity;
use chat_history_view::startup::Metrics;
use chat_history_view::store::Store;
use chat_history_view::subject::DeliveryKey;
use chat_history_view::view::{Footprint, ThreadView};
use serde_json::Value;
use test_support::turns::{Conversation, PRIMARY};

use crate::counting::held;
use crate::data::Message;
use crate::p5_memory::{self, EVENTS_PER_THREAD};
use crate::report::Row;

/// Threads of each mix measured.
const THREADS: usize = 2_000;
/// Turns of a P7 thread.
const P7_TURNS: usize = 10;

/// One mix's messages, thread by thread.
pub struct Mix {
    pub name: &'static str,
    pub threads: Vec<Vec<Message>>,
    /// The identity its reads name (aihub's assistant paths name the primary agent).
    pub reader: Option<Identity>,
}

impl Mix {
    /// P5's: a marker and 9 chunks of about 100 bytes on one display.
    pub fn p5() -> Self {
        let threads = (0..THREADS)
            .map(|t| {
                (0..EVENTS_PER_THREAD)
                    .map(|seq| p5_memory::message(t * EVENTS_PER_THREAD + seq))
                    .collect()
            })
            .collect();
        Self {
            name: "P5's mix",
            threads,
            reader: None,
        }
    }

    /// P7's turns: aihub's realistic mix.
    pub fn p7() -> Self {
        let threads = (0..THREADS)
            .map(|t| {
                let mut conversation = Conversation::new(format!("p7-thread-{t:05}"));
                (0..P7_TURNS)
                    .flat_map(|_| conversation.next_turn())
                    .map(|row: Value| Message::from_row(&row))
                    .collect()
            })
            .collect();
        Self {
            name: "P7's mix",
            threads,
            reader: Some(Identity {
                agent_class: PRIMARY.0.to_owned(),
                agent_id: PRIMARY.1.to_owned(),
            }),
        }
    }

    fn events(&self) -> usize {
        self.threads.iter().map(Vec::len).sum()
    }

    fn messages(&self) -> impl Iterator<Item = &Message> {
        self.threads.iter().flatten()
    }
}

/// What one mix's threads hold, in bytes (totals over the mix's threads).
#[derive(Debug, Default, Clone)]
pub struct Breakdown {
    pub threads: usize,
    pub events: usize,
    /// Subject + JSON payload, as published.
    pub payload: usize,
    /// Measured: the keys alone; the decoded events (keys + bodies); the views' containers on top of the events
    /// (live, and as a hydration leaves them).
    pub keys: usize,
    pub decoded: usize,
    pub views: usize,
    pub hydrated: usize,
    /// Measured: the cache on top of the decoded events (views, entries, moka).
    pub cache: usize,
    /// Measured: moka's own share of an entry (a same-shaped moka cache, less its keys and values).
    pub moka: usize,
    /// Measured: the history bodies a read of each view keeps, and the feed's transcripts; the messages in them.
    pub answers: usize,
    pub transcripts: usize,
    pub messages: usize,
    /// What the views say they hold, by part (summed).
    pub footprint: Footprint,
    /// What the cache charged for the threads (its weighted size).
    pub charged: u64,
}

impl Breakdown {
    pub fn per_event(&self, bytes: usize) -> f64 {
        bytes as f64 / self.events as f64
    }

    pub fn per_thread(&self, bytes: usize) -> f64 {
        bytes as f64 / self.threads as f64
    }

    /// Held per event: the events and the views' containers, less the views' fixed part.
    pub fn held_per_event(&self) -> f64 {
        self.per_event(self.decoded + self.views - self.threads * self.footprint_fixed())
    }

    fn footprint_fixed(&self) -> usize {
        std::mem::size_of::<ThreadView>()
    }

    /// Per thread beyond moka's entry and the events: the entry with its view's struct and empty containers.
    pub fn fixed_per_thread(&self) -> f64 {
        self.per_thread(
            self.cache - self.decoded - self.views + self.threads * self.footprint_fixed()
                - self.moka,
        )
    }
}

/// Measures `mix` on an OS thread of its own (the counting allocator counts per thread).
pub fn measure(mix: Mix, mongo_uri: String) -> Breakdown {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the breakdown");
        runtime.block_on(breakdown(&mix, &mongo_uri))
    })
    .join()
    .expect("the breakdown's thread")
}

fn decode(message: &Message) -> ViewEvent {
    let key = DeliveryKey::parse_subject(&message.subject).expect("a display-event subject");
    match decode_payload(key, &message.payload).expect("a JSON payload") {
        Decoded::Event(event) => event,
        Decoded::Irrelevant => panic!("the mixes hold only relevant events"),
    }
}

async fn breakdown(mix: &Mix, mongo_uri: &str) -> Breakdown {
    let events = mix.events();
    let mut out = Breakdown {
        threads: mix.threads.len(),
        events,
        payload: mix
            .messages()
            .map(|m| m.subject.len() + m.payload.len())
            .sum(),
        ..Breakdown::default()
    };

    // 1. The keys alone.
    let mut keys = Vec::with_capacity(events);
    let before = held();
    keys.extend(
        mix.messages()
            .map(|m| DeliveryKey::parse_subject(&m.subject).expect("a display-event subject")),
    );
    out.keys = delta(before);
    drop(keys);

    // 2. The decoded events, in one vector (freed only after the views are measured).
    let mut decoded: Vec<ViewEvent> = Vec::with_capacity(events);
    let before = held();
    decoded.extend(mix.messages().map(decode));
    out.decoded = delta(before);

    // 3. The views: live, then as a hydration leaves them (every display with a marker covered).
    let mut views: Vec<ThreadView> = Vec::with_capacity(mix.threads.len());
    let mut decoded = decoded.into_iter();
    let before = held();
    for messages in &mix.threads {
        let mut view = ThreadView::new();
        for event in decoded.by_ref().take(messages.len()) {
            view.insert(event);
        }
        views.push(view);
    }
    // The vector of views was allocated before: the views' structs count as their fixed part.
    out.views = delta(before) + views.len() * std::mem::size_of::<ThreadView>();
    drop(decoded);
    out.footprint = sum(views.iter().map(ThreadView::footprint));

    // What a read keeps: the history body it answered with, and the feed's transcript, for the mix's reader.
    let mut answers = Vec::with_capacity(views.len());
    let mut transcripts = Vec::with_capacity(views.len());
    let before = held();
    for (view, messages) in views.iter_mut().zip(&mix.threads) {
        let projection = view.project(mix.reader.as_ref());
        let thread = DeliveryKey::parse_subject(&messages[0].subject).expect("a subject");
        answers.push(HistoryBody::render(
            thread.thread_id(),
            view,
            &projection,
            &Vec::new(),
        ));
        out.messages += projection.history.messages.len();
        drop(thread);
        let at = held();
        transcripts.push(Transcript::new(&projection));
        out.transcripts += delta(at);
    }
    out.answers = delta(before) - out.transcripts;
    drop((answers, transcripts));
    let before = held();
    let hydrated: Vec<ThreadView> = views
        .into_iter()
        .map(|view| {
            let displays: Vec<String> = view
                .events()
                .filter(|e| e.is_marker())
                .map(|e| e.key.display_id().to_owned())
                .collect();
            ThreadView::hydrated(Vec::new(), displays, view, 0).0
        })
        .collect();
    out.hydrated = out.views + delta(before);
    drop(hydrated);

    // 4. Through the worker's cache, with no eviction.
    let config = Config::try_load_from(["breakdown", "--mongodb-uri", mongo_uri])
        .expect("the breakdown's settings parse");
    let metrics = Metrics::new();
    let coverage = Coverage::new(config.bounds.persist_lag);
    let store = Store::connect(
        &config.store,
        config.bounds,
        false,
        std::sync::Arc::clone(&metrics.store),
        coverage.clone(),
    )
    .await
    .expect("a store client (never asked)");
    let mut settings = config.cache.clone();
    settings.max_bytes = 1 << 40;
    let views = ViewCache::new(
        store,
        metrics.views(),
        coverage.clone(),
        Freshness::new(coverage, config.bounds.persist_lag),
        CacheSetup {
            settings,
            shadow: config.shadow.clone(),
            bounds: config.bounds,
            gap_window: config.nats.gap_window(),
        },
    );
    let mut decoded: Vec<ViewEvent> = mix.messages().map(decode).collect();
    views.report_size().await;
    let before = held();
    for event in decoded.drain(..) {
        views.apply(event, None).await;
    }
    views.report_size().await;
    out.cache = delta(before) + out.decoded;
    drop(decoded);
    out.charged = metrics
        .render()
        .lines()
        .find_map(|line| {
            line.strip_prefix("history_view_cache_weighted_bytes ")?
                .parse::<f64>()
                .ok()
        })
        .expect("the cache's weighted size") as u64;

    // Moka's own share: a cache of the same shape holding one small value per thread.
    let ids: Vec<String> = mix
        .threads
        .iter()
        .map(|t| {
            DeliveryKey::parse_subject(&t[0].subject)
                .expect("a subject")
                .thread_id()
                .to_owned()
        })
        .collect();
    let moka: moka::future::Cache<String, Arc<u64>, foldhash::quality::RandomState> =
        moka::future::Cache::builder()
            .max_capacity(1 << 40)
            .weigher(|_: &String, _: &Arc<u64>| 1)
            .time_to_idle(Duration::from_secs(600))
            .build_with_hasher(foldhash::quality::RandomState::default());
    let before = held();
    for id in &ids {
        moka.get_with_by_ref(id.as_str(), async { Arc::new(0) })
            .await;
    }
    moka.run_pending_tasks().await;
    // Less the keys' strings and the values, which the cache's own entries replace with theirs.
    let values: usize = ids
        .iter()
        .map(|id| id.len().next_multiple_of(8).max(8) + 24)
        .sum();
    out.moka = delta(before).saturating_sub(values);
    drop(moka);
    out
}

fn delta(before: isize) -> usize {
    usize::try_from(held() - before).unwrap_or(0)
}

fn sum(footprints: impl Iterator<Item = Footprint>) -> Footprint {
    footprints.fold(Footprint::default(), |a, b| Footprint {
        fixed: a.fixed + b.fixed,
        events: a.events + b.events,
        keys: a.keys + b.keys,
        bodies: a.bodies + b.bodies,
        order: a.order + b.order,
        index: a.index + b.index,
        displays: a.displays + b.displays,
        publishers: a.publishers + b.publishers,
    })
}

/// How far a charge may lie from the bytes it stands for (the "within 15%").
pub const CHARGE_TOLERANCE: f64 = 0.15;

/// The breakdown's rows for both mixes.
pub fn rows(mongo_uri: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for mix in [Mix::p5(), Mix::p7()] {
        let name = mix.name;
        let b = measure(mix, mongo_uri.to_owned());
        let payload = b.per_event(b.payload);
        let held = b.held_per_event();
        let limit = 1.25 * payload + 64.0;
        rows.push(Row::check(
            "P5",
            format!("held bytes per event, {name}"),
            format!(
                "{held:.0} B held per event for {payload:.0} B published = {:.2}x payload",
                held / payload
            ),
            format!("<= 1.25x payload + 64 B ({limit:.0} B)"),
            held <= limit,
        ));
        let fixed = b.fixed_per_thread();
        rows.push(Row::check(
            "P5",
            format!("fixed bytes per thread beyond moka's entry, {name}"),
            format!("{fixed:.0} B (moka's entry {:.0} B)", b.per_thread(b.moka)),
            "<= 512 B",
            fixed <= 512.0,
        ));
        let f = b.footprint;
        rows.push(Row::info(
            "P5",
            format!("a view's parts, bytes per event, {name}"),
            format!(
                "keys {:.0}, bodies {:.0} (both measured {:.0}), event structs {:.0}, order {:.0}, index {:.0}; \
                 per thread: view struct {:.0}, entry and moka {:.0}, covered displays once hydrated {:.0}; \
                 a read keeps its answer {:.0} and a feed its transcript {:.0} per event ({:.0} and {:.0} per message)",
                b.per_event(f.keys),
                b.per_event(f.bodies),
                b.per_event(b.decoded),
                b.per_event(f.events),
                b.per_event(f.order),
                b.per_event(f.index),
                b.per_thread(f.fixed),
                fixed - b.per_thread(f.fixed) + b.per_thread(b.moka),
                b.per_thread(b.hydrated - b.views),
                b.per_event(b.answers),
                b.per_event(b.transcripts),
                b.answers as f64 / b.messages.max(1) as f64,
                b.transcripts as f64 / b.messages.max(1) as f64,
            ),
        ));
        let ratio = b.charged as f64 / b.cache as f64;
        rows.push(Row::check(
            "P5",
            format!("charge against bytes allocated, {name}"),
            format!(
                "charged {:.0} B, allocated {:.0} B per thread (the views' own count {:.0}) = {ratio:.2}x",
                b.per_thread(b.charged as usize),
                b.per_thread(b.cache),
                b.per_thread(f.total()),
            ),
            format!("within {:.0}%", CHARGE_TOLERANCE * 100.0),
            (ratio - 1.0).abs() <= CHARGE_TOLERANCE,
        ));
    }
    rows
}
