//! The HTTP contract: ETag and 304, every 400, 401 with a token, canonical ids, JSON errors, the OpenAPI document.

use serde_json::json;

use crate::cases::cases_dir;
use crate::helpers::{chunk_row, spawn_app, spawn_app_with, turns, user_row};

#[tokio::test]
async fn a_matching_if_none_match_gives_304_and_the_second_read_comes_from_the_cache() {
    let app = spawn_app().await;
    app.store
        .insert_rows(&[
            user_row("t1", "d1", "e1", 1, "Q"),
            chunk_row("t1", "d1", "A", "e2", 2, "A"),
        ])
        .await;
    let first = app.api.history("t1", "").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.source(), Some("store"));
    let etag = first.header("etag").expect("an ETag").to_owned();
    assert!(etag.starts_with('"') && etag.ends_with('"'), "{etag}");

    let second = app.api.history("t1", "").await;
    assert_eq!(second.source(), Some("cache"));
    assert_eq!(second.header("etag"), Some(etag.as_str()));
    assert_eq!(second.body, first.body);

    let path = "/v1/threads/t1/history";
    let not_modified = app.api.get(path, &[("if-none-match", &etag)]).await;
    assert_eq!(not_modified.status, 304);
    assert_eq!(not_modified.header("etag"), Some(etag.as_str()));
    assert!(not_modified.body.is_empty());
    let other = app
        .api
        .get(path, &[("if-none-match", "\"something-else\"")])
        .await;
    assert_eq!(other.status, 200);

    // The query changes the answer, so it changes the ETag.
    let with_primary = app.api.history("t1", "agent_class=A&agent_id=a1").await;
    assert_eq!(with_primary.status, 200);
    assert_eq!(with_primary.body, first.body);
    assert_eq!(
        with_primary.header("etag"),
        Some(etag.as_str()),
        "same body, same ETag"
    );
}

#[tokio::test]
async fn bad_thread_ids_and_half_identities_are_400_with_json_errors() {
    let app = spawn_app().await;
    let long = "x".repeat(257);
    for (path, code) in [
        ("/v1/threads//history".to_owned(), "invalid_thread_id"),
        (format!("/v1/threads/{long}/history"), "invalid_thread_id"),
        ("/v1/threads/a.b/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a*/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%3Eb/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%20b/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%09b/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%FFb/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%00b/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%1Bb/history".to_owned(), "invalid_thread_id"),
        ("/v1/threads/a%7Fb/history".to_owned(), "invalid_thread_id"),
        (
            "/v1/threads/t/history?agent_class=%FF&agent_id=a".to_owned(),
            "invalid_query",
        ),
        (
            "/v1/threads/t/history?agent_class=A%00&agent_id=a".to_owned(),
            "invalid_query",
        ),
        (
            "/v1/threads/t/history?agent_class=A".to_owned(),
            "incomplete_identity",
        ),
        (
            "/v1/threads/t/history?agent_id=a".to_owned(),
            "incomplete_identity",
        ),
        (
            "/v1/threads/t/history?agent_class=&agent_id=a".to_owned(),
            "incomplete_identity",
        ),
        (
            "/v1/threads/t/history?canonicalize=maybe".to_owned(),
            "invalid_query",
        ),
        (
            "/v1/threads/%20/history?canonicalize=true".to_owned(),
            "invalid_thread_id",
        ),
    ] {
        let reply = app.api.get(&path, &[]).await;
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert_eq!(reply.json()["error"]["code"], code, "{path}");
        assert!(reply.json()["error"]["message"].is_string());
        assert_eq!(reply.header("x-should-retry"), Some("false"), "{path}");
    }
    let reply = app.api.get("/v1/nowhere", &[]).await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.json()["error"]["code"], "not_found");
    assert_eq!(reply.header("x-should-retry"), Some("false"));
}

