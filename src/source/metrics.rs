//! The source wing's metrics: the NATS connection's events (either source), and the JetStream source's streams,
//! resumes, gaps, lanes behind and the Core witness's judgements. Recorded by `core.rs`, the [`super::Tracker`]
//! and the [`super::Witness`].

use async_nats::Event;
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec};

use super::GapCause;
use super::witness::WitnessOutcome;
use crate::catch_up::Refusal;
use crate::metrics::{Registrar, gauge_value, preset};

/// What a JetStream consumer's resume found ([design 2.1.3](../../docs/design.md#2.1.3)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeOutcome {
    /// The stream kept its identity and the messages after the last one applied: not a gap.
    Continued,
    /// The stream was recreated, lost messages not read yet, changed its leader, was deleted, or is new: a gap.
    Gap,
}

impl ResumeOutcome {
    const ALL: [ResumeOutcome; 2] = [ResumeOutcome::Continued, ResumeOutcome::Gap];

    fn label(self) -> &'static str {
        match self {
            ResumeOutcome::Continued => "continued",
            ResumeOutcome::Gap => "gap",
        }
    }
}

/// The `event` label of `history_view_nats_connection_events_total`, one per kind of client event.
const CONNECTION_EVENTS: [&str; 8] = [
    "connected",
    "disconnected",
    "closed",
    "slow_consumer",
    "server_error",
    "client_error",
    "lame_duck_mode",
    "draining",
];

fn connection_event_label(event: &Event) -> &'static str {
    match event {
        Event::Connected => CONNECTION_EVENTS[0],
        Event::Disconnected => CONNECTION_EVENTS[1],
        Event::Closed => CONNECTION_EVENTS[2],
        Event::SlowConsumer(_) => CONNECTION_EVENTS[3],
        Event::ServerError(_) => CONNECTION_EVENTS[4],
        Event::ClientError(_) => CONNECTION_EVENTS[5],
        Event::LameDuckMode => CONNECTION_EVENTS[6],
        Event::Draining => CONNECTION_EVENTS[7],
    }
}

pub struct SourceMetrics {
    nats_connection_events: IntCounterVec,
    last_sequence: IntGaugeVec,
    pending: IntGaugeVec,
    resumes: IntCounterVec,
    gaps: IntCounterVec,
    streams: IntGauge,
    behind: IntGauge,
    refusing: IntGaugeVec,
    witnessed: IntCounterVec,
}

