#!/usr/bin/env python3
"""Check the Helm chart with real Helm: lint, render, validate, and prove the check can fail.

Run it through scripts/check-chart.sh, which installs its two dependencies into .tools/venv:

- helm-python-sdk (import name ``helm_python``) carries Helm's Go SDK as a shared library, so
  ``helm_python.lint(path, values, strict=True, kube_version=...)`` is `helm lint --strict` and
  ``Chart.load(path).render(values, name=..., namespace=...)`` is `helm template`, with no helm
  binary and no network.
- kubernetes-validate ships the Kubernetes JSON schemas per version; each rendered manifest is
  validated in strict mode (unknown fields are errors) against KUBE_VERSION.

Steps:
1. lint the chart (default and every non-default value set): any error or warning fails;
2. render it with each value set, validate every manifest, and assert the facts that matter
   (replicas and strategy, probes on their own port, security context, every secret a read-only mounted file
   named by its _FILE setting and never a value or secretKeyRef in the env, extraEnv replacing the chart's
   entry, the grace period above shutdown delay + drain, the memory limit from the README's formula, the
   PrometheusRule equal to files/alerts.yaml with the values' overrides, the dashboard ConfigMap, ...);
   every mode (Core one replica, Core two replicas, JetStream, partitioned) renders with the monitoring
   objects (ServiceMonitor, PrometheusRule, dashboard) all on and all off, and every NATS authentication
   (none, creds, NKey, token, user and password) and TLS (CA only, client certificate) renders with the
   chart's own Secret and with an existing one; tracing renders its OTEL_* settings and the pod's resource
   attributes only when an endpoint is set; every setting of --help is set by some value set;
3. check that the values' alert defaults equal files/alerts.yaml (no drift), and that every alert has its
   labels, annotations and a runbook_url naming its section of docs/operations.md;
4. render values the chart must refuse (schema and template guards) and expect a failure;
5. self-check: break copies of the chart (a template syntax error, a manifest field Kubernetes
   does not know, a RollingUpdate strategy for one replica, a Mongo URI in plain text, a secret through
   secretKeyRef, a writable secret mount, an appended extraEnv, probes on the API port, an ignored alert
   override, a drifted default, a grace check without the delay, ...) and expect steps 1-4 to report each one.

Exits non-zero on any failure; the last line is `check-chart: N passed, M failed`.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "chat-history-view"
KUBE_VERSION = "1.30.0"
RELEASE = "chv"
NAMESPACE = "aihub"
# The worst case of resident memory (docs/operations.md "Sizing"): cache budget + 64 MiB (spec section 7, P5) + (concurrent
# hydrations + 2 shadow checks) x the per-thread limit (each store read may hold up to a thread's events).
MEMORY_ALLOWANCE = 64 * 1024 * 1024
SHADOW_READS = 2
MIB = 1024 * 1024
# Lint severities as helm_python.lint reports them: 0 unknown, 1 info, 2 warning, 3 error.
LINT_WARNING = 2
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
# The runbooks' base when Chart.yaml names no home or sources.
DEFAULT_REPOSITORY = "https://github.com/aihub/chat-history-view"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """base with extra's keys laid over it, nested maps merged (as Helm merges values)."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# The deployment modes; each renders with the monitoring objects all off and all on.
MODES: dict[str, dict[str, Any]] = {
    "core": {},
    "core,replicas-2": {"replicaCount": 2},
    "jetstream": {"config": {"source": "jetstream"}},
    "partitioned": {
        "partitions": 3,
        "config": {"source": "jetstream", "jetstreamMaxBytes": 1073741824, "jetstreamStream": "CHAT_HISTORY_VIEW_3"},
        "podDisruptionBudget": {"maxUnavailable": 1},
    },
}
MONITORING_ON: dict[str, Any] = {
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True, "namespace": "monitoring", "additionalLabels": {"release": "kps"}},
    "grafanaDashboard": {
        "enabled": True,
        "namespace": "grafana",
        "annotations": {"grafana_folder": "aihub"},
    },
}

# Value sets rendered besides the defaults. Each one exercises other branches of the templates.
CASES: dict[str, dict[str, Any]] = {
    **{f"{mode},monitoring-off": values for mode, values in MODES.items()},
    **{f"{mode},monitoring-on": deep_merge(values, MONITORING_ON) for mode, values in MODES.items()},
    "alert-overrides,dashboard-label": {
        "prometheusRule": {
            "enabled": True,
            "alerts": {
                # A threshold and a `for` overridden, a large threshold (Helm prints it as 2e+06), a dropped alert.
                "HistoryViewStoreErrors": {"for": "7m", "threshold": 0.25},
                "HistoryViewJetStreamConsumerPending": {"threshold": 2000000},
                "HistoryViewNotReady": {"for": "90s"},
                "HistoryViewSlowConsumer": {"enabled": False},
            },
        },
        "grafanaDashboard": {"enabled": True, "label": "example.com/dashboard", "labelValue": "chv"},
        "probePort": 9091,
    },
    "existing-secret,service-monitor,text-logs": {
        "secret": {"existingSecret": "aihub-history", "mongodbUriKey": "uri", "apiTokenKey": "token"},
        "serviceMonitor": {
            "enabled": True,
            "namespace": "monitoring",
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "15s",
            "scrapeTimeout": "5s",
        },
        "config": {"logFormat": "text", "logLevel": "info,chat_history_view=debug"},
        "podAnnotations": {"example.com/team": "aihub"},
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "token,custom-resources,overrides": {
        "fullnameOverride": "history",
        "image": {"tag": "0.2.0", "pullPolicy": "Always"},
        "secret": {"apiToken": "s3cr3t", "mongodbUri": "mongodb://user:pw@db-0:27017/?authSource=admin"},
        "config": {
            "natsUrl": "nats://nats.messaging:4222",
            "mongodb": {"database": "aihub_prod", "indexHint": "", "fillIndexHint": "display_idx"},
            "cacheMaxBytes": 805306368,
            "cacheIdleSecs": 600,
            "storeTimeoutMs": 1500,
            "maxConcurrentHydrations": 3,
            "maxThreadBytes": 33554432,
            "httpMaxConnections": 200,
            "httpIdleTimeoutSecs": 30,
            "persistLagMs": 5000,
            "shutdownDrainSecs": 20,
            "warm": {
                "maxThreads": 2000,
                "bucket": "chv_hot",
                "snapshotSecs": 30,
                "rate": 50,
                "maxSecs": 900,
            },
        },
        "terminationGracePeriodSeconds": 45,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
        "service": {"type": "NodePort", "port": 80},
        "containerPort": 9090,
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "aihub", "effect": "NoSchedule"}],
        "priorityClassName": "high",
        "readinessProbe": {"periodSeconds": 3, "failureThreshold": 2},
    },
    # Tracing on: the default sampler; a raised ratio with attributes of the values' (one replacing a chart's); a
    # named sampler with a ratio, partitioned; the traces endpoint alone with a parent-based sampler, replicas.
    "tracing-on,default-sampler": {"tracing": {"endpoint": "http://otel-collector.observability:4318"}},
    "tracing-on,raised-ratio,attributes": {
        "tracing": {
            "endpoint": "http://otel-collector.observability:4318/",
            "samplerArg": 0.25,
            "resourceAttributes": {"deployment.environment.name": "prod", "k8s.node.name": "from-values"},
        },
    },
    "partitioned,tracing-on,ratio-sampler,service-name": deep_merge(
        MODES["partitioned"],
        {
            "tracing": {
                "endpoint": "https://otel-collector.observability.svc:4318",
                "sampler": "parentbased_traceidratio",
                "samplerArg": 0.05,
                "serviceName": "chat-history-view-eu",
                "resourceAttributes": {"k8s.cluster.name": "eu-1"},
            },
        },
    ),
    "core,replicas-2,tracing-traces-endpoint-only,parentbased-always-on": {
        "replicaCount": 2,
        "tracing": {"tracesEndpoint": "http://tempo.tracing:4318/v1/traces", "sampler": "parentbased_always_on"},
    },
    "image-digest": {
        "image": {"digest": "sha256:" + "a" * 64},
        "podSecurityContext": {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
        "securityContext": {"runAsUser": 10001, "runAsGroup": 10001},
    },
}

# Secret values the cases store in the chart's own Secret: each must reach the pod as a file and appear nowhere in
# the workload (not in an env value, an annotation or a command).
TEST_SECRETS = {
    "mongodbUri": "mongodb://chv:mongo-pw-4c1d@db-0:27017/?authSource=admin",
    "apiToken": "api-token-7e2a",
    "natsCreds": "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.creds-jwt-91b3\n------END NATS USER JWT------\n",
    "natsNkeySeed": "SUACSSL3UAHUDXKFSNVUZRF5UHPMWZ6BFDTJ7M6USDXIEDNPPQYYYCU3VY",
    "natsToken": "nats-token-5f08",
    "natsPassword": "nats-password-b6d2",
}
# nats.auth -> the secret value it needs.
AUTH_SECRET = {"creds": "natsCreds", "nkey": "natsNkeySeed", "token": "natsToken", "userPassword": "natsPassword"}


def auth_values(auth: str, existing_secret: bool) -> dict[str, Any]:
    """Values for one NATS authentication, with the chart's own Secret holding test secrets or an existing one."""
    nats: dict[str, Any] = {"auth": auth, **({"user": "chat-history-view"} if auth == "userPassword" else {})}
    if existing_secret:
        secret: dict[str, Any] = {"existingSecret": "aihub-history"}
    else:
        secret = {name: TEST_SECRETS[name] for name in ("mongodbUri", "apiToken")}
        if auth in AUTH_SECRET:
            secret[AUTH_SECRET[auth]] = TEST_SECRETS[AUTH_SECRET[auth]]
    return {"nats": nats, "secret": secret}


