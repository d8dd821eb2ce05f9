//! The live source: where events come from and what the worker knows about what it may have missed.
//!
//! - `connect.rs`: the NATS connection: the servers, login and TLS read and checked from the settings at start, the
//!   client connected with them, and the rate-limited log of its failures.
//! - `core.rs`: Core NATS (`HISTORY_VIEW_SOURCE=core`): the subscription loop and the connection watcher, which
//!   confirms the subscription by a round trip and turns possible losses into gaps.
//! - The JetStream source (`HISTORY_VIEW_SOURCE=jetstream`): `discovery.rs` finds the class streams (or binds the
//!   partitioned stream, `partitioned.rs`) and fails closed when there is none; `consumer.rs` runs one consumer loop
//!   per stream that resumes by sequence and checks the stream every [`Timing::interval`]; `rule.rs` is the pure
//!   resume and retention rule; `api.rs` is the seam over the JetStream calls.
//! - [`Tracker`]: the one place that turns what the sources report ([`SourceEvent`]) into coverage (gaps,
//!   [`crate::coverage`]), catch-up ([`crate::catch_up`]) and freshness ([`crate::freshness`]).
//! - `metrics.rs`: the source wing's metrics ([`SourceMetrics`]), recorded by the watcher, the tracker and the
//!   witness.
//!
//! Events go through the same subject → decode → view path whatever the source ([`Sink`], [`crate::ingest`]).
//! Every case of [design 2.1.3](../../docs/design.md#2.1.3)'s table is a gap, "behind" or fail-closed here.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::coverage::{Coverage, Stamp};
use crate::freshness::{Freshness, Part};

pub mod access;
pub mod api;
pub mod connect;
mod consumer;
pub mod core;
mod discovery;
mod ingest;
mod live;
mod metrics;
mod partitioned;
mod rule;
pub mod settings;
#[cfg(test)]
mod tests;
mod upstream;
pub mod witness;

pub use crate::catch_up::{CatchUp, Lane, Refusal};
pub use discovery::{JetStreamSettings, JetStreamSource, filter_subjects, matches_pattern};
pub use ingest::{EventOutcome, Ingest, IngestMetrics};
pub use live::{LiveSource, Parts};
pub use metrics::{ResumeOutcome, SourceMetrics};
pub use settings::Source;
pub use witness::Witness;

/// Added to a moment read off the server's clock: the server's clock may run behind the worker's.
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(1);

/// Where an event goes once a source has it: subject → decode → view ([`Ingest`]).
pub trait Sink: Clone + Send + Sync + 'static {
    /// One message by its subject, payload and headers (Core NATS and JetStream both deliver headers: a
    /// publisher's W3C trace context, [`crate::telemetry::trace::publisher_context`]), received at `arrived`
    /// ([`crate::decode::ViewEvent::arrived`]).
    fn apply(
        &self,
        subject: &str,
        payload: &[u8],
        headers: Option<&async_nats::HeaderMap>,
        arrived: u32,
    ) -> impl Future<Output = ()> + Send;
}

/// Why a JetStream stream may have lost an event the worker did not read: each a gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GapCause {
    /// Messages removed from the front beyond the read-through position: age, `max_msgs`, `max_bytes`,
    /// `max_msgs_per_subject`, a purge.
    Removed,
    /// Messages deleted between the first and the last while something was unread.
    Deleted,
    /// Another stream under the same name.
    Recreated,
    /// A new leader of a replicated stream: Core publishes made during the election reached no replica.
    NewLeader,
    /// The stream is gone.
    StreamDeleted,
    /// A stream found after the start: events of its class before it existed were in no stream.
    NewStream,
    /// Partitioned: a class stream sourced for the first time, recreated, under a new leader, or deleted, or one
    /// that removed messages its source had not copied yet.
    Upstream,
    /// A stream that refused display events is taking them again: those refused meanwhile reached no stream.
    Refused,
    /// A stream's subjects changed: messages on subjects its consumer's filters left out were passed unread.
    Subjects,
    /// The Core witness's own subscription may have lost an event (a slow consumer, a lost connection): what it
    /// did not see it cannot judge.
    Witness,
}

impl GapCause {
    pub const ALL: [GapCause; 10] = [
        GapCause::Removed,
        GapCause::Deleted,
        GapCause::Recreated,
        GapCause::NewLeader,
        GapCause::StreamDeleted,
        GapCause::NewStream,
        GapCause::Upstream,
        GapCause::Refused,
        GapCause::Subjects,
        GapCause::Witness,
    ];

