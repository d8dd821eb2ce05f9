{{/*
The chart name, or nameOverride.
*/}}
{{- define "chat-history-view.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full resource name: fullnameOverride, or <release>-<name> (just <release> when it already
contains the name), cut to the 63 characters a DNS label allows.
*/}}
{{- define "chat-history-view.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version for the helm.sh/chart label.
*/}}
{{- define "chat-history-view.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every resource.
*/}}
{{- define "chat-history-view.labels" -}}
helm.sh/chart: {{ include "chat-history-view.chart" . }}
{{ include "chat-history-view.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: aihub
{{- end }}

{{/*
Labels that select the pod; they never change across upgrades.
*/}}
{{- define "chat-history-view.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chat-history-view.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The image reference: repository@digest when a digest is set, else repository:tag (tag defaults
to the chart's appVersion).
*/}}
{{- define "chat-history-view.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
The Secret holding the Mongo URI and the API token: the named existing one, or the chart's own.
*/}}
{{- define "chat-history-view.secretName" -}}
{{- if .Values.secret.existingSecret }}
{{- .Values.secret.existingSecret }}
{{- else }}
{{- include "chat-history-view.fullname" . }}
{{- end }}
{{- end }}

{{/*
The headless Service of partitioned workers: each pod is <fullname>-<ordinal>.<headless>.
*/}}
{{- define "chat-history-view.headlessName" -}}
{{- printf "%s-headless" (include "chat-history-view.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Where the Secret's files are mounted (the secret volume, read-only, the whole directory: the kubelet updates a
mounted Secret's files in place, which it never does for a subPath mount, so a rotated API token arrives).
*/}}
{{- define "chat-history-view.secretDir" -}}
/etc/chat-history-view/secret
{{- end }}

{{/*
Where nats.tls.existingSecret's files are mounted (the nats-tls volume, read-only).
*/}}
{{- define "chat-history-view.natsTlsDir" -}}
/etc/chat-history-view/nats-tls
{{- end }}

{{/*
The files of the Secret (existing or the chart's) the worker reads, as a YAML list of {key, path, env, value}:
key in the Secret, file name in the mounted directory, the _FILE setting naming it, and the name of the value
under `secret` the chart stores under the key (without existingSecret; by name, as a YAML round trip would drop a
creds file's final newline). One list for the volume's items, the settings and the chart's own Secret, so the three
cannot disagree. The Mongo URI always; the API token when one is configured; the one NATS credential nats.auth
names.
*/}}
{{- define "chat-history-view.secretFiles" -}}
{{- $s := .Values.secret }}
{{- $files := list (dict "key" $s.mongodbUriKey "path" "mongodb-uri" "env" "HISTORY_VIEW_MONGODB_URI_FILE" "value" "mongodbUri") }}
{{- if or (and $s.existingSecret $s.existingSecretHasApiToken) (and (not $s.existingSecret) $s.apiToken) }}
{{- $files = append $files (dict "key" $s.apiTokenKey "path" "api-token" "env" "HISTORY_VIEW_API_TOKEN_FILE" "value" "apiToken") }}
{{- end }}
{{- $auth := .Values.nats.auth }}
{{- if eq $auth "creds" }}
{{- $files = append $files (dict "key" $s.natsCredsKey "path" "nats-creds" "env" "HISTORY_VIEW_NATS_CREDS_FILE" "value" "natsCreds") }}
{{- else if eq $auth "nkey" }}
{{- $files = append $files (dict "key" $s.natsNkeySeedKey "path" "nats-nkey-seed" "env" "HISTORY_VIEW_NATS_NKEY_SEED_FILE" "value" "natsNkeySeed") }}
{{- else if eq $auth "token" }}
{{- $files = append $files (dict "key" $s.natsTokenKey "path" "nats-token" "env" "HISTORY_VIEW_NATS_TOKEN_FILE" "value" "natsToken") }}
{{- else if eq $auth "userPassword" }}
{{- $files = append $files (dict "key" $s.natsPasswordKey "path" "nats-password" "env" "HISTORY_VIEW_NATS_PASSWORD_FILE" "value" "natsPassword") }}
{{- end }}
{{- toYaml $files }}
{{- end }}

{{/*
The files of nats.tls.existingSecret, as a YAML list of {key, env} (the file name is the key): the CA always, the
client certificate and its key with nats.tls.clientCert. Empty without nats.tls.existingSecret.
*/}}
{{- define "chat-history-view.natsTlsFiles" -}}
{{- $files := list }}
{{- if .Values.nats.tls.existingSecret }}
{{- $files = append $files (dict "key" "ca.crt" "env" "HISTORY_VIEW_NATS_TLS_CA_FILE") }}
{{- if .Values.nats.tls.clientCert }}
{{- $files = append $files (dict "key" "tls.crt" "env" "HISTORY_VIEW_NATS_TLS_CERT_FILE") }}
{{- $files = append $files (dict "key" "tls.key" "env" "HISTORY_VIEW_NATS_TLS_KEY_FILE") }}
{{- end }}
{{- end }}
{{- toYaml $files }}
{{- end }}

{{/*
A Kubernetes quantity ("1088Mi", "1.5Gi", "2G", 1073741824) as a number of bytes, printed; fails naming `what` on a
form it does not read. Call with (dict "quantity" q "what" "resources.limits.memory").
*/}}
{{- define "chat-history-view.bytes" -}}
{{- $q := .quantity }}
{{- if kindIs "string" $q }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $units := dict "" 1 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 }}
{{- $unit := trimPrefix $number $q }}
{{- if or (not $number) (not (hasKey $units $unit)) }}
{{- fail (printf "%s (%s) is no quantity the chart reads: a number with one of the units Ki Mi Gi Ti Pi k M G T P" .what $q) }}
{{- end }}
{{- mulf (float64 $number) (get $units $unit) }}
{{- else }}
{{- float64 $q }}
{{- end }}
{{- end }}

{{/*
The worst case of the worker's resident memory, in bytes, from the values (docs/operations.md
"Sizing"): the cache budget + 64 MiB for the process + (store reads at once + 2 shadow checks) x the per-thread
limit, each of those reads holding up to a thread at the limit.
*/}}
{{- define "chat-history-view.memoryBytes" -}}
{{- $c := .Values.config }}
{{- addf (float64 $c.cacheMaxBytes) 67108864 (mulf (addf (float64 $c.maxConcurrentHydrations) 2) (float64 $c.maxThreadBytes)) }}
{{- end }}

{{/*
The container's resources: the values', with the memory limit computed from the formula above (rounded up to a
MiB) when none is set, and the memory request equal to the limit when none is set (the pod is not evicted for
using the memory it was sized for). An explicit limit below the formula fails the render.
*/}}
{{- define "chat-history-view.resources" -}}
{{- $resources := deepCopy (.Values.resources | default dict) }}
{{- $limits := get $resources "limits" | default dict }}
{{- $requests := get $resources "requests" | default dict }}
{{- $need := include "chat-history-view.memoryBytes" . | float64 }}
{{- $needMi := printf "%dMi" (ceil (divf $need 1048576) | int64) }}
{{- $formula := printf "config.cacheMaxBytes + 64 MiB + (config.maxConcurrentHydrations + 2) x config.maxThreadBytes = %s" $needMi }}
{{- if hasKey $limits "memory" }}
{{- $limit := include "chat-history-view.bytes" (dict "quantity" $limits.memory "what" "resources.limits.memory") | float64 }}
{{- if lt $limit $need }}
{{- fail (printf "resources.limits.memory (%v) is below the worker's worst case, %s: raise it, lower those values, or leave the limit unset for the chart to compute it" $limits.memory $formula) }}
{{- end }}
{{- else }}
{{- $_ := set $limits "memory" $needMi }}
{{- end }}
{{- if not (hasKey $requests "memory") }}
{{- $_ := set $requests "memory" $limits.memory }}
{{- else if gt (include "chat-history-view.bytes" (dict "quantity" $requests.memory "what" "resources.requests.memory") | float64) (include "chat-history-view.bytes" (dict "quantity" $limits.memory "what" "resources.limits.memory") | float64) }}
{{- fail (printf "resources.requests.memory (%v) is above resources.limits.memory (%v)" $requests.memory $limits.memory) }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- toYaml $resources }}
{{- end }}

{{/*
topologySpreadConstraints as given, an entry without a labelSelector given one selecting this release's pods (a
constraint selecting nothing spreads nothing).
*/}}
{{- define "chat-history-view.topologySpreadConstraints" -}}
{{- $selector := dict "matchLabels" (include "chat-history-view.selectorLabels" . | fromYaml) }}
{{- $constraints := list }}
{{- range .Values.topologySpreadConstraints }}
{{- if hasKey . "labelSelector" }}
{{- $constraints = append $constraints . }}
{{- else }}
{{- $constraints = append $constraints (merge (dict "labelSelector" $selector) .) }}
{{- end }}
{{- end }}
{{- toYaml $constraints }}
{{- end }}

{{/*
A Deployment's progressDeadlineSeconds: Kubernetes' default (600), or more when the warm-up's longest wait plus the
readiness probe's failures (failureThreshold x periodSeconds) and two minutes to pull and start would not fit in it.
*/}}
{{- define "chat-history-view.progressDeadline" -}}
{{- $probe := mul (.Values.readinessProbe.failureThreshold | int64) (.Values.readinessProbe.periodSeconds | int64) }}
{{- max 600 (add (.Values.config.warm.maxSecs | int64) $probe 120) }}
{{- end }}