# Every NATS authentication with the chart's Secret and with an existing one, the two TLS forms, and the options
# a deployment beside aihub adds (extraEnv overriding chart entries, extra volumes, topology spread).
CASES.update(
    {
        **{
            f"nats-auth-{auth},{'existing' if existing else 'chart'}-secret": auth_values(auth, existing)
            for auth in AUTH_SECRET
            for existing in (False, True)
        },
        "nats-tls-ca-only,existing-secret-without-token": {
            "nats": {"tls": {"existingSecret": "nats-client-tls"}},
            "secret": {"existingSecret": "aihub-history", "existingSecretHasApiToken": False},
            "config": {"natsUrl": "tls://nats.messaging:4222"},
        },
        "nats-tls-client-cert,nkey,chart-secret": deep_merge(
            auth_values("nkey", False), {"nats": {"tls": {"existingSecret": "nats-client-tls", "clientCert": True}}}
        ),
        "partitioned,nats-creds,tls-client-cert,existing-secret": deep_merge(
            deep_merge(MODES["partitioned"], auth_values("creds", True)),
            {"nats": {"tls": {"existingSecret": "nats-client-tls", "clientCert": True}}},
        ),
        "extra-env,extra-volumes,topology-spread,memory-limit-in-bytes": {
            **auth_values("token", False),
            "extraEnv": [
                {"name": "RUST_LOG", "value": "debug"},
                {"name": "HISTORY_VIEW_CACHE_IDLE_SECS", "value": "120"},
                {"name": "TZ", "value": "UTC"},
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ],
            "extraVolumes": [{"name": "mongo-ca", "secret": {"secretName": "mongo-ca", "defaultMode": 288}}],
            "extraVolumeMounts": [{"name": "mongo-ca", "mountPath": "/etc/mongo-ca", "readOnly": True}],
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "chat-history-view"}},
                },
            ],
            "config": {"shutdownDelaySecs": 15, "shutdownDrainSecs": 10},
            "terminationGracePeriodSeconds": 30,
            "resources": {"limits": {"memory": 2147483648}, "requests": {"memory": "1.5Gi"}},
        },
    }
)

# Values the chart must refuse, by the schema or a template guard, with the word the error must name
# (so a chart that fails for another reason, say a syntax error, does not pass this check).
REJECTED: dict[str, tuple[dict[str, Any], str]] = {
    "a replicas value (the value is replicaCount)": ({"replicas": 2}, "'replicas'"),
    "an unknown top-level key": ({"replica": 1}, "'replica'"),
    "no replica": ({"replicaCount": 0}, "/replicaCount"),
    "replicas of partitioned workers": (
        {"replicaCount": 2, "partitions": 3, "config": {"source": "jetstream"}},
        "does not combine with partitions",
    ),
    "the probes on the API port": ({"probePort": 8080}, "probePort (8080) must differ from containerPort"),
    "an alert the rules do not have": (
        {"prometheusRule": {"enabled": True, "alerts": {"HistoryViewTypo": {"for": "1m"}}}},
        "'HistoryViewTypo'",
    ),
    "a threshold for an alert without one": (
        {"prometheusRule": {"alerts": {"HistoryViewSlowConsumer": {"threshold": 1}}}},
        "'threshold'",
    ),
    "an alert duration Prometheus does not read": (
        {"prometheusRule": {"alerts": {"HistoryViewNotReady": {"for": "5 minutes"}}}},
        "/prometheusRule/alerts/HistoryViewNotReady/for",
    ),
    "a dashboard label that is no label key": (
        {"grafanaDashboard": {"label": "grafana dashboard"}},
        "/grafanaDashboard/label",
    ),
    "a string where an integer belongs": ({"config": {"cacheMaxBytes": "256Mi"}}, "/config/cacheMaxBytes"),
    "an unknown log format": ({"config": {"logFormat": "xml"}}, "/config/logFormat"),
    "an unknown inspector mode": ({"config": {"inspector": "yes"}}, "/config/inspector"),
    "a negative persister-lag bound": ({"config": {"persistLagMs": -1}}, "/config/persistLagMs"),
    "no hydration slot": ({"config": {"maxConcurrentHydrations": 0}}, "/config/maxConcurrentHydrations"),
    "a per-thread limit below 64 KiB": ({"config": {"maxThreadBytes": 1024}}, "/config/maxThreadBytes"),
    "a writable root filesystem": ({"securityContext": {"readOnlyRootFilesystem": False}}, "readOnlyRootFilesystem"),
    "running as root allowed": ({"podSecurityContext": {"runAsNonRoot": False}}, "runAsNonRoot"),
    "a grace period not above the drain": (
        {"terminationGracePeriodSeconds": 5},
        "must exceed config.shutdownDelaySecs + config.shutdownDrainSecs",
    ),
    "a grace period above the drain but not above delay + drain": (
        {"terminationGracePeriodSeconds": 20, "config": {"shutdownDelaySecs": 10, "shutdownDrainSecs": 10}},
        "must exceed config.shutdownDelaySecs + config.shutdownDrainSecs",
    ),
    "a memory limit below the worst case": (
        {"resources": {"limits": {"memory": "1Gi"}}},
        "is below the worker's worst case",
    ),
    "a memory limit in bytes below the worst case of raised values": (
        {"resources": {"limits": {"memory": 1610612736}}, "config": {"maxConcurrentHydrations": 20}},
        "is below the worker's worst case",
    ),
    "a memory request above the limit": (
        {"resources": {"limits": {"memory": "2Gi"}, "requests": {"memory": "3Gi"}}},
        "is above resources.limits.memory",
    ),
    "an unknown NATS authentication": ({"nats": {"auth": "password"}}, "/nats/auth"),
    "user and password without a user": (
        {"nats": {"auth": "userPassword"}, "secret": {"natsPassword": "pw"}},
        "needs nats.user",
    ),
    "a NATS user with a token": (
        {"nats": {"auth": "token", "user": "chv"}, "secret": {"natsToken": "t"}},
        "a user goes with nats.auth=userPassword",
    ),
    "credentials in the NATS URL": (
        {"config": {"natsUrl": "nats://chv:pw@nats:4222"}},
        "config.natsUrl holds credentials",
    ),
    "a token in the NATS URL": ({"config": {"natsUrl": "tls://s3cr3t@nats:4222"}}, "config.natsUrl holds credentials"),
    "a chosen authentication without its secret": ({"nats": {"auth": "creds"}}, "needs secret.natsCreds"),
    "two NATS credentials": (
        {"nats": {"auth": "token"}, "secret": {"natsToken": "t", "natsPassword": "pw"}},
        "secret.natsPassword is set, but nats.auth is token",
    ),
    "a secret value beside an existing Secret": (
        {"secret": {"existingSecret": "aihub-history", "natsToken": "t"}, "nats": {"auth": "token"}},
        "names the Secret the worker reads",
    ),
    "a client certificate without a TLS Secret": (
        {"nats": {"tls": {"clientCert": True}}},
        "needs nats.tls.existingSecret",
    ),
    "extraEnv naming a setting the chart passes as a file": (
        {"extraEnv": [{"name": "HISTORY_VIEW_MONGODB_URI", "value": "mongodb://x"}]},
        "its _FILE twin together",
    ),
    "extraEnv naming one variable twice": (
        {"extraEnv": [{"name": "TZ", "value": "UTC"}, {"name": "TZ", "value": "CET"}]},
        "extraEnv names TZ twice",
    ),
    "an extraEnv value that is no string": ({"extraEnv": [{"name": "TZ", "value": 1}]}, "/extraEnv/0/value"),
    "an extra volume named like the chart's": (
        {"extraVolumes": [{"name": "secret", "emptyDir": {}}]},
        "a volume of the chart's own",
    ),
    "an extra mount over the Secret's directory": (
        {
            "extraVolumes": [{"name": "x", "emptyDir": {}}],
            "extraVolumeMounts": [{"name": "x", "mountPath": "/etc/chat-history-view/secret"}],
        },
        "where the chart mounts a volume of its own",
    ),
    "a topology spread constraint without its topology key": (
        {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]},
        "topologyKey",
    ),
    "a mistyped nested key": ({"serviceMonitor": {"enable": True}}, "'enable'"),
    "an unknown sampler": ({"tracing": {"endpoint": "http://c:4318", "sampler": "ratio"}}, "/tracing/sampler"),
    "a sampler ratio above 1": ({"tracing": {"endpoint": "http://c:4318", "samplerArg": 1.5}}, "/tracing/samplerArg"),
    "a ratio for a sampler that takes none": (
        {"tracing": {"endpoint": "http://c:4318", "sampler": "always_on", "samplerArg": 0.5}},
        "/tracing/samplerArg",
    ),
    "an OTLP endpoint that is no http(s) URL": ({"tracing": {"endpoint": "otel-collector:4317"}}, "/tracing/endpoint"),
    "credentials in the OTLP endpoint": (
        {"tracing": {"endpoint": "https://chv:pw@collector:4318"}},
        "tracing.endpoint holds credentials",
    ),
    "credentials in the OTLP traces endpoint": (
        {"tracing": {"tracesEndpoint": "https://key@collector:4318/v1/traces"}},
        "tracing.tracesEndpoint holds credentials",
    ),
    "a resource attribute value with a comma": (
        {"tracing": {"endpoint": "http://c:4318", "resourceAttributes": {"team": "a,b"}}},
        "/tracing/resourceAttributes",
    ),
    "partitions on Core NATS": ({"partitions": 2}, "need config.source=jetstream"),
    "no partition": ({"partitions": 0}, "/partitions"),
}


