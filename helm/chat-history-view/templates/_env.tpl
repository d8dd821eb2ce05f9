{{/*
The container's environment: every HISTORY_VIEW_* setting the chart passes (and the OTEL_* ones with tracing on),
then extraEnv. An extraEnv entry replaces the chart's entry of the same name in place (never a second entry of one
name: which of two wins is up to the kubelet's version), and the others are appended. No secret is ever a value
here: the Mongo URI, the API token and the NATS credentials are files of the mounted Secret, named by the _FILE
settings.
*/}}
{{- define "chat-history-view.env" -}}
{{- $chartEnv := include "chat-history-view.chartEnv" . | fromYamlArray }}
{{- $extra := dict }}
{{- range .Values.extraEnv }}
{{- if hasKey $extra .name }}
{{- fail (printf "extraEnv names %s twice" .name) }}
{{- end }}
{{- $_ := set $extra .name . }}
{{- end }}
{{- $env := list }}
{{- $chartNames := dict }}
{{- range $chartEnv }}
{{- $_ := set $chartNames .name true }}
{{- if hasKey $extra .name }}
{{- $env = append $env (get $extra .name) }}
{{- else }}
{{- $env = append $env . }}
{{- end }}
{{- end }}
{{- range .Values.extraEnv }}
{{- if hasKey $chartNames (printf "%s_FILE" .name) }}
{{- fail (printf "extraEnv sets %s, but the chart passes %s_FILE (from the Secret): the worker refuses a setting and its _FILE twin together" .name .name) }}
{{- end }}
{{- if not (hasKey $chartNames .name) }}
{{- $env = append $env . }}
{{- end }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/*
The chart's own entries, before extraEnv.
*/}}
{{- define "chat-history-view.chartEnv" -}}
{{- $partitions := .Values.partitions | int64 }}
- name: HISTORY_VIEW_LISTEN
  value: {{ printf "0.0.0.0:%d" (.Values.containerPort | int64) | quote }}
- name: HISTORY_VIEW_PROBE_LISTEN
  value: {{ printf "0.0.0.0:%d" (.Values.probePort | int64) | quote }}
- name: HISTORY_VIEW_NATS_URL
  value: {{ .Values.config.natsUrl | quote }}
{{- if eq .Values.nats.auth "userPassword" }}
- name: HISTORY_VIEW_NATS_USER
  value: {{ .Values.nats.user | quote }}
{{- end }}
{{- range include "chat-history-view.natsTlsFiles" . | fromYamlArray }}
- name: {{ .env }}
  value: {{ printf "%s/%s" (include "chat-history-view.natsTlsDir" $) .key | quote }}
{{- end }}
{{- range include "chat-history-view.secretFiles" . | fromYamlArray }}
- name: {{ .env }}
  value: {{ printf "%s/%s" (include "chat-history-view.secretDir" $) .path | quote }}
{{- end }}
- name: HISTORY_VIEW_SUBJECT
  value: {{ .Values.config.subject | quote }}
- name: HISTORY_VIEW_SOURCE
  value: {{ .Values.config.source | quote }}
- name: HISTORY_VIEW_JETSTREAM_STREAMS
  value: {{ .Values.config.jetstreamStreams | quote }}
- name: HISTORY_VIEW_JETSTREAM_REPLAY_SECS
{{- if kindIs "invalid" .Values.config.jetstreamReplaySecs }}
  value: {{ add (div (.Values.config.persistLagMs | int64) 1000) 4 | quote }}
{{- else }}
  value: {{ .Values.config.jetstreamReplaySecs | int64 | quote }}
{{- end }}
- name: HISTORY_VIEW_JETSTREAM_WITNESS
  value: {{ .Values.config.jetstreamWitness | quote }}
