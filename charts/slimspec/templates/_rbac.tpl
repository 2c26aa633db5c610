{{/*
RBAC rules of the operator, shared by the ClusterRole and the Roles (rbac.yaml).
Each rule is an API call the operator makes (operator/slimspec_operator/kube/client.py,
the client of the reconciler and the tuner, and Kopf itself). Server-side apply (PATCH
with application/apply-patch+yaml) needs "create" as well as "patch" for an
object that does not exist yet. Objects the operator creates carry an owner
reference to their SlimSpecService, so the garbage collector deletes them: the
operator deletes only superseded Deployments itself.
*/}}
{{- define "slimspec.namespacedRules" -}}
# The custom resources: Kopf lists/watches them and keeps its progress in
# annotations (patch); the reconciler re-reads one before acting (get); status
# is written through /status; the autoscaler sets replicas through /scale.
- apiGroups: ["slimspec.io"]
  resources: ["slimspecservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["slimspec.io"]
  resources: ["slimspecservices/status", "slimspecservices/scale"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion=true on everything the operator
# creates: clusters with the OwnerReferencesPermissionEnforcement admission
# plugin (e.g. OpenShift) require update on the owner's finalizers for that.
- apiGroups: ["slimspec.io"]
  resources: ["slimspecservices/finalizers"]
  verbs: ["update"]
# One Deployment per model version (server-side apply, replica changes, delete
# of the old version after a rollout); Kopf watches them for readiness. "get":
# before writing any object the operator reads it, and refuses to touch one that
# it does not own (kube/ownership.py); the same "get" is in the rules below.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The Service in front of the engines (read to see which version it selects).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The runtime ConfigMap (applied; the tuner patches its ratio). get/list/watch
# are held because the engines' Role grants exactly these on it, and RBAC lets
# the operator grant only what it holds itself (no "escalate"/"bind").
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The engines' identity: ServiceAccount, Role and RoleBinding per SlimSpecService.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
# The PodDisruptionBudget over the engine pods (deleted when the spec turns it off).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# Model preparation: a Job per model version (downloads, calibration) writing
# into a cache claim; Kopf watches the Jobs to start the rollout when one ends,
# and the Jobs of versions no longer in use are deleted.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
# The engines' admin bearer token (preStop drain): created once, never read back.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Kopf's and the tuner's Kubernetes events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if and .Values.operator.peering.enabled (eq .Values.rbac.scope "namespace") }}
# Kopf peering between replicas (namespaced peering objects): Kopf watches them
# and writes its heartbeat into the chart's own peering object only.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  resourceNames: [{{ include "slimspec.peeringName" . | quote }}]
  verbs: ["patch"]
{{- end }}
{{- if .Values.rbac.keda }}
# autoscaling.mode=keda: the tuner applies / deletes a KEDA ScaledObject and, with
# spec.prometheus.auth, a TriggerAuthentication (read first: never adopt another's).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects", "triggerauthentications"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- with .Values.rbac.prometheusSecrets }}
# The Prometheus credentials the tuner may read (rbac.prometheusSecrets), by name only.
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: {{ toJson . }}
  verbs: ["get"]
{{- end }}
{{- end }}

{{- define "slimspec.clusterRules" -}}
# Kopf follows the CRDs it serves (resource scanning; cluster-scoped, read only).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if eq .Values.rbac.scope "namespace" }}
# Given --namespace, Kopf lists/watches namespaces to follow the watched ones.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- if and .Values.operator.peering.enabled (ne .Values.rbac.scope "namespace") }}
# Kopf peering between replicas of a cluster-wide operator (the chart's
# ClusterKopfPeering; heartbeats written to that object only).
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  resourceNames: [{{ include "slimspec.peeringName" . | quote }}]
  verbs: ["patch"]
{{- end }}
{{- end }}
