{{/* Names ---------------------------------------------------------------- */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The name of a component's objects: (dict "root" $ "component" "worker"). */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.configMapName" -}}
{{- printf "%s-config" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "tandem.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{- define "tandem.tokenSecretName" -}}
{{- default (printf "%s-token" (include "tandem.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "tandem.tokenSecretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{/* The coordinator's Service, which members reach it by. */}}
{{- define "tandem.coordinatorAddress" -}}
{{- printf "%s:%d" (include "tandem.componentName" (dict "root" . "component" "coordinator")) (int .Values.coordinator.ports.grpc) -}}
{{- end -}}

{{/* The name clients check in the certificate. */}}
{{- define "tandem.tlsServerName" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "coordinator")) .Values.tls.serverName -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- $repo := .root.Values.image.repository -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag -}}
{{- with .override -}}
{{- if .repository -}}{{- $repo = .repository -}}{{- end -}}
{{- if .tag -}}{{- $tag = .tag -}}{{- end -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Labels: (dict "root" $ "component" "worker"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .root }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Daemon configuration --------------------------------------------------

A map rendered as the YAML the daemons read: keys sorted, strings quoted,
whole numbers without an exponent (Helm reads numbers as float64, and
toYaml would write 1000000 as 1e+06, which a daemon refuses as an integer).
*/}}
{{- define "tandem.configYaml" -}}
{{- $pad := .pad -}}
{{- $map := .value -}}
{{- range $key := keys $map | sortAlpha }}
{{- $v := get $map $key }}
{{- if kindIs "map" $v }}
{{- if empty $v }}
{{ $pad }}{{ $key }}: {}
{{- else }}
{{ $pad }}{{ $key }}:
{{- include "tandem.configYaml" (dict "value" $v "pad" (printf "%s  " $pad)) }}
{{- end }}
{{- else }}
{{ $pad }}{{ $key }}: {{ include "tandem.configScalar" $v }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "tandem.configScalar" -}}
{{- if kindIs "string" . -}}
{{ toJson . }}
{{- else if kindIs "bool" . -}}
{{ ternary "true" "false" . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) -}}
{{- if eq (float64 .) (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if kindIs "invalid" . -}}
""
{{- else -}}
{{ . }}
{{- end -}}
{{- end -}}

{{/* The keys every daemon gets from the chart: TLS. */}}
{{- define "tandem.tlsConfig" -}}
{{- if .Values.tls.enabled -}}
{{- toJson (dict "cert_file" "/etc/tandem/tls/tls.crt" "key_file" "/etc/tandem/tls/tls.key" "ca_file" "/etc/tandem/tls/ca.crt" "require_client_cert" .Values.tls.requireClientCert "server_name" (include "tandem.tlsServerName" .)) -}}
{{- else -}}
{{- toJson (dict "cert_file" "" "key_file" "" "ca_file" "" "require_client_cert" false "server_name" "") -}}
{{- end -}}
{{- end -}}

{{/* Workers in the whole job. */}}
{{- define "tandem.workerRanks" -}}
{{- mul (int .Values.workers.replicas) (int .Values.workers.ranksPerPod) -}}
{{- end -}}

{{/*
Elements of the reference model that workers.config.train describes (the
layout of worker/model/model.cc's TensorLayout: byte vocabulary of 256, MLP
four times d_model wide): per block 12·c² + 13·c, plus the token and position
embeddings, the final LayerNorm and the head.
*/}}
{{- define "tandem.referenceParameterCount" -}}
{{- $train := default dict .Values.workers.config.train -}}
{{- $c := int64 (default 128 $train.d_model) -}}
{{- $l := int64 (default 4 $train.layers) -}}
{{- $t := int64 (default 64 $train.context) -}}
{{- $v := int64 256 -}}
{{- add (mul $l (add (mul 12 $c $c) (mul 13 $c))) (mul 2 $v $c) (mul $t $c) (mul 2 $c) -}}
{{- end -}}

{{/* Pods ---------------------------------------------------------------- */}}

{{/* The downward-API variables every container gets. */}}
{{- define "tandem.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- end -}}

{{/*
Liveness and readiness: (dict "root" $ "port" 7400 "host" "127.0.0.1").
Native gRPC probes without TLS; with TLS `tandem health` in the container,
since the kubelet's gRPC probe cannot speak TLS. host may name an
environment variable ("$POD_IP").
*/}}
{{- define "tandem.probes" -}}
{{- $root := .root -}}
{{- $live := $root.Values.probes.liveness -}}
{{- $ready := $root.Values.probes.readiness -}}
{{- if $root.Values.tls.enabled }}
{{- $tls := printf "--tls-ca-file /etc/tandem/tls/ca.crt --tls-cert-file /etc/tandem/tls/tls.crt --tls-key-file /etc/tandem/tls/tls.key --tls-server-name %s" (include "tandem.tlsServerName" $root) }}
livenessProbe:
  exec:
    command:
      - sh
      - -c
      - {{ printf "exec tandem health \"%s:%d\" --timeout %ds %s" .host (int .port) (max 1 (sub (int $live.timeoutSeconds) 1)) $tls | quote }}
  periodSeconds: {{ $live.periodSeconds }}
  timeoutSeconds: {{ $live.timeoutSeconds }}
  failureThreshold: {{ $live.failureThreshold }}
readinessProbe:
  exec:
    command:
      - sh
      - -c
      - {{ printf "exec tandem health \"%s:%d\" --service tandem.ready --timeout %ds %s" .host (int .port) (max 1 (sub (int $ready.timeoutSeconds) 1)) $tls | quote }}
  periodSeconds: {{ $ready.periodSeconds }}
  timeoutSeconds: {{ $ready.timeoutSeconds }}
  failureThreshold: {{ $ready.failureThreshold }}
{{- else }}
livenessProbe:
  grpc:
    port: {{ .port }}
    service: ""
  periodSeconds: {{ $live.periodSeconds }}
  timeoutSeconds: {{ $live.timeoutSeconds }}
  failureThreshold: {{ $live.failureThreshold }}
readinessProbe:
  grpc:
    port: {{ .port }}
    service: tandem.ready
  periodSeconds: {{ $ready.periodSeconds }}
  timeoutSeconds: {{ $ready.timeoutSeconds }}
  failureThreshold: {{ $ready.failureThreshold }}
{{- end }}
{{- end -}}

{{/* Volume mounts every daemon gets: its configuration, /tmp, TLS, the token. */}}
{{- define "tandem.commonVolumeMounts" -}}
- name: config
  mountPath: /etc/tandem/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- if .Values.auth.enabled }}
- name: token
  mountPath: /etc/tandem/auth
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "tandem.configMapName" . }}
- name: tmp
  emptyDir: {}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "tandem.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- if .Values.auth.enabled }}
- name: token
  secret:
    secretName: {{ include "tandem.tokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ include "tandem.tokenSecretKey" . }}
        path: token
{{- end }}
{{- end -}}

{{/*
Annotations that restart a component's pods when its configuration or the
chart-made certificate changes: (dict "root" $ "config" "tandem.workerConfig").
*/}}
{{- define "tandem.checksums" -}}
checksum/config: {{ include .config .root | sha256sum }}
{{- if and .root.Values.tls.enabled (not .root.Values.tls.existingSecret) }}
checksum/tls: {{ include (print .root.Template.BasePath "/secret-tls.yaml") .root | sha256sum }}
{{- end }}
{{- end -}}

{{/*
Soft or hard anti-affinity between the pods of one component:
(dict "root" $ "component" "server" "mode" "soft").
*/}}
{{- define "tandem.antiAffinity" -}}
{{- if eq .mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "tandem.selectorLabels" . | nindent 10 }}
{{- else if eq .mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "tandem.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end -}}

{{/* RDMA device resources: (dict "rdma" .Values.workers.rdma). */}}
{{- define "tandem.rdmaResources" -}}
{{- if .rdma.enabled }}
{{ .rdma.resourceName | quote }}: {{ .rdma.count }}
{{- end }}
{{- end -}}

{{/*
A container's resources with device resources added to its requests and
limits: (dict "base" .Values.workers.resources "devices" (dict "nvidia.com/gpu" 1)).
*/}}
{{- define "tandem.resources" -}}
{{- $r := deepCopy .base -}}
{{- range $name, $count := .devices -}}
{{- if gt (int $count) 0 -}}
{{- $req := default dict (get $r "requests") -}}
{{- $lim := default dict (get $r "limits") -}}
{{- $_ := set $req $name (int $count) -}}
{{- $_ = set $lim $name (int $count) -}}
{{- $_ = set $r "requests" $req -}}
{{- $_ = set $r "limits" $lim -}}
{{- end -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}

{{/* The container security context; RDMA needs IPC_LOCK to pin memory: (dict "root" $ "rdma" bool). */}}
{{- define "tandem.securityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext -}}
{{- if .rdma -}}
{{- $caps := default dict (get $sc "capabilities") -}}
{{- $add := default list (get $caps "add") -}}
{{- $_ := set $caps "add" (append $add "IPC_LOCK" | uniq) -}}
{{- $_ = set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* Daemon configuration files ---------------------------------------------

Each daemon's file: its `config` values plus the keys the chart owns. What
varies per pod (name, listen addresses, node id) goes on the command line,
where flags win over the file.
*/}}

{{- define "tandem.tokenFile" -}}
{{- ternary "/etc/tandem/auth/token" "" .Values.auth.enabled -}}
{{- end -}}

{{- define "tandem.coordinatorConfig" -}}
{{- $c := deepCopy (default dict .Values.coordinator.config) -}}
{{- $_ := set $c "listen_address" (printf "0.0.0.0:%d" (int .Values.coordinator.ports.grpc)) -}}
{{- $_ = set $c "metrics_address" (printf "0.0.0.0:%d" (int .Values.coordinator.ports.metrics)) -}}
{{- $_ = set $c "data_dir" "/var/lib/tandem/coordinator" -}}
{{- $_ = set $c "auth" (dict "token_file" (include "tandem.tokenFile" .)) -}}
{{- $_ = set $c "tls" (include "tandem.tlsConfig" . | fromJson) -}}
{{- $job := default dict (get $c "job") -}}
{{- $_ = set $job "id" .Values.jobId -}}
{{- if not (hasKey $job "min_workers") -}}
{{- $_ = set $job "min_workers" (max 1 (int (include "tandem.workerRanks" .))) -}}
{{- end -}}
{{- if not (hasKey $job "min_servers") -}}
{{- $_ = set $job "min_servers" (int .Values.servers.replicas) -}}
{{- end -}}
{{- if not (hasKey $job "parameter_count") -}}
{{- if gt (int .Values.servers.replicas) 0 -}}
{{- if ne (first .Values.workers.command | base) "tandem-worker" -}}
{{- fail (printf "workers.command runs %s, not tandem-worker: set coordinator.config.job.parameter_count to the number of parameters of its model (the servers' shard map covers them)" (first .Values.workers.command)) -}}
{{- end -}}
{{- $_ = set $job "parameter_count" (include "tandem.referenceParameterCount" . | int64) -}}
{{- else -}}
{{- $_ = set $job "parameter_count" 0 -}}
{{- end -}}
{{- end -}}
{{- $_ = set $c "job" $job -}}
# tandem-coordinator configuration (check with: tandem-coordinator --config coordinator.yaml --check-config)
{{- include "tandem.configYaml" (dict "value" $c "pad" "") }}
{{- end -}}

{{/* The keys servers and workers share: their coordinator, job and TLS. */}}
{{- define "tandem.memberConfig" -}}
{{- toJson (dict "coordinator" (dict "address" (include "tandem.coordinatorAddress" .) "token_file" (include "tandem.tokenFile" .)) "job" (dict "id" .Values.jobId) "tls" (include "tandem.tlsConfig" . | fromJson)) -}}
{{- end -}}

{{- define "tandem.serverConfig" -}}
{{- $s := merge (include "tandem.memberConfig" . | fromJson) (deepCopy (default dict .Values.servers.config)) -}}
# tandem-server configuration (check with: tandem-server --config server.yaml --check-config)
{{- include "tandem.configYaml" (dict "value" $s "pad" "") }}
{{- end -}}

{{- define "tandem.workerConfig" -}}
{{- $w := merge (include "tandem.memberConfig" . | fromJson) (deepCopy (default dict .Values.workers.config)) -}}
# tandem-worker configuration (check with: tandem-worker --config worker.yaml --check-config)
{{- include "tandem.configYaml" (dict "value" $w "pad" "") }}
{{- end -}}
