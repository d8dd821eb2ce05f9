//! Traces ([design 5](../../docs/design.md#5), "Traces"): OpenTelemetry through `tracing`, exported over OTLP/HTTP
//! with protobuf, W3C trace context in and out. Off unless an OTLP endpoint is set: no provider, no exporter, and no
//! `tracing` span of the worker's is then enabled by any layer, so each costs one cached callsite check.
//!
//! What this module owns: the settings (the standard `OTEL_*` variables), the provider and its sampler, and the
//! propagation glue: `opentelemetry-http`'s extractor and injector for HTTP headers, and the one extractor written
//! here, over async-nats header maps (whose lookups are case-sensitive, where aihub's names may differ in case).
//!
//! Sampling: the configured sampler (by default parent-based, with 1% of roots) decides every span of a read. An
//! ingested event gets no span of its own unless [`sample_ingest`] decides, before any span is made, that it is
//! one of the sampled roots: its short `process` span is then always recorded ([`WorkerSampler`]) and linked, not
//! parented, to the publisher's context, so a publisher that samples everything does not make the worker trace
//! everything.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Link, SpanContext, SpanKind, TraceContextExt, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, SamplingResult, SdkTracerProvider,
    ShouldSample, SpanData, SpanExporter,
};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::RateLimit;

/// The name of an ingested event's span (messaging semantic conventions: the operation, `process`).
pub const INGEST_SPAN: &str = "process";
/// The service name when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names one.
const SERVICE_NAME: &str = "chat-history-view";
/// The ratio of root spans sampled when `OTEL_TRACES_SAMPLER` is unset (the SDK's own default samples all).
const DEFAULT_ROOT_RATIO: f64 = 0.01;
/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most links to publishers' contexts one hydration or fill span carries.
pub const MAX_LINKS: usize = 32;

/// The samplers of the OpenTelemetry specification (`OTEL_TRACES_SAMPLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum SamplerKind {
    AlwaysOn,
    AlwaysOff,
    #[value(name = "traceidratio")]
    TraceIdRatio,
    ParentbasedAlwaysOn,
    ParentbasedAlwaysOff,
    #[value(name = "parentbased_traceidratio")]
    ParentbasedTraceIdRatio,
}

/// The tracing settings (help heading "Tracing"): the standard OpenTelemetry variables. `OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_EXPORTER_OTLP_HEADERS` are read by the SDK itself.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Tracing")]
#[deny(missing_docs)]
pub struct TraceSettings {
    /// The OTLP/HTTP collector's base URL (spans go to its /v1/traces), http or https. Unset (or empty): tracing is
    /// off, with no exporter and no span recorded. Its value is never shown (it may carry `user:password@`).
    #[arg(
        id = "otel_exporter_otlp_endpoint",
        value_name = "URL",
        long = "otel-exporter-otlp-endpoint",
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        hide_env_values = true,
        value_parser = endpoint
    )]
    pub endpoint: Option<Endpoint>,
    /// The full URL spans are sent to, instead of the base URL's /v1/traces.
    #[arg(
        id = "otel_exporter_otlp_traces_endpoint",
        value_name = "URL",
        long = "otel-exporter-otlp-traces-endpoint",
        env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        hide_env_values = true,
        value_parser = endpoint
    )]
    pub traces_endpoint: Option<Endpoint>,
    /// The OTLP protocol: only http/protobuf.
    #[arg(
        id = "otel_exporter_otlp_protocol",
        value_name = "PROTOCOL",
        long = "otel-exporter-otlp-protocol",
        env = "OTEL_EXPORTER_OTLP_PROTOCOL",
        default_value = "http/protobuf",
        value_parser = ["http/protobuf"]
    )]
    pub protocol: String,
    /// The sampler: always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or
    /// parentbased_traceidratio. Unset: parentbased_traceidratio with a ratio of 0.01.
    #[arg(
        id = "otel_traces_sampler",
        value_name = "SAMPLER",
        long = "otel-traces-sampler",
        env = "OTEL_TRACES_SAMPLER",
        value_parser = sampler_kind
    )]
    pub sampler: Option<Choice>,
    /// The ratio sampler's ratio, 0 to 1. Unset: 1 for a sampler named by OTEL_TRACES_SAMPLER, 0.01 by default.
    #[arg(
        id = "otel_traces_sampler_arg",
        value_name = "RATIO",
        long = "otel-traces-sampler-arg",
        env = "OTEL_TRACES_SAMPLER_ARG",
        value_parser = ratio
    )]
    pub sampler_arg: Option<Ratio>,
    /// true turns tracing off whatever the endpoint.
    #[arg(
        id = "otel_sdk_disabled",
        value_name = "BOOL",
        long = "otel-sdk-disabled",
        env = "OTEL_SDK_DISABLED",
        default_value = "false",
        action = clap::ArgAction::Set,
        value_parser = boolish
    )]
    pub disabled: bool,
}

