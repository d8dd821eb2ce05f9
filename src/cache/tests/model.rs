//! A model test of the cache: seeded random sequences of operations on the paused clock and an in-memory store
//! of its own, every read held to what the rules promise ([design 2.1](../../../docs/design.md#2.1)).
//!
//! **What it plays.** aihub publishes display events (user messages, chunks, HITL questions and answers, stops)
//! on three threads of three displays each, and its persister stores each one after a delay: within the
//! persister-lag bound, or now and then beyond it. The source delivers an event live, or loses it and reports a
//! gap at once, or stalls (its probes stop, what it receives is held back) and then either catches up or reports
//! the loss as a gap. Entries are evicted; store queries fail or are slow (slower than the store timeout: a
//! timeout, and an outage the coverage hears of, as from the real store); reads run concurrently; time
//! advances, so background re-reads and fills run.
//!
//! **What each read is held to**, as of the moment it started:
//! - answered from memory: every row stored more than the bound before it (the promise of
//!   [design 2.1](../../../docs/design.md#2.1)); every event delivered live, or lost in a gap reported, before it
//!   (a complete view covers both, [design 2.1.1](../../../docs/design.md#2.1.1)); and every event applied to the
//!   entry that answered. An event persisted beyond the bound breaks the assumption the rule rests on: it counts
//!   only where the cache must hold it anyway (applied to the answering entry, or stored before a gap or an
//!   eviction that forced a new store read).
//! - answered from the store: every row stored before its store read began (the earliest query of the thread
//!   that started within the store timeout before the read), on a display the store had a marker of then, and
//!   every event applied to the entry that answered. A read that waited for a fill is answered from the view
//!   the fill completed ([design 2](../../../docs/design.md#2)), so a row persisted late counts here too only
//!   where a complete view must hold it.
//!
//! An event is in an answer when its text is (each carries a token of its own, `[e12]`), a stop when its run is
//! finished. Where what the read must hold is every event of the thread, the whole answer (body and facts) must
//! equal the reference projection of them ([`crate::project::project`]). Every sequence ends with every event
//! stored, a gap and the bound: each thread's read must then be exact, and within a few bounds (re-reads
//! done) answered from memory too.
//!
//! **Seeded**: the seed is `MODEL_SEED` if set, else the time; `MODEL_SEED=<n> cargo test --lib
//! cache::tests::model` replays a run (`MODEL_SEQUENCES` runs more sequences). A failing sequence is shrunk to
//! the operations that still fail the same check and printed as a trace, with the seed.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::task::{JoinError, JoinHandle};
use tokio::time::Instant;

use super::super::form::{Facts, Form};
use super::*;
use crate::project::{Trace, project};
use crate::view::ThreadView;

/// A read in flight.
type ReadHandle = JoinHandle<Result<Answer<HistoryBody>, ReadError>>;

const THREADS: [&str; 3] = ["m0", "m1", "m2"];
const DISPLAYS: u32 = 3;
const RUNS: u32 = 2;
/// Sequences a run plays (`MODEL_SEQUENCES` overrides), and operations a sequence has.
const SEQUENCES: usize = 2000;
const OPS: usize = 60;
const STORE_TIMEOUT: Duration = Duration::from_secs(2);
const LAG_MS: u32 = LAG.as_millis() as u32;
/// Rounds of final reads, the bound twice apart, within which every thread must be answered from memory.
const FINAL_ROUNDS: usize = 4;
/// Most sequences a shrink replays.
const SHRINK_RUNS: usize = 400;

/// splitmix64: small, seeded, the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }

    /// In `lo..=hi`.
    fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + self.below(hi - lo + 1)
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    User,
    Chunk,
    Question,
    Answer,
    Stop,
}

impl Family {
    fn is_marker(self) -> bool {
        matches!(self, Family::User | Family::Answer)
    }
}

/// The store's queries a test can make fail or slow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Markers,
    Events,
    Fill,
}

