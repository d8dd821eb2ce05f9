//! Demo client: plays aihub's part for a realistic two-turn conversation (publishes the display events on NATS, then
//! persists them in `agent_events` as aihub's persister does), reads the thread's history back from a running
//! chat-history-view, prints the transcript, and fails if it is not the expected one.
//!
//! Environment: `HISTORY_VIEW_NATS_URL` (default nats://127.0.0.1:4222), `HISTORY_VIEW_MONGODB_URI` (default
//! mongodb://127.0.0.1:27017), `HISTORY_VIEW_MONGODB_DATABASE` (default aihub), `DEMO_API` (default
//! http://127.0.0.1:8080), `DEMO_THREAD` (default: a fresh id).

mod conversation;

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aihub_rows::subject;
use chat_history_view::http::SOURCE_HEADER;
use conversation::{EXPECTED, PRIMARY, rows, transcript};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("demo failed: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> anyhow::Result<bool> {
    let nats_url =
        std::env::var("HISTORY_VIEW_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let api = std::env::var("DEMO_API").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let thread = std::env::var("DEMO_THREAD").unwrap_or_else(|_| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("demo{:x}", nanos % 0xffff_ffff)
    });

    let client = async_nats::connect(&nats_url).await?;
    let rows = rows(&thread);
    println!(
        "Publishing {} display events for thread {thread} on {nats_url}:",
        rows.len()
    );
    for row in &rows {
        let subject = subject(row);
        println!("  {subject}");
        client
            .publish(subject, serde_json::to_vec(&row["event_data"])?.into())
            .await?;
    }
    client.flush().await?;

    // aihub's persister writes every event to agent_events (its entity declares the index history reads use).
    let mongodb_uri = std::env::var("HISTORY_VIEW_MONGODB_URI")
        .unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
    let database =
        std::env::var("HISTORY_VIEW_MONGODB_DATABASE").unwrap_or_else(|_| "aihub".into());
    let events = mongodb::Client::with_uri_str(&mongodb_uri)
        .await?
        .database(&database)
        .collection::<mongodb::bson::Document>("agent_events");
    events
        .create_index(
            mongodb::IndexModel::builder()
                .keys(mongodb::bson::doc! {"thread_id": 1, "event_type": 1, "event_parents": 1})
                .options(
                    mongodb::options::IndexOptions::builder()
                        .name("thread_id_1_event_type_1_event_parents_1".to_owned())
                        .build(),
                )
                .build(),
        )
        .await?;
    let documents = rows
        .iter()
        .map(mongodb::bson::to_document)
        .collect::<Result<Vec<_>, _>>()?;
    events.insert_many(documents).await?;
    println!("Persisted them in {database}.agent_events, as aihub's persister does.");

    let url = format!(
        "{api}/v1/threads/{thread}/history?agent_class={}&agent_id={}",
        PRIMARY.0, PRIMARY.1
    );
    let uri: hyper::Uri = url.parse()?;
    let http = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let deadline = Instant::now() + Duration::from_secs(15);
    let (body, source) = loop {
        let response = http.get(uri.clone()).await?;
        let source = response
            .headers()
            .get(SOURCE_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("?")
            .to_owned();
        let body: serde_json::Value =
            serde_json::from_slice(&response.into_body().collect().await?.to_bytes())?;
        if transcript(&body).len() >= EXPECTED.len() || Instant::now() > deadline {
            break (body, source);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    println!("\nGET {url}\n(X-History-Source: {source})\n");
    let actual = transcript(&body);
    for (role, text) in &actual {
        println!("  {role:>9}: {text}");
    }
    let expected: Vec<(String, String)> = EXPECTED
        .iter()
        .map(|(r, t)| (r.to_string(), t.to_string()))
        .collect();
    if actual == expected {
        println!(
            "\nThe history matches the expected transcript: hidden displays left out, the delegate's chunk kept,"
        );
        println!(
            "the stop's unstreamed end appended, the HITL question and answer as assistant and user turns."
        );
        Ok(true)
    } else {
        eprintln!(
            "\nunexpected history: {}",
            serde_json::to_string_pretty(&body)?
        );
        Ok(false)
    }
}
