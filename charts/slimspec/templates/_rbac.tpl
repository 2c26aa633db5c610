{{/*
RBAC rules of the operator, shared by the ClusterRole and the Roles (rbac.yaml).
Each rule is an API call the operator makes (operator/slimspec_operator/kube.py,
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
# of the old version after a rollout); Kopf watches them for readiness.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "patch", "delete"]
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
  verbs: ["create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "patch"]
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
# autoscaling.mode=keda: the tuner applies / deletes a KEDA ScaledObject.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["create", "patch", "delete"]
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