#[derive(Debug, Clone)]
enum Op {
    /// aihub publishes event `e<id>`, created `early_ms` before now, and stores it `persist_ms` later. `lost`:
    /// the source never delivers it and reports a gap at once.
    Publish {
        id: u32,
        thread: usize,
        display: u32,
        run: u32,
        family: Family,
        early_ms: u32,
        persist_ms: u32,
        lost: bool,
    },
    /// An event delivered again (a redelivery; nothing if it was not published).
    Redeliver {
        id: u32,
    },
    /// A gap signal that lost nothing.
    Gap,
    Evict {
        thread: usize,
    },
    /// The next query of `stage` fails (an outage).
    Fail {
        stage: Stage,
    },
    /// The next query of `stage` takes `ms` (beyond the read's deadline: a timeout).
    Slow {
        stage: Stage,
        ms: u32,
    },
    Read {
        thread: usize,
    },
    Advance {
        ms: u32,
    },
    /// The source stops proving what it applied; what it receives is held back.
    Stall,
    /// The stalled source resumes: it delivers what it held, or reports it lost (a gap).
    Resume {
        catch_up: bool,
    },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::Publish {
                id,
                thread,
                display,
                run,
                family,
                early_ms,
                persist_ms,
                lost,
            } => {
                let verb = if lost { "lose" } else { "publish" };
                let thread = THREADS[thread];
                write!(
                    f,
                    "{verb} e{id}: {family:?} on {thread}/d{display} run d{display}r{run}"
                )?;
                if early_ms > 0 {
                    write!(f, ", created {early_ms} ms early")?;
                }
                write!(f, ", stored after {persist_ms} ms")?;
                if persist_ms > LAG_MS {
                    write!(f, " (late: beyond the bound)")?;
                }
                if lost {
                    write!(f, "; the source reports a gap")?;
                }
                Ok(())
            }
            Op::Redeliver { id } => write!(f, "deliver e{id} again"),
            Op::Gap => write!(f, "a gap is reported (nothing lost)"),
            Op::Evict { thread } => write!(f, "evict {}", THREADS[thread]),
            Op::Fail { stage } => write!(f, "the next {stage:?} query fails"),
            Op::Slow { stage, ms } => write!(f, "the next {stage:?} query takes {ms} ms"),
            Op::Read { thread } => write!(f, "read {}", THREADS[thread]),
            Op::Advance { ms } => write!(f, "advance {ms} ms"),
            Op::Stall => write!(f, "the source stalls: no probes, live events held back"),
            Op::Resume { catch_up: true } => {
                write!(f, "the source resumes and delivers what it held")
            }
            Op::Resume { catch_up: false } => {
                write!(f, "the source resumes, what it held lost: a gap")
            }
        }
    }
}

fn publish(rng: &mut Rng, id: u32, lost: bool, persist_ms: Option<u32>) -> Op {
    let family = match rng.below(100) {
        0..=19 => Family::User,
        20..=54 => Family::Chunk,
        55..=69 => Family::Question,
        70..=81 => Family::Answer,
        _ => Family::Stop,
    };
    let early_ms = if rng.chance(20) {
        rng.range(1, 3_000)
    } else {
        0
    };
    let persist_ms = persist_ms.unwrap_or_else(|| match rng.below(100) {
        0..=59 => rng.range(0, 500),
        60..=87 => rng.range(501, LAG_MS - 1),
        _ => rng.range(LAG_MS + 1, 3 * LAG_MS),
    });
    Op::Publish {
        id,
        thread: rng.below(THREADS.len() as u32) as usize,
        display: rng.below(DISPLAYS),
        run: rng.below(RUNS),
        family,
        early_ms,
        persist_ms,
        lost,
    }
}

fn stage(rng: &mut Rng) -> Stage {
    [Stage::Markers, Stage::Events, Stage::Fill][rng.below(3) as usize]
}

/// A sequence: what the store held before the worker listened (stored, never delivered), then [`OPS`] random
/// operations.
fn generate(rng: &mut Rng) -> Vec<Op> {
    let mut ops = Vec::with_capacity(OPS + 4);
    let mut ids = 0;
    for _ in 0..rng.below(4) {
        ops.push(publish(rng, ids, true, Some(0)));
        ids += 1;
    }
    for _ in 0..OPS {
        let thread = rng.below(THREADS.len() as u32) as usize;
        let op = match rng.below(100) {
            0..=33 => {
                ids += 1;
                let lost = rng.chance(8);
                publish(rng, ids - 1, lost, None)
            }
            34..=36 => Op::Redeliver {
                id: rng.below(ids.max(1)),
            },
            37..=38 => Op::Gap,
            39..=43 => Op::Evict { thread },
            44..=47 => Op::Fail { stage: stage(rng) },
            48..=51 => Op::Slow {
                stage: stage(rng),
                ms: rng.range(20, 2_600),
            },
            52..=75 => Op::Read { thread },
            76..=95 => Op::Advance {
                ms: match rng.below(100) {
                    0..=44 => rng.range(1, 200),
                    45..=79 => rng.range(201, 2_500),
                    _ => rng.range(2_501, 6_000),
                },
            },
            96..=97 => Op::Stall,
            _ => Op::Resume {
                catch_up: rng.chance(50),
            },
        };
        ops.push(op);
    }
    ops
}

