"""KEDA objects for autoscaling.mode=keda (pure builders): the ScaledObject that
scales the SlimSpecService through its scale subresource on the request-rate
query, and the TriggerAuthentication with the Prometheus credentials' Secret.
tick.py applies or deletes them.
"""

from __future__ import annotations

from typing import Any

from slimspec_operator.contract import (
    API_VERSION,
    KEDA_API_VERSION,
    KEDA_AUTH_KIND,
    KEDA_KIND,
    KIND,
)
from slimspec_operator.resource.queries import REQUEST_RATE
from slimspec_operator.resource.spec import (
    PASSWORD_KEY,
    TOKEN_KEY,
    USERNAME_KEY,
    PrometheusSpec,
    TuningView,
)
from slimspec_operator.rollout.manifests import common_labels, owner_reference
from slimspec_operator.tuning.autoscaler import AutoscalerSettings
from slimspec_operator.tuning.plan import autoscaler_settings
from slimspec_operator.tuning.prometheus.queries import rate_window, render_query

Manifest = dict[str, Any]


def trigger_auth_name(name: str) -> str:
    return f"{name}-prometheus"


def scaled_object_for(view: TuningView, namespace: str, name: str, uid: str) -> dict[str, Any]:
    """The KEDA ScaledObject for autoscaling.mode=keda."""
    window = rate_window(view.tuning.interval_seconds)
    return scaled_object(
        name=name,
        namespace=namespace,
        owner_uid=uid,
        prometheus_url=view.prometheus.url,
        request_rate_query=render_query(
            view.tuning.queries.template(REQUEST_RATE), namespace, name, window
        ),
        settings=autoscaler_settings(view),
        polling_interval=max(1, round(view.tuning.interval_seconds)),
    )


def scaled_object(
    *,
    name: str,
    namespace: str,
    owner_uid: str,
    prometheus_url: str,
    request_rate_query: str,
    settings: AutoscalerSettings,
    polling_interval: int = 30,
) -> dict[str, Any]:
    """KEDA ScaledObject that scales the SlimSpecService through its scale subresource."""
    s = settings
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": KEDA_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": common_labels(name),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "pollingInterval": polling_interval,
            "minReplicaCount": s.min_replicas,
            "maxReplicaCount": s.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {
                            "stabilizationWindowSeconds": int(s.stabilization_window),
                        }
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": "request-rate",
                    # AverageValue: KEDA divides the query by the replica count,
                    # the same rule as the operator-mode autoscaler.
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": request_rate_query,
                        "threshold": f"{s.target_requests_per_replica:g}",
                        "ignoreNullValues": "false",
                    },
                }
            ],
        },
    }


def trigger_authentication(
    spec: PrometheusSpec, namespace: str, name: str, uid: str
) -> Manifest | None:
    """KEDA's TriggerAuthentication with the credentials' Secret; None without auth.

    KEDA's Prometheus scaler takes a CA only with client certificates (its `tls`
    mode), so a private CA is left to KEDA's own trust store (docs/deploy.md)."""
    if spec.auth is None:
        return None
    secret = spec.auth.secret_name
    if spec.auth.type == "bearer":
        refs = [{"parameter": "bearerToken", "name": secret, "key": TOKEN_KEY}]
    else:
        refs = [
            {"parameter": "username", "name": secret, "key": USERNAME_KEY},
            {"parameter": "password", "name": secret, "key": PASSWORD_KEY},
        ]
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": KEDA_AUTH_KIND,
        "metadata": {
            "name": trigger_auth_name(name),
            "namespace": namespace,
            "labels": common_labels(name),
            "ownerReferences": [owner_reference(name, uid)],
        },
        "spec": {"secretTargetRef": refs},
    }


def with_trigger_auth(scaled_object: Manifest, spec: PrometheusSpec, name: str) -> Manifest:
    """The ScaledObject's Prometheus triggers pointed at the TriggerAuthentication."""
    if spec.auth is None:
        return scaled_object
    for trigger in scaled_object["spec"]["triggers"]:
        if trigger.get("type") == "prometheus":
            trigger["metadata"]["authModes"] = spec.auth.type
            trigger["authenticationRef"] = {"name": trigger_auth_name(name)}
    return scaled_object
