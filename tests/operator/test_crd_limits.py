"""Every string of the spec is bounded, so that a maximal spec still fits where
Kubernetes keeps copies of it: Kopf stores the whole spec in an annotation
(its last-handled configuration) and `kubectl apply` in another
(last-applied-configuration); all annotations of an object together may hold at
most 256 KiB. A spec that does not fit is accepted by the API server and then
never handled: the operator's every patch is refused.

The maximal spec is built from the CRD itself: every string at its maxLength in the
character that costs most once JSON-encoded (an astral-plane character: 12 bytes
in Kopf's ASCII-only JSON, 4 in kubectl's), every enum at its longest value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from kubernetes import client

from tests.support.crd_fixtures import CrdServer

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "slimspecservice.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
G, V, P = "slimspec.io", "v1alpha1", "slimspecservices"

ANNOTATIONS_LIMIT = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB
# What a maximal spec may take of it (Kopf's and kubectl's copies together); the
# rest is left to the user's own labels and annotations (which both copy too).
SPEC_BUDGET = 192 * 1024
WORST_CHAR = "\U0001f600"

# Strings with a pattern: a legal value of the maximal length (all ASCII, so any
# legal value of that length encodes to the same size).
PATTERNED: dict[str, str] = {
    "image": "a" * 512,
    "model.version": "v" * 63,
    "model.target.pvc.claimName": "m" * 253,
    "model.draft.pvc.claimName": "m" * 253,
    "model.target.huggingface.id": "a" * 256,
    "model.draft.huggingface.id": "a" * 256,
    "model.target.huggingface.revision": "a" * 256,
    "model.draft.huggingface.revision": "a" * 256,
    "prometheus.url": "http://" + WORST_CHAR * (1024 - len("http://")),
    "resources.memory": "1" * 64,
    "resources.cpu": "1" * 64,
}


def maximal(schema: dict[str, Any], path: str = "") -> Any:
    """The largest value the schema lets through (CEL rules aside: see maximal_spec)."""
    if "properties" in schema:
        return {
            key: maximal(sub, f"{path}.{key}" if path else key)
            for key, sub in schema["properties"].items()
        }
    if path in PATTERNED:
        return PATTERNED[path]
    kind = schema.get("type")
    assert kind not in ("array", "object"), f"{path}: bound it (maxItems, maxProperties)"
    if kind == "string":
        if "enum" in schema:
            return max(schema["enum"], key=len)
        assert "pattern" not in schema, f"{path}: add a maximal legal value to PATTERNED"
        assert "maxLength" in schema, f"spec.{path}: a string without maxLength"
        return WORST_CHAR * schema["maxLength"]
    if kind == "boolean":
        return True
    assert kind in ("integer", "number"), f"spec.{path}: {schema}"
    return schema.get("default", schema.get("maximum", 1))


def maximal_spec() -> dict[str, Any]:
    spec = maximal(SPEC_SCHEMA)
    # Mutually exclusive sources (a CEL rule): a pvc is the larger of the two.
    for role in ("target", "draft"):
        del spec["model"][role]["huggingface"]
        spec["model"][role]["source"] = "pvc"
    return spec


def test_every_spec_string_is_bounded() -> None:
    spec = maximal_spec()  # asserts a bound on every string, array and map
    assert spec["tuning"]["queries"]["p99Latency"] == WORST_CHAR * 1024


def _kopf_annotations(obj: dict[str, Any]) -> dict[str, str]:
    """What Kopf writes after handling obj, with the operator's storage settings
    (slimspec_operator/handlers.py: annotations under the API group's prefix)."""
    storage = kopf.AnnotationsDiffBaseStorage(prefix=G, key="last-handled-configuration")
    body = kopf.Body(obj)
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body))
    return dict(patch["metadata"]["annotations"])


def _size(annotations: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


@pytest.mark.cluster
def test_maximal_spec_fits_kopfs_and_kubectls_annotations(crd_server: CrdServer) -> None:
    name = "maximal"
    body = {
        "apiVersion": f"{G}/{V}",
        "kind": "SlimSpecService",
        "metadata": {"name": name, "namespace": crd_server.namespace},
        "spec": maximal_spec(),
    }
    cluster = crd_server.cluster
    # Client-side apply: kubectl keeps its own copy of the spec in an annotation.
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    try:
        with cluster.api_client() as api:
            custom = client.CustomObjectsApi(api)
            stored = custom.get_namespaced_custom_object(G, V, crd_server.namespace, P, name)
            kubectl_copy = stored["metadata"]["annotations"]
            assert "kubectl.kubernetes.io/last-applied-configuration" in kubectl_copy
            kopf_copy = _kopf_annotations(stored)
            used = _size(kubectl_copy) + _size(kopf_copy)
            assert used <= SPEC_BUDGET, f"{used} bytes of annotations for a maximal spec"
            # The API server takes Kopf's bookkeeping patch (a merge patch).
            patched = custom.patch_namespaced_custom_object(
                G, V, crd_server.namespace, P, name, {"metadata": {"annotations": kopf_copy}}
            )
        assert _size(patched["metadata"]["annotations"]) == used <= ANNOTATIONS_LIMIT
        print(f"maximal spec: {used} of {ANNOTATIONS_LIMIT} bytes of annotations")
    finally:
        cluster.kubectl("delete", f"{P}.{G}", name, "-n", crd_server.namespace, "--wait=false")


def test_cel_rules_see_bounded_strings() -> None:
    """The API server estimates each CEL rule's cost from the bounds of what it reads
    and refuses a CRD over budget; metadata.name counts as unbounded unless both it
    and generateName carry a maxLength in the schema (then the name regex is
    estimated at ~700 units instead of ~2.2 million)."""
    meta = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]
    assert meta["properties"]["name"]["maxLength"] == 253
    assert meta["properties"]["generateName"]["maxLength"] == 253
    resources = SPEC_SCHEMA["properties"]["resources"]["properties"]
    for quantity in ("memory", "cpu"):  # isQuantity() reads them
        assert resources[quantity]["maxLength"] == 64