def binary_settings() -> set[str]:
    """The environment names of the binary's own settings, from its `--help` (check-chart.sh passes them in
    CHART_SETTINGS): the HISTORY_VIEW_* ones and the OTEL_* ones of its "Tracing" heading, so the chart cannot
    drift from the configuration."""
    names = set(os.environ.get("CHART_SETTINGS", "").split())
    if len(names) < 10 or not all(n.startswith(("HISTORY_VIEW_", "OTEL_")) for n in names):
        sys.exit(f"check-chart: CHART_SETTINGS does not list the binary's settings: {sorted(names)}")
    return names


# Settings the chart never sets: the secrets' literal forms (it passes their _FILE twins, never a secret value),
# and the partition (a partitioned worker takes the ordinal ending its pod's name; the pod-index label exists only
# from Kubernetes 1.28).
# The OTLP protocol has one value, the binary's default, and an empty tracing.endpoint already turns tracing off
# (OTEL_SDK_DISABLED).
NEVER_SET = {
    "HISTORY_VIEW_MONGODB_URI",
    "HISTORY_VIEW_API_TOKEN",
    "HISTORY_VIEW_PARTITION",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_SDK_DISABLED",
}
# Read by the OpenTelemetry SDK itself, so not in --help: the resource.
SDK_SETTINGS = {"OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"}
# The pod's own fields the resource attributes take from the downward API, by the variable that carries each.
K8S_ATTRIBUTES = {
    "k8s.pod.name": ("K8S_POD_NAME", "metadata.name"),
    "k8s.namespace.name": ("K8S_NAMESPACE_NAME", "metadata.namespace"),
    "k8s.node.name": ("K8S_NODE_NAME", "spec.nodeName"),
}
# Files of the Secret, by setting; set when the values use them (check_facts computes which).
SECRET_FILE_SETTINGS = {
    "HISTORY_VIEW_MONGODB_URI_FILE",
    "HISTORY_VIEW_API_TOKEN_FILE",
    "HISTORY_VIEW_NATS_CREDS_FILE",
    "HISTORY_VIEW_NATS_NKEY_SEED_FILE",
    "HISTORY_VIEW_NATS_TOKEN_FILE",
    "HISTORY_VIEW_NATS_PASSWORD_FILE",
}
TLS_FILE_SETTINGS = {
    "HISTORY_VIEW_NATS_TLS_CA_FILE",
    "HISTORY_VIEW_NATS_TLS_CERT_FILE",
    "HISTORY_VIEW_NATS_TLS_KEY_FILE",
}
# Set in some modes only: the files, the NATS user (userPassword), the partitioned stream's byte limit (when one is).
MODE_ENV = SECRET_FILE_SETTINGS | TLS_FILE_SETTINGS | {"HISTORY_VIEW_NATS_USER", "HISTORY_VIEW_JETSTREAM_MAX_BYTES"}
BINARY_SETTINGS = binary_settings()
# Set with tracing on only (check_tracing says which): the binary's OTEL_* settings and the SDK's.
MODE_ENV |= {n for n in BINARY_SETTINGS if n.startswith("OTEL_")} - NEVER_SET | SDK_SETTINGS
# Every other setting the binary has is set in every mode, and RUST_LOG.
EXPECTED_ENV = (BINARY_SETTINGS - MODE_ENV - NEVER_SET) | {"RUST_LOG"}


class CheckError(Exception):
    """A fact about the chart that does not hold."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckError(message)


def parse_quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("512Mi", "1G", "0.5", 1) as a number of base units."""
    suffixes = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "m": 10**-3,
        "": 1,
    }
    match = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|k|M|G|T|m|)", str(value))
    expect(match is not None, f"unparsable quantity {value!r}")
    assert match is not None  # for the type checker; expect() raised otherwise
    return float(match.group(1)) * suffixes[match.group(2)]


# --- lint ---------------------------------------------------------------------------------------


def lint(chart: Path, values: dict[str, Any]) -> None:
    """`helm lint --strict`: any error, or any message at warning level or above, fails."""
    report = helm.lint(chart, values or None, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [f"{m['path']}: {m['error'].strip()}" for m in report["messages"] if m["severity"] >= LINT_WARNING]
    # "errors" repeats the error-level messages; it is the fallback should a message lack a severity.
    problems = problems or [e.strip() for e in report["errors"]]
    expect(not problems, "lint: " + "; ".join(problems))
    expect(report["total_charts_linted"] == 1, f"lint linted {report['total_charts_linted']} charts")


# --- render and validate ------------------------------------------------------------------------


def render(chart: Path, values: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """`helm template`: the rendered manifests (parsed) and NOTES.txt."""
    with helm.Chart.load(chart) as loaded:
        loaded.validate_schema(values)
        rendered = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    notes = ""
    manifests: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError as err:
            raise CheckError(f"{path} is not valid YAML: {err}") from err
        for document in documents:
            if document is None:
                continue
            expect(isinstance(document, dict), f"{path} holds a non-object document")
            document["__source"] = path
            manifests.append(document)
    return manifests, notes


def validate(manifest: dict[str, Any]) -> None:
    """Strict schema validation for built-in kinds; the CRD gets a shape check of its own."""
    source = manifest.pop("__source")
    kind = manifest.get("kind")
    expect(bool(manifest.get("apiVersion")) and bool(kind), f"{source}: no apiVersion or kind")
    name = manifest.get("metadata", {}).get("name", "")
    expect(
        re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name or "") is not None,
        f"{source}: metadata.name {name!r} is not a DNS label",
    )
    if kind == "ServiceMonitor":
        check_service_monitor_shape(manifest, source)
        return
    if kind == "PrometheusRule":
        check_prometheus_rule_shape(manifest, source)
        return
    try:
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path)
        raise CheckError(
            f"{source}: {kind}/{name} does not match Kubernetes {KUBE_VERSION}: {path}: {err.message}"
        ) from err
    except kubernetes_validate.SchemaNotFoundError as err:
        raise CheckError(f"{source}: {err.message}") from err


