#!/usr/bin/env bash
# Check the monitoring files the Helm chart ships with real promtool:
#   promtool check rules  helm/chat-history-view/files/alerts.yaml parses, every expr is valid PromQL
#   promtool test rules   tests/monitoring/alerts.test.yaml: each alert fires where it must, with its labels and
#                         annotations, and stays silent where it must not (at the threshold, short of `for`);
#                         every alert has both kinds of case
#   the dashboard         every expr of helm/chat-history-view/files/dashboard.json, with $__rate_interval -> 1m
#                         and $pod -> .* as Grafana would substitute them, parses (as recording rules given to
#                         promtool check rules); its only variables are those two, every selector filters by
#                         pod=~"$pod"; and every metric named there or in the alerts is one src/startup.rs pins
# promtool comes from .tools/venv/bin (Debian's prometheus package, extracted there by scripts/services.sh
# install, which runs first when it is missing). Exits non-zero on any failure.
#
# Usage: scripts/check-alerts.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
promtool="$root/.tools/venv/bin/promtool"
rules="helm/chat-history-view/files/alerts.yaml"
tests="tests/monitoring/alerts.test.yaml"

if [[ ! -x "$promtool" ]]; then
    echo "check-alerts: promtool is missing; running scripts/services.sh install" >&2
    "$root/scripts/services.sh" install
fi

cd "$root"
"$promtool" --version 2>&1 | head -n 1
"$promtool" check rules "$rules"
"$promtool" test rules "$tests"

# promtool passes a test file that forgets an alert: require, for every alert of the file, a case where it fires
# (`exp_alerts:` with entries) and one where it stays silent (`exp_alerts: []`), each written as an
# `alertname:` line directly followed by its `exp_alerts` line.
missing=0
alerts="$(sed -n 's/^ *- alert: *\([A-Za-z0-9_]*\) *$/\1/p' "$rules")"
[[ -n "$alerts" ]] || { echo "check-alerts: no alert found in $rules" >&2; exit 1; }
for alert in $alerts; do
    cases="$(grep -A1 -E "^ *alertname: *$alert *$" "$tests" | grep -E '^ *exp_alerts:' || true)"
    if ! grep -qE 'exp_alerts: *$' <<<"$cases"; then
        echo "check-alerts: $tests has no case where $alert fires" >&2
        missing=1
    fi
    if ! grep -qE 'exp_alerts: *\[\] *$' <<<"$cases"; then
        echo "check-alerts: $tests has no case where $alert stays silent" >&2
        missing=1
    fi
done
[[ "$missing" == 0 ]] || exit 1

# The dashboard's exprs, and the metric names of both files.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 - "$work/dashboard-exprs.yaml" <<'PY'
import json, re, sys
from pathlib import Path

dashboard = json.loads(Path("helm/chat-history-view/files/dashboard.json").read_text())
alerts = Path("helm/chat-history-view/files/alerts.yaml").read_text()
# The names src/startup.rs pins (its test holds what the components register to that list); a histogram's series
# add _bucket, _count and _sum.
registered = set(re.findall(r'"(history_view_[a-z_]+)"', Path("src/startup.rs").read_text()))
failures = []


def known(name):
    base = re.sub(r"_(bucket|count|sum)$", "", name)
    return name in registered or base in registered


exprs = []
for panel in dashboard.get("panels", []):
    for target in panel.get("targets", []):
        exprs.append((panel.get("title", "?"), target.get("expr", "")))
if len(exprs) < 10:
    failures.append(f"the dashboard has only {len(exprs)} exprs")
rules = []
for title, expr in exprs:
    variables = set(re.findall(r"\$\{?(\w+)", expr))
    if variables - {"__rate_interval", "pod"}:
        failures.append(f"{title}: variables other than $__rate_interval and $pod: {sorted(variables)}")
    for range_ in re.findall(r"\[([^\]]*)\]", expr):
        if range_ != "$__rate_interval":
            failures.append(f"{title}: range [{range_}] is not [$__rate_interval]")
    for name, matchers in re.findall(r"\b(history_view_\w+)(\{[^}]*\})?", expr):
        if 'pod=~"$pod"' not in matchers:
            failures.append(f"{title}: {name} is not filtered by pod=~\"$pod\"")
    rules.append(expr.replace("$__rate_interval", "1m").replace("$pod", ".*"))
for name in sorted(set(re.findall(r"\bhistory_view_\w+", alerts + json.dumps(dashboard)))):
    if not known(name):
        failures.append(f"{name} is not a metric src/startup.rs pins")
lines = ["groups:", "  - name: dashboard", "    rules:"]
for i, expr in enumerate(rules):
    lines += [f"      - record: dashboard_expr_{i}", f"        expr: {json.dumps(expr)}"]
Path(sys.argv[1]).write_text("\n".join(lines) + "\n")
for failure in failures:
    print(f"check-alerts: {failure}", file=sys.stderr)
print(f"dashboard: {len(exprs)} exprs in {len(dashboard.get('panels', []))} panels")
sys.exit(1 if failures else 0)
PY
"$promtool" check rules "$work/dashboard-exprs.yaml" >/dev/null ||
    { "$promtool" check rules "$work/dashboard-exprs.yaml" || true; echo "check-alerts: a dashboard expr does not parse" >&2; exit 1; }
echo "dashboard: every expr parses"
echo "check-alerts: $(wc -w <<<"$alerts") alerts checked and tested (each fires and stays silent), dashboard exprs parse"
