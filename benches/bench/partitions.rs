//! Workers that divide the threads among them ([design 8](../../docs/design.md#8)), as the bench starts them: worker
//! `k` of `n` listens on `<prefix>k`, the port its peers reach it on (`HISTORY_VIEW_PEER_URL` with `{partition}`, as
//! a StatefulSet's headless Service names each pod). Shared by P9(d) and P13.

use std::time::Duration;

use chat_history_view::partition::owner;
use test_support::process::port_prefix;

use crate::setup::Setup;
use crate::worker::Worker;

/// `count` workers' ports and partition settings. One worker is an ordinary worker, with no partition settings
/// (the binary takes `HISTORY_VIEW_PARTITIONS=1` as unpartitioned).
pub struct Partitions {
    pub count: u32,
    /// The ports' prefix: worker `k` listens on `prefix * 10 + k`.
    prefix: u16,
}

impl Partitions {
    /// `count` (at most 10) workers on ports free now.
    pub fn new(count: u32) -> Self {
        let digits = u16::try_from(count).expect("at most 10 partitions");
        Self {
            count,
            prefix: port_prefix(digits),
        }
    }

    /// The partition that owns `thread`: nats-server's `partition()` of its id.
    pub fn owner(&self, thread: &str) -> u32 {
        owner(thread, self.count)
    }

    /// Starts worker `partition` on `database` with `env` (which sets the source) besides its partition settings;
    /// returns as soon as it answers `/healthz`, so the caller can time its way to `/readyz`.
    pub async fn start(
        &self,
        setup: &Setup,
        partition: u32,
        database: &str,
        env: &[(&str, String)],
    ) -> Worker {
        let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (partitions, this, peers) = (
            self.count.to_string(),
            partition.to_string(),
            format!("http://127.0.0.1:{}{{partition}}", self.prefix),
        );
        if self.count > 1 {
            env.extend([
                ("HISTORY_VIEW_PARTITIONS", partitions.as_str()),
                ("HISTORY_VIEW_PARTITION", this.as_str()),
                ("HISTORY_VIEW_JETSTREAM_REPLICAS", "1"),
                ("HISTORY_VIEW_PEER_URL", peers.as_str()),
            ]);
        }
        let port = self.prefix * 10 + partition as u16;
        Worker::start_on(setup, port, database, &env).await
    }

    /// Starts every worker in turn, each ready (within [`Worker::wait_ready_within`]'s bound plus `extra`) before the
    /// next starts: the first creates the partitioned stream the others find.
    pub async fn start_all(
        &self,
        setup: &Setup,
        database: &str,
        env: &[(&str, String)],
        extra: Duration,
    ) -> Vec<Worker> {
        let mut workers = Vec::new();
        for partition in 0..self.count {
            let worker = self.start(setup, partition, database, env).await;
            worker.wait_ready_within(extra).await;
            workers.push(worker);
        }
        workers
    }
}
