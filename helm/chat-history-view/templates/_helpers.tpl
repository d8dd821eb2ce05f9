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