- name: HISTORY_VIEW_PARTITIONS
  value: {{ $partitions | quote }}
{{- /* No HISTORY_VIEW_PARTITION: a partitioned worker takes the ordinal ending its host name, the StatefulSet pod's
name, on every Kubernetes version (the pod-index label exists only from 1.28). */}}
- name: HISTORY_VIEW_PEER_URL
  value: {{ printf "http://%s-{partition}.%s.%s.svc:%d" (include "chat-history-view.fullname" .) (include "chat-history-view.headlessName" .) .Release.Namespace (.Values.containerPort | int64) | quote }}
- name: HISTORY_VIEW_JETSTREAM_STREAM
  value: {{ .Values.config.jetstreamStream | quote }}
- name: HISTORY_VIEW_JETSTREAM_CREATE_STREAM
  value: {{ .Values.config.jetstreamCreateStream | quote }}
- name: HISTORY_VIEW_JETSTREAM_SUBJECT_PREFIX
  value: {{ .Values.config.jetstreamSubjectPrefix | quote }}
- name: HISTORY_VIEW_JETSTREAM_MAX_AGE_SECS
  value: {{ .Values.config.jetstreamMaxAgeSecs | int64 | quote }}
{{- if not (kindIs "invalid" .Values.config.jetstreamMaxBytes) }}
- name: HISTORY_VIEW_JETSTREAM_MAX_BYTES
  value: {{ .Values.config.jetstreamMaxBytes | int64 | quote }}
{{- end }}
- name: HISTORY_VIEW_JETSTREAM_REPLICAS
  value: {{ .Values.config.jetstreamReplicas | int64 | quote }}
- name: HISTORY_VIEW_MONGODB_DATABASE
  value: {{ .Values.config.mongodb.database | quote }}
- name: HISTORY_VIEW_MONGODB_COLLECTION
  value: {{ .Values.config.mongodb.collection | quote }}
- name: HISTORY_VIEW_MONGODB_INDEX_HINT
  value: {{ .Values.config.mongodb.indexHint | quote }}
- name: HISTORY_VIEW_MONGODB_FILL_INDEX_HINT
  value: {{ .Values.config.mongodb.fillIndexHint | quote }}
- name: HISTORY_VIEW_CACHE_MAX_BYTES
  value: {{ .Values.config.cacheMaxBytes | int64 | quote }}
- name: HISTORY_VIEW_CACHE_IDLE_SECS
  value: {{ .Values.config.cacheIdleSecs | int64 | quote }}
- name: HISTORY_VIEW_WARM_MAX_THREADS
  value: {{ .Values.config.warm.maxThreads | int64 | quote }}
- name: HISTORY_VIEW_WARM_BUCKET
  value: {{ .Values.config.warm.bucket | quote }}
- name: HISTORY_VIEW_WARM_SNAPSHOT_SECS
  value: {{ .Values.config.warm.snapshotSecs | int64 | quote }}
- name: HISTORY_VIEW_WARM_RATE
  value: {{ .Values.config.warm.rate | int64 | quote }}
- name: HISTORY_VIEW_WARM_MAX_SECS
  value: {{ .Values.config.warm.maxSecs | int64 | quote }}
- name: HISTORY_VIEW_STORE_TIMEOUT_MS
  value: {{ .Values.config.storeTimeoutMs | int64 | quote }}
- name: HISTORY_VIEW_MAX_CONCURRENT_HYDRATIONS
  value: {{ .Values.config.maxConcurrentHydrations | int64 | quote }}
- name: HISTORY_VIEW_MAX_THREAD_BYTES
  value: {{ .Values.config.maxThreadBytes | int64 | quote }}
- name: HISTORY_VIEW_HTTP_MAX_CONNECTIONS
  value: {{ .Values.config.httpMaxConnections | int64 | quote }}
- name: HISTORY_VIEW_HTTP_MAX_IN_FLIGHT
  value: {{ .Values.config.httpMaxInFlight | int64 | quote }}
