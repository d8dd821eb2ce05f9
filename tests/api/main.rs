//! One integration test binary; a module per feature.

// The shared conformance cases.
mod cases;
// Conformance cases through the pure projector.
mod projector;
// The naive reference builder: every conformance case, and agreement with the projector on random rows.
mod reference;
// Property tests of the pure core (order, duplicates, decoder agreement, no panics).
mod properties;
// Random thread generator shared by property and convergence tests.
mod threads;
// Conformance cases end to end through the store and live paths.
mod conformance;
// `explain` held to every conformance case; the inspector page in a real browser.
mod explain;
// Test applications and helpers.
mod helpers;
// The store path: index use, missing index, outage, operator characters.
mod store;
// The HTTP contract.
mod http;
// HTTP hardening: timeouts, connection and in-flight caps, secrets never printed.
mod hardening;
// The live path: read-after-publish, convergence, gaps, shared hydration, warnings, memory.
mod live;
// The promise's oracle held to account: the judge on constructed answers and on a real worker's stale answer.
mod promise;
// Scenarios through the built binary: servers, store, publisher, workers, shared waits.
mod scene;
// The persister-lag rule end to end: late persistence after start, gaps, evictions and store outages.
mod persister_lag;
// Fills of newly visible displays: the read pattern from memory, a fill racing a read, failing, or racing a gap.
mod fills;
// Hostile publishers: subjects that are not UTF-8, a hot thread in reverse order.
mod hostile;
// HISTORY_VIEW_MAX_THREAD_BYTES: 507 for threads past it, memory bounded and given back, live views leaving.
mod limits;
// NATS liveness: a frozen server and a half-open link are noticed within 15 s.
mod liveness;
// A NATS that requires a login and TLS: client certificates with an NKey user, a token, a user and password (from
// files and in the URL), a creds file in operator mode; refusals at start name the setting, never the secret.
mod nats_auth;
// The fuzz targets' checks over their committed corpus (and the seeds it grew from).
mod fuzz_corpus;
// Overlapping faults under load: nothing lost, recovery by itself (SOAK_SECS; `make soak`). Named to sort early:
// libtest starts tests in name order, and this one-cycle soak is the longest test of `make test`.
mod chaos;
// Shadow checks through the binary: a row the view lacks found and healed (missing, late, differs), no false alarm
// under the multi-turn workload, freshness on every answer, verify on demand.
mod shadow;
// Graceful shutdown.
mod shutdown;
// Secrets from mounted files: the MongoDB URI, API tokens rotated without a restart.
mod secrets;
// Metrics and readiness.
mod operations;
// The demo conversation behind `make run`.
mod demo;
// Relative links in comments and docs resolve; cited rules are links.
mod links;
// The JetStream source: conformance, a cut link and a NATS restart (no gap), a recreated stream (a gap), replay.
mod jetstream;
// The JetStream source under load: a large replay, again and again, without a resume or a pause.
mod jetstream_ingest;
// mongodb+srv:// URIs: started before the name resolves, ready once it does (a DNS responder of its own).
mod srv;
// Partitioned workers on a JetStream subject transform.
mod partitioned;
// JetStream retention and faults read through: expiry, purges, limits, a killed leader, no stream, no JetStream,
// new class streams; no answer from memory lacks what was stored more than the persister-lag bound before.
mod retention;
// What operators install: a real Prometheus scraping workers, the dashboard's and alerts' expressions, promtool,
// replicas answering alike.
mod monitoring;
// The Conversations items and conversation, and reads waiting for a run (read-your-writes).
mod conversations;
// The Conversations endpoints through the official OpenAI Python SDK.
mod sdk;
// The live feed (Server-Sent Events): updates, resumes, gaps, evictions, idle timeouts, shutdown.
mod feed;
// Resuming a running answer with the real AI SDK (tests/clients/ui_resume.mjs).
mod resume;
// Resuming a run with the official OpenAI Python SDK's Responses streaming (tests/clients/responses_resume.py).
mod responses;
// Warm restarts: the hot set handed over through a NATS key-value bucket and hydrated before ready.
mod warm;
// Trace continuation: a read's spans in the caller's trace down to the store and through a forward, ingested events'
// spans, hydrations and fills linked to aihub's publisher (the OpenTelemetry Python SDK), trace ids in logs and
// explain, nothing without an endpoint.
mod tracing;