/// A live event whose text (or, for a stop, its run) tells whether an answer holds it.
fn live_event(thread: &str, display: u32, run: u32, family: Family, id: u32, at: i64) -> ViewEvent {
    let token = format!("[e{id}]");
    let (agent, name, data) = match family {
        Family::User => (
            "UserAgent",
            "UserMessageEvent",
            format!(
                r#", "messages": [{{"role": "user", "blocks": [{{"block_type": "text", "text": "{token}"}}]}}]"#
            ),
        ),
        Family::Answer => (
            "UserAgent",
            "HumanInTheLoopResponseEvent",
            format!(r#", "response": "{token}""#),
        ),
        Family::Chunk => (
            "Primary",
            "ChunkEvent",
            format!(r#", "content": "{token}""#),
        ),
        Family::Question => (
            "Primary",
            "HumanInTheLoopRequestEvent",
            format!(r#", "question": "{token}""#),
        ),
        Family::Stop => ("Primary", "StopEvent", String::new()),
    };
    let key = DeliveryKey::parse_subject(&format!(
        "agent.{agent}.{agent}-1.{thread}.d{display}.d{display}r{run}.display_event.{name}.e{id}"
    ))
    .expect("a display-event subject");
    let payload = format!(r#"{{"_parent_event_names": ["{name}"], "created_at": {at}{data}}}"#);
    match decode_payload(key, payload.as_bytes()) {
        // Dated a day ahead: the model deletes nothing, and the deleted-thread rule
        // ([design 2.1.8](../../../docs/design.md#2.1.8)) judges arrivals on the wall clock, which the paused
        // clock does not move, so a slow machine must not make a live event look old enough to drop.
        Ok(Decoded::Event(event)) => ViewEvent {
            arrived: crate::decode::arrival(SystemTime::now() + Duration::from_secs(86_400)),
            ..event
        },
        other => panic!("a relevant event expected, got {other:?}"),
    }
}

/// The store of the model: rows as the persister wrote them, and queries that fail or take time when told to,
/// each honouring its read's deadline and reporting outages and answers to the coverage as the real store does.
#[derive(Clone)]
struct ModelStore {
    state: Arc<Mutex<StoreState>>,
    coverage: Coverage,
}

#[derive(Default)]
struct StoreState {
    rows: Vec<ViewEvent>,
    fail: [u32; 3],
    slow: [Vec<Duration>; 3],
    /// Every query's start and the threads it read.
    started: Vec<(Instant, Vec<String>)>,
    /// The threads of every failed query.
    failed: Vec<Vec<String>>,
}

impl ModelStore {
    fn new(coverage: Coverage) -> Self {
        Self {
            state: Arc::default(),
            coverage,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, StoreState> {
        self.state.lock().unwrap()
    }

    fn persist(&self, event: &ViewEvent) {
        let mut row = event.clone();
        row.arrived = STORED;
        self.state().rows.push(row);
    }

    /// No more failures or slow queries (the end of a sequence).
    fn calm(&self) {
        let mut state = self.state();
        state.fail = [0; 3];
        state.slow = Default::default();
    }

    fn failures(&self, thread: &str) -> usize {
        self.state()
            .failed
            .iter()
            .filter(|threads| threads.iter().any(|t| t == thread))
            .count()
    }

    /// The earliest moment a store answer to a read of `thread` starting at `at` may have read the store: the
    /// start of the earliest query of the thread within the store timeout before (a store job in flight, whose
    /// outcome the read may share), or `at`.
    fn cutoff(&self, thread: &str, at: Instant) -> Instant {
        self.state()
            .started
            .iter()
            .filter(|(start, threads)| {
                *start + STORE_TIMEOUT >= at && threads.iter().any(|t| t == thread)
            })
            .map(|(start, _)| *start)
            .fold(at, Instant::min)
    }

    /// A query of `stage` for `threads`: counted, slowed or failed as told (a yield at least: the store is
    /// never answered in the same step), until `deadline` at most.
    async fn pass(
        &self,
        stage: Stage,
        threads: &[&str],
        deadline: Instant,
    ) -> Result<(), StoreError> {
        let threads: Vec<String> = threads.iter().map(|t| (*t).to_owned()).collect();
        let start = Instant::now();
        let (latency, fail) = {
            let mut state = self.state();
            state.started.push((start, threads.clone()));
            let k = stage as usize;
            let fail = state.fail[k] > 0;
            if fail {
                state.fail[k] -= 1;
            }
            let latency = if state.slow[k].is_empty() {
                Duration::ZERO
            } else {
                state.slow[k].remove(0)
            };
            (latency, fail)
        };
        let timed_out = start + latency > deadline;
        if latency.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep_until((start + latency).min(deadline)).await;
        }
        if timed_out || fail {
            self.coverage.store_failed();
            self.state().failed.push(threads);
            return Err(StoreError::Timeout(STORE_TIMEOUT));
        }
        self.coverage.store_answered(self.coverage.now());
        Ok(())
    }

    fn select(&self, keep: impl Fn(&ViewEvent) -> bool) -> Vec<ViewEvent> {
        let mut events: Vec<ViewEvent> = self
            .state()
            .rows
            .iter()
            .filter(|e| keep(e))
            .cloned()
            .collect();
        events.sort_by_key(|e| {
            (
                e.created_at.unwrap_or(i64::MIN),
                e.key.event_id().to_owned(),
            )
        });
        events
    }
}

impl StoreReads for ModelStore {
    async fn visible_displays(
        &self,
        thread_id: &str,
        _hydration: Hydration,
        bounds: Bounds,
    ) -> Result<VisibleDisplays, StoreError> {
        self.pass(Stage::Markers, &[thread_id], bounds.deadline)
            .await?;
        let mut displays: Vec<String> = Vec::new();
        for event in self.select(|e| e.key.thread_id() == thread_id && e.is_marker()) {
            let display = event.key.display_id();
            if !displays.iter().any(|d| d == display) {
                displays.push(display.to_owned());
            }
        }
        Ok(VisibleDisplays {
            displays,
            skipped_markers: 0,
        })
    }

    async fn display_events(
        &self,
        thread_id: &str,
        displays: &[String],
        _hydration: Hydration,
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        self.pass(Stage::Events, &[thread_id], bounds.deadline)
            .await?;
        Ok(self.select(|e| {
            e.key.thread_id() == thread_id && displays.iter().any(|d| d == e.key.display_id())
        }))
    }

    async fn stored_rows(
        &self,
        _thread_id: &str,
        _displays: &[String],
        _bounds: Bounds,
    ) -> Result<Vec<StoredRow>, StoreError> {
        unreachable!("the model samples no shadow checks")
    }

    async fn fill_events(
        &self,
        wanted: &[(&str, &[Box<str>])],
        bounds: Bounds,
    ) -> Result<Vec<ViewEvent>, StoreError> {
        let threads: Vec<&str> = wanted.iter().map(|(thread, _)| *thread).collect();
        self.pass(Stage::Fill, &threads, bounds.deadline).await?;
        Ok(self.select(|e| {
            wanted.iter().any(|(thread, displays)| {
                *thread == e.key.thread_id() && displays.iter().any(|d| **d == *e.key.display_id())
            })
        }))
    }

    async fn row_metadata(
        &self,
        _thread_id: &str,
        _bounds: Bounds,
    ) -> Result<Vec<RowMeta>, StoreError> {
        unreachable!("the model explains nothing")
    }
}

/// One published event and what happened to it; moments are the model's ticks (every action is one).
struct Record {
    id: u32,
    thread: usize,
    display: u32,
    run: u32,
    family: Family,
    event: ViewEvent,
    /// Stored beyond the bound (or to be).
    late: bool,
    /// When it was stored: the tick and the instant.
    stored: Option<(u64, Instant)>,
    /// Each live delivery: its tick and the generation of the entry it was applied to.
    deliveries: Vec<(u64, u64)>,
    /// The tick of the gap that reported it lost.
    lost: Option<u64>,
}

impl Record {
    fn token(&self) -> String {
        format!("[e{}]", self.id)
    }

    fn run(&self) -> String {
        format!("d{}r{}", self.display, self.run)
    }
}

/// A read as it started.
struct Started {
    op: usize,
    thread: usize,
    tick: u64,
    at: Instant,
    cutoff: Instant,
    failures: usize,
}

/// Why a sequence failed: the check (a shrink keeps a sequence only while the same check fails) and the story.
#[derive(Debug)]
struct Failure {
    check: &'static str,
    detail: String,
}

#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    reads: u64,
    memory: u64,
    /// Answers from memory before a sequence's end (its final reads left out).
    memory_midway: u64,
    store: u64,
    errors: u64,
    exact: u64,
    /// Events an answer was found to hold because the model said it must.
    held: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, other: Self) {
        self.reads += other.reads;
        self.memory += other.memory;
        self.memory_midway += other.memory_midway;
        self.store += other.store;
        self.errors += other.errors;
        self.exact += other.exact;
        self.held += other.held;
    }
}

/// What a read's check found.
struct Checked {
    source: Option<AnswerSource>,
    exact: bool,
}

/// The cache, its store and source, and the model of everything that happened.
struct World {
    views: ViewCache<ModelStore>,
    store: ModelStore,
    coverage: Coverage,
    probing: Arc<AtomicBool>,
    start: Instant,
    tick: u64,
    events: Vec<Record>,
    /// Stores due: when, and which record.
    due: Vec<(Instant, usize)>,
    gaps: Vec<u64>,
    evictions: [Vec<u64>; 3],
    stalled: bool,
    /// Events the stalled source holds back, in arrival order.
    held_back: Vec<usize>,
    reads: Vec<(Started, ReadHandle)>,
    log: Vec<String>,
    stats: Stats,
}

impl World {
    fn new(metrics: &Metrics) -> Self {
        let coverage = Coverage::new(LAG);
        assert!(coverage.confirm_live(coverage.connection(), coverage.now()));
        let store = ModelStore::new(coverage.clone());
        let freshness = Freshness::new(coverage.clone(), LAG);
        let setup = CacheSetup {
            settings: CacheSettings {
                max_bytes: 64 << 20,
                idle: Duration::from_secs(3_600),
                concurrent_hydrations: 4,
                max_thread_bytes: 64 << 20,
            },
            shadow: ShadowSettings {
                sample: 0.0,
                max_per_sec: 1_000,
                clock_margin: Duration::from_secs(1),
            },
            bounds: StoreBounds {
                store_timeout: STORE_TIMEOUT,
                persist_lag: LAG,
            },
            gap_window: Duration::from_secs(12),
        };
        crate::telemetry::testing::undecided_default();
        let views = ViewCache::new(
            store.clone(),
            metrics.views(),
            coverage.clone(),
            freshness.clone(),
            setup,
        );
        let probing = Arc::new(AtomicBool::new(true));
        tokio::spawn(probes(coverage.clone(), freshness, Arc::clone(&probing)));
        Self {
            views,
            store,
            coverage,
            probing,
            start: Instant::now(),
            tick: 0,
            events: Vec::new(),
            due: Vec::new(),
            gaps: Vec::new(),
            evictions: Default::default(),
            stalled: false,
            held_back: Vec::new(),
            reads: Vec::new(),
            log: Vec::new(),
            stats: Stats::default(),
        }
    }

    fn elapsed_ms(&self) -> u128 {
        (Instant::now() - self.start).as_millis()
    }

    fn note(&mut self, text: impl fmt::Display) {
        let line = format!("{:>7} ms  {text}", self.elapsed_ms());
        self.log.push(line);
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    async fn play(&mut self, ops: &[Op]) -> Result<(), Failure> {
        for (index, op) in ops.iter().enumerate() {
            self.note(format_args!("#{index:<3} {op}"));
            self.step(index, op).await;
            self.store_due();
            settle_tasks().await;
            self.harvest().await?;
        }
        self.finish().await
    }

    async fn step(&mut self, index: usize, op: &Op) {
        match *op {
            Op::Publish {
                id,
                thread,
                display,
                run,
                family,
                early_ms,
                persist_ms,
                lost,
            } => {
                let created_ms = self.elapsed_ms() as i64 - i64::from(early_ms);
                let at = created_ms * 1_000_000 + i64::from(id);
                let event = live_event(THREADS[thread], display, run, family, id, at);
                self.events.push(Record {
                    id,
                    thread,
                    display,
                    run,
                    family,
                    event,
                    late: persist_ms > LAG_MS,
                    stored: None,
                    deliveries: Vec::new(),
                    lost: None,
                });
                let record = self.events.len() - 1;
                self.due.push((Instant::now() + ms(persist_ms), record));
                if lost {
                    let gap = self.gap();
                    self.events[record].lost = Some(gap);
                } else {
                    self.arrive(record).await;
                }
            }
            Op::Redeliver { id } => {
                if let Some(record) = self.events.iter().position(|r| r.id == id) {
                    self.arrive(record).await;
                }
            }
            Op::Gap => {
                self.gap();
            }
            Op::Evict { thread } => {
                self.views.cache.invalidate(THREADS[thread]).await;
                self.views.cache.run_pending_tasks().await;
                let tick = self.next_tick();
                self.evictions[thread].push(tick);
            }
            Op::Fail { stage } => self.store.state().fail[stage as usize] += 1,
            Op::Slow { stage, ms: latency } => {
                self.store.state().slow[stage as usize].push(ms(latency));
            }
            Op::Read { thread } => self.spawn_read(index, thread),
            Op::Advance { ms: step } => self.advance_to(Instant::now() + ms(step)).await,
            Op::Stall => {
                if !self.stalled {
                    self.stalled = true;
                    self.probing.store(false, Ordering::Release);
                }
            }
            Op::Resume { catch_up } => self.resume(catch_up).await,
        }
    }

    /// A live event reaches the source: applied now, or held back while it stalls.
    async fn arrive(&mut self, record: usize) {
        if self.stalled {
            self.held_back.push(record);
        } else {
            self.deliver(record).await;
        }
    }

    async fn deliver(&mut self, record: usize) {
        let thread = THREADS[self.events[record].thread];
        self.views
            .apply(self.events[record].event.clone(), None)
            .await;
        let generation = self
            .views
            .cache
            .get(thread)
            .await
            .map_or(0, |entry| entry.generation);
        let tick = self.next_tick();
        self.events[record].deliveries.push((tick, generation));
    }

    fn gap(&mut self) -> u64 {
        self.coverage.gap(self.coverage.now());
        let tick = self.next_tick();
        self.gaps.push(tick);
        tick
    }

    async fn resume(&mut self, catch_up: bool) {
        if !self.stalled {
            return;
        }
        self.stalled = false;
        let held = std::mem::take(&mut self.held_back);
        if catch_up {
            for record in held {
                self.deliver(record).await;
            }
        } else {
            let gap = self.gap();
            for record in held {
                let lost = &mut self.events[record].lost;
                *lost = Some(lost.unwrap_or(gap));
            }
        }
        // Only now: the probes prove what was applied before them.
        self.probing.store(true, Ordering::Release);
    }

    fn spawn_read(&mut self, op: usize, thread: usize) {
        let name = THREADS[thread];
        let at = Instant::now();
        let started = Started {
            op,
            thread,
            tick: self.next_tick(),
            at,
            cutoff: self.store.cutoff(name, at),
            failures: self.store.failures(name),
        };
        let views = self.views.clone();
        let handle = tokio::spawn(async move { views.read::<HistoryBody>(name, None).await });
        self.reads.push((started, handle));
    }

    /// Stores the events due by now, in order.
    fn store_due(&mut self) {
        while let Some(record) = self.next_due(Instant::now()) {
            self.store_one(record);
        }
    }

    /// The next store due by `until` (taken off the list).
    fn next_due(&mut self, until: Instant) -> Option<usize> {
        let (i, &(at, _)) = self
            .due
            .iter()
            .enumerate()
            .min_by_key(|(_, (at, record))| (*at, *record))?;
        (at <= until).then(|| self.due.remove(i).1)
    }

    fn store_one(&mut self, record: usize) {
        self.store.persist(&self.events[record].event);
        let tick = self.next_tick();
        self.events[record].stored = Some((tick, Instant::now()));
        let id = self.events[record].id;
        self.note(format_args!("     e{id} stored"));
    }

    /// Lets time pass to `until`, storing what falls due on time.
    async fn advance_to(&mut self, until: Instant) {
        while let Some(&(at, _)) = self.due.iter().min_by_key(|(at, r)| (*at, *r)) {
            if at > until {
                break;
            }
            if at > Instant::now() {
                tokio::time::sleep_until(at).await;
            }
            self.store_due();
        }
        if until > Instant::now() {
            tokio::time::sleep_until(until).await;
        }
    }

    /// Checks the reads that have finished.
    async fn harvest(&mut self) -> Result<(), Failure> {
        let mut i = 0;
        while i < self.reads.len() {
            if self.reads[i].1.is_finished() {
                let (started, handle) = self.reads.remove(i);
                let result = handle.await;
                self.check(&started, result)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Whether the model holds `record` to be in an answer to `read` from the entry `generation`: applied live
    /// to that entry, and why else it must be there (or `None`).
    fn must(
        &self,
        record: &Record,
        read: &Started,
        memory: bool,
        generation: u64,
    ) -> (bool, Option<String>) {
        let applied_here = record
            .deliveries
            .iter()
            .any(|&(tick, g)| tick < read.tick && g == generation);
        let losses = || {
            self.gaps
                .iter()
                .chain(&self.evictions[record.thread])
                .copied()
        };
        let stored_before_a_loss = record
            .stored
            .is_some_and(|(stored, _)| losses().any(|loss| stored < loss && loss < read.tick));
        let other = if memory {
            let stored_ago = record
                .stored
                .filter(|&(_, at)| at + LAG < read.at)
                .map(|(_, at)| (read.at - at).as_millis());
            let delivered = record.deliveries.iter().any(|&(tick, _)| tick < read.tick);
            let lost = record.lost.is_some_and(|tick| tick < read.tick);
            match () {
                () if record.late && stored_before_a_loss => Some(
                    "stored late, but before a gap or an eviction that came before the read".into(),
                ),
                () if record.late => None,
                () if stored_ago.is_some() => Some(format!(
                    "stored {} ms before the read (the bound is {LAG_MS} ms)",
                    stored_ago.unwrap_or_default()
                )),
                () if delivered => {
                    Some("delivered live before the read, stored within the bound".into())
                }
                () if lost => {
                    Some("lost in a gap reported before the read, stored within the bound".into())
                }
                () => None,
            }
        } else {
            // A read that waited for a fill answers from the view it completed (labelled store): late rows
            // count only where a complete view must hold them.
            record
                .stored
                .filter(|&(_, at)| at < read.cutoff)
                .filter(|_| !record.late || stored_before_a_loss)
                .map(|(_, at)| {
                    format!(
                        "stored {} ms before the read's store query began",
                        (read.cutoff - at).as_millis()
                    )
                })
        };
        (applied_here, other)
    }

    fn check(
        &mut self,
        read: &Started,
        result: Result<Result<Answer<HistoryBody>, ReadError>, JoinError>,
    ) -> Result<Checked, Failure> {
        let name = THREADS[read.thread];
        self.stats.reads += 1;
        let answer = match result {
            Err(error) => {
                return Err(Failure {
                    check: "a read panicked",
                    detail: format!("{} of {name}: {error}", label(read.op)),
                });
            }
            Ok(Err(error)) => {
                self.stats.errors += 1;
                self.note(format_args!(
                    "     {} of {name} failed: {error}",
                    label(read.op)
                ));
                let failed = self.store.failures(name) > read.failures;
                let allowed = match error {
                    ReadError::Store(_) | ReadError::ConcurrentReadFailed => failed,
                    ReadError::Busy => true,
                    ReadError::TooLarge { .. } => false,
                };
                if !allowed {
                    return Err(Failure {
                        check: "a read failed without a store failure",
                        detail: format!(
                            "{} of {name} failed ({error:?}), but no store query of the thread failed \
                             while it ran",
                            label(read.op)
                        ),
                    });
                }
                return Ok(Checked {
                    source: None,
                    exact: false,
                });
            }
            Ok(Ok(answer)) => answer,
        };
        let memory = answer.source == AnswerSource::Cache;
        if memory {
            self.stats.memory += 1;
            self.stats.memory_midway += u64::from(read.op != usize::MAX);
        } else {
            self.stats.store += 1;
        }
        let body = String::from_utf8_lossy(&answer.body.body).into_owned();
        self.note(format_args!(
            "     {} of {name} answered from {}: {}",
            label(read.op),
            answer.source.label(),
            tokens(&body)
        ));
        let records: Vec<&Record> = self
            .events
            .iter()
            .filter(|r| r.thread == read.thread)
            .collect();
        let judged: Vec<(bool, Option<String>)> = records
            .iter()
            .map(|r| self.must(r, read, memory, answer.generation))
            .collect();
        let must = |i: usize| judged[i].0 || judged[i].1.is_some();
        // Displays the must-have events make visible; from the store, a row stored before the read is
        // guaranteed only on a display the store had a marker of then (a live marker alone reveals a display
        // the store's first stage did not read: the next read fills or hydrates it).
        let visible = |display: u32, stored_only: bool| {
            records.iter().enumerate().any(|(i, r)| {
                r.display == display
                    && r.family.is_marker()
                    && if stored_only {
                        judged[i].1.is_some()
                    } else {
                        must(i)
                    }
            })
        };
        let guaranteed = |i: usize| {
            let display = records[i].display;
            match &judged[i] {
                (true, _) => visible(display, false),
                (false, Some(_)) => visible(display, !memory),
                (false, None) => false,
            }
        };
        let mut missing = Vec::new();
        for (i, record) in records.iter().enumerate() {
            if !guaranteed(i) {
                continue;
            }
            let held = if record.family == Family::Stop {
                answer.facts.run_finished(&record.run())
            } else {
                body.contains(&record.token())
            };
            if held {
                self.stats.held += 1;
            } else {
                let why = judged[i]
                    .1
                    .clone()
                    .unwrap_or_else(|| "applied live to the entry that answered".into());
                missing.push(format!(
                    "e{} ({:?} on d{}, run {}): {why}",
                    record.id,
                    record.family,
                    record.display,
                    record.run()
                ));
            }
        }
        if !missing.is_empty() {
            return Err(Failure {
                check: if memory {
                    "an answer from memory lacks an event it must hold"
                } else {
                    "an answer from the store lacks an event it must hold"
                },
                detail: format!(
                    "{} of {name} (started at {} ms, answered from {}) lacks:\n  {}\nits body: {body}",
                    label(read.op),
                    (read.at - self.start).as_millis(),
                    answer.source.label(),
                    missing.join("\n  ")
                ),
            });
        }
        // Exact when the read must hold every event of the thread (from the store: each on a display the store
        // showed it, or applied here, or on a display no marker makes visible).
        let exact = (0..records.len())
            .all(|i| must(i) && (memory || guaranteed(i) || !visible(records[i].display, false)));
        if exact {
            self.stats.exact += 1;
            let events: Vec<ViewEvent> = records.iter().map(|r| r.event.clone()).collect();
            let projection = project(&events, None);
            let trace: Trace<'_> = Vec::new();
            let expected = HistoryBody::render(name, &ThreadView::new(), &projection, &trace);
            let facts = Facts::of(&projection);
            if expected.body != answer.body.body || facts != *answer.facts {
                return Err(Failure {
                    check: "an answer differs from the reference projection",
                    detail: format!(
                        "{} of {name} (answered from {}):\n  expected {}\n  facts    {facts:?}\n  \
                         answered {body}\n  facts    {:?}",
                        label(read.op),
                        answer.source.label(),
                        String::from_utf8_lossy(&expected.body),
                        answer.facts
                    ),
                });
            }
        }
        Ok(Checked {
            source: Some(answer.source),
            exact,
        })
    }

    /// Every event stored, a gap, the bound: each thread's read must then be exact, and, within a few bounds,
    /// from memory too.
    async fn finish(&mut self) -> Result<(), Failure> {
        self.note("end: resume, store everything, a gap, the bound");
        self.resume(true).await;
        self.store.calm();
        if let Some(last) = self.due.iter().map(|(at, _)| *at).max() {
            self.advance_to(last).await;
        }
        // Queries in flight end within the store timeout.
        self.advance_to(Instant::now() + STORE_TIMEOUT).await;
        for _ in 0..30 {
            self.harvest().await?;
            if self.reads.is_empty() {
                break;
            }
            self.advance_to(Instant::now() + Duration::from_secs(1))
                .await;
        }
        if let Some((started, _)) = self.reads.first() {
            return Err(Failure {
                check: "a read never finished",
                detail: format!(
                    "{} of {} did not finish in 30 s",
                    label(started.op),
                    THREADS[started.thread]
                ),
            });
        }
        // The readiness ping: the store answers, ending any outage; then a gap, and the bound.
        self.coverage.store_answered(self.coverage.now());
        self.gap();
        self.advance_to(Instant::now() + LAG + Duration::from_millis(600))
            .await;
        // Every final read is exact; within a few bounds every thread is answered from memory (an evicted
        // entry kept alive by its own background re-read records its removal when dropped, which may make the
        // current entry partial again after it completed).
        for round in 0..FINAL_ROUNDS {
            let mut from_memory = 0;
            for (thread, name) in THREADS.iter().enumerate() {
                self.note(format_args!("     final read of {name}"));
                self.spawn_read(usize::MAX, thread);
                let (started, handle) = self.reads.pop().expect("just spawned");
                let result = handle.await;
                let checked = self.check(&started, result)?;
                if !checked.exact {
                    return Err(Failure {
                        check: "a final read was not exact",
                        detail: format!(
                            "final read {} of {} was answered from {:?}, not exactly",
                            round + 1,
                            THREADS[thread],
                            checked.source
                        ),
                    });
                }
                from_memory += usize::from(checked.source == Some(AnswerSource::Cache));
            }
            if from_memory == THREADS.len() {
                self.views.stop_background();
                return Ok(());
            }
            self.advance_to(Instant::now() + LAG * 2 + Duration::from_millis(600))
                .await;
        }
        Err(Failure {
            check: "a thread was never answered from memory",
            detail: format!(
                "{FINAL_ROUNDS} rounds of final reads, the bound twice apart, and not every thread was answered \
                 from memory"
            ),
        })
    }
}

/// How the trace names a read: by its operation, or as a final read.
fn label(op: usize) -> String {
    if op == usize::MAX {
        "the final read".into()
    } else {
        format!("read #{op}")
    }
}

fn ms(ms: u32) -> Duration {
    Duration::from_millis(u64::from(ms))
}

/// Lets every task that can run at this instant run (a store query yields at least once).
async fn settle_tasks() {
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
}

/// The event tokens of a body, in order.
fn tokens(body: &str) -> String {
    let found: Vec<&str> = body
        .match_indices("[e")
        .filter_map(|(at, _)| body[at..].find(']').map(|end| &body[at..=at + end]))
        .collect();
    if found.is_empty() {
        "nothing".into()
    } else {
        found.concat()
    }
}

/// Plays one sequence on a paused runtime of its own; a panic is a failure too.
fn play(ops: &[Op], metrics: &Metrics) -> (Result<Stats, Failure>, Vec<String>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&log);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            let mut world = World::new(metrics);
            let result = world.play(ops).await;
            *kept.lock().unwrap() = std::mem::take(&mut world.log);
            result.map(|()| world.stats)
        })
    }));
    let result = outcome.unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        Err(Failure {
            check: "a panic",
            detail: message,
        })
    });
    let log = std::mem::take(&mut *log.lock().unwrap());
    (result, log)
}