/// An OTLP endpoint: an http or https URL, or nothing (an empty value, as a chart renders an unset one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint(Option<url::Url>);

fn endpoint(text: &str) -> Result<Endpoint, String> {
    if text.trim().is_empty() {
        return Ok(Endpoint(None));
    }
    let url = url::Url::parse(text).map_err(|error| format!("not a URL: {error}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
        return Err("an http:// or https:// URL with a host is required".into());
    }
    Ok(Endpoint(Some(url)))
}

/// A sampler named by `OTEL_TRACES_SAMPLER`, or nothing (an empty value counts as unset, as the specification
/// says of every `OTEL_*` variable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice(Option<SamplerKind>);

fn sampler_kind(text: &str) -> Result<Choice, String> {
    use clap::ValueEnum;
    if text.trim().is_empty() {
        return Ok(Choice(None));
    }
    SamplerKind::from_str(text.trim(), false)
        .map(|kind| Choice(Some(kind)))
        .map_err(|_| {
            let names: Vec<String> = SamplerKind::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_owned()))
                .collect();
            format!("one of {} is required", names.join(", "))
        })
}

/// `OTEL_SDK_DISABLED`: true or false in the usual spellings; empty counts as unset (false).
fn boolish(text: &str) -> Result<bool, String> {
    if text.trim().is_empty() {
        return Ok(false);
    }
    clap::builder::TypedValueParser::parse_ref(
        &clap::builder::BoolishValueParser::new(),
        &clap::Command::new("otel"),
        None,
        std::ffi::OsStr::new(text.trim()),
    )
    .map_err(|_| "true or false is required".to_owned())
}

/// A sampling ratio, 0 to 1, or nothing (an empty value).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratio(Option<f64>);

fn ratio(text: &str) -> Result<Ratio, String> {
    if text.trim().is_empty() {
        return Ok(Ratio(None));
    }
    match text.trim().parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(Ratio(Some(value))),
        _ => Err("a number from 0 to 1 is required".into()),
    }
}

impl TraceSettings {
    /// Where spans go, or `None` when tracing is off: no endpoint set (the exporter would fall back to
    /// localhost), or `OTEL_SDK_DISABLED=true`.
    pub fn traces_url(&self) -> Option<String> {
        if self.disabled {
            return None;
        }
        let url = |endpoint: &Option<Endpoint>| endpoint.as_ref().and_then(|e| e.0.clone());
        if let Some(url) = url(&self.traces_endpoint) {
            return Some(url.to_string());
        }
        let base = url(&self.endpoint)?;
        Some(format!("{}/v1/traces", base.as_str().trim_end_matches('/')))
    }

    /// Says at start whether tracing is on, where its spans go (without credentials) and how they are sampled:
    /// one INFO line, once logging is set up.
    pub fn announce(&self) {
        match self.traces_url().and_then(|url| url::Url::parse(&url).ok()) {
            Some(url) => tracing::info!(
                endpoint = %shown(&url),
                sampler = ?self.sampler(),
                "tracing on: spans are exported over OTLP/HTTP"
            ),
            None if self.disabled => tracing::info!("tracing off: OTEL_SDK_DISABLED is true"),
            None => tracing::info!("tracing off: no OTEL_EXPORTER_OTLP_ENDPOINT"),
        }
    }

    /// The configured sampler.
    pub fn sampler(&self) -> Sampler {
        let arg = self.sampler_arg.and_then(|r| r.0);
        match self.sampler.and_then(|choice| choice.0) {
            None => Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                arg.unwrap_or(DEFAULT_ROOT_RATIO),
            ))),
            Some(kind) => {
                let ratio = || Sampler::TraceIdRatioBased(arg.unwrap_or(1.0));
                match kind {
                    SamplerKind::AlwaysOn => Sampler::AlwaysOn,
                    SamplerKind::AlwaysOff => Sampler::AlwaysOff,
                    SamplerKind::TraceIdRatio => ratio(),
                    SamplerKind::ParentbasedAlwaysOn => {
                        Sampler::ParentBased(Box::new(Sampler::AlwaysOn))
                    }
                    SamplerKind::ParentbasedAlwaysOff => {
                        Sampler::ParentBased(Box::new(Sampler::AlwaysOff))
                    }
                    SamplerKind::ParentbasedTraceIdRatio => Sampler::ParentBased(Box::new(ratio())),
                }
            }
        }
    }
}