/// Issue 37: a 405 had an empty body. It is the JSON error every other error is, with `Allow`, and not retryable.
#[tokio::test]
async fn a_method_a_path_does_not_serve_is_a_405_with_a_json_error_and_allow() {
    let app = spawn_app().await;
    for (method, path, allow) in [
        (
            reqwest::Method::DELETE,
            "/v1/threads/t1/history",
            "GET,HEAD",
        ),
        (
            reqwest::Method::POST,
            "/v1/conversations/t1/items",
            "GET,HEAD",
        ),
        (reqwest::Method::GET, "/v1/threads/t1/verify", "POST"),
        (reqwest::Method::POST, "/readyz", "GET,HEAD"),
    ] {
        let response = app
            .api
            .http
            .request(method.clone(), format!("{}{path}", app.api.address))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 405, "{method} {path}");
        let headers = response.headers().clone();
        assert_eq!(headers["x-should-retry"], "false", "{method} {path}");
        assert_eq!(headers["allow"], allow, "{method} {path}");
        let body: serde_json::Value = response.json().await.expect("a JSON body");
        assert_eq!(
            body["error"]["code"], "method_not_allowed",
            "{method} {path}"
        );
    }
}

#[tokio::test]
async fn a_configured_token_is_required_on_the_read_api_only() {
    let app = spawn_app_with(|c| {
        c.http.api_token = Some(chat_history_view::config::Secret::new("s3cret"))
    })
    .await;
    let path = "/v1/threads/t1/history";
    for headers in [
        &[][..],
        &[("authorization", "Bearer wrong")][..],
        &[("authorization", "Bearer s3cret2")][..],
        &[("authorization", "Bearer s3cre")][..],
        &[("authorization", "Basic s3cret")][..],
        &[("authorization", "s3cret")][..],
    ] {
        let reply = app.api.get(path, headers).await;
        assert_eq!(reply.status, 401, "{headers:?}");
        assert_eq!(reply.json()["error"]["code"], "unauthorized");
        assert_eq!(reply.header("www-authenticate"), Some("Bearer"));
        assert_eq!(reply.header("x-should-retry"), Some("false"));
    }
    // The scheme is case-insensitive (RFC 9110).
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let authorization = format!("{scheme} s3cret");
        let reply = app
            .api
            .get(path, &[("authorization", authorization.as_str())])
            .await;
        assert_eq!(reply.status, 200, "{scheme}: {}", reply.body);
    }
    for open in ["/healthz", "/readyz", "/metrics", "/openapi.json"] {
        assert_eq!(app.api.get(open, &[]).await.status, 200, "{open}");
    }
}

#[tokio::test]
async fn canonicalize_applies_aihubs_object_id_rule() {
    let app = spawn_app().await;
    let table: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(cases_dir().join("canonical-ids.json")).unwrap(),
    )
    .unwrap();
    for (i, row) in table.iter().enumerate() {
        let canonical = row["canonical"].as_str().unwrap();
        app.store
            .insert_rows(&[user_row(canonical, "d1", &format!("e{i}"), 1, canonical)])
            .await;
    }
    for row in &table {
        let (input, canonical) = (
            row["input"].as_str().unwrap(),
            row["canonical"].as_str().unwrap(),
        );
        let reply = app.api.history(input, "canonicalize=true").await;
        assert_eq!(reply.status, 200, "{input}: {}", reply.body);
        assert_eq!(
            reply.json(),
            json!({"thread_id": canonical, "messages": turns(&[("user", canonical)])}),
            "{input}"
        );
    }
    // Without the flag the id is used as stored.
    let reply = app.api.history("ext-42", "").await;
    assert_eq!(reply.json()["messages"], json!([]));
}

#[tokio::test]
async fn the_served_openapi_document_is_docs_openapi_yaml() {
    let app = spawn_app().await;
    let reply = app.api.get("/openapi.json", &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let file =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.yaml")).unwrap();
    let expected: serde_json::Value = serde_norway::from_str(&file).unwrap();
    assert_eq!(reply.json(), expected);
    assert_eq!(expected["openapi"], "3.1.0");
    // Every status the API answers is described.
    let responses = &expected["paths"]["/v1/threads/{thread_id}/history"]["get"]["responses"];
    for status in ["200", "304", "400", "401", "503"] {
        assert!(
            responses.get(status).is_some(),
            "status {status} is not described"
        );
    }
}
