"""The CRD file itself: every field documented (schema and docs/crd-reference.md),
structure the tools rely on, and the typed spec's defaults equal the schema's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from slimspec_operator.resource.spec import SlimSpecService

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "slimspecservice.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def fields(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for key, sub in (schema.get("properties") or {}).items():
        p = f"{path}.{key}" if path else key
        if p in ("apiVersion", "kind", "metadata"):
            continue
        yield p, sub
        yield from fields(sub, p)
        if sub.get("type") == "array":
            yield from fields(sub.get("items") or {}, p + "[]")


ALL = list(fields(SCHEMA))


def test_every_field_has_a_description_and_is_in_the_reference():
    doc = (ROOT / "docs" / "crd-reference.md").read_text()
    missing_desc = [p for p, s in ALL if not s.get("description")]
    assert missing_desc == []
    missing_doc = [p for p, _ in ALL if f"`{p}`" not in doc]
    assert missing_doc == []


def test_names_subresources_and_columns():
    assert CRD["metadata"]["name"] == "slimspecservices.slimspec.io"
    assert CRD["spec"]["names"]["shortNames"] == ["ssvc"]
    assert VERSION["name"] == "v1alpha1"
    scale = VERSION["subresources"]["scale"]
    assert scale["labelSelectorPath"] == ".status.selector"
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert "status" in VERSION["subresources"]
    cols = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert cols == ["Ready", "Version", "Serving", "Ratio", "Replicas", "Available", "URL", "Age"]
    url = next(c for c in VERSION["additionalPrinterColumns"] if c["name"] == "URL")
    assert url["jsonPath"] == ".status.url"
    assert "url" in SCHEMA["properties"]["status"]["properties"]
    conds = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conds["x-kubernetes-list-type"] == "map"  # reconciler and tuner apply their own


def _get(d: Any, path: list[str]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            raise KeyError
        d = d[key]
    return d


MINIMAL = {
    "metadata": {"name": "x", "namespace": "y"},
    "spec": {
        "model": {
            "version": "v1",
            "target": {"source": "pvc", "pvc": {"claimName": "m"}},
            "draft": {
                "source": "huggingface",
                "huggingface": {"id": "a/b", "tokenSecret": {"name": "hf"}},
            },
        },
        # optional blocks without a default of their own, so their fields' defaults show
        "prometheus": {"tls": {"caSecretName": "ca"}},
    },
}


@pytest.mark.parametrize(
    ("path", "default"),
    [
        (p, s["default"])
        for p, s in ALL
        if p.startswith("spec.") and "default" in s and not isinstance(s["default"], dict)
    ],
)
def test_typed_spec_defaults_match_schema(path: str, default: Any):
    dumped = SlimSpecService.from_body(MINIMAL).spec.model_dump(by_alias=True)
    parts = path.split(".")[1:]
    if parts[0] == "model" and len(parts) > 2:  # a pvc target and a huggingface draft
        parts[1] = "target" if parts[2] == "pvc" else "draft"
    assert _get(dumped, parts) == default, path
