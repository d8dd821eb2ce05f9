# Developer and CI entry points. The servers (NATS with JetStream, SecantusDB) come
# from scripts/services.sh, which installs them into the git-ignored .tools/.
#
#   make services-up      start NATS and SecantusDB on 127.0.0.1 (left running)
#   make services-down    stop them
#   make services-status  show whether they run
#   make test             installs the servers, then fmt, clippy, release build, tests, chart check; every test
#                         starts its own nats-server and Mongo-wire server (it may stop, freeze or restart them)
#   make run              the service against the local servers (or scripts/demo.sh)
#   make soak             overlapping faults under load on the release worker, 5 cycles over 200 threads (SOAK_SECS,
#                         SOAK_THREADS; tests/api/chaos.rs); a one-cycle version runs in `make test`
#   make fuzz             the decoders' fuzz targets, 60 s each (FUZZ_SECS, FUZZ_RUNS, FUZZ_TARGETS: scripts/fuzz.sh)
#   make bench            the performance targets (docs/design.md section 7): installs the servers, builds the
#                         release binary, runs benches/bench/main.rs (it starts its own servers and workers)
#
# `run` stops, on exit (also on failure or Ctrl-C), exactly the servers that it
# started itself; servers that were already running stay up. The exit code of the
# failing step is kept. `test` starts none: it only installs them for the tests.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

SERVICES := scripts/services.sh

# Start the servers this recipe needs, remembering which ones it started, stop
# those on exit, and export NATS_URL and MONGODB_URI. Used as the head of a
# one-shell recipe (each recipe below is a single shell).
define with_services
started="$$(mktemp)"; \
cleanup() { trap '' PIPE; $(SERVICES) down --started-file "$$started" || true; rm -f "$$started"; }; \
trap cleanup EXIT; trap 'exit 130' INT; trap 'exit 143' TERM; \
$(SERVICES) up --started-file "$$started" >&2; \
eval "$$($(SERVICES) env)"
endef

.PHONY: services-up services-down services-status test run bench fuzz soak

services-up:
	@$(SERVICES) up

services-down:
	@$(SERVICES) down

services-status:
	@$(SERVICES) status

test:
	@$(SERVICES) install >&2; \
	echo "==> servers installed in .tools/venv/bin; each test starts its own" >&2; \
	echo "==> cargo fmt --check" >&2; \
	cargo fmt --check; \
	echo "==> cargo clippy --workspace --all-targets -- -D warnings" >&2; \
	cargo clippy --workspace --all-targets -- -D warnings; \
	echo "==> cargo build --release --bin chat-history-view (scenarios that measure keeping up run it)" >&2; \
	cargo build --release --bin chat-history-view; \
	echo "==> cargo test --lib --bins --tests --examples (the benchmark compiles under clippy; it runs under make bench)" >&2; \
	cargo test --lib --bins --tests --examples; \
	if [ -x scripts/check-chart.sh ]; then \
		echo "==> scripts/check-chart.sh" >&2; \
		scripts/check-chart.sh; \
	fi

run:
	@$(with_services); \
	export HISTORY_VIEW_NATS_URL="$$NATS_URL" HISTORY_VIEW_MONGODB_URI="$$MONGODB_URI"; \
	if [ -x scripts/demo.sh ]; then \
		scripts/demo.sh; \
	else \
		cargo run --release --bin chat-history-view; \
	fi

bench:
	@$(SERVICES) install >&2; \
	echo "==> cargo build --release --bin chat-history-view" >&2; \
	cargo build --release --bin chat-history-view; \
	echo "==> cargo bench --bench bench" >&2; \
	cargo bench --bench bench

fuzz:
	@scripts/fuzz.sh

soak:
	@$(SERVICES) install >&2; \
	echo "==> cargo build --release --bin chat-history-view" >&2; \
	cargo build --release --bin chat-history-view; \
	echo "==> soak: SOAK_SECS=$${SOAK_SECS:-300} SOAK_THREADS=$${SOAK_THREADS:-200}" >&2; \
	SOAK_SECS="$${SOAK_SECS:-300}" SOAK_THREADS="$${SOAK_THREADS:-200}" \
		cargo test --test api chaos:: -- --nocapture