impl SourceMetrics {
    pub fn register(registrar: &mut Registrar) -> Self {
        let metrics = Self {
            nats_connection_events: registrar.counter_vec(
                "history_view_nats_connection_events_total",
                "NATS connection state changes the client reported, by event: connected, disconnected, closed, \
                 slow_consumer, server_error, client_error, lame_duck_mode, draining.",
                &["event"],
            ),
            last_sequence: registrar.gauge_vec(
                "history_view_jetstream_last_sequence",
                "Stream sequence of the last message the JetStream source applied, by stream.",
                &["stream"],
            ),
            pending: registrar.gauge_vec(
                "history_view_jetstream_pending",
                "Messages a JetStream consumer had still to deliver when it delivered the last message applied, by \
                 stream.",
                &["stream"],
            ),
            resumes: registrar.counter_vec(
                "history_view_jetstream_resumes_total",
                "JetStream consumer resumes and stream changes, by outcome: continued (a resume that kept the \
                 stream's identity and lost nothing), gap (a possible loss, whatever its cause: as many as \
                 history_view_jetstream_gaps_total counts).",
                &["outcome"],
            ),
            gaps: registrar.counter_vec(
                "history_view_jetstream_gaps_total",
                "Possible losses of events the JetStream source did not read (each a gap: every complete view \
                 hydrates again), by cause: removed (messages removed from the front before they were read), deleted \
                 (messages deleted while unread), recreated (another stream under the same name), new_leader (a \
                 replicated stream's new leader), stream_deleted, new_stream (a stream found after the start), \
                 upstream (partitioned: a class stream sourced anew, recreated, under a new leader or deleted, or one \
                 that removed messages its source had not copied), refused (a stream that refused display events \
                 takes them again), subjects (a stream's subjects changed), witness (the Core witness's own \
                 subscription may have lost a sighting).",
                &["cause"],
            ),
            streams: registrar.gauge(
                "history_view_jetstream_streams",
                "Streams the JetStream source consumes now (0 when none matches HISTORY_VIEW_JETSTREAM_STREAMS, \
                 failing closed, or on Core NATS).",
            ),
            witnessed: registrar.counter_vec(
                "history_view_jetstream_witnessed_total",
                "Display events the Core witness saw on Core NATS beside the JetStream source, by result: \
                 delivered (a consumed stream delivered it too), missing (no stream delivered it: a gap of its \
                 thread), overflow (given up unjudged, too many waiting: a gap of every view).",
                &["result"],
            ),
            behind: registrar.gauge(
                "history_view_jetstream_behind",
                "Whether the JetStream source is behind: 1 while a lane is (a stream resuming, a class stream not \
                 sourced or not confirmed, a stalled source, a refusing stream, no stream; reads wait or go to the \
                 store), else 0.",
            ),
            refusing: registrar.gauge_vec(
                "history_view_jetstream_refusing",
                "Whether a stream cannot take or keep display events (1 while it lasts), by stream and cause: full (discard: new at a \
                 limit), sealed, subjects (its subjects no longer cover the display-event subjects it was consumed \
                 on), unmatched (a stream the name pattern misses captures display-event subjects). Nothing is \
                 served from memory meanwhile; 0 once it is over.",
                &["stream", "cause"],
            ),
        };
        // The watcher runs with either source; the resumes have been exported by every worker from the start.
        preset(&metrics.nats_connection_events, &CONNECTION_EVENTS);
        preset(
            &metrics.resumes,
            &ResumeOutcome::ALL.map(ResumeOutcome::label),
        );
        metrics
    }

    /// Exports the gap causes and the witness's results at zero: called when a JetStream worker starts, so a Core
    /// worker exports neither.
    pub fn preset_jetstream(&self) {
        preset(&self.gaps, &GapCause::ALL.map(GapCause::label));
        preset(
            &self.witnessed,
            &WitnessOutcome::ALL.map(WitnessOutcome::label),
        );
    }

    pub fn nats_connection_event(&self, event: &Event) {
        self.nats_connection_events
            .with_label_values(&[connection_event_label(event)])
            .inc();
    }

    /// A message of `stream` applied: its stream sequence and what the consumer still has to deliver.
    pub fn jetstream_applied(&self, stream: &str, sequence: u64, pending: u64) {
        self.last_sequence
            .with_label_values(&[stream])
            .set(gauge_value(sequence));
        self.pending
            .with_label_values(&[stream])
            .set(gauge_value(pending));
    }

    pub fn jetstream_resume(&self, outcome: ResumeOutcome) {
        self.resumes.with_label_values(&[outcome.label()]).inc();
    }

    /// A possible loss of a JetStream source, by cause.
    pub fn jetstream_gap(&self, cause: GapCause) {
        self.gaps.with_label_values(&[cause.label()]).inc();
    }

    /// A stream is consumed (1) or no longer (-1).
    pub fn jetstream_streams(&self, change: i64) {
        self.streams.add(change);
    }

    /// Whether the JetStream source is behind.
    pub fn jetstream_behind(&self, behind: bool) {
        self.behind.set(i64::from(behind));
    }

    /// Whether `stream` refuses display events for `cause`.
    pub fn jetstream_refusing(&self, stream: &str, cause: Refusal, refusing: bool) {
        self.refusing
            .with_label_values(&[stream, cause.label()])
            .set(i64::from(refusing));
    }

    /// `count` events judged by the Core witness alike.
    pub fn witnessed(&self, result: WitnessOutcome, count: u64) {
        if count > 0 {
            self.witnessed
                .with_label_values(&[result.label()])
                .inc_by(count);
        }
    }
}