    /// The `cause` label of `history_view_jetstream_gaps_total`.
    pub fn label(self) -> &'static str {
        match self {
            GapCause::Removed => "removed",
            GapCause::Deleted => "deleted",
            GapCause::Recreated => "recreated",
            GapCause::NewLeader => "new_leader",
            GapCause::StreamDeleted => "stream_deleted",
            GapCause::NewStream => "new_stream",
            GapCause::Upstream => "upstream",
            GapCause::Refused => "refused",
            GapCause::Subjects => "subjects",
            GapCause::Witness => "witness",
        }
    }
}

/// The source's clock, derived from the persister-lag bound: an answer from memory may lack only what was stored
/// less than the bound before it ([`Freshness::serves`]), so each part of the covered-through instant must be proved
/// again well within it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How often the class streams are listed. Consumed streams are checked (and partitioned workers read the
    /// class streams) as often as the serving rule needs its parts proved ([`Freshness::prove_every`]).
    pub interval: Duration,
    /// How long one JetStream request may take before the consumer is resumed.
    pub request_timeout: Duration,
    /// The window of the serving rule: the bound, at least a second.
    pub silence: Duration,
}

impl Timing {
    /// The timing for a persister-lag bound of `lag`.
    pub fn for_lag(lag: Duration) -> Self {
        let silence = lag.max(Duration::from_secs(1));
        Self {
            interval: silence / 2,
            request_timeout: silence / 2,
            silence,
        }
    }
}

