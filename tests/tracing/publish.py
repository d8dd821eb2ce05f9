"""Publishes display events on NATS as aihub's publisher does: the OpenTelemetry Python SDK opens a producer span per
publish, the global W3C propagator injects its context into the message's headers, and nats-py publishes the event
with them. No exporter: the spans go nowhere, only their context travels.

Usage: python publish.py <nats_url> <sampler> < events.json

<sampler>: always_on, always_off, parentbased_always_on, parentbased_always_off, traceidratio:<ratio> or
parentbased_traceidratio:<ratio> (the SDK's samplers, as OTEL_TRACES_SAMPLER names them).

events.json: [{"subject": ..., "payload": <the payload's text>, "title_case": false}, ...], published in order;
with "title_case" true the header names go out title-cased ("Traceparent"), as another publisher's might.

Prints one JSON line per event, in order: {"subject": ..., "trace_id": ..., "span_id": ..., "headers": {...}}, the
producer span's ids as 32 and 16 lowercase hex digits and the headers the message carried.
"""

import asyncio
import json
import sys

import nats
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import sampling
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


def sampler(spec: str) -> sampling.Sampler:
    name, _, ratio = spec.partition(":")
    fixed = {
        "always_on": sampling.ALWAYS_ON,
        "always_off": sampling.ALWAYS_OFF,
        "parentbased_always_on": sampling.DEFAULT_ON,
        "parentbased_always_off": sampling.DEFAULT_OFF,
    }
    if name in fixed and not ratio:
        return fixed[name]
    if name == "traceidratio":
        return sampling.TraceIdRatioBased(float(ratio))
    if name == "parentbased_traceidratio":
        return sampling.ParentBasedTraceIdRatio(float(ratio))
    sys.exit(f"unknown sampler {spec!r}")


async def main() -> None:
    nats_url, sampler_spec = sys.argv[1], sys.argv[2]
    events = json.load(sys.stdin)
    trace.set_tracer_provider(TracerProvider(sampler=sampler(sampler_spec)))
    # aihub's global propagator: W3C trace context (and baggage, the SDK's default pair).
    propagate.set_global_textmap(
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    )
    tracer = trace.get_tracer("aihub.nats.publisher")
    client = await nats.connect(nats_url)
    published = []
    for event in events:
        subject = event["subject"]
        with tracer.start_as_current_span(
            f"send {subject}",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.type": "send",
                "messaging.destination.name": subject,
            },
        ) as span:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            if event.get("title_case"):
                headers = {name.title(): value for name, value in headers.items()}
            await client.publish(subject, event["payload"].encode("utf-8"), headers=headers)
            context = span.get_span_context()
            published.append(
                {
                    "subject": subject,
                    "trace_id": trace.format_trace_id(context.trace_id),
                    "span_id": trace.format_span_id(context.span_id),
                    "headers": headers,
                }
            )
    await client.flush()
    await client.close()
    for line in published:
        print(json.dumps(line))


if __name__ == "__main__":
    asyncio.run(main())
