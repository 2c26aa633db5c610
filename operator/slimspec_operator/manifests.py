"""Pure builders: SlimSpecService -> Kubernetes manifests (plain dicts).

Names and labels follow docs/contracts.md. Each model version (more exactly,
each distinct pod template) runs in its own Deployment `<name>-<hash>`, so a
rollout is blue/green: the Service selects one template hash at a time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .contract import (
    API_VERSION,
    ENGINE_NAME,
    FALLBACK_KEY,
    HASH_LABEL,
    INSTANCE_LABEL,
    KIND,
    MANAGED_BY_LABEL,
    MANAGER,
    NAME_LABEL,
    RATIO_KEY,
    THRESHOLD_KEY,
    VERSION_LABEL,
    configmap_name,
    format_ratio,
)
from .model_volumes import model_volumes
from .spec import SlimSpecService, ratio_in_force

Manifest = dict[str, Any]

ENGINE_PORT = 8080
ENGINE_UID = 10001

ADMIN_TOKEN_DIR = "/var/run/slimspec/admin"
CACHE_DIR = "/var/cache/slimspec"
TERMINATION_GRACE_SECONDS = 60
PRESTOP_SLEEP_SECONDS = 5

# preStop: ask the engine to drain (stop taking work, finish in-flight requests),
# then wait so endpoint removal reaches every proxy before the process exits.
# Token path and port come from the container's own env (set below).
DRAIN_TIMEOUT_SECONDS = TERMINATION_GRACE_SECONDS - PRESTOP_SLEEP_SECONDS - 10
_PRESTOP = f"""import json,os,time,urllib.request as u
try:
 t=open(os.environ['SLIMSPEC_ADMIN_TOKEN_FILE']).read().strip()
 r=u.Request('http://127.0.0.1:'+os.environ.get('PORT','{ENGINE_PORT}')+'/admin/drain',
  data=json.dumps({{'timeout_s':{DRAIN_TIMEOUT_SECONDS}}}).encode(),method='POST',
  headers={{'Authorization':'Bearer '+t,'Content-Type':'application/json'}})
 print(u.urlopen(r,timeout={DRAIN_TIMEOUT_SECONDS + 5}).read().decode())
except Exception as e:
 print('drain failed:',e)