/// The fewest operations that still fail the same check (chunks of the sequence left out while it does).
fn shrink(
    mut ops: Vec<Op>,
    mut failure: Failure,
    mut log: Vec<String>,
    metrics: &Metrics,
) -> (Vec<Op>, Failure, Vec<String>) {
    let mut runs = 0;
    let mut chunk = ops.len() / 2;
    while chunk >= 1 && runs < SHRINK_RUNS {
        let mut at = 0;
        let mut shrunk = false;
        while at < ops.len() && runs < SHRINK_RUNS {
            let mut candidate = ops.clone();
            candidate.drain(at..(at + chunk).min(ops.len()));
            runs += 1;
            match play(&candidate, metrics) {
                (Err(again), again_log) if again.check == failure.check => {
                    ops = candidate;
                    failure = again;
                    log = again_log;
                    shrunk = true;
                }
                _ => at += chunk,
            }
        }
        if !shrunk {
            chunk /= 2;
        }
    }
    (ops, failure, log)
}

/// A bug the model found, replayed: a read waiting for the source holds its entry; the entry is
/// evicted; the source delivers an event it held back (stored more than the bound before the read) to the
/// successor, then proves the window. The read must not answer from memory without that event (it answered from
/// the evicted entry's view until reads checked that their entry is still current).
#[tokio::test(start_paused = true)]
async fn an_answer_from_memory_after_waiting_for_the_source_comes_from_the_current_entry() {
    let scene = Scene::new();
    scene.complete_thread().await;
    // The source falls behind: an event reaches the stream and the store, and is not delivered yet.
    scene.probing.store(false, Ordering::Release);
    let held_back = super::chunk("d1", "held", 3, "held-back");
    scene.store.persist(&held_back);
    tokio::time::sleep(scene.freshness.window() + Duration::from_millis(100)).await;
    // A read now waits for the source (the view is complete, the window unproven), holding its entry.
    let reader = scene.spawn_read();
    settle().await;
    assert!(!reader.is_finished(), "waiting for the source");
    // The entry is evicted; the source catches up, applying the event to the thread's next entry, and proves it.
    scene.views.cache.invalidate(THREAD).await;
    scene.views.cache.run_pending_tasks().await;
    scene.views.apply(held_back, None).await;
    scene.probing.store(true, Ordering::Release);
    let answer = reader.await.unwrap().unwrap();
    assert!(
        body(&answer).contains("held-back"),
        "answered from {:?} without an event stored {:?} before the read: {}",
        answer.source,
        scene.freshness.window() + Duration::from_millis(100),
        body(&answer)
    );
}

