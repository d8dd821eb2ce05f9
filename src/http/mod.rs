//! The HTTP API (worker.md section 3): `router(state)` and the shared `AppState`. Handlers are thin: extract,
//! call one function, map the result.

mod error;
mod health;
mod history;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use subtle::ConstantTimeEq;

pub use error::ApiError;
pub use history::{ThreadId, canonical_object_id};

use crate::cache::Views;
use crate::config::Secret;
use crate::health::Readiness;
use crate::metrics::Metrics;

/// What every handler may use. Cloning is cheap.
#[derive(Clone)]
pub struct AppState {
    pub views: Views,
    pub metrics: Metrics,
    pub readiness: Readiness,
    /// When set, `/v1/*` requires `Authorization: Bearer <token>`.
    pub api_token: Option<Arc<Secret>>,
    /// The OpenAPI document as JSON, served at `/openapi.json`.
    pub openapi: Bytes,
}

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/threads/{thread_id}/history", get(history::get_history))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(api)
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/openapi.json", get(health::openapi))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::NotFound
}

/// Checks the bearer token in constant time when one is configured.
async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(expected) = &state.api_token {
        let presented = request
            .headers()
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !bool::from(presented.as_bytes().ct_eq(expected.expose().as_bytes())) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(request).await)
}
