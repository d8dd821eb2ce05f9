{{/*
The checks the schema cannot express, each failing the render with what to change: settings that contradict each
other, a secret where it would land in the Deployment, a grace period the shutdown does not fit in.
*/}}
{{- define "chat-history-view.validate" -}}
{{- $delay := .Values.config.shutdownDelaySecs | int64 }}
{{- $drain := .Values.config.shutdownDrainSecs | int64 }}
{{- $grace := .Values.terminationGracePeriodSeconds | int64 }}
{{- if le $grace (add $delay $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must exceed config.shutdownDelaySecs + config.shutdownDrainSecs (%d + %d): the pod would be killed while it drains" $grace $delay $drain) }}
{{- end }}
{{- $partitions := .Values.partitions | int64 }}
{{- if and (gt $partitions 1) (ne .Values.config.source "jetstream") }}
{{- fail "partitions above 1 need config.source=jetstream (the partitions are a JetStream subject transform)" }}
{{- end }}
{{- $replicas := .Values.replicaCount | int64 }}
{{- if and (gt $replicas 1) (gt $partitions 1) }}
{{- fail (printf "replicaCount (%d) above 1 does not combine with partitions (%d) above 1: a partition has exactly one worker (its StatefulSet ordinal); set replicaCount: 1" $replicas $partitions) }}
{{- end }}
{{- if eq (.Values.probePort | int64) (.Values.containerPort | int64) }}
{{- fail (printf "probePort (%d) must differ from containerPort, the API's port: the probes need a listener of their own" (.Values.probePort | int64)) }}
{{- end }}
{{- /* The URL is a plain value in the Deployment: credentials in it would be readable by anyone who can read the Deployment. */}}
{{- if regexMatch "://[^/?#,]*@" .Values.config.natsUrl }}
{{- fail "config.natsUrl holds credentials (user@ or user:password@), which would be a plain value in the Deployment: set nats.auth (token or userPassword with nats.user) and put the secret in the Secret" }}
{{- end }}
{{- range $name, $url := dict "endpoint" .Values.tracing.endpoint "tracesEndpoint" .Values.tracing.tracesEndpoint }}
{{- if regexMatch "://[^/?#]*@" $url }}
{{- fail (printf "tracing.%s holds credentials (user@ or user:password@), which would be a plain value in the Deployment: send spans to a collector in the cluster, which holds the backend's credentials" $name) }}
{{- end }}
{{- end }}
{{- $auth := .Values.nats.auth }}
{{- if and (eq $auth "userPassword") (not .Values.nats.user) }}
{{- fail "nats.auth=userPassword needs nats.user (the password is the Secret's natsPasswordKey)" }}
{{- end }}
{{- if and .Values.nats.user (ne $auth "userPassword") }}
{{- fail (printf "nats.user is set, but nats.auth is %s: a user goes with nats.auth=userPassword only" $auth) }}
{{- end }}
{{- if and .Values.nats.tls.clientCert (not .Values.nats.tls.existingSecret) }}
{{- fail "nats.tls.clientCert needs nats.tls.existingSecret (the Secret holding tls.crt and tls.key)" }}
{{- end }}
{{- $s := .Values.secret }}
{{- $literals := dict "apiToken" $s.apiToken "natsCreds" $s.natsCreds "natsNkeySeed" $s.natsNkeySeed "natsToken" $s.natsToken "natsPassword" $s.natsPassword }}
{{- if $s.existingSecret }}
{{- range $name, $value := $literals }}
{{- if $value }}
{{- fail (printf "secret.%s is set, but secret.existingSecret names the Secret the worker reads: put it there under its key, or drop existingSecret" $name) }}
{{- end }}
{{- end }}
{{- else }}
{{- $wanted := get (dict "creds" "natsCreds" "nkey" "natsNkeySeed" "token" "natsToken" "userPassword" "natsPassword") $auth }}
{{- range $name, $value := $literals }}
{{- if and $value (ne $name "apiToken") (ne $name $wanted) }}
{{- fail (printf "secret.%s is set, but nats.auth is %s: the worker takes one NATS credential" $name $auth) }}
{{- end }}
{{- end }}
{{- if and $wanted (not (get $literals $wanted)) }}
{{- fail (printf "nats.auth=%s needs secret.%s (or secret.existingSecret holding it)" $auth $wanted) }}
{{- end }}
{{- end }}
{{- $chartVolumes := list "tmp" "secret" "nats-tls" }}
{{- range .Values.extraVolumes }}
{{- if has .name $chartVolumes }}
{{- fail (printf "extraVolumes names %s, a volume of the chart's own (tmp, secret, nats-tls)" .name) }}
{{- end }}
{{- end }}
{{- $chartPaths := list "/tmp" (include "chat-history-view.secretDir" .) (include "chat-history-view.natsTlsDir" .) }}
{{- range .Values.extraVolumeMounts }}
{{- if has (trimSuffix "/" .mountPath) $chartPaths }}
{{- fail (printf "extraVolumeMounts mounts at %s, where the chart mounts a volume of its own" .mountPath) }}
{{- end }}
{{- end }}
{{- end }}