/// The provider's sampler: the configured one, except for an ingested event's root span, which [`sample_ingest`]
/// has already sampled by the configured sampler before the span was made (sampling it again would square the
/// ratio).
#[derive(Debug, Clone)]
struct WorkerSampler(Sampler);

impl ShouldSample for WorkerSampler {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let root = parent_context.is_none_or(|cx| !cx.span().span_context().is_valid());
        if root && *span_kind == SpanKind::Consumer && name == INGEST_SPAN {
            return SamplingResult {
                decision: SamplingDecision::RecordAndSample,
                attributes: Vec::new(),
                trace_state: TraceState::default(),
            };
        }
        self.0
            .should_sample(parent_context, trace_id, name, span_kind, attributes, links)
    }
}

/// What the ingest path needs to decide, per event, without a lock: the configured sampler and an id generator.
struct IngestSampling {
    sampler: Sampler,
    ids: RandomIdGenerator,
}

/// Set once, when tracing is on.
static INGEST: OnceLock<IngestSampling> = OnceLock::new();

/// Whether tracing is on (an endpoint is set and the provider was built).
pub fn enabled() -> bool {
    INGEST.get().is_some()
}

/// Whether the next ingested event gets a `process` span: the configured sampler's decision for a root span, made
/// before any span exists. False at once when tracing is off.
pub fn sample_ingest() -> bool {
    let Some(ingest) = INGEST.get() else {
        return false;
    };
    let trace_id = ingest.ids.new_trace_id();
    ingest
        .sampler
        .should_sample(None, trace_id, INGEST_SPAN, &SpanKind::Consumer, &[], &[])
        .decision
        == SamplingDecision::RecordAndSample
}

/// The running exporter: flushed and stopped by [`Tracer::shutdown`].
pub struct Tracer {
    provider: SdkTracerProvider,
}

impl Tracer {
    /// Exports what is still buffered and stops the exporter.
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "the trace exporter did not shut down cleanly");
        }
    }
}

/// The tracer provider, its sampler and the W3C propagator, when an endpoint is set; `None` (tracing off)
/// otherwise. Must run inside the tokio runtime: the batch processor and the HTTP client run on it.
pub fn build(
    settings: &TraceSettings,
) -> anyhow::Result<Option<(Tracer, opentelemetry_sdk::trace::Tracer)>> {
    let Some(url) = settings.traces_url() else {
        return Ok(None);
    };
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()?
        .https_or_http()
        .enable_http1()
        .build();
    let client = opentelemetry_http::hyper::HyperClient::new(https, EXPORT_TIMEOUT, None);
    // Credentials in the URL (`user:password@`) become a Basic authorization header, and the URL the exporter and
    // its HTTP client see has none: their log lines (hyper's pool names the authority at TRACE) cannot show them.
    let parsed = url::Url::parse(&url)?;
    let mut headers = std::collections::HashMap::new();
    if !parsed.username().is_empty() || parsed.password().is_some() {
        let decode = |part: &str| {
            percent_encoding::percent_decode_str(part)
                .decode_utf8_lossy()
                .into_owned()
        };
        let credentials = format!(
            "{}:{}",
            decode(parsed.username()),
            decode(parsed.password().unwrap_or_default())
        );
        use base64::Engine as _;
        headers.insert(
            "authorization".to_owned(),
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(credentials)
            ),
        );
    }
    let exporter = Reporting {
        exporter: opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(shown(&parsed).to_string())
            .with_headers(headers)
            .with_timeout(EXPORT_TIMEOUT)
            .with_http_client(client)
            .build()?,
        warned: RateLimit::default(),
    };
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let sampler = settings.sampler();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(WorkerSampler(sampler.clone()))
        .with_resource(resource())
        .build();
    let tracer = provider.tracer("chat-history-view");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let _ = INGEST.set(IngestSampling {
        sampler,
        ids: RandomIdGenerator::default(),
    });
    Ok(Some((Tracer { provider }, tracer)))
}

/// The spans the exporter could not send so far (`history_view_trace_spans_dropped_total`).
pub fn spans_dropped() -> u64 {
    SPANS_DROPPED.load(Ordering::Relaxed)
}

static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// `url` as logged: without its user and password.
fn shown(url: &url::Url) -> url::Url {
    let mut shown = url.clone();
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    shown
}