def check_service_monitor_shape(monitor: dict[str, Any], source: str) -> None:
    """ServiceMonitor is a CRD (no schema in kubernetes-validate): check the fields we rely on."""
    expect(monitor["apiVersion"] == "monitoring.coreos.com/v1", f"{source}: apiVersion {monitor['apiVersion']}")
    spec = monitor.get("spec", {})
    unknown = set(spec) - {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
    expect(not unknown, f"{source}: unknown spec fields {sorted(unknown)}")
    expect(isinstance(spec.get("selector", {}).get("matchLabels"), dict), f"{source}: no spec.selector.matchLabels")
    endpoints = spec.get("endpoints")
    expect(isinstance(endpoints, list) and len(endpoints) == 1, f"{source}: expected one endpoint")
    endpoint = endpoints[0]
    unknown = set(endpoint) - {
        "port",
        "path",
        "scheme",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "relabelings",
        "metricRelabelings",
    }
    expect(not unknown, f"{source}: unknown endpoint fields {sorted(unknown)}")
    expect(endpoint.get("port") == "http" and endpoint.get("path") == "/metrics", f"{source}: endpoint {endpoint}")
    for key in ("interval", "scrapeTimeout"):
        expect(re.fullmatch(r"([0-9]+(ms|s|m|h))+", str(endpoint.get(key))) is not None, f"{source}: bad {key}")


DURATION = re.compile(r"(0|([0-9]+(ms|s|m|h|d|w|y))+)")


def check_prometheus_rule_shape(rule: dict[str, Any], source: str) -> None:
    """PrometheusRule is a CRD too: check the fields the Prometheus Operator reads, as it would reject them."""
    expect(rule["apiVersion"] == "monitoring.coreos.com/v1", f"{source}: apiVersion {rule['apiVersion']}")
    expect(set(rule) <= {"apiVersion", "kind", "metadata", "spec"}, f"{source}: unknown fields {sorted(rule)}")
    expect(isinstance(rule["metadata"].get("labels"), dict), f"{source}: no metadata.labels")
    spec = rule.get("spec", {})
    expect(set(spec) == {"groups"}, f"{source}: spec fields {sorted(spec)}")
    groups = spec["groups"]
    expect(isinstance(groups, list) and groups, f"{source}: no spec.groups")
    for group in groups:
        expect(set(group) <= {"name", "interval", "rules"}, f"{source}: unknown group fields {sorted(group)}")
        expect(bool(group.get("name")) and isinstance(group.get("rules"), list), f"{source}: group {group}")
        for entry in group["rules"]:
            check_alert_shape(entry, f"{source}: rule {entry.get('alert')!r}")


def check_alert_shape(entry: dict[str, Any], where: str) -> None:
    """One alerting rule: alert, expr, for, labels.severity, and the three annotations (the rule file's contract)."""
    expect(set(entry) == {"alert", "expr", "for", "labels", "annotations"}, f"{where}: fields {sorted(entry)}")
    expect(re.fullmatch(r"HistoryView[A-Za-z]+", str(entry["alert"])) is not None, f"{where}: alert name")
    expect(isinstance(entry["expr"], str) and entry["expr"].strip() != "", f"{where}: no expr")
    expect(DURATION.fullmatch(str(entry["for"])) is not None, f"{where}: for {entry['for']!r}")
    expect(entry["labels"].get("severity") in ("warning", "critical"), f"{where}: labels {entry['labels']}")
    annotations = entry["annotations"]
    expect(
        set(annotations) == {"summary", "description", "runbook_url"} and all(annotations.values()),
        f"{where}: annotations {sorted(annotations)}",
    )


# --- the alert rules and the dashboard ----------------------------------------------------------

# The number an alert's expr ends with: the threshold the chart replaces.
FINAL_NUMBER = re.compile(r"([0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)\s*$")


def file_alerts(chart: Path) -> dict[str, dict[str, Any]]:
    """The alerting rules of the chart's files/alerts.yaml, by name, in order."""
    text = (chart / "files" / "alerts.yaml").read_text()
    document = yaml.safe_load(text)
    expect(isinstance(document, dict) and isinstance(document.get("groups"), list), "files/alerts.yaml: no groups")
    alerts: dict[str, dict[str, Any]] = {}
    for group in document["groups"]:
        for entry in group.get("rules", []):
            expect(entry.get("alert") not in alerts, f"files/alerts.yaml: {entry.get('alert')} twice")
            alerts[entry.get("alert")] = entry
    expect(bool(alerts), "files/alerts.yaml holds no alert")
    return alerts


def final_number(expr: str) -> float | None:
    match = FINAL_NUMBER.search(expr)
    return float(match.group(1)) if match else None


def expected_rules(chart: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The rules the PrometheusRule must hold for these prometheusRule.alerts values: the file's, with `for` and
    the threshold replaced, disabled ones left out."""
    rules = []
    for name, entry in file_alerts(chart).items():
        alert = settings.get(name, {})
        if alert.get("enabled", True) is False:
            continue
        rule = copy.deepcopy(entry)
        rule["for"] = alert.get("for", entry["for"])
        if "threshold" in alert:
            rule["expr"] = FINAL_NUMBER.sub("", entry["expr"].strip()) + str(alert["threshold"])
        rules.append(rule)
    return rules


def same_rule(rendered: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Equal, the expr's final number compared as a number (Helm prints 2000000 as 2e+06)."""
    if {k: v for k, v in rendered.items() if k != "expr"} != {k: v for k, v in expected.items() if k != "expr"}:
        return False
    got, want = rendered["expr"].strip(), expected["expr"].strip()
    return FINAL_NUMBER.sub("", got) == FINAL_NUMBER.sub("", want) and final_number(got) == final_number(want)


def repository_url(chart: Path) -> str:
    """The project's repository: Chart.yaml's home or first source, else the default."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    url = meta.get("home") or next(iter(meta.get("sources") or []), None) or DEFAULT_REPOSITORY
    return str(url).rstrip("/")


def check_alert_file(chart: Path) -> None:
    """Every alert's shape and runbook (a `### <name>` section of docs/operations.md, whose GitHub anchor is the
    lowercased name), and values.yaml's alert defaults equal to the file's `for` and thresholds (no drift)."""
    alerts = file_alerts(chart)
    runbook_base = f"{repository_url(chart)}/blob/main/docs/operations.md#"
    headings = set(re.findall(r"^### (\S+)\s*$", OPERATIONS_DOC.read_text(), re.MULTILINE))
    for name, entry in alerts.items():
        check_alert_shape(entry, f"files/alerts.yaml: {name}")
        runbook = entry["annotations"]["runbook_url"]
        expect(
            runbook == runbook_base + name.lower(), f"{name}: runbook_url {runbook}, not {runbook_base}{name.lower()}"
        )
        expect(name in headings, f"{name}: docs/operations.md has no '### {name}' section")
    defaults = yaml.safe_load((chart / "values.yaml").read_text())["prometheusRule"]["alerts"]
    expect(
        list(defaults) == list(alerts),
        f"values.yaml's prometheusRule.alerts {list(defaults)} are not files/alerts.yaml's {list(alerts)}",
    )
    schema = json.loads((chart / "values.schema.json").read_text())
    schema_alerts = schema["properties"]["prometheusRule"]["properties"]["alerts"]["properties"]
    expect(set(schema_alerts) == set(alerts), f"values.schema.json's alerts {sorted(schema_alerts)}")
    for name, default in defaults.items():
        entry = alerts[name]
        expect(
            default.get("for") == entry["for"],
            f"{name}: values.yaml's for {default.get('for')!r}, the file's {entry['for']!r}",
        )
        allows_threshold = schema_alerts[name]["$ref"].endswith("alertWithThreshold")
        if "threshold" in default:
            number = final_number(entry["expr"])
            expect(number is not None, f"{name}: a threshold in values.yaml, but its expr ends with no number")
            expect(
                float(default["threshold"]) == number,
                f"{name}: values.yaml's threshold {default['threshold']}, the file's {number}",
            )
        expect(
            allows_threshold == ("threshold" in default), f"{name}: the schema and values.yaml disagree on a threshold"
        )


def check_monitoring(
    manifests: list[dict[str, Any]], values: dict[str, Any], chart: Path, chart_labels: dict[str, str]
) -> None:
    """The PrometheusRule and the dashboard ConfigMap: rendered when enabled, equal to the chart's files, with the
    chart's labels (chart_labels, the workload's) and the ones the values add."""
    rules = by_kind(manifests, "PrometheusRule")
    settings = values["prometheusRule"]
    if settings["enabled"]:
        expect(len(rules) == 1, f"expected one PrometheusRule, got {len(rules)}")
        rule = rules[0]
        expect(rule["metadata"].get("namespace") == (settings["namespace"] or NAMESPACE), "PrometheusRule namespace")
        labels = rule["metadata"]["labels"]
        expect(chart_labels.items() <= labels.items(), f"PrometheusRule labels {labels} lack the chart's")
        expect(settings["additionalLabels"].items() <= labels.items(), f"PrometheusRule labels {labels}")
        rendered = [r for group in rule["spec"]["groups"] for r in group["rules"]]
        expected = expected_rules(chart, settings.get("alerts") or {})
        expect(
            [r["alert"] for r in rendered] == [r["alert"] for r in expected],
            f"PrometheusRule alerts {[r['alert'] for r in rendered]}, expected {[r['alert'] for r in expected]}",
        )
        for got, want in zip(rendered, expected):
            expect(same_rule(got, want), f"PrometheusRule's {got['alert']} is {got}, expected {want}")
    else:
        expect(not rules, "PrometheusRule rendered although disabled")

    dashboard = values["grafanaDashboard"]
    maps = by_kind(manifests, "ConfigMap")
    if dashboard["enabled"]:
        expect(len(maps) == 1, f"expected one dashboard ConfigMap, got {len(maps)}")
        config_map = maps[0]
        metadata = config_map["metadata"]
        expect(
            metadata["labels"].get(dashboard["label"]) == dashboard["labelValue"],
            f"the dashboard ConfigMap lacks the label {dashboard['label']}={dashboard['labelValue']}",
        )
        expect(chart_labels.items() <= metadata["labels"].items(), "the dashboard ConfigMap lacks the chart's labels")
        expect(metadata.get("namespace") == (dashboard["namespace"] or NAMESPACE), "dashboard ConfigMap namespace")
        expect(dashboard["annotations"].items() <= metadata.get("annotations", {}).items(), "dashboard annotations")
        data = config_map.get("data", {})
        expect(list(data) == ["chat-history-view.json"], f"dashboard ConfigMap keys {list(data)}")
        try:
            parsed = json.loads(data["chat-history-view.json"])
        except ValueError as err:
            raise CheckError(f"the dashboard ConfigMap's JSON does not parse: {err}") from err
        expect(
            parsed == json.loads((chart / "files" / "dashboard.json").read_text()),
            "the dashboard differs from files/dashboard.json",
        )
        panels = parsed.get("panels", [])
        expect(
            sum(1 for p in panels if p.get("targets")) >= 10
            and all(t.get("expr") for p in panels for t in p.get("targets", [])),
            "the dashboard has too few panels with queries",
        )
        variables = {v.get("name"): v for v in parsed.get("templating", {}).get("list", [])}
        expect(
            variables.get("datasource", {}).get("type") == "datasource"
            and variables["datasource"].get("query") == "prometheus",
            "no Prometheus datasource variable",
        )
        expect(
            "label_values(history_view_cache_entries, pod)" in json.dumps(variables.get("pod", {})), "no pod variable"
        )
    else:
        expect(not maps, "a dashboard ConfigMap rendered although disabled")


# --- facts --------------------------------------------------------------------------------------


def by_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m.get("kind") == kind]


def check_facts(manifests: list[dict[str, Any]], notes: str, values: dict[str, Any], chart: Path) -> None:
    """The facts the issue names, for any value set (values are the merged, effective values)."""
    partitions = values["partitions"]
    partitioned = partitions > 1
    replicas = values["replicaCount"]
    workloads = by_kind(manifests, "StatefulSet" if partitioned else "Deployment")
    expect(
        len(workloads) == 1 and not by_kind(manifests, "Deployment" if partitioned else "StatefulSet"),
        f"expected one {'StatefulSet' if partitioned else 'Deployment'}, got {len(workloads)}",
    )
    deployment = workloads[0]
    spec = deployment["spec"]
    if partitioned:
        expect(spec.get("replicas") == partitions, f"replicas is {spec.get('replicas')!r}, not {partitions}")
        expect(spec.get("podManagementPolicy") == "Parallel", "the workers do not start in parallel")
    else:
        expect(spec.get("replicas") == replicas, f"replicas is {spec.get('replicas')!r}, not {replicas}")
        strategy = spec.get("strategy")
        if replicas == 1:
            # One worker: never two pods' memory at once.
            expect(strategy == {"type": "Recreate"}, f"strategy is {strategy!r}, not Recreate")
        else:
            # Replicas: the others serve while one is replaced.
            expect(
                strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                f"strategy is {strategy!r}, not RollingUpdate with maxUnavailable 0, maxSurge 1",
            )
        # A new pod is unready during its warm-up (at most config.warm.maxSecs) and the readiness probe's failures
        # after it: the rollout must not be marked failed meanwhile.
        probe = values["readinessProbe"]
        warm_wait = values["config"]["warm"]["maxSecs"] + probe["failureThreshold"] * probe["periodSeconds"]
        expect(
            spec.get("progressDeadlineSeconds", 600) > warm_wait,
            f"progressDeadlineSeconds {spec.get('progressDeadlineSeconds')!r} does not exceed the warm-up's"
            f" {warm_wait}s",
        )

    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    expect(selector.items() <= pod_labels.items(), "the Deployment selector does not match its pod labels")

    pod_security = pod.get("securityContext", {})
    expect(pod_security.get("runAsNonRoot") is True, "pod runAsNonRoot is not true")
    expect(
        pod_security.get("seccompProfile", {}).get("type") == "RuntimeDefault",
        "pod seccompProfile is not RuntimeDefault",
    )
    expect(pod.get("automountServiceAccountToken") is False, "the service account token is mounted")

    containers = pod["containers"]
    expect(len(containers) == 1, f"expected one container, got {len(containers)}")
    container = containers[0]
    security = container.get("securityContext", {})
    expect(security.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem is not true")
    expect(security.get("runAsNonRoot") is True, "container runAsNonRoot is not true")
    expect(security.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation is not false")
    expect(security.get("capabilities", {}).get("drop") == ["ALL"], "capabilities do not drop ALL")
    user = security.get("runAsUser", pod_security.get("runAsUser"))
    expect(isinstance(user, int) and user > 0, f"runAsUser is {user!r}")

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expect(
        ports == {"http": values["containerPort"], "probes": values["probePort"]},
        f"container ports {ports}, not http {values['containerPort']} and probes {values['probePort']}",
    )
    # On the probe listener: API clients filling the connection cap cannot starve the kubelet's probes.
    for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        probe = container.get(probe_name, {}).get("httpGet", {})
        expect(
            probe.get("path") == path and probe.get("port") == "probes",
            f"{probe_name} is {probe}, not GET {path} on probes",
        )

    env_list = container["env"]
    names = [e["name"] for e in env_list]
    expect(len(names) == len(set(names)), f"duplicate env vars: {names}")
    env = {e["name"]: e for e in env_list}
    missing = EXPECTED_ENV - set(env)
    expect(not missing, f"env vars missing: {sorted(missing)}")
    # The other way, a setting the binary does not know, is checked once over every value set (check_chart).
    expect(env["HISTORY_VIEW_LISTEN"]["value"] == f"0.0.0.0:{values['containerPort']}", "HISTORY_VIEW_LISTEN")
    expect(
        env["HISTORY_VIEW_PROBE_LISTEN"].get("value") == f"0.0.0.0:{values['probePort']}",
        f"HISTORY_VIEW_PROBE_LISTEN is {env['HISTORY_VIEW_PROBE_LISTEN']}, not 0.0.0.0:{values['probePort']}",
    )
    expect(env["HISTORY_VIEW_LOG_FORMAT"]["value"] == values["config"]["logFormat"], "HISTORY_VIEW_LOG_FORMAT")
    expect(env["HISTORY_VIEW_INSPECTOR"]["value"] == values["config"]["inspector"], "HISTORY_VIEW_INSPECTOR")
    cache_bytes = values["config"]["cacheMaxBytes"]
    expect(
        env["HISTORY_VIEW_CACHE_MAX_BYTES"]["value"] == str(cache_bytes),
        f"HISTORY_VIEW_CACHE_MAX_BYTES is {env['HISTORY_VIEW_CACHE_MAX_BYTES'].get('value')!r}",
    )
    expect(env["HISTORY_VIEW_MONGODB_INDEX_HINT"]["value"] == values["config"]["mongodb"]["indexHint"], "index hint")
    expect(
        env["HISTORY_VIEW_MONGODB_FILL_INDEX_HINT"]["value"] == values["config"]["mongodb"]["fillIndexHint"],
        "fill index hint",
    )
    expect(
        env["HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS"]["value"] == str(values["config"]["maxConcurrentHydrations"]),
        "HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS",
    )
    for name, key in [
        ("HISTORY_VIEW_MAX_THREAD_BYTES", "maxThreadBytes"),
        ("HISTORY_VIEW_HTTP_MAX_CONNECTIONS", "httpMaxConnections"),
        ("HISTORY_VIEW_HTTP_MAX_IN_FLIGHT", "httpMaxInFlight"),
        ("HISTORY_VIEW_HTTP_MAX_WAITING", "httpMaxWaiting"),
        ("HISTORY_VIEW_HTTP_MAX_STREAMS", "httpMaxStreams"),
        ("HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY", "natsSubscriptionCapacity"),
        ("HISTORY_VIEW_NATS_PING_INTERVAL_SECS", "natsPingIntervalSecs"),
        ("HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS", "httpHeaderTimeoutSecs"),
        ("HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS", "httpIdleTimeoutSecs"),
    ]:
        expect(env[name]["value"] == str(values["config"][key]), name)
    expect(
        env["HISTORY_VIEW_PERSIST_LAG_MS"]["value"] == str(values["config"]["persistLagMs"]),
        f"HISTORY_VIEW_PERSIST_LAG_MS is {env['HISTORY_VIEW_PERSIST_LAG_MS'].get('value')!r}",
    )
    for name, key in [
        ("HISTORY_VIEW_WARM_MAX_THREADS", "maxThreads"),
        ("HISTORY_VIEW_WARM_BUCKET", "bucket"),
        ("HISTORY_VIEW_WARM_SNAPSHOT_SECS", "snapshotSecs"),
        ("HISTORY_VIEW_WARM_RATE", "rate"),
        ("HISTORY_VIEW_WARM_MAX_SECS", "maxSecs"),
    ]:
        expect(env[name]["value"] == str(values["config"]["warm"][key]), name)
    delay = int(env["HISTORY_VIEW_SHUTDOWN_DELAY_SECS"]["value"])
    drain = int(env["HISTORY_VIEW_SHUTDOWN_DRAIN_SECS"]["value"])
    expect(
        (delay, drain) == (values["config"]["shutdownDelaySecs"], values["config"]["shutdownDrainSecs"]),
        f"shutdown delay and drain {delay}, {drain} are not the values'",
    )
    expect(
        pod["terminationGracePeriodSeconds"] > delay + drain,
        f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} does not exceed the {delay}s delay +"
        f" the {drain}s drain",
    )
    for name in EXPECTED_ENV | (MODE_ENV & set(env)):
        expect(set(env[name]) == {"name", "value"}, f"{name} is {env[name]}, not a plain value")
    expect(env["HISTORY_VIEW_PARTITIONS"]["value"] == str(partitions), "HISTORY_VIEW_PARTITIONS")
    # The partition is never set: a StatefulSet pod's name ends with its ordinal, which the worker reads from the
    # host name on every Kubernetes version the chart claims (the pod-index label exists only from 1.28).
    expect("HISTORY_VIEW_PARTITION" not in env, f"HISTORY_VIEW_PARTITION is set: {env.get('HISTORY_VIEW_PARTITION')}")
    expect(
        "HOSTNAME" not in env and "hostname" not in pod and "subdomain" not in pod,
        "the pod's host name is overridden, so it no longer ends with the ordinal",
    )
    peer_url = env["HISTORY_VIEW_PEER_URL"]["value"]
    if partitioned:
        expect(values["config"]["source"] == "jetstream", "partitioned workers without the JetStream source")
        expect(deployment["kind"] == "StatefulSet", "partitioned workers are not a StatefulSet (no ordinal)")
        expect(
            peer_url
            == f"http://{deployment['metadata']['name']}-{{partition}}.{spec['serviceName']}.{NAMESPACE}.svc:"
            f"{values['containerPort']}",
            f"the peer URL {peer_url} does not name the pods of the headless Service",
        )
        max_bytes = values["config"]["jetstreamMaxBytes"]
        if max_bytes is not None:
            expect(env["HISTORY_VIEW_JETSTREAM_MAX_BYTES"]["value"] == str(max_bytes), "HISTORY_VIEW_JETSTREAM_MAX_BYTES")
    pdbs = by_kind(manifests, "PodDisruptionBudget")
    if partitioned or replicas > 1:
        expect(len(pdbs) == 1, f"expected one PodDisruptionBudget, got {len(pdbs)}")
        expect(
            pdbs[0]["spec"]["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items(),
            "the PodDisruptionBudget does not select the workers",
        )
    else:
        expect(not pdbs, "a PodDisruptionBudget for one worker")

    check_memory(container, values)
    check_extras(pod, container, env_list, values, pod_labels)
    check_tracing(env_list, values, notes)
    check_secrets(manifests, deployment, pod, container, env, values, notes)

    services = [s for s in by_kind(manifests, "Service") if s["spec"].get("clusterIP") != "None"]
    expect(len(services) == 1, f"expected one Service, got {len(services)}")
    service = services[0]
    headless = [s for s in by_kind(manifests, "Service") if s["spec"].get("clusterIP") == "None"]
    if partitioned:
        expect(
            len(headless) == 1 and headless[0]["metadata"]["name"] == spec["serviceName"],
            "no headless Service named by the StatefulSet",
        )
        expect(headless[0]["spec"]["selector"].items() <= pod_labels.items(), "the headless Service selects no pod")
    else:
        expect(not headless, "a headless Service for one worker")
    expect(service["spec"]["selector"].items() <= pod_labels.items(), "the Service selector does not match the pod")
    service_ports = service["spec"]["ports"]
    expect(
        [(p["name"], p["targetPort"], p["port"]) for p in service_ports]
        == [("http", "http", values["service"]["port"])],
        f"Service ports {service_ports}",
    )

    monitors = by_kind(manifests, "ServiceMonitor")
    if values["serviceMonitor"]["enabled"]:
        expect(len(monitors) == 1, "ServiceMonitor enabled but not rendered")
        monitor = monitors[0]
        expect(
            monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items(),
            "the ServiceMonitor does not select the Service",
        )
        expect(monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE], "ServiceMonitor namespaceSelector")
        expected_ns = values["serviceMonitor"]["namespace"] or NAMESPACE
        expect(monitor["metadata"].get("namespace") == expected_ns, "ServiceMonitor namespace")
        expect(
            values["serviceMonitor"]["labels"].items() <= monitor["metadata"]["labels"].items(), "ServiceMonitor labels"
        )
    else:
        expect(not monitors, "ServiceMonitor rendered although disabled")
    check_monitoring(manifests, values, chart, deployment["metadata"]["labels"])

    kinds = sorted(m["kind"] for m in manifests)
    expect(
        set(kinds)
        <= {
            "Deployment",
            "StatefulSet",
            "PodDisruptionBudget",
            "Service",
            "Secret",
            "ServiceMonitor",
            "PrometheusRule",
            "ConfigMap",
        },
        f"unexpected kinds {kinds}",
    )
    expect("port-forward" in notes and "/readyz" in notes, "NOTES.txt does not say how to reach the service")


def check_memory(container: dict[str, Any], values: dict[str, Any]) -> None:
    """The memory limit covers the worst case (docs/operations.md "Sizing"); without a limit in the values it is that formula,
    rounded up to a MiB, and the request defaults to the limit."""
    config = values["config"]
    need = (
        config["cacheMaxBytes"]
        + MEMORY_ALLOWANCE
        + (config["maxConcurrentHydrations"] + SHADOW_READS) * config["maxThreadBytes"]
    )
    resources = container.get("resources", {})
    limit = resources.get("limits", {}).get("memory")
    request = resources.get("requests", {}).get("memory")
    expect(limit is not None, "no memory limit")
    expect(
        parse_quantity(limit) >= need,
        f"memory limit {limit} is below the worst case: the {config['cacheMaxBytes']}-byte cache budget + 64 MiB +"
        f" ({config['maxConcurrentHydrations']} + {SHADOW_READS}) x {config['maxThreadBytes']} bytes of store reads",
    )
    given = values.get("resources", {})
    if "memory" not in given.get("limits", {}):
        computed = f"{-(-need // MIB)}Mi"
        expect(limit == computed, f"the computed memory limit is {limit}, not {computed}")
    else:
        expect(parse_quantity(limit) == parse_quantity(given["limits"]["memory"]), f"memory limit {limit}")
    expected_request = given.get("requests", {}).get("memory", limit)
    expect(
        request is not None and parse_quantity(request) == parse_quantity(expected_request),
        f"memory request {request}, not {expected_request}",
    )
    expect(
        resources.get("requests", {}).get("cpu") == given.get("requests", {}).get("cpu"),
        "the CPU request is not the values'",
    )


def check_extras(
    pod: dict[str, Any],
    container: dict[str, Any],
    env_list: list[dict[str, Any]],
    values: dict[str, Any],
    pod_labels: dict[str, str],
) -> None:
    """extraEnv replaces the chart's entry of its name (one entry a name, the extra one as given); extraVolumes,
    extraVolumeMounts and topologySpreadConstraints reach the pod (a constraint without a selector selects the
    release's pods)."""
    for extra in values["extraEnv"]:
        matching = [e for e in env_list if e["name"] == extra["name"]]
        expect(matching == [extra], f"extraEnv {extra} is in the env as {matching}")
    for volume in values["extraVolumes"]:
        expect(volume in pod["volumes"], f"extra volume {volume['name']} is not in the pod")
    for mount in values["extraVolumeMounts"]:
        expect(mount in container["volumeMounts"], f"extra mount {mount['mountPath']} is not in the container")
    constraints = pod.get("topologySpreadConstraints", [])
    expect(
        len(constraints) == len(values["topologySpreadConstraints"]),
        f"{len(constraints)} topology spread constraints, not {len(values['topologySpreadConstraints'])}",
    )
    for got, given in zip(constraints, values["topologySpreadConstraints"]):
        expect(
            got == {**given, "labelSelector": got.get("labelSelector")},
            f"topology spread constraint {got}, given {given}",
        )
        if "labelSelector" in given:
            expect(got["labelSelector"] == given["labelSelector"], f"topology spread constraint {got}'s selector")
        else:
            match_labels = got.get("labelSelector", {}).get("matchLabels", {})
            expect(
                bool(match_labels) and match_labels.items() <= pod_labels.items(),
                f"topology spread constraint {got} does not select the release's pods",
            )


def check_tracing(env_list: list[dict[str, Any]], values: dict[str, Any], notes: str) -> None:
    """Tracing off (no endpoint): no OTEL_* variable and none of the downward API's. On: each OTEL_* setting the
    values set, and only those (an empty OTEL_TRACES_SAMPLER would stop the worker); the pod's name, namespace and
    node from the downward API into variables defined before OTEL_RESOURCE_ATTRIBUTES references them (Kubernetes
    expands only earlier ones), the values' attributes after them (the SDK keeps a key's last value); NOTES names
    where spans go."""
    tracing = values["tracing"]
    extra = {e["name"] for e in values["extraEnv"]}
    chart_env = [e for e in env_list if e["name"] not in extra]
    env = {e["name"]: e for e in chart_env}
    names = [e["name"] for e in chart_env]
    k8s_vars = {var for var, _ in K8S_ATTRIBUTES.values()}
    if not (tracing["endpoint"] or tracing["tracesEndpoint"]):
        present = sorted(n for n in names if n.startswith("OTEL_") or n in k8s_vars)
        expect(not present, f"tracing is off (no endpoint), but the chart sets {present}")
        expect("Traces: off" in notes, "NOTES.txt does not say that tracing is off")
        return
    wanted = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": tracing["endpoint"],
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": tracing["tracesEndpoint"],
        "OTEL_TRACES_SAMPLER": tracing["sampler"],
        "OTEL_SERVICE_NAME": tracing["serviceName"],
    }
    for name, value in wanted.items():
        got = env.get(name, {}).get("value")
        expect(got == (value or None), f"{name} is {got!r}, the values say {value!r} (empty: not set)")
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", {}).get("value")
    # Helm drops a key whose value is null from the values it merges.
    if tracing.get("samplerArg") is None:
        expect(arg is None, f"OTEL_TRACES_SAMPLER_ARG is {arg!r} without tracing.samplerArg")
    else:
        expect(
            arg is not None and float(arg) == float(tracing["samplerArg"]),
            f"OTEL_TRACES_SAMPLER_ARG is {arg!r}, not {tracing['samplerArg']}",
        )
    for var, field in K8S_ATTRIBUTES.values():
        expect(
            env.get(var) == {"name": var, "valueFrom": {"fieldRef": {"fieldPath": field}}},
            f"{var} is {env.get(var)}, not the pod's {field} from the downward API",
        )
    expect("OTEL_RESOURCE_ATTRIBUTES" in env, "tracing is on, but OTEL_RESOURCE_ATTRIBUTES is not set")
    text = env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    pairs = [entry.split("=", 1) for entry in text.split(",")]
    expect(all(len(pair) == 2 for pair in pairs), f"OTEL_RESOURCE_ATTRIBUTES {text!r} has an entry without '='")
    expected = {key: f"$({var})" for key, (var, _) in K8S_ATTRIBUTES.items()} | tracing["resourceAttributes"]
    expect(dict(pairs) == expected, f"OTEL_RESOURCE_ATTRIBUTES {text!r} means {dict(pairs)}, not {expected}")
    before = names[: names.index("OTEL_RESOURCE_ATTRIBUTES")]
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
        expect(ref in before, f"OTEL_RESOURCE_ATTRIBUTES references $({ref}), not defined before it")
    url = tracing["tracesEndpoint"] or tracing["endpoint"].rstrip("/") + "/v1/traces"
    expect(f"OTLP/HTTP to {url}," in notes, f"NOTES.txt does not say that spans go to {url}")


