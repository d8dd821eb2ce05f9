//! P12: what the Core witness (`HISTORY_VIEW_JETSTREAM_WITNESS`) costs the JetStream source, paired: the same P1
//! messages published on Core NATS into one class stream (`agent.>`, file storage), consumed by a fresh JetStream
//! worker per round, rounds alternating the witness off and on. Each round reports the worker's CPU per event (from
//! the OS, its whole process) and its rate; the verdict compares the per-side medians (target: the witness costs
//! at most 10% of the worker's CPU per event, the bar for making it the default).

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;

use crate::report::{self, Row, fmt_count, progress};
use crate::setup::Setup;

const ROUNDS: usize = 6;
const STREAM: &str = "agent_bench_stream";
const POLL: Duration = Duration::from_millis(20);
const STALL: Duration = Duration::from_secs(5);

struct Round {
    witness: bool,
    received: u64,
    elapsed: Duration,
    cpu: Duration,
}

impl Round {
    fn cpu_per_event(&self) -> f64 {
        report::cpu_per_event(self.cpu, self.received)
    }

    fn rate(&self) -> f64 {
        report::rate(self.received, self.elapsed)
    }
}

pub async fn run(setup: Arc<Setup>) -> Vec<Row> {
    let n = setup.settings.events_p1;
    let messages = crate::p1_ingest::messages(n);
    let client = setup.nats_client().await;
    let context = jetstream::new(client.clone());
    let _ = context.delete_stream(STREAM).await;
    let stream = context
        .create_stream(jetstream::stream::Config {
            name: STREAM.into(),
            subjects: vec!["agent.>".into()],
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("the bench's class stream");
    let mut rounds = Vec::new();
    for number in 1..=ROUNDS {
        stream
            .purge()
            .await
            .expect("an empty stream for each round");
        let witness = number % 2 == 0;
        let worker = setup
            .start_worker(
                &format!("bench_p12_{number}"),
                &[
                    ("HISTORY_VIEW_SOURCE", "jetstream"),
                    ("HISTORY_VIEW_JETSTREAM_STREAMS", STREAM),
                    ("HISTORY_VIEW_JETSTREAM_REPLAY_SECS", "0"),
                    (
                        "HISTORY_VIEW_JETSTREAM_WITNESS",
                        if witness { "on" } else { "off" },
                    ),
                ],
            )
            .await;
        let cpu_before = worker.cpu_time();
        let started = Instant::now();
        for message in messages.iter() {
            message.publish(&client).await;
        }
        client.flush().await.expect("flush the publisher");
        let finished = worker.wait_received(n as u64, POLL, STALL).await;
        let cpu = worker.cpu_time().saturating_sub(cpu_before);
        let round = Round {
            witness,
            received: worker.metrics().await.events_received(),
            elapsed: finished - started,
            cpu,
        };
        progress(
            "P12",
            &format!(
                "round {number}: witness {}, {} of {n} events, {}/s, {:.2} µs CPU per event",
                if witness { "on" } else { "off" },
                round.received,
                fmt_count(round.rate()),
                round.cpu_per_event()
            ),
        );
        rounds.push(round);
    }
    let _ = context.delete_stream(STREAM).await;
    let median = |witness: bool| {
        let mut of: Vec<f64> = rounds
            .iter()
            .filter(|r| r.witness == witness)
            .map(Round::cpu_per_event)
            .collect();
        of.sort_by(f64::total_cmp);
        of[of.len() / 2]
    };
    let (off, on) = (median(false), median(true));
    let complete = rounds.iter().all(|r| r.received == n as u64);
    let mut rows = vec![Row::check(
        "P12",
        "Core witness: worker CPU per event, JetStream source",
        format!(
            "median {on:.2} µs with the witness against {off:.2} µs without = {:.2}x",
            on / off
        ),
        "<= 1.10x (then on by default with the class streams); every event received",
        on <= off * 1.10 && complete,
    )];
    rows.extend(rounds.iter().enumerate().map(|(i, r)| {
        Row::info(
            "P12",
            format!("round {}", i + 1),
            format!(
                "witness {}: {} events, {}/s, {:.2} µs CPU per event",
                if r.witness { "on" } else { "off" },
                r.received,
                fmt_count(r.rate()),
                r.cpu_per_event()
            ),
        )
    }));
    rows
}