- name: HISTORY_VIEW_HTTP_MAX_WAITING
  value: {{ .Values.config.httpMaxWaiting | int64 | quote }}
- name: HISTORY_VIEW_HTTP_MAX_STREAMS
  value: {{ .Values.config.httpMaxStreams | int64 | quote }}
- name: HISTORY_VIEW_NATS_SUBSCRIPTION_CAPACITY
  value: {{ .Values.config.natsSubscriptionCapacity | int64 | quote }}
- name: HISTORY_VIEW_NATS_PING_INTERVAL_SECS
  value: {{ .Values.config.natsPingIntervalSecs | int64 | quote }}
- name: HISTORY_VIEW_HTTP_HEADER_TIMEOUT_SECS
  value: {{ .Values.config.httpHeaderTimeoutSecs | int64 | quote }}
- name: HISTORY_VIEW_HTTP_IDLE_TIMEOUT_SECS
  value: {{ .Values.config.httpIdleTimeoutSecs | int64 | quote }}
- name: HISTORY_VIEW_PERSIST_LAG_MS
  value: {{ .Values.config.persistLagMs | int64 | quote }}
- name: HISTORY_VIEW_SHADOW_SAMPLE
  value: {{ .Values.config.shadowSample | toString | quote }}
- name: HISTORY_VIEW_SHADOW_MAX_PER_SEC
  value: {{ .Values.config.shadowMaxPerSec | int64 | quote }}
- name: HISTORY_VIEW_SHADOW_CLOCK_MARGIN_MS
  value: {{ .Values.config.shadowClockMarginMs | int64 | quote }}
- name: HISTORY_VIEW_SHUTDOWN_DELAY_SECS
  value: {{ .Values.config.shutdownDelaySecs | int64 | quote }}
- name: HISTORY_VIEW_SHUTDOWN_DRAIN_SECS
  value: {{ .Values.config.shutdownDrainSecs | int64 | quote }}
- name: RUST_LOG
  value: {{ .Values.config.logLevel | quote }}
- name: HISTORY_VIEW_INSPECTOR
  value: {{ .Values.config.inspector | quote }}
- name: HISTORY_VIEW_LOG_FORMAT
  value: {{ .Values.config.logFormat | quote }}
{{- include "chat-history-view.tracingEnv" . }}
{{- end }}

{{/*
The tracing settings, only when tracing is on (an endpoint is set): the worker records nothing without one, and
an empty OTEL_TRACES_SAMPLER would be refused, so an unset value is left out rather than rendered empty. The pod's
name, namespace and node come from the downward API into K8S_* variables that OTEL_RESOURCE_ATTRIBUTES references
(Kubernetes expands $(NAME) only for variables defined before it); the values' attributes come after the chart's,
and the SDK keeps the last of one key.
*/}}
{{- define "chat-history-view.tracingEnv" -}}
{{- $t := .Values.tracing }}
{{- if or $t.endpoint $t.tracesEndpoint }}
{{- if $t.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $t.endpoint | quote }}
{{- end }}
{{- if $t.tracesEndpoint }}
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ $t.tracesEndpoint | quote }}
{{- end }}
{{- if $t.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $t.sampler | quote }}
{{- end }}
{{- if not (kindIs "invalid" $t.samplerArg) }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplerArg | toString | quote }}
{{- end }}
{{- if $t.serviceName }}
- name: OTEL_SERVICE_NAME
  value: {{ $t.serviceName | quote }}
{{- end }}
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: K8S_NAMESPACE_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: K8S_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- $attributes := list "k8s.pod.name=$(K8S_POD_NAME)" "k8s.namespace.name=$(K8S_NAMESPACE_NAME)" "k8s.node.name=$(K8S_NODE_NAME)" }}
{{- range $key, $value := $t.resourceAttributes }}
{{- $attributes = append $attributes (printf "%s=%s" $key $value) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attributes | quote }}
{{- end }}
{{- end }}
