//! aihub's JetStream class streams, created as aihub creates them: `agent_<Class>_stream` over
//! `agent.<Class>.*.*.*.*.*.*.*`, file storage (the worker creates no stream; its JetStream source consumes these).

use std::time::{Duration, Instant};

use async_nats::jetstream;

/// Creates aihub's stream of each agent class (the worker creates none).
pub async fn create_class_streams(nats_url: &str, classes: impl IntoIterator<Item = String>) {
    create_replicated_class_streams(nats_url, classes, 1).await;
}

/// [`create_class_streams`] with `replicas` (a cluster's meta leader may take a few seconds to be elected).
pub async fn create_replicated_class_streams(
    nats_url: &str,
    classes: impl IntoIterator<Item = String>,
    replicas: usize,
) {
    let client = async_nats::connect(nats_url).await.expect("nats client");
    let context = jetstream::new(client);
    for class in classes {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let created = context
                .create_stream(jetstream::stream::Config {
                    name: format!("agent_{class}_stream"),
                    subjects: vec![format!("agent.{class}.*.*.*.*.*.*.*")],
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(_) => break,
                Err(error) => assert!(Instant::now() < deadline, "a class stream: {error}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Waits (at most 60 s) until `stream` holds `messages` messages: what was published on Core NATS into it is stored.
pub async fn wait_until_stored(context: &jetstream::Context, stream: &str, messages: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut handle = context.get_stream(stream).await.expect("the stream");
        let held = handle.info().await.expect("its info").state.messages;
        if held == messages {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{stream} holds {held} of {messages} messages"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
