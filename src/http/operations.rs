//! Operations endpoints: liveness, readiness, Prometheus metrics and the OpenAPI document.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde_json::json;

use super::AppState;

pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let readiness = &state.readiness;
    let (nats, store, shutdown) = (readiness.nats(), readiness.store(), readiness.shutdown());
    let warm_up = readiness.warm_up();
    let ready = nats.ok && store.ok && shutdown.ok && warm_up.ok;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "ready": ready,
        "checks": {
            "nats": {"ok": nats.ok, "detail": nats.detail},
            "store": {"ok": store.ok, "detail": store.detail},
            "shutdown": {"ok": shutdown.ok, "detail": shutdown.detail},
            "warm_up": {"ok": warm_up.ok, "detail": warm_up.detail},
        }
    });
    (status, Json(body))
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state.views.report_size().await;
    let readiness = &state.readiness;
    state.metrics.readiness(
        readiness.nats().ok,
        readiness.store().ok,
        readiness.nats_connected(),
    );
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        state.exposition.render(),
    )
}

pub async fn openapi(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.clone(),
    )
}
