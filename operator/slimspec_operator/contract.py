"""Names and values the operator shares with the API server, the engines and the chart.

The operator's half of docs/contracts.md, in one place: the CRD's API names, the
field managers of its two writers, the labels on everything it creates, the
runtime ConfigMap's name, keys and text form, and the quality defaults.
"""

from __future__ import annotations

from typing import Literal, get_args

# The SlimSpecService CRD (crds/slimspecservice.yaml).
GROUP = "slimspec.io"
VERSION = "v1alpha1"
KIND = "SlimSpecService"
PLURAL = "slimspecservices"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/finalizer"

# KEDA's ScaledObject (autoscaling.mode=keda).
KEDA_GROUP = "keda.sh"
KEDA_VERSION = "v1alpha1"
KEDA_KIND = "ScaledObject"
KEDA_PLURAL = "scaledobjects"
KEDA_API_VERSION = f"{KEDA_GROUP}/{KEDA_VERSION}"

# Server-side apply field managers. The reconciler and the tuner own different
# status fields (and conditions); each applies only its own, so neither erases
# the other's.
OPERATOR_FIELD_MANAGER = "slimspec-operator"
TUNER_FIELD_MANAGER = "slimspec-tuner"

# Labels on the engine pods and every object made for a resource.
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
VERSION_LABEL = f"{GROUP}/model-version"
HASH_LABEL = f"{GROUP}/template-hash"
ENGINE_NAME = "slimspec-engine"
MANAGER = "slimspec-operator"

# The runtime ConfigMap the engines watch: `<name>-runtime`, string values.
RATIO_KEY = "compression_ratio"
THRESHOLD_KEY = "quality_threshold"
FALLBACK_KEY = "fallback_strategy"

FallbackStrategy = Literal["auto", "none"]
FALLBACK_STRATEGIES: tuple[str, ...] = get_args(FallbackStrategy)
DEFAULT_QUALITY_THRESHOLD = 0.95
MAX_RATIO = 0.95  # the engine's largest compression ratio


def configmap_name(name: str) -> str:
    return f"{name}-runtime"


def format_ratio(value: float) -> str:
    """A ratio's text in the ConfigMap: the shortest decimal ("0.3", not
    "0.30000000000000004"). The reconciler and the tuner both write it, so the
    same value always has the same text and a write of an unchanged value is a no-op."""
    return repr(round(float(value), 6))