fn seed() -> u64 {
    match std::env::var("MODEL_SEED") {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("MODEL_SEED={text:?} is not a number")),
        Err(_) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |since| since.as_nanos() as u64),
    }
}

#[test]
fn random_interleavings_keep_what_every_read_must_hold() {
    let seed = seed();
    let sequences = std::env::var("MODEL_SEQUENCES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(SEQUENCES);
    let metrics = Metrics::new();
    let began = std::time::Instant::now();
    let mut stats = Stats::default();
    let mut seeds = Rng(seed);
    let only: Option<usize> = std::env::var("MODEL_SEQUENCE")
        .ok()
        .and_then(|n| n.parse().ok());
    for n in 0..sequences {
        let ops = generate(&mut Rng(seeds.next()));
        if only.is_some_and(|only| only != n) {
            continue;
        }
        let (result, log) = play(&ops, &metrics);
        match result {
            Ok(played) => stats += played,
            Err(failure) => {
                let played = ops.len();
                let (ops, failure, log) = shrink(ops, failure, log, &metrics);
                panic!(
                    "MODEL_SEED={seed}, sequence {n}: {}\n{}\n\nshrunk from {played} to {} operations; the \
                     trace:\n{}\n\nreplay: MODEL_SEED={seed} cargo test --lib cache::tests::model",
                    failure.check,
                    failure.detail,
                    ops.len(),
                    log.join("\n")
                );
            }
        }
    }
    println!(
        "model (MODEL_SEED={seed}): {sequences} sequences of up to {OPS} operations in {:?}: {stats:?}",
        began.elapsed()
    );
    // Proof that the checks had something to check.
    let played = if only.is_some() { 1 } else { sequences as u64 };
    assert!(
        stats.memory_midway >= played && stats.store > played * 3,
        "MODEL_SEED={seed}: too few answers of either source: {stats:?}"
    );
    assert!(
        stats.exact > played * 6 && stats.held > stats.reads,
        "MODEL_SEED={seed}: too few checks: {stats:?}"
    );
}
