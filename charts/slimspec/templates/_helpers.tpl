{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "slimspec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release name, plus the chart name unless it already contains it. */}}
{{- define "slimspec.fullname" -}}
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

{{/* Name of the operator's objects (Deployment, Service, RBAC). */}}
{{- define "slimspec.operatorName" -}}
{{- printf "%s-operator" (include "slimspec.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slimspec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "slimspec.labels" -}}
helm.sh/chart: {{ include "slimspec.chart" . }}
app.kubernetes.io/part-of: slimspec
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of the operator pods (stable across upgrades). */}}
{{- define "slimspec.operatorSelectorLabels" -}}
app.kubernetes.io/name: slimspec-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "slimspec.operatorLabels" -}}
{{ include "slimspec.labels" . }}
{{ include "slimspec.operatorSelectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "slimspec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "slimspec.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest is set. */}}
{{- define "slimspec.image" -}}
{{- if .digest }}
{{- printf "%s@%s" .repository .digest }}
{{- else }}
{{- printf "%s:%s" .repository .tag }}
{{- end }}
{{- end }}

{{/* Name of the Kopf peering object the operator replicas share. */}}
{{- define "slimspec.peeringName" -}}
{{- default (include "slimspec.operatorName" .) .Values.operator.peering.name }}
{{- end }}

{{/* Namespaces the operator watches in namespace scope (default: the release's). */}}
{{- define "slimspec.watchNamespaces" -}}
{{- if .Values.rbac.watchNamespaces }}
{{- join "," .Values.rbac.watchNamespaces }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}
