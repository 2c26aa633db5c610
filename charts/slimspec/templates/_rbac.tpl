{{/* RBAC rules of the operator, shared by the ClusterRole and the Roles (rbac.yaml). */}}
{{- define "slimspec.namespacedRules" -}}
# The custom resources: Kopf watches them, adds its finalizer and progress
# annotations (patch), and the operator writes their status.
- apiGroups: ["slimspec.io"]
  resources: ["slimspecservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["slimspec.io"]
  resources: ["slimspecservices/status"]
  verbs: ["get", "patch"]
# What the operator creates for each SlimSpecService: the engine Deployment(s),
# the Service, the runtime ConfigMap.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The engine pods' identity (read its runtime ConfigMap): ServiceAccount, Role
# and RoleBinding per SlimSpecService.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The engines' admin bearer token (preStop drain): created once per
# SlimSpecService. No list/watch: the operator never reads other Secrets in bulk.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Pod readiness during rollouts (read only).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Kopf posts Kubernetes events about what it did.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.operator.peering.enabled }}
# Kopf peering between replicas (namespaced peering objects).
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- if .Values.rbac.keda }}
# The tuner may manage a KEDA ScaledObject per SlimSpecService.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}
{{- end }}

{{- define "slimspec.clusterRules" -}}
# Kopf discovers and follows the CRD it serves (cluster-scoped, read only).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.operator.peering.enabled }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
