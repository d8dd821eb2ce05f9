#!/usr/bin/env bash
# Lint, render and validate the Helm chart in helm/chat-history-view with real Helm.
#
# Installs (once) into the project's git-ignored venv .tools/venv:
#   helm-python-sdk      Helm's Go SDK as a library (no helm binary, no network at run time)
#   kubernetes-validate  the Kubernetes JSON schemas, to validate the rendered manifests
# then runs scripts/check_chart.py, which exits non-zero on any failure. The settings the chart must set are
# read from the worker binary's --help (CHV_BINARY, or built if needed), so chart and configuration cannot drift.
#
# Usage: scripts/check-chart.sh [--install-only]
#   --install-only  install the tools and stop (`make test` runs it in the background while it builds)
set -euo pipefail

HELM_PYTHON_SDK_VERSION=0.2.2
KUBERNETES_VALIDATE_VERSION=1.37.0

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
venv="$tools/venv"
python="$venv/bin/python"

mkdir -p "$tools"
# Other scripts share this venv: hold a lock while creating it or installing into it, so two
# runs never race on pip. The lock is released when the subshell exits.
(
    flock 9
    if [[ ! -x "$python" ]]; then
        echo "check-chart: creating $venv" >&2
        python3 -m venv "$venv"
    fi
    if ! "$python" - "$HELM_PYTHON_SDK_VERSION" "$KUBERNETES_VALIDATE_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version

sys.exit(version("helm-python-sdk") != sys.argv[1] or version("kubernetes-validate") != sys.argv[2])
EOF
        echo "check-chart: installing helm-python-sdk==$HELM_PYTHON_SDK_VERSION kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >&2
        "$python" -m pip install --quiet --disable-pip-version-check \
            "helm-python-sdk==$HELM_PYTHON_SDK_VERSION" \
            "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    fi
) 9>"$tools/venv.lock"

if [[ "${1:-}" == "--install-only" ]]; then
    exit 0
fi

# The settings the binary has, by environment name (HISTORY_VIEW_*, and the OTEL_* ones of its "Tracing" heading):
# the chart must set each of them.
# CHV_BINARY names a built worker binary (`make test` passes the one its tests built); otherwise cargo builds one.
if [[ -n "${CHV_BINARY:-}" ]]; then
    help="$("$CHV_BINARY" --help)"
else
    help="$(cd "$root" && cargo run --quiet --bin chat-history-view -- --help)"
fi
CHART_SETTINGS="$(grep -oE '\[env: (HISTORY_VIEW|OTEL)_[A-Z_]*' <<<"$help" | cut -c7-)"
export CHART_SETTINGS
exec "$python" "$root/scripts/check_chart.py"