def expected_secret_files(values: dict[str, Any]) -> dict[str, str]:
    """The _FILE settings of the Secret's files the values call for, each with its key in the Secret: the Mongo URI
    always, the API token when one is configured, the credential nats.auth names."""
    secret = values["secret"]
    files = {"HISTORY_VIEW_MONGODB_URI_FILE": secret["mongodbUriKey"]}
    existing = bool(secret["existingSecret"])
    if (existing and secret["existingSecretHasApiToken"]) or (not existing and secret["apiToken"]):
        files["HISTORY_VIEW_API_TOKEN_FILE"] = secret["apiTokenKey"]
    by_auth = {
        "creds": ("HISTORY_VIEW_NATS_CREDS_FILE", "natsCredsKey"),
        "nkey": ("HISTORY_VIEW_NATS_NKEY_SEED_FILE", "natsNkeySeedKey"),
        "token": ("HISTORY_VIEW_NATS_TOKEN_FILE", "natsTokenKey"),
        "userPassword": ("HISTORY_VIEW_NATS_PASSWORD_FILE", "natsPasswordKey"),
    }
    if values["nats"]["auth"] in by_auth:
        setting, key_value = by_auth[values["nats"]["auth"]]
        files[setting] = secret[key_value]
    return files


def expected_tls_files(values: dict[str, Any]) -> dict[str, str]:
    """The _FILE settings of nats.tls.existingSecret's files, each with its key: the CA, and the client
    certificate and key with clientCert."""
    tls = values["nats"]["tls"]
    if not tls["existingSecret"]:
        return {}
    files = {"HISTORY_VIEW_NATS_TLS_CA_FILE": "ca.crt"}
    if tls["clientCert"]:
        files |= {"HISTORY_VIEW_NATS_TLS_CERT_FILE": "tls.crt", "HISTORY_VIEW_NATS_TLS_KEY_FILE": "tls.key"}
    return files


