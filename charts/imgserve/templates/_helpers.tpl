{{/* Names, labels and the derived values that several templates share. */}}

{{/* Chart name, overridable. */}}
{{- define "imgserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release name, plus the chart name unless the release name contains it; 63 characters at most. */}}
{{- define "imgserve.fullname" -}}
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

{{/* Chart label value. */}}
{{- define "imgserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels (immutable on the Deployment: keep them minimal). */}}
{{- define "imgserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "imgserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Standard labels of every object. */}}
{{- define "imgserve.labels" -}}
helm.sh/chart: {{ include "imgserve.chart" . }}
{{ include "imgserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: imgserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "imgserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "imgserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Server image reference (digest wins over tag; tag defaults to appVersion). */}}
{{- define "imgserve.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether an autoscaler (HPA or KEDA) owns the replica count. */}}
{{- define "imgserve.autoscaled" -}}
{{- if or .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled }}true{{ end }}
{{- end }}

{{/* Whether the GPU-utilization signal is used (needs GPUs). */}}
{{- define "imgserve.gpuScaling" -}}
{{- if and .Values.gpu.enabled .Values.autoscaling.gpuUtilization.enabled }}true{{ end }}
{{- end }}

{{/* The replica count the workload is meant to keep at least (PDB decision). */}}
{{- define "imgserve.minReplicas" -}}
{{- if include "imgserve.autoscaled" . }}{{ .Values.autoscaling.minReplicas }}{{ else }}{{ .Values.replicaCount }}{{ end }}
{{- end }}

{{/* Drain timeout in whole seconds (settings.drain_timeout_s; the server's default is 30). */}}
{{- define "imgserve.drainSeconds" -}}
{{- $drain := 30 }}
{{- if hasKey .Values.settings "drain_timeout_s" }}{{ $drain = .Values.settings.drain_timeout_s }}{{ end }}
{{- int (ceil $drain) }}
{{- end }}

{{/* terminationGracePeriodSeconds = preStop sleep + drain timeout + margin, so the drain is never cut short by SIGKILL. */}}
{{- define "imgserve.terminationGracePeriodSeconds" -}}
{{- add .Values.lifecycle.preStopSleepSeconds (include "imgserve.drainSeconds" .) .Values.lifecycle.terminationMarginSeconds }}
{{- end }}

{{/* IMGSERVE_MODEL for the configured model source. */}}
{{- define "imgserve.modelPath" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.path }}
{{- else }}
{{- printf "/models/%s" .Values.model.file }}
{{- end }}
{{- end }}

{{/* The server's environment: IMGSERVE_<NAME> from settings (whole numbers printed as integers, not 2e+07), with MODEL/PORT/HOST from the chart and DEVICE from gpu.enabled unless set. */}}
{{/* IMGSERVE_* of the settings (the Deployment and the KServe runtime share them): `settings` and the device, as a
YAML map from setting name (upper case) to its string value. */}}
{{- define "imgserve.settingsEnv" -}}
{{- $env := dict }}
{{- range $key, $value := .Values.settings }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}{{ $value = int64 $value }}{{ end }}
{{- $_ := set $env (upper $key) (toString $value) }}
{{- end }}
{{- if not (hasKey $env "DEVICE") }}
{{- $_ := set $env "DEVICE" (ternary "cuda" "cpu" .Values.gpu.enabled) }}
{{- end }}
{{- if not (or .Values.api .Values.models) }}
{{- $_ := set $env "MODEL" (include "imgserve.modelPath" .) }}
{{- end }}
{{- if .Values.modelName }}
{{- $_ := set $env "MODEL_NAME" .Values.modelName }}
{{- end }}
{{- if .Values.api }}
{{- $_ := set $env "API" .Values.api }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/* A map from setting name to value -> the container's env list of IMGSERVE_<NAME> variables. */}}
{{- define "imgserve.envList" -}}
{{- range $key, $value := . }}
- name: IMGSERVE_{{ $key }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Where the compile cache's volume is mounted; imgserve keeps its code in a folder it makes there (mode 0700: the
volume's own root is group-writable under fsGroup). */}}
{{- define "imgserve.compileCacheMount" -}}
/var/cache/imgserve
{{- end }}

{{/* The Deployment's IMGSERVE_*: the settings, the ports, the model repository and its control, the compile cache
and the API key file. */}}
{{- define "imgserve.env" -}}
{{- $env := include "imgserve.settingsEnv" . | fromYaml }}
{{- if not (hasKey $env "COMPILE_CACHE_DIR") }}
{{- $_ := set $env "COMPILE_CACHE_DIR" (printf "%s/compiled" (include "imgserve.compileCacheMount" .)) }}
{{- end }}
{{- $_ := set $env "PORT" (toString .Values.containerPort) }}
{{- $_ := set $env "GRPC_PORT" (toString .Values.grpcPort) }}
{{- $_ := set $env "HOST" "0.0.0.0" }}
{{- if .Values.models }}
{{- $_ := set $env "MODEL_REPOSITORY" (include "imgserve.repositoryDir" .) }}
{{- end }}
{{- if eq .Values.modelControl "explicit" }}
{{- $_ := set $env "MODEL_CONTROL" "explicit" }}
{{- with .Values.loadModels }}
{{- $_ := set $env "LOAD_MODEL" (join "," .) }}
{{- end }}
{{- end }}
{{- if .Values.auth.existingSecret }}
{{- $_ := set $env "API_KEY_FILE" (printf "%s/%s" (include "imgserve.apiKeyDir" .) .Values.auth.secretKey) }}
{{- $_ := set $env "PROTECT_METRICS" (toString .Values.auth.protectMetrics) }}
{{- end }}
{{- include "imgserve.envList" $env }}
{{- end }}

{{/* OpenTelemetry's own variables from `tracing` (nothing while its endpoint is empty: tracing off). */}}
{{- define "imgserve.tracingEnv" -}}
{{- with .Values.tracing }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .ratio | toString | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ .serviceName | default (include "imgserve.fullname" $) | quote }}
- name: OTEL_K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name={{ $.Release.Namespace }},k8s.pod.name=$(OTEL_K8S_POD_NAME)"
{{- end }}
{{- end }}
{{- end }}

{{/* The server container's resources, with the GPU limit from `gpu`. */}}
{{- define "imgserve.resources" -}}
{{- $resources := deepCopy .Values.resources }}
{{- if .Values.gpu.enabled }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits .Values.gpu.resourceName .Values.gpu.count }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Prometheus label selector of this release's pods (the ServiceMonitor target labels namespace and pod). */}}
{{- define "imgserve.podSelector" -}}
namespace="{{ .Release.Namespace }}",pod=~"{{ include "imgserve.fullname" . }}-.*"
{{- end }}

{{/* DCGM GPU utilization (0..100) moved onto the serving pods: dcgm-exporter's workload labels arrive as
exported_pod/exported_namespace (honorLabels false) or pod/namespace (honorLabels true); label_replace covers both,
and the join keeps only pods that export imgserve_build_info with the given matchers. */}}
{{- define "imgserve.dcgmJoined" -}}
label_replace(label_replace(DCGM_FI_DEV_GPU_UTIL, "pod", "$1", "exported_pod", "(.+)"), "namespace", "$1", "exported_namespace", "(.+)") and on (namespace, pod) imgserve_build_info{ {{- . -}} }
{{- end }}

{{/* KEDA query: total admitted-not-answered requests of the release (one element; AverageValue divides by pods). */}}
{{- define "imgserve.kedaQueueQuery" -}}
sum(imgserve_queue_depth{ {{- include "imgserve.podSelector" . -}} })
{{- end }}

{{/* KEDA query: average GPU utilization of the release's pods in percent (one element; Value). */}}
{{- define "imgserve.kedaGpuQuery" -}}
{{- if eq .Values.autoscaling.gpuUtilization.source "dcgm" }}
{{- printf "avg(%s)" (include "imgserve.dcgmJoined" (include "imgserve.podSelector" .)) }}
{{- else }}
{{- printf "100 * avg(imgserve_gpu_utilization_ratio{%s})" (include "imgserve.podSelector" .) }}
{{- end }}
{{- end }}

{{/* HPA Pods metric name of GPU utilization, as named by the rules in prometheus-adapter-values.yaml. */}}
{{- define "imgserve.hpaGpuMetric" -}}
{{- ternary "imgserve_dcgm_gpu_utilization_percent" "imgserve_gpu_utilization_percent" (eq .Values.autoscaling.gpuUtilization.source "dcgm") }}
{{- end }}

{{/* Refuse combinations the schema cannot fully express or that --skip-schema-validation lets through. */}}
{{- define "imgserve.validate" -}}
{{- $a := .Values.autoscaling }}
{{- if and $a.hpa.enabled $a.keda.enabled }}
{{- fail "autoscaling.hpa.enabled and autoscaling.keda.enabled are mutually exclusive: enable one (KEDA is recommended)" }}
{{- end }}
{{- if and $a.keda.enabled (eq (toString $a.keda.idleReplicaCount) "0") (not $a.keda.wakeQuery) }}
{{- fail "autoscaling.keda.idleReplicaCount=0 (scale to zero) needs autoscaling.keda.wakeQuery: at zero pods the pods' own metrics are gone and could never wake the workload" }}
{{- end }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- if and (eq .Values.model.source "pvc") (not .Values.model.pvc.claimName) }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- if and (ne .Values.model.source "image") (not .Values.model.file) (not .Values.models) }}
{{- fail "model.source=pvc or init needs model.file (the file under /models)" }}
{{- end }}
{{- include "imgserve.validateModels" . }}
{{- if and (eq .Values.compileCache.source "pvc") (not .Values.compileCache.claimName) }}
{{- fail "compileCache.source=pvc needs compileCache.claimName" }}
{{- end }}
{{- if and (eq .Values.model.source "init") (not .Values.model.init.command) }}
{{- fail "model.source=init needs model.init.command (it writes the model into /models)" }}
{{- end }}
{{- $isvc := .Values.kserve.inferenceService }}
{{- if and $isvc.enabled (not .Values.kserve.servingRuntime.enabled) }}
{{- fail "kserve.inferenceService.enabled needs kserve.servingRuntime.enabled (the runtime it names)" }}
{{- end }}
{{- if and $isvc.storageUri (not $isvc.modelFile) }}
{{- fail "kserve.inferenceService.storageUri needs kserve.inferenceService.modelFile (the file under /mnt/models)" }}
{{- end }}
{{- end }}

{{/* checkov skip annotations for objects that run the server image, each with its reason (checkov reads them from
metadata.annotations). Argument: a dict with "root" (the chart context) and "probes" (true for the one-shot test Pod). */}}
{{- define "imgserve.checkovSkips" -}}
{{- $v := .root.Values }}
{{- $n := 0 }}
{{- if ne $v.image.pullPolicy "Always" }}
{{- $n = add1 $n }}
checkov.io/skip{{ $n }}: "CKV_K8S_15=IfNotPresent is deliberate, the CUDA image is several GB and release tags are immutable; Always slows every scale-up"
{{- end }}
{{- if not $v.image.digest }}
{{- $n = add1 $n }}
checkov.io/skip{{ $n }}: "CKV_K8S_43=pinning by digest is the user's choice via image.digest; the default is the chart appVersion tag"
{{- end }}
{{- if .probes }}
{{- $n = add1 $n }}
checkov.io/skip{{ $n }}: "CKV_K8S_8=a one-shot helm test Pod that exits after one request has nothing to probe for liveness"
{{- $n = add1 $n }}
checkov.io/skip{{ $n }}: "CKV_K8S_9=a one-shot helm test Pod receives no traffic, so readiness means nothing"
{{- end }}
{{- end }}

{{/* Where the API key Secret is mounted (a directory, so that a rotated Secret reaches the pod). */}}
{{- define "imgserve.apiKeyDir" -}}
/var/run/secrets/imgserve
{{- end }}

{{/* The API key Secret as a volume (server and helm test), when auth.existingSecret is set. */}}
{{- define "imgserve.apiKeyVolume" -}}
{{- with .Values.auth.existingSecret -}}
- name: api-key
  secret:
    secretName: {{ . }}
    items:
      - key: {{ $.Values.auth.secretKey }}
        path: {{ $.Values.auth.secretKey }}
{{- end }}
{{- end }}

{{/* Where the model repository (the `models` ConfigMap, one folder per model) is mounted. */}}
{{- define "imgserve.repositoryDir" -}}
/etc/imgserve/repository
{{- end }}

{{/* One model's config.yaml in the repository, from an item of `models`: `api`, or `model` with the built-in model's
`settings`; then its batching and api_path. Whole numbers are written as integers (YAML from Helm has only floats). */}}
{{- define "imgserve.modelConfig" -}}
{{- $config := dict }}
{{- if .api }}
{{- $_ := set $config "api" .api }}
{{- else }}
{{- range $key, $value := (default dict .settings) }}
{{- $_ := set $config $key $value }}
{{- end }}
{{- $_ := set $config "model" .model }}
{{- end }}
{{- range $key := list "max_batch_size" "batch_timeout_ms" "api_path" }}
{{- if hasKey $ $key }}
{{- $_ := set $config $key (get $ $key) }}
{{- end }}
{{- end }}
{{- range $key, $value := $config }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- $_ := set $config $key (int64 $value) }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The names of `models`, in order. */}}
{{- define "imgserve.modelNames" -}}
{{- range .Values.models }}
- {{ .name | quote }}
{{- end }}
{{- end }}

{{/* Where each model of `models` answers over HTTP, as `name: path` (a built-in model at /<name>/predict unless its
api_path says; an API at its api_path, else the one its class names, which the chart cannot know: "" then). */}}
{{- define "imgserve.modelPaths" -}}
{{- $paths := dict }}
{{- range .Values.models }}
{{- $builtin := ternary "/predict" (printf "/%s/predict" .name) (eq (len $.Values.models) 1) }}
{{- $_ := set $paths .name (.api_path | default (ternary "" $builtin (hasKey . "api"))) }}
{{- end }}
{{- toYaml $paths }}
{{- end }}

{{/* Refuse what the schema cannot say of `models`: two models of one name, a loadModels name that is no model's,
and (schema skipped) models beside the one-model values. */}}
{{- define "imgserve.validateModels" -}}
{{- $names := list }}
{{- range .Values.models }}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$" (toString .name)) }}
{{- fail (printf "models: %q is not a model name (a folder of the repository: letters, digits, _ . -, 64 at most)" (toString .name)) }}
{{- end }}
{{- if has .name $names }}
{{- fail (printf "models: two models are named %q: each model's name must be its own" .name) }}
{{- end }}
{{- if and .api .model }}
{{- fail (printf "models: %s has both api and model: give one" .name) }}
{{- end }}
{{- if not (or .api .model) }}
{{- fail (printf "models: %s needs api (module:Class) or model (its file)" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- end }}
{{- if .Values.models }}
{{- if .Values.api }}
{{- fail "models and api are exclusive: name your API in models as {name, api}" }}
{{- end }}
{{- if .Values.modelName }}
{{- fail "models and modelName are exclusive: each model of models has its own name" }}
{{- end }}
{{- if .Values.kserve.servingRuntime.enabled }}
{{- fail "models and kserve.servingRuntime.enabled are exclusive: KServe runs one model per InferenceService (one InferenceService per model on the runtime)" }}
{{- end }}
{{- end }}
{{- if and .Values.loadModels (ne .Values.modelControl "explicit") }}
{{- fail "loadModels needs modelControl explicit (without it every model loads at start)" }}
{{- end }}
{{- range .Values.loadModels }}
{{- if and $.Values.models (ne . "*") (not (has . $names)) }}
{{- fail (printf "loadModels: %q is not the name of a model in models" .) }}
{{- end }}
{{- end }}
{{- end }}
