//! The publisher's trace context a live event's message carried ([`PublisherContext`]), kept beside the event
//! while tracing is on.

use opentelemetry::propagation::Extractor;
use opentelemetry::trace::SpanContext;

use crate::telemetry::trace::{NatsHeaders, publisher_context};

/// A version-00 `traceparent`'s length: `00-<32 hex>-<16 hex>-<2 hex>`.
const TRACEPARENT_LEN: usize = 55;
/// The W3C header a publisher's context comes in.
const TRACEPARENT: &str = "traceparent";

/// The publisher's context a live event's message carried: its `traceparent` as received, kept while tracing is
/// on, and read by the SDK's W3C propagator ([`crate::telemetry::trace::publisher_context`]) only when explain or a
/// link needs it. Reading it costs about 200 ns (the propagator splits and checks the text and builds a context),
/// 4% of the worker's CPU per event by itself, beyond the ingest path's budget for tracing (3%); finding and copying
/// it costs about 25 ns. So the 55 bytes are kept rather than the 25 they hold.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PublisherContext(pub(super) [u8; TRACEPARENT_LEN]);

impl std::fmt::Debug for PublisherContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PublisherContext")
            .field(&String::from_utf8_lossy(&self.0))
            .finish()
    }
}

impl PublisherContext {
    /// The `traceparent` a message's headers carry (the name in any case), unread. One of another length (a
    /// later version of the format) is read now, and kept in version 00's form if valid.
    pub fn from_headers(headers: &async_nats::HeaderMap) -> Option<Self> {
        let headers_read = NatsHeaders(headers);
        let value = headers_read.get(TRACEPARENT)?;
        match <[u8; TRACEPARENT_LEN]>::try_from(value.as_bytes()) {
            Ok(raw) => Some(Self(raw)),
            Err(_) => publisher_context(headers).map(|context| Self::from(&context)),
        }
    }

    /// The publisher's span context, if the `traceparent` is valid: for a link.
    pub fn span_context(&self) -> Option<SpanContext> {
        // Only the propagator reads it; kept as received, the bytes are the header's text (UTF-8).
        let value = std::str::from_utf8(&self.0).ok()?;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TRACEPARENT, value);
        publisher_context(&headers)
    }

    /// The publisher's trace id as W3C writes it (32 lowercase hex digits), if the `traceparent` is valid.
    pub fn trace_id(&self) -> Option<String> {
        self.span_context()
            .map(|context| context.trace_id().to_string())
    }
}

impl From<&SpanContext> for PublisherContext {
    /// A context in version 00's form.
    fn from(context: &SpanContext) -> Self {
        let text = format!(
            "00-{}-{}-{:02x}",
            context.trace_id(),
            context.span_id(),
            context.trace_flags().to_u8()
        );
        let mut raw = [0; TRACEPARENT_LEN];
        raw.copy_from_slice(text.as_bytes());
        Self(raw)
    }
}