time.sleep(float(os.environ.get('SLIMSPEC_PRESTOP_SLEEP','{PRESTOP_SLEEP_SECONDS}')))
"""


# ---------------------------------------------------------------- names


def service_name(name: str) -> str:
    return name


def engine_account_name(name: str) -> str:
    return f"{name}-engine"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin"


def deployment_name(name: str, template_hash: str) -> str:
    return f"{name}-{template_hash}"


def common_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: ENGINE_NAME, INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGER}


def selector_string(name: str) -> str:
    """status.selector: every engine pod of the resource (scale subresource, HPA, KEDA)."""
    return f"{NAME_LABEL}={ENGINE_NAME},{INSTANCE_LABEL}={name}"


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Controller reference: the garbage collector deletes the object with its resource."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(svc: SlimSpecService, name: str, labels: dict[str, str] | None = None) -> Manifest:
    return {
        "name": name,
        "namespace": svc.namespace,
        "labels": {**common_labels(svc.name), **(labels or {})},
        "ownerReferences": [owner_reference(svc.name, svc.metadata.uid)],
    }


# ---------------------------------------------------------------- pod template


def _container_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": ENGINE_UID,
        "runAsGroup": ENGINE_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _cm_env(env: str, key: str, cm: str) -> Manifest:
    # Initial value from the runtime ConfigMap: the template only names the key,
    # so a ratio change never changes the template hash.
    return {"name": env, "valueFrom": {"configMapKeyRef": {"name": cm, "key": key}}}


def _resources(svc: SlimSpecService) -> Manifest:
    r = svc.spec.resources
    limits: dict[str, Any] = {"memory": str(r.memory)}
    if r.gpu > 0:
        limits["nvidia.com/gpu"] = str(r.gpu)
    return {"requests": {"cpu": str(r.cpu), "memory": str(r.memory)}, "limits": limits}


def pod_template(svc: SlimSpecService) -> Manifest:
    """The engine pod template without the hash label (the hash is computed over this)."""
    spec = svc.spec
    cm = configmap_name(svc.name)
    models = model_volumes(svc)
    paths = models.paths
    env: list[Manifest] = [
        {"name": "PORT", "value": str(ENGINE_PORT)},
        {"name": "MODEL_PATH", "value": paths["target"]},
        {"name": "DRAFT_MODEL_PATH", "value": paths["draft"]},
        {"name": "MODEL_VERSION", "value": spec.model.version},
        _cm_env("COMPRESSION_RATIO", RATIO_KEY, cm),
        _cm_env("QUALITY_THRESHOLD", THRESHOLD_KEY, cm),
        _cm_env("FALLBACK_STRATEGY", FALLBACK_KEY, cm),
        {"name": "SLIMSPEC_DEVICE", "value": "cuda" if spec.resources.gpu > 0 else "cpu"},
        {"name": "SLIMSPEC_MAX_BATCH_SIZE", "value": str(spec.batching.max_batch_size)},
        {"name": "SLIMSPEC_ADMIN_TOKEN_FILE", "value": f"{ADMIN_TOKEN_DIR}/token"},
        {"name": "SLIMSPEC_RUNTIME_CONFIGMAP", "value": cm},
        {"name": "SLIMSPEC_CACHE", "value": CACHE_DIR},
        {
            "name": "POD_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
    ]
    probe_get = {"port": "http", "scheme": "HTTP"}
    container: Manifest = {
        "name": "engine",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # The image's entrypoint is `slimspec`; these batching knobs are flags only.
        "args": [
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(ENGINE_PORT),
            "--max-queue",
            str(spec.batching.max_queue),
            "--batch-wait-ms",
            str(spec.batching.max_wait_ms),
        ],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": _resources(svc),
        "readinessProbe": {
            "httpGet": {"path": "/readyz", **probe_get},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", **probe_get},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", _PRESTOP]}}},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            *models.mounts,
        ],
    }
    pod_spec: Manifest = {
        "serviceAccountName": engine_account_name(svc.name),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
            {
                "name": "admin-token",
                "secret": {"secretName": admin_secret_name(svc.name), "defaultMode": 0o440},
            },
            *models.volumes,
        ],
    }
    if models.init_containers:
        security = {"securityContext": _container_security()}
        pod_spec["initContainers"] = [c | security for c in models.init_containers]
    return {
        "metadata": {
            "labels": {**common_labels(svc.name), VERSION_LABEL: spec.model.version},
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


def template_hash(template: Manifest) -> str:
    """Stable short hash of a pod template (canonical JSON, sha256, 10 hex digits)."""
    canon = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:10]


def desired_template_hash(svc: SlimSpecService) -> str:
    return template_hash(pod_template(svc))


# ---------------------------------------------------------------- objects


def deployment(svc: SlimSpecService, replicas: int) -> Manifest:
    template = pod_template(svc)
    h = template_hash(template)
    version = svc.spec.model.version
    template["metadata"]["labels"][HASH_LABEL] = h
    template["metadata"]["annotations"][HASH_LABEL] = h
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **_meta(svc, deployment_name(svc.name, h), {VERSION_LABEL: version, HASH_LABEL: h}),
            "annotations": {HASH_LABEL: h, VERSION_LABEL: version},
        },
        "spec": {
            "replicas": replicas,
            "selector": {
                "matchLabels": {NAME_LABEL: ENGINE_NAME, INSTANCE_LABEL: svc.name, HASH_LABEL: h}
            },
            # The template never changes inside one Deployment (its name carries
            # the hash); this only matters when pods are replaced.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "revisionHistoryLimit": 1,
            "template": template,
        },
    }


def service(svc: SlimSpecService, serving_hash: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(svc, service_name(svc.name)),
        "spec": {
            "type": svc.spec.service.type,
            "selector": {
                NAME_LABEL: ENGINE_NAME,
                INSTANCE_LABEL: svc.name,
                HASH_LABEL: serving_hash,
            },
            "ports": [
                {
                    "name": "http",
                    "port": svc.spec.service.port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def runtime_configmap(svc: SlimSpecService) -> Manifest:
    qc = svc.spec.quality_control
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(svc, configmap_name(svc.name)),
        "data": {
            RATIO_KEY: format_ratio(ratio_in_force(svc)),
            THRESHOLD_KEY: format_ratio(qc.threshold),
            FALLBACK_KEY: qc.fallback_strategy,
        },
    }


def admin_secret(svc: SlimSpecService, token: str) -> Manifest:
    """Bearer token for the engines' admin endpoints (preStop drain). Created once."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(svc, admin_secret_name(svc.name)),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def service_account(svc: SlimSpecService) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(svc, engine_account_name(svc.name)),
    }


def role(svc: SlimSpecService) -> Manifest:
    """Engines may read (and watch) their own runtime ConfigMap and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(svc, engine_account_name(svc.name)),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [configmap_name(svc.name)],
                "verbs": ["get", "list", "watch"],
            }
        ],
    }


def role_binding(svc: SlimSpecService) -> Manifest:
    name = engine_account_name(svc.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(svc, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.namespace}],
    }
