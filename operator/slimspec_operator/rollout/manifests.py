"""Pure builders: SlimSpecService -> Kubernetes manifests (plain dicts).

Names and labels follow docs/contracts.md. Each model version (more exactly,
each distinct pod template) runs in its own Deployment `<name>-<hash>`, so a
rollout is blue/green: the Service selects one template hash at a time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from slimspec_operator.contract import (
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
from slimspec_operator.resource.spec import SlimSpecService, ratio_in_force
from slimspec_operator.rollout.model_prep import ARTIFACT_ANNOTATION, KEY_ANNOTATION, preparation
from slimspec_operator.rollout.model_volumes import model_volumes
from slimspec_operator.rollout.pod_settings import (
    container_security,
    engine_resources,
    extra_args,
    extra_env,
    extra_env_from,
    placement,
    pod_metadata,
    pod_security,
    scratch_volumes,
)

Manifest = dict[str, Any]

ENGINE_PORT = 8080

ADMIN_TOKEN_DIR = "/var/run/slimspec/admin"
CACHE_DIR = "/var/cache/slimspec"
# preStop, in the order kube-proxy and other proxies need: the engine turns readiness
# 503 at once but keeps answering for PRESTOP_SLEEP_SECONDS while the endpoint's removal
# reaches every proxy (delay_s), then refuses new requests and finishes the ones in flight,
# streams included (timeout_s). If the engine cannot be reached the hook still waits
# the propagation delay. Token path and port come from the container's own env.
PRESTOP_SLEEP_SECONDS = 5
# The engine's --request-timeout (its default; docs/contracts.md): the longest a request
# in flight can take, so the drain and the grace period are sized from it.
ENGINE_REQUEST_TIMEOUT_SECONDS = 300
DRAIN_TIMEOUT_SECONDS = ENGINE_REQUEST_TIMEOUT_SECONDS
TERMINATION_GRACE_SECONDS = PRESTOP_SLEEP_SECONDS + DRAIN_TIMEOUT_SECONDS + 15
_PRESTOP = f"""import json,os,time,urllib.request as u
d=float(os.environ.get('SLIMSPEC_PRESTOP_SLEEP','{PRESTOP_SLEEP_SECONDS}'))
t0=time.monotonic()
try:
 t=open(os.environ['SLIMSPEC_ADMIN_TOKEN_FILE']).read().strip()
 r=u.Request('http://127.0.0.1:'+os.environ.get('PORT','{ENGINE_PORT}')+'/admin/drain',
  data=json.dumps({{'timeout_s':{DRAIN_TIMEOUT_SECONDS},'delay_s':d}}).encode(),method='POST',
  headers={{'Authorization':'Bearer '+t,'Content-Type':'application/json'}})
 print(u.urlopen(r,timeout={DRAIN_TIMEOUT_SECONDS + 5}+d).read().decode())
except Exception as e:
 print('drain failed:',e)
 time.sleep(max(0.0,d-(time.monotonic()-t0)))