# The values naming a key of the Secret, each with the value the chart's own Secret stores under that key.
SECRET_VALUE_OF_KEY = {
    "mongodbUriKey": "mongodbUri",
    "apiTokenKey": "apiToken",
    "natsCredsKey": "natsCreds",
    "natsNkeySeedKey": "natsNkeySeed",
    "natsTokenKey": "natsToken",
    "natsPasswordKey": "natsPassword",
}


def check_secrets(
    manifests: list[dict[str, Any]],
    workload: dict[str, Any],
    pod: dict[str, Any],
    container: dict[str, Any],
    env: dict[str, dict[str, Any]],
    values: dict[str, Any],
    notes: str,
) -> None:
    """No secret in the workload: every one is a file of a read-only mounted secret volume (the directory, so the
    kubelet's updates arrive), named by its _FILE setting; no secretKeyRef, no envFrom, no secret value anywhere in
    the workload or the notes; the chart's Secret (without existingSecret) holds exactly the keys the pod reads."""
    secret_values = values["secret"]
    refs = sorted(n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {}))
    expect(not refs, f"env read from a Secret (a secret in the Deployment's env): {refs}")
    expect("envFrom" not in container, "envFrom in the container")
    literals = [secret_values[name] for name in SECRET_VALUE_OF_KEY.values() if secret_values[name]]
    # A multi-line secret (a creds file) must not appear line by line either.
    literals += [line for value in literals for line in value.splitlines() if len(line) >= 8 and "-----" not in line]
    for name, entry in env.items():
        expect(entry.get("value") not in literals, f"{name}'s value is a secret")
    workload_text = json.dumps(workload)
    for literal in literals:
        expect(json.dumps(literal)[1:-1] not in workload_text, f"a secret value is in the {workload['kind']}")
        expect(literal not in notes, "a secret value is in NOTES.txt")
    nats_url = env["HISTORY_VIEW_NATS_URL"]["value"]
    expect(re.search(r"://[^/?#,]*@", nats_url) is None, "credentials in HISTORY_VIEW_NATS_URL")
    user = env.get("HISTORY_VIEW_NATS_USER", {}).get("value")
    expected_user = values["nats"]["user"] if values["nats"]["auth"] == "userPassword" else None
    expect(user == expected_user, f"HISTORY_VIEW_NATS_USER is {user!r}, not {expected_user!r}")

    secret_files = expected_secret_files(values)
    tls_files = expected_tls_files(values)
    present = set(env) & (SECRET_FILE_SETTINGS | TLS_FILE_SETTINGS)
    expect(
        present == set(secret_files) | set(tls_files),
        f"file settings {sorted(present)}, expected {sorted(set(secret_files) | set(tls_files))}",
    )
    secret_name = secret_values["existingSecret"] or workload["metadata"]["name"]
    mounts = {m["mountPath"].rstrip("/"): m for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    # The items each secret volume must list: exactly the keys the values use (a listed key the Secret lacks keeps
    # the pod from starting).
    wanted_items: dict[str, list[dict[str, str]]] = {}
    for files, wanted_secret in ((secret_files, secret_name), (tls_files, values["nats"]["tls"]["existingSecret"])):
        for setting, key in files.items():
            path = env[setting]["value"]
            directory, _, file = path.rpartition("/")
            mount = mounts.get(directory)
            expect(mount is not None, f"{setting}={path} points into no mounted directory")
            assert mount is not None
            expect(mount.get("readOnly") is True, f"the mount of {directory} is not read-only")
            volume = volumes.get(mount["name"], {})
            expect(
                volume.get("secret", {}).get("secretName") == wanted_secret,
                f"{setting}: {directory} is not Secret {wanted_secret} (volume {volume})",
            )
            expect(
                {"key": key, "path": file} in volume["secret"].get("items", []),
                f"{setting}: Secret {wanted_secret}'s key {key} is not mounted as {path}",
            )
            wanted_items.setdefault(mount["name"], []).append({"key": key, "path": file})
    for name, items in wanted_items.items():
        got = volumes[name]["secret"]["items"]
        expect(sorted(got, key=str) == sorted(items, key=str), f"volume {name} mounts {got}, the values use {items}")
        mode = volumes[name]["secret"].get("defaultMode", 0o644)
        expect(mode & 0o007 == 0, f"volume {name}'s files are readable by others (mode {mode:o})")
    for mount in container.get("volumeMounts", []):
        if "secret" in volumes.get(mount["name"], {}):
            expect(mount.get("readOnly") is True, f"secret volume {mount['name']} is mounted writable")
            expect(
                "subPath" not in mount and "subPathExpr" not in mount,
                f"secret volume {mount['name']} is mounted by subPath, which the kubelet never updates",
            )

    chart_secrets = by_kind(manifests, "Secret")
    if secret_values["existingSecret"]:
        expect(not chart_secrets, "a Secret is rendered although existingSecret is named")
    else:
        expect(len(chart_secrets) == 1, f"expected one Secret, got {len(chart_secrets)}")
        secret = chart_secrets[0]
        expect(secret["metadata"]["name"] == secret_name, "the pod does not mount the chart's Secret")
        data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
        value_of_key = {secret_values[key_value]: value_name for key_value, value_name in SECRET_VALUE_OF_KEY.items()}
        expected_data = {key: secret_values[value_of_key[key]] for key in secret_files.values()}
        expect(data == expected_data, f"the chart's Secret holds keys {sorted(data)}, not {sorted(expected_data)}")
        checksum = workload["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/secret", "")
        expect(re.fullmatch(r"[0-9a-f]{64}", checksum) is not None, "no checksum/secret annotation on the pod")


def check_chart(chart: Path, record: Callable[[str, str | None], None]) -> None:
    """Lint, render, validate and check facts for every value set, and the alert file; record each outcome. Every
    setting of the binary must be set by some value set (NEVER_SET aside), and every HISTORY_VIEW_* variable set
    must be one of the binary's: a setting it does not know would be ignored (a probe listener never opened). That
    last check is one outcome of its own, so a binary older than the chart fails it alone, naming the settings,
    while every other fact is still checked."""
    set_somewhere: set[str] = set()
    try:
        check_alert_file(chart)
        record(
            f"alerts: {len(file_alerts(chart))} rules shaped, runbooks in docs/operations.md, values' defaults equal",
            None,
        )
    except (CheckError, OSError, KeyError, yaml.YAMLError) as err:
        record("alerts", f"{type(err).__name__}: {err}")
    for case, overrides in CASES.items():
        try:
            lint(chart, overrides)
            manifests, notes = render(chart, overrides)
            for workload in by_kind(manifests, "Deployment") + by_kind(manifests, "StatefulSet"):
                for container in workload["spec"]["template"]["spec"]["containers"]:
                    set_somewhere |= {e["name"] for e in container.get("env", [])}
            for manifest in manifests:
                validate(manifest)
            with helm.Chart.load(chart) as loaded:
                # Helm's own coalescing of defaults and overrides: the values the render used.
                effective = loaded.merge_values(overrides)
            check_facts(manifests, notes, effective, chart)
            record(f"{case}: lint, render, {len(manifests)} manifests valid, facts hold", None)
        except (CheckError, helm.HelmError) as err:
            record(f"{case}", f"{type(err).__name__}: {err}")
    never = sorted(BINARY_SETTINGS - NEVER_SET - set_somewhere)
    record(
        f"settings: each of the binary's {len(BINARY_SETTINGS)} is set by some value set, but {sorted(NEVER_SET)}",
        f"set by no value set: {never}" if never else None,
    )
    unknown = sorted(
        {n for n in set_somewhere if n.startswith(("HISTORY_VIEW_", "OTEL_"))} - BINARY_SETTINGS - SDK_SETTINGS
    )
    record(
        "settings: the chart sets only settings the binary's --help lists",
        f"env vars the binary's --help does not list (rebuild the binary?): {unknown}" if unknown else None,
    )


def check_rejections(chart: Path, record: Callable[[str, str | None], None]) -> None:
    for reason, (values, named) in REJECTED.items():
        try:
            render(chart, values)
        except helm.HelmError as err:
            last_line = next((line.strip() for line in str(err).splitlines()[::-1] if line.strip()), "")
            if named in str(err):
                record(f"rejects {reason} ({type(err).__name__}: {last_line[:90]})", None)
            else:
                record(f"rejects {reason}", f"it failed for another reason: {last_line}")
        else:
            record(f"rejects {reason}", "the chart rendered it")


SYNTAX_BREAKAGE = "an unclosed {{ if }} in a template"

# Mutations of a chart copy; each must make check_chart report at least one failure.
BREAKAGES: dict[str, tuple[str, str, str]] = {
    # name: (file in the chart, text to replace, replacement)
    SYNTAX_BREAKAGE: (
        "templates/deployment.yaml",
        "{{- with .Values.nodeSelector }}",
        "{{- if .Values.nodeSelector }}{{- with .Values.nodeSelector }}",
    ),
    "a field Kubernetes does not know": ("templates/deployment.yaml", "containerPort:", "containerPorts:"),
    "a RollingUpdate strategy for one replica": ("templates/deployment.yaml", "type: Recreate", "type: RollingUpdate"),
    "secrets given as plain values": (
        "templates/_env.tpl",
        '  value: {{ printf "%s/%s" (include "chat-history-view.secretDir" $) .path | quote }}',
        "  value: {{ get $.Values.secret .value | quote }}",
    ),
    "secrets read through secretKeyRef": (
        "templates/_env.tpl",
        '  value: {{ printf "%s/%s" (include "chat-history-view.secretDir" $) .path | quote }}',
        (
            "  valueFrom:\n    secretKeyRef:\n"
            '      name: {{ include "chat-history-view.secretName" $ }}\n      key: {{ .key }}'
        ),
    ),
    "the Secret mounted writable": (
        "templates/deployment.yaml",
        'mountPath: {{ include "chat-history-view.secretDir" . }}\n              readOnly: true',
        'mountPath: {{ include "chat-history-view.secretDir" . }}\n              readOnly: false',
    ),
    "the TLS files mounted under other names": (
        "templates/deployment.yaml",
        "path: {{ .key }}\n",
        "path: {{ .key }}.pem\n",
    ),
    "the client key not passed": (
        "templates/_helpers.tpl",
        '{{- $files = append $files (dict "key" "tls.key" "env" "HISTORY_VIEW_NATS_TLS_KEY_FILE") }}',
        "",
    ),
    "the chart's Secret storing another value under the NATS token's key": (
        "templates/_helpers.tpl",
        '"env" "HISTORY_VIEW_NATS_TOKEN_FILE" "value" "natsToken"',
        '"env" "HISTORY_VIEW_NATS_TOKEN_FILE" "value" "natsPassword"',
    ),
    "extraEnv appended beside the chart's entry": (
        "templates/_env.tpl",
        "{{- if not (hasKey $chartNames .name) }}",
        "{{- if true }}",
    ),
    "the partition from the pod-index label": (
        "templates/_env.tpl",
        "- name: HISTORY_VIEW_PEER_URL\n",
        (
            "- name: HISTORY_VIEW_PARTITION\n  valueFrom:\n    fieldRef:\n"
            "      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']\n- name: HISTORY_VIEW_PEER_URL\n"
        ),
    ),
    "the grace period checked against the drain only": (
        "templates/_validate.tpl",
        "{{- if le $grace (add $delay $drain) }}",
        "{{- if le $grace $drain }}",
    ),
    "a fixed memory limit": (
        "templates/_helpers.tpl",
        '{{- $_ := set $limits "memory" $needMi }}',
        '{{- $_ := set $limits "memory" "1Gi" }}',
    ),
    "a memory limit below the formula accepted": (
        "templates/_helpers.tpl",
        "{{- if lt $limit $need }}",
        "{{- if lt $limit 0.0 }}",
    ),
    "credentials in the NATS URL accepted": (
        "templates/_validate.tpl",
        '{{- if regexMatch "://[^/?#,]*@" .Values.config.natsUrl }}',
        "{{- if false }}",
    ),
    "the liveness probe on the API port": (
        "templates/deployment.yaml",
        "path: /healthz\n              port: probes",
        "path: /healthz\n              port: http",
    ),
    "replicas rendered as one": ("templates/deployment.yaml", "replicas: {{ $replicas }}", "replicas: 1"),
    "no PodDisruptionBudget for replicas": ("templates/pdb.yaml", "(gt (.Values.replicaCount | int64) 1)", "false"),
    "a `for` override ignored": ("templates/prometheusrule.yaml", '$_ := set $out "for" $alert.for', "$_ := 0"),
    "a threshold override ignored": (
        "templates/prometheusrule.yaml",
        "(toString $alert.threshold)",
        "(toString 0.1)",
    ),
    "a disabled alert kept": ("templates/prometheusrule.yaml", 'ne (toString (get $alert "enabled")) "false"', "true"),
    "the PrometheusRule without its additional labels": (
        "templates/prometheusrule.yaml",
        ".Values.prometheusRule.additionalLabels",
        ".Values.prometheusRule.noSuchLabels",
    ),
    "the dashboard ConfigMap without its label": (
        "templates/dashboard.yaml",
        "{{ .Values.grafanaDashboard.label }}: ",
        "dashboard: ",
    ),
    "a values default drifted from the rule file": ("values.yaml", "      threshold: 0.1\n", "      threshold: 0.2\n"),
    "an alert without a runbook": ("files/alerts.yaml", "          runbook_url:", "          runbook:"),
    "the tracing settings rendered while tracing is off": (
        "templates/_env.tpl",
        "{{- if or $t.endpoint $t.tracesEndpoint }}",
        "{{- if true }}",
    ),
    "the sampler not passed": (
        "templates/_env.tpl",
        "- name: OTEL_TRACES_SAMPLER\n  value: {{ $t.sampler | quote }}\n",
        "",
    ),
    "an empty sampler rendered": ("templates/_env.tpl", "{{- if $t.sampler }}", "{{- if true }}"),
    "the resource attributes without the pod's name": (
        "templates/_env.tpl",
        '"k8s.pod.name=$(K8S_POD_NAME)" ',
        "",
    ),
    "the values' attributes before the chart's": (
        "templates/_env.tpl",
        "{{- $attributes = append $attributes",
        "{{- $attributes = prepend $attributes",
    ),
    "credentials in the OTLP endpoint accepted": (
        "templates/_validate.tpl",
        '{{- if regexMatch "://[^/?#]*@" $url }}',
        "{{- if false }}",
    ),
}


def check_both_fail(broken: Path, record: Callable[[str, str | None], None]) -> None:
    """A template syntax error must fail `helm lint` and `helm template` alike, on their own."""
    report = helm.lint(broken, strict=True, kube_version=f"v{KUBE_VERSION}")
    lint_failed = bool(report["errors"])
    try:
        render(broken, {})
        render_failed = False
    except helm.HelmError:
        render_failed = True
    outcome = None if lint_failed and render_failed else f"lint failed: {lint_failed}, render failed: {render_failed}"
    record("self-check: a template syntax error fails both lint and render", outcome)


class Caught(Exception):
    """A failure the intact chart does not have: the self-check's breakage was reported."""


def first_new_failure(chart: Path, baseline: set[str]) -> str | None:
    """Run check_chart and check_rejections on a chart silently, up to the first failure not in baseline (the
    intact chart's failures), and return it; None when the chart passes as well as the intact one."""

    def record(_label: str, failure: str | None) -> None:
        if failure is not None and failure not in baseline:
            raise Caught(failure)

    try:
        check_chart(chart, record)
        check_rejections(chart, record)
    except Caught as caught:
        return str(caught)
    return None


def check_self(record: Callable[[str, str | None], None]) -> None:
    """Prove the check fails on a broken chart: break a copy and expect a failure the intact chart does not have
    (so a failure of the chart itself, say a setting the release binary lacks, cannot pass for a caught one)."""
    baseline: set[str] = set()

    def collect(_label: str, failure: str | None) -> None:
        if failure is not None:
            baseline.add(failure)

    check_chart(CHART, collect)
    check_rejections(CHART, collect)
    for name, (template, old, new) in BREAKAGES.items():
        with tempfile.TemporaryDirectory(prefix="check-chart-") as tmp:
            broken = Path(tmp) / CHART.name
            shutil.copytree(CHART, broken)
            target = broken / template
            text = target.read_text()
            if old not in text:
                record(f"self-check: {name}", f"cannot apply it: {old!r} is not in {template}")
                continue
            target.write_text(text.replace(old, new, 1))
            if name == SYNTAX_BREAKAGE:
                check_both_fail(broken, record)
            failure = first_new_failure(broken, baseline)
            if failure is not None:
                record(f"self-check: {name} is caught ({failure[:100]})", None)
            else:
                record(f"self-check: {name}", "the broken chart passed the check")


def main() -> int:
    started = time.monotonic()
    passed = 0
    failed: list[str] = []

    def record(label: str, failure: str | None) -> None:
        nonlocal passed
        if failure is None:
            passed += 1
            print(f"ok    {label}")
        else:
            failed.append(label)
            print(f"FAIL  {label}: {failure}")

    print(
        f"helm-python-sdk {helm.__version__} (Helm {helm.helm_sdk_version()}), "
        f"kubernetes-validate {kubernetes_validate.__version__}, Kubernetes {KUBE_VERSION} schemas"
    )
    check_chart(CHART, record)
    check_rejections(CHART, record)
    check_self(record)
    print(f"chart {CHART.relative_to(ROOT)} checked in {time.monotonic() - started:.1f}s")
    print(f"check-chart: {passed} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
