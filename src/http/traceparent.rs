//! The server span of an API request ([design 5](../../docs/design.md#5), "Traces"): every route under `/v1/` and
//! `/inspect/` runs inside one, `{METHOD} {route}`, whose parent is the caller's `traceparent` when the request
//! carries a valid one; its status is recorded as the answer leaves, and the answer carries the span's own
//! `traceparent`, so the caller learns where its read is in the trace. The operations endpoints get none (the router
//! adds them outside this middleware), nor does a path no route matched.
//!
//! A live feed's span covers opening it (routing, the first read, the resume) and ends with the response head: a
//! feed lives for minutes or hours, and a span held open that long would be exported only at its end, if ever. The
//! feed's later reads are background work, whose spans are roots the configured sampler decides.
//!
//! With tracing off this adds nothing to a request: [`trace::enabled`] is checked first, before any header is read.

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::TraceContextExt;
use tracing::Instrument;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::telemetry::trace;

/// Runs the request inside its server span when tracing is on.
pub(super) async fn trace_request(request: Request, next: Next) -> Response {
    if !trace::enabled() {
        return next.run(request).await;
    }
    traced(request, next).await
}

/// Runs the request inside its server span: made, parented to the caller's context, the status recorded and the
/// span's `traceparent` added to the answer (by `inject`, only when tracing is on).
async fn traced(request: Request, next: Next) -> Response {
    let Some(span) = server_span(&request) else {
        return next.run(request).await;
    };
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    // An integer attribute: `tracing` hands unsigned values to the OpenTelemetry layer as text.
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
    trace::inject(&span, response.headers_mut());
    response
}

/// The server span of `request`, a child of the caller's span when its `traceparent` is valid and a root
/// otherwise; `None` for a path no route matched (the fallback's 404).
fn server_span(request: &Request) -> Option<tracing::Span> {
    let route = request.extensions().get::<MatchedPath>()?.as_str();
    let method = request.method().as_str();
    let span = tracing::info_span!(
        "request",
        otel.name = %format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = method,
        http.route = route,
        url.path = request.uri().path(),
        http.response.status_code = Empty,
        otel.status_code = Empty,
    );
    let caller = trace::caller_context(request.headers());
    if caller.span().span_context().is_valid() {
        // Err: the span is disabled (no layer takes it); it has no parent to set.
        let _ = span.set_parent(caller);
    }
    Some(span)
}

#[cfg(test)]
mod tests {
    use axum::Router;
    use axum::body::Body;
    use axum::http::StatusCode;
    use axum::routing::get;
    use opentelemetry::trace::{SpanKind, Status};
    use tower_service::Service;

    use super::*;
    use crate::telemetry::testing::{attribute, is_child_of, record};

    const CALLER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A router whose handlers open a span of their own (so the test sees what runs inside the server span),
    /// behind the middleware as it runs with tracing on.
    fn app() -> Router {
        async fn read() -> &'static str {
            tracing::info_span!("inner").in_scope(|| "ok")
        }
        async fn fail() -> StatusCode {
            tracing::info_span!("inner").in_scope(|| StatusCode::SERVICE_UNAVAILABLE)
        }
        Router::new()
            .route("/v1/threads/{thread_id}/history", get(read))
            .route("/v1/threads/{thread_id}/verify", get(fail))
            .fallback(|| async { StatusCode::NOT_FOUND })
            .layer(axum::middleware::from_fn(traced))
    }

    async fn call(path: &str, traceparent: Option<&str>) -> Response {
        let mut request = Request::builder().uri(path);
        if let Some(value) = traceparent {
            request = request.header("traceparent", value);
        }
        // The router is always ready: no `poll_ready` needed before `call`.
        app()
            .call(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_request_with_a_valid_traceparent_is_a_child_of_the_callers_span_and_the_handler_runs_inside_it()
     {
        let spans = record();
        let response = call("/v1/threads/t1/history", Some(CALLER)).await;
        assert_eq!(response.status(), StatusCode::OK);
        let server = spans.one("GET /v1/threads/{thread_id}/history");
        assert_eq!(server.span_kind, SpanKind::Server);
        assert_eq!(
            server.span_context.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(server.parent_span_id.to_string(), "b7ad6b7169203331");
        assert!(server.parent_span_is_remote);
        for (key, value) in [
            ("http.request.method", "GET"),
            ("http.route", "/v1/threads/{thread_id}/history"),
            ("url.path", "/v1/threads/t1/history"),
        ] {
            assert_eq!(
                attribute(&server, key).map(|v| v.to_string()),
                Some(value.to_owned()),
                "{key}"
            );
        }
        assert_eq!(
            attribute(&server, "http.response.status_code"),
            Some(opentelemetry::Value::I64(200))
        );
        assert_eq!(server.status, Status::Unset);
        assert!(is_child_of(&spans.one("inner"), &server));
        // Tracing is off for the process in unit tests: `inject` adds nothing, whatever span is current.
        assert!(response.headers().get("traceparent").is_none());
    }

    #[tokio::test]
    async fn a_request_without_a_valid_traceparent_is_a_root_and_a_5xx_is_an_error() {
        let spans = record();
        call("/v1/threads/t1/history", None).await;
        call(
            "/v1/threads/t1/verify",
            Some("00-00000000000000000000000000000000-b7ad6b7169203331-01"),
        )
        .await;
        let read = spans.one("GET /v1/threads/{thread_id}/history");
        assert_eq!(read.parent_span_id, opentelemetry::trace::SpanId::INVALID);
        let failed = spans.one("GET /v1/threads/{thread_id}/verify");
        assert_eq!(failed.parent_span_id, opentelemetry::trace::SpanId::INVALID);
        assert_ne!(failed.span_context.trace_id(), read.span_context.trace_id());
        assert!(matches!(failed.status, Status::Error { .. }));
        assert_eq!(
            attribute(&failed, "http.response.status_code"),
            Some(opentelemetry::Value::I64(503))
        );
    }

    #[tokio::test]
    async fn a_path_no_route_matched_gets_no_span() {
        let spans = record();
        let response = call("/nowhere", Some(CALLER)).await;
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert!(spans.spans().is_empty(), "{:?}", spans.spans());
    }

    #[tokio::test]
    async fn with_tracing_off_the_middleware_adds_no_header() {
        let response = Router::new()
            .route("/v1/threads/{thread_id}/history", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn(trace_request))
            .call(
                Request::builder()
                    .uri("/v1/threads/t1/history")
                    .header("traceparent", CALLER)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert!(!trace::enabled());
        assert!(response.headers().get("traceparent").is_none());
        assert!(response.headers().get("tracestate").is_none());
    }
}