/// What a source reports.
#[derive(Debug, Clone, Copy)]
pub enum SourceEvent<'a> {
    /// A message of `stream` was applied; the consumer had `pending` more to deliver.
    Applied {
        stream: &'a str,
        /// The original display-event subject.
        subject: &'a str,
        sequence: u64,
        pending: u64,
    },
    /// A check of a consumer of `generation` of `stream` found nothing unread gone; `drained`: every message the
    /// stream held when asked is applied; `covered`: what it proved applied ([`rule::Position::covered`]).
    Confirmed {
        stream: &'a str,
        generation: u64,
        drained: bool,
        covered: Option<Stamp>,
    },
    /// Partitioned: every message the class stream `stream` stored before `covered` was copied and applied.
    Upstream { stream: &'a str, covered: Stamp },
    /// A stream cannot take or keep display events (`Some`), or can again (`None`, after `was`).
    Refusing {
        stream: &'a str,
        now: Option<Refusal>,
        was: Option<Refusal>,
    },
    /// A lane that lasts until someone acts is behind (a class stream not sourced or not confirmed, a stalled
    /// source, no stream); `why` is logged once when it falls behind (none: the source logs it itself).
    Blocked {
        lane: &'a Lane,
        why: Option<&'static str>,
    },
    /// That lane is clear again.
    Cleared(&'a Lane),
    /// An event of `stream` may be lost: every complete view is partial from `at` (now if `None`).
    Gap {
        stream: &'a str,
        cause: GapCause,
        at: Option<SystemTime>,
    },
    /// A consumer resumed with nothing lost.
    Continued,
    /// A stream is consumed from now on.
    StreamAdded(&'a str),
    /// A stream is no longer consumed.
    StreamRemoved(&'a str),
}

/// Turns [`SourceEvent`]s into coverage, catch-up, freshness and metrics. Cloning is cheap.
#[derive(Clone)]
pub struct Tracker {
    coverage: Coverage,
    freshness: Freshness,
    metrics: Arc<SourceMetrics>,
    timing: Timing,
    /// The Core witness, told of every delivery.
    witness: Option<Witness>,
}

impl Tracker {
    pub fn new(
        coverage: Coverage,
        freshness: Freshness,
        metrics: Arc<SourceMetrics>,
        timing: Timing,
        witness: Option<Witness>,
    ) -> Self {
        // Every JetStream worker exports them at zero, the witness's results too (a panel sees 0, not nothing).
        metrics.preset_jetstream();
        Self {
            coverage,
            freshness,
            metrics,
            timing,
            witness,
        }
    }

    pub fn coverage(&self) -> &Coverage {
        &self.coverage
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    fn catch_up(&self) -> &CatchUp {
        self.coverage.catch_up()
    }

    /// A consumer of `lane` is being (re)created: behind until a consumer created from now catches up. Returns the
    /// lane's new generation, which that consumer's [`SourceEvent::Confirmed`] carries.
    pub fn resuming(&self, lane: &Lane) -> u64 {
        let generation = self.catch_up().behind(lane);
        self.lanes_changed();
        generation
    }

    /// Applies one event.
    pub fn emit(&self, event: SourceEvent<'_>) {
        match event {
            SourceEvent::Applied {
                stream,
                subject,
                sequence,
                pending,
            } => {
                self.metrics.jetstream_applied(stream, sequence, pending);
                if let Some(witness) = &self.witness {
                    witness.delivered(subject);
                }
            }
            SourceEvent::Confirmed {
                stream,
                generation,
                drained,
                covered,
            } => {
                self.catch_up()
                    .confirmed(&Lane::Stream(stream.to_owned()), generation, drained);
                if let Some(covered) = covered {
                    self.freshness
                        .covered(Part::Stream(stream.to_owned()), covered);
                }
                self.lanes_changed();
            }
            SourceEvent::Upstream { stream, covered } => {
                self.freshness
                    .covered(Part::Upstream(stream.to_owned()), covered);
            }
            SourceEvent::Refusing { stream, now, was } => {
                if let Some(was) = was.filter(|was| Some(*was) != now) {
                    if let Some(cause) = rule::gap(rule::Seen::Refusing {
                        was: Some(was),
                        now,
                    }) {
                        tracing::info!(
                            stream,
                            cause = was.label(),
                            "the stream takes display events again"
                        );
                        // The gap first: once the hold is released, no complete view may predate it.
                        self.emit(SourceEvent::Gap {
                            stream,
                            cause,
                            at: None,
                        });
                    }
                    self.metrics.jetstream_refusing(stream, was, false);
                    self.clear(&Lane::Refusing(stream.to_owned(), was));
                }
                if let Some(now) = now.filter(|now| Some(*now) != was) {
                    tracing::error!(
                        stream,
                        cause = now.label(),
                        "the stream {}: its class's events reach no view live; nothing is served from memory \
                         and reads go to the store until it is fixed (see the runbook)",
                        now.describe()
                    );
                    self.metrics.jetstream_refusing(stream, now, true);
                    self.block(&Lane::Refusing(stream.to_owned(), now));
                }
            }
            SourceEvent::Blocked { lane, why } => {
                if self.catch_up().is_behind(lane) {
                    return;
                }
                if let Some(why) = why {
                    tracing::warn!(?lane, "{why}");
                }
                self.block(lane);
            }
            SourceEvent::Cleared(lane) => self.clear(lane),
            SourceEvent::Gap { stream, cause, at } => {
                tracing::warn!(
                    stream,
                    cause = cause.label(),
                    "an event of a consumed stream may be lost: a gap (every complete view hydrates again)"
                );
                self.metrics.jetstream_resume(ResumeOutcome::Gap);
                self.metrics.jetstream_gap(cause);
                let at = at.map_or_else(|| self.coverage.now(), |at| self.coverage.stamp_of(at));
                self.coverage.gap(at);
            }
            SourceEvent::Continued => {
                self.metrics.jetstream_resume(ResumeOutcome::Continued);
            }
            SourceEvent::StreamAdded(stream) => {
                self.freshness.track(Part::Stream(stream.to_owned()));
                self.metrics.jetstream_streams(1);
                // A consumed stream exports its refusals at 0 (a panel sees 0, not nothing).
                for cause in Refusal::ALL {
                    self.metrics.jetstream_refusing(stream, cause, false);
                }
            }
            SourceEvent::StreamRemoved(stream) => {
                self.freshness.forget(&Part::Stream(stream.to_owned()));
                self.catch_up().forget(&Lane::Stream(stream.to_owned()));
                self.metrics.jetstream_streams(-1);
                self.lanes_changed();
            }
        }
    }

    /// A lane that lasts until someone acts: behind, and nothing served from memory while it lasts.
    fn block(&self, lane: &Lane) {
        self.freshness.track(Part::Held(lane.clone()));
        self.catch_up().behind(lane);
        self.lanes_changed();
    }

    fn clear(&self, lane: &Lane) {
        self.catch_up().forget(lane);
        self.freshness.forget(&Part::Held(lane.clone()));
        self.lanes_changed();
    }

    /// Partitioned: `stream` is a class stream upstream whose copies count toward the instant from now on.
    pub fn track_upstream(&self, stream: &str) {
        self.freshness.track(Part::Upstream(stream.to_owned()));
    }

    /// Partitioned: `stream` is no longer upstream.
    pub fn forget_upstream(&self, stream: &str) {
        self.freshness.forget(&Part::Upstream(stream.to_owned()));
    }

    /// The covered-through instant and the serving rule (how often its parts must be proved).
    pub fn freshness(&self) -> &Freshness {
        &self.freshness
    }

    fn lanes_changed(&self) {
        self.metrics
            .jetstream_behind(!self.catch_up().lanes_caught_up());
    }
}
