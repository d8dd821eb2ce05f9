//! The demo conversation of `make run` gives the expected transcript, live and from the store.

#[path = "../../examples/demo/conversation.rs"]
pub mod conversation;

use conversation::{EXPECTED, PRIMARY, rows, transcript};

use crate::helpers::{publish_rows, spawn_app};

fn expected() -> Vec<(String, String)> {
    EXPECTED
        .iter()
        .map(|(r, t)| (r.to_string(), t.to_string()))
        .collect()
}

#[tokio::test]
async fn the_demo_conversation_reconstructs_as_expected_live_and_from_the_store() {
    let app = spawn_app().await;
    let query = format!("agent_class={}&agent_id={}", PRIMARY.0, PRIMARY.1);

    let live = rows("live");
    publish_rows(&app.publisher, &live).await;
    app.api.wait_for_events(live.len() as u64).await;
    let reply = app.api.history("live", &query).await;
    assert_eq!(transcript(&reply.json()), expected(), "{}", reply.body);

    let stored = rows("stored");
    app.store.insert_rows(&stored).await;
    let reply = app.api.history("stored", &query).await;
    assert_eq!(reply.source(), Some("store"));
    assert_eq!(transcript(&reply.json()), expected(), "{}", reply.body);
}