"""


# ---------------------------------------------------------------- names


def service_name(name: str) -> str:
    return name


def engine_account_name(name: str) -> str:
    return f"{name}-engine"


def admin_secret_name(name: str, uid: str) -> str:
    """The admin token's Secret carries the resource's UID in its name: the operator
    may create Secrets but not read them, so it cannot check who owns one, and no
    one can have made this one before the resource existed."""
    return f"{name}-admin-{uid[:8]}"


def disruption_budget_name(name: str) -> str:
    return name


def status_url(svc: SlimSpecService) -> str:
    """The in-cluster URL clients use (status.url)."""
    return f"http://{service_name(svc.name)}.{svc.namespace}.svc:{svc.spec.service.port}"


def deployment_name(name: str, template_hash: str) -> str:
    return f"{name}-{template_hash}"


def common_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: ENGINE_NAME, INSTANCE_LABEL: name, MANAGED_BY_LABEL: MANAGER}


def engine_selector(name: str) -> dict[str, str]:
    """matchLabels of every engine pod of the resource (PDB, spread constraints)."""
    return {NAME_LABEL: ENGINE_NAME, INSTANCE_LABEL: name}


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


def _cm_env(env: str, key: str, cm: str) -> Manifest:
    # Initial value from the runtime ConfigMap: the template only names the key,
    # so a ratio change never changes the template hash.
    return {"name": env, "valueFrom": {"configMapKeyRef": {"name": cm, "key": key}}}


def pod_template(svc: SlimSpecService) -> Manifest:
    """The engine pod template without the hash label (the hash is computed over this)."""
    spec = svc.spec
    cm = configmap_name(svc.name)
    prep = preparation(svc)
    models = model_volumes(svc, prep)
    paths = models.paths
    env: list[Manifest] = [
        {"name": "PORT", "value": str(ENGINE_PORT)},
        {"name": "MODEL_PATH", "value": paths["target"]},
        {"name": "DRAFT_MODEL_PATH", "value": paths["draft"]},
        {"name": "MODEL_VERSION", "value": spec.model.version},
        {"name": "SLIMSPEC_TARGET_QUANTIZATION", "value": spec.model.target_quantization},
        {"name": "SLIMSPEC_PREFIX_CACHE_MB", "value": str(spec.engine.prefix_cache_mb)},
        {"name": "SLIMSPEC_LOOKUP_TOKENS", "value": str(spec.engine.lookup_tokens)},
        {"name": "SLIMSPEC_DRAFT_CONTEXT", "value": str(spec.engine.draft_context)},
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
    if models.calibration is not None:
        env.append({"name": "SLIMSPEC_CALIBRATION", "value": models.calibration})
    env += extra_env(svc)
    scratch, scratch_mounts = scratch_volumes(svc, CACHE_DIR)
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
            *extra_args(svc),
        ],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": engine_resources(svc),
        # Readiness turns 503 at the start of a drain; liveness only when the engine
        # cannot recover (failed load after its retries, hung step, failing steps).
        "readinessProbe": {
            "httpGet": {"path": "/readyz", **probe_get},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", **probe_get},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["python", "-c", _PRESTOP]}}},
        "securityContext": container_security(),
        "volumeMounts": [
            *scratch_mounts,
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            *models.mounts,
        ],
    }
    if spec.engine.env_from:
        container["envFrom"] = extra_env_from(svc)
    labels = {**common_labels(svc.name), VERSION_LABEL: spec.model.version}
    pod_spec: Manifest = {
        "serviceAccountName": engine_account_name(svc.name),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": pod_security(),
        "containers": [container],
        "volumes": [
            *scratch,
            {
                "name": "admin-token",
                "secret": {
                    "secretName": admin_secret_name(svc.name, svc.metadata.uid),
                    "defaultMode": 0o440,
                },
            },
            *models.volumes,
        ],
        **placement(svc, engine_selector(svc.name)),
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {"metadata": pod_metadata(svc, labels, annotations), "spec": pod_spec}


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
    annotations = {HASH_LABEL: h, VERSION_LABEL: version}
    prep = preparation(svc)
    if prep is not None:  # which preparation this version runs on (status.models)
        annotations[KEY_ANNOTATION] = prep.key
        if prep.artifact is not None:
            annotations[ARTIFACT_ANNOTATION] = prep.artifact
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **_meta(svc, deployment_name(svc.name, h), {VERSION_LABEL: version, HASH_LABEL: h}),
            "annotations": annotations,
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
        "metadata": _meta(svc, admin_secret_name(svc.name, svc.metadata.uid)),
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


def disruption_budget(svc: SlimSpecService) -> Manifest | None:
    """PodDisruptionBudget over every engine pod of the resource (both versions during a
    rollout); None when disabled. maxUnavailable 1 unless the spec says otherwise."""
    db = svc.spec.disruption_budget
    if not db.enabled:
        return None
    budget: dict[str, Any] = (
        {"minAvailable": db.min_available}
        if db.min_available is not None
        else {"maxUnavailable": db.max_unavailable if db.max_unavailable is not None else 1}
    )
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(svc, disruption_budget_name(svc.name)),
        "spec": {"selector": {"matchLabels": engine_selector(svc.name)}, **budget},
    }