/// The OTLP exporter, reporting what it could not send: the spans are counted ([`spans_dropped`]) and a WARN is
/// logged at most once a second (its endpoint carries no credentials: [`build`] moved them to a header).
#[derive(Debug)]
struct Reporting<E> {
    exporter: E,
    warned: RateLimit,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.exporter.export(batch).await;
        if let Err(error) = &result {
            SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
            if self.warned.allow() {
                tracing::warn!(
                    %error,
                    spans,
                    "the trace exporter could not send spans to the collector; they are dropped"
                );
            }
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.exporter.set_resource(resource);
    }
}

/// The SDK's resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, the SDK's own attributes) with the
/// worker's name and version where they name none.
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::new("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    let mut builder = Resource::builder();
    if !named {
        builder = builder.with_service_name(SERVICE_NAME);
    }
    if detected
        .get(&opentelemetry::Key::new("service.version"))
        .is_none()
    {
        builder =
            builder.with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    }
    builder.build()
}

/// A NATS message's headers as the propagator reads them: names matched without regard to case.
pub struct NatsHeaders<'a>(pub &'a async_nats::HeaderMap);

impl Extractor for NatsHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| {
                let name: &str = name.as_ref();
                // The exact spelling first: one compare, where folding the case costs a step per byte (the ingest
                // path looks `traceparent` up in every message while tracing is on).
                name == key || name.eq_ignore_ascii_case(key)
            })
            .and_then(|(_, values)| values.first())
            .map(|value| value.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

/// The publisher's span context a message carries (`traceparent`, with `tracestate`), if valid.
pub fn publisher_context(headers: &async_nats::HeaderMap) -> Option<SpanContext> {
    // From an empty context: `extract` starts from the current one and returns it unchanged for a header it cannot
    // read, which inside a span would make that span's own context the publisher's.
    let cx =
        TraceContextPropagator::new().extract_with_context(&Context::new(), &NatsHeaders(headers));
    let span = cx.span();
    let context = span.span_context();
    context.is_valid().then(|| context.clone())
}

/// The caller's context an HTTP request carries (`traceparent`, with `tracestate`); an empty context without one.
pub fn caller_context(headers: &axum::http::HeaderMap) -> Context {
    TraceContextPropagator::new().extract_with_context(
        &Context::new(),
        &opentelemetry_http::HeaderExtractor(headers),
    )
}

/// Writes `span`'s context as `traceparent` (and `tracestate`) into `headers`: a forwarded request's, so that the
/// owner's spans join the trace, and an answer's, so that the caller learns the read's span. Nothing when tracing
/// is off or the span is disabled.
pub fn inject(span: &tracing::Span, headers: &mut axum::http::HeaderMap) {
    if !enabled() || span.is_disabled() {
        return;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return;
    }
    TraceContextPropagator::new()
        .inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers));
    // The propagator writes an empty `tracestate` when the trace has none: W3C allows leaving it out.
    if headers
        .get("tracestate")
        .is_some_and(|value| value.as_bytes().is_empty())
    {
        headers.remove("tracestate");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        trace: TraceSettings,
    }

    fn settings(args: &[&str]) -> Result<TraceSettings, clap::Error> {
        let mut argv = vec!["test"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).map(|cli| cli.trace)
    }

    #[test]
    fn tracing_is_off_without_an_endpoint_and_the_base_url_gains_the_traces_path() {
        let off = settings(&[]).unwrap();
        assert_eq!(off.traces_url(), None);
        let empty = settings(&["--otel-exporter-otlp-endpoint", ""]).unwrap();
        assert_eq!(empty.traces_url(), None);
        // Every empty OTEL_* value counts as unset, as a chart renders one it has no value for.
        let blank = settings(&[
            "--otel-traces-sampler",
            "",
            "--otel-traces-sampler-arg",
            "",
            "--otel-sdk-disabled",
            "",
            "--otel-exporter-otlp-endpoint",
            "http://collector:4318",
        ])
        .unwrap();
        assert!(blank.traces_url().is_some());
        assert!(format!("{:?}", blank.sampler()).contains("0.01"));
        let base = settings(&["--otel-exporter-otlp-endpoint", "http://collector:4318/"]).unwrap();
        assert_eq!(
            base.traces_url().as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        let full = settings(&[
            "--otel-exporter-otlp-endpoint",
            "http://collector:4318",
            "--otel-exporter-otlp-traces-endpoint",
            "https://other:443/custom",
        ])
        .unwrap();
        assert_eq!(full.traces_url().as_deref(), Some("https://other/custom"));
        let disabled = settings(&[
            "--otel-exporter-otlp-endpoint",
            "http://collector:4318",
            "--otel-sdk-disabled",
            "true",
        ])
        .unwrap();
        assert_eq!(disabled.traces_url(), None);
    }

    #[test]
    fn bad_values_are_refused() {
        for args in [
            &["--otel-exporter-otlp-endpoint", "collector:4318"][..],
            &["--otel-exporter-otlp-endpoint", "grpc://collector:4317"],
            &["--otel-exporter-otlp-protocol", "grpc"],
            &["--otel-traces-sampler", "xray"],
            &["--otel-traces-sampler-arg", "1.5"],
            &["--otel-traces-sampler-arg", "one"],
            &["--otel-sdk-disabled", "maybe"],
        ] {
            assert!(settings(args).is_err(), "{args:?}");
        }
    }

    fn samples(sampler: &Sampler, parent: Option<&Context>) -> bool {
        let trace_id = RandomIdGenerator::default().new_trace_id();
        sampler
            .should_sample(parent, trace_id, "read", &SpanKind::Server, &[], &[])
            .decision
            == SamplingDecision::RecordAndSample
    }

    fn remote_parent(sampled: bool) -> Context {
        let flags = if sampled {
            opentelemetry::trace::TraceFlags::SAMPLED
        } else {
            opentelemetry::trace::TraceFlags::default()
        };
        Context::new().with_remote_span_context(SpanContext::new(
            TraceId::from(7u128),
            opentelemetry::trace::SpanId::from(9u64),
            flags,
            true,
            TraceState::default(),
        ))
    }

    #[test]
    fn the_default_sampler_follows_the_parent_and_samples_one_root_in_a_hundred() {
        let sampler = settings(&[]).unwrap().sampler();
        assert!(samples(&sampler, Some(&remote_parent(true))));
        assert!(!samples(&sampler, Some(&remote_parent(false))));
        let sampled = (0..20_000).filter(|_| samples(&sampler, None)).count();
        // 1% of 20,000 is 200; the binomial's standard deviation is 14.
        assert!((100..300).contains(&sampled), "{sampled}");
        let all = settings(&["--otel-traces-sampler", "parentbased_traceidratio"]).unwrap();
        assert!((0..100).all(|_| samples(&all.sampler(), None)));
        let none = settings(&["--otel-traces-sampler", "always_off"]).unwrap();
        assert!(!samples(&none.sampler(), Some(&remote_parent(true))));
    }

    #[test]
    fn an_ingest_root_is_recorded_once_decided_and_other_spans_follow_the_configured_sampler() {
        let sampler = WorkerSampler(Sampler::AlwaysOff);
        let decide = |name: &str, kind: SpanKind, parent: Option<&Context>| {
            sampler
                .should_sample(parent, TraceId::from(1u128), name, &kind, &[], &[])
                .decision
        };
        assert_eq!(
            decide(INGEST_SPAN, SpanKind::Consumer, None),
            SamplingDecision::RecordAndSample
        );
        assert_eq!(
            decide(INGEST_SPAN, SpanKind::Consumer, Some(&Context::new())),
            SamplingDecision::RecordAndSample
        );
        assert_eq!(
            decide(INGEST_SPAN, SpanKind::Consumer, Some(&remote_parent(true))),
            SamplingDecision::Drop
        );
        assert_eq!(
            decide("read", SpanKind::Server, None),
            SamplingDecision::Drop
        );
    }

    #[test]
    fn a_publishers_context_is_read_whatever_the_case_of_its_header_names_and_flags_03_are_accepted()
     {
        for name in ["traceparent", "Traceparent", "TRACEPARENT"] {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(
                name,
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",
            );
            let context = publisher_context(&headers).expect(name);
            assert_eq!(
                context.trace_id().to_string(),
                "0af7651916cd43dd8448eb211c80319c"
            );
            assert_eq!(context.span_id().to_string(), "b7ad6b7169203331");
            assert!(context.is_sampled());
            assert!(context.is_remote());
        }
        let mut bad = async_nats::HeaderMap::new();
        bad.insert(
            "traceparent",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        );
        assert!(publisher_context(&bad).is_none());
        bad.insert("traceparent", "not a traceparent");
        assert!(publisher_context(&bad).is_none());
        assert!(publisher_context(&async_nats::HeaderMap::new()).is_none());
    }

    #[test]
    fn a_callers_context_is_read_from_http_headers() {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        let cx = caller_context(&headers);
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert!(
            !caller_context(&axum::http::HeaderMap::new())
                .span()
                .span_context()
                .is_valid()
        );
    }
}
