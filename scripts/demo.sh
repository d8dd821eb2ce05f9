#!/usr/bin/env bash
# The demo behind `make run`: starts the worker against the local servers (their URLs come from the environment
# `make run` sets), publishes a realistic conversation live, prints the reconstructed history, and leaves the worker
# running until Ctrl-C. Worker logs go to .tools/run/demo-worker.log.
set -euo pipefail
cd "$(dirname "$0")/.."

port="${DEMO_PORT:-8080}"
log=".tools/run/demo-worker.log"
mkdir -p .tools/run

# Cargo's progress stays visible: a first release build takes minutes. The demo client is a package of its own
# (examples/demo), so this builds the worker and the demo only, without the tests' dev-dependencies.
echo "==> cargo build --release -p chat-history-view -p demo" >&2
cargo build --release -p chat-history-view -p demo

# No orchestrator removes endpoints here: Ctrl-C stops the worker at once (HISTORY_VIEW_SHUTDOWN_DELAY_SECS=0).
HISTORY_VIEW_LISTEN="127.0.0.1:$port" HISTORY_VIEW_LOG_FORMAT=text HISTORY_VIEW_SHUTDOWN_DELAY_SECS=0 \
    target/release/chat-history-view >"$log" 2>&1 &
worker=$!
trap 'kill "$worker" 2>/dev/null || true; wait "$worker" 2>/dev/null || true' EXIT

# Ready when /readyz answers 200 (plain bash: no HTTP client needed).
ready() {
    exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
    printf 'GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
    local status
    read -r _ status _ <&3 || status=""
    exec 3<&-
    [ "$status" = "200" ]
}

for _ in $(seq 1 400); do
    if ! kill -0 "$worker" 2>/dev/null; then
        echo "the worker exited; its log ($log):" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
    if ready 2>/dev/null; then
        break
    fi
    sleep 0.05
done

DEMO_API="http://127.0.0.1:$port" target/release/demo

echo
echo "chat-history-view is running at http://127.0.0.1:$port (log: $log). Try:"
echo "  curl -s http://127.0.0.1:$port/metrics | grep history_view_"
echo "Press Ctrl-C to stop."
wait "$worker"
