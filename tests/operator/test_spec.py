"""The typed spec (resource/spec.py) against the CRD, which is the contract: every field the
CRD has, with the same type, bounds, enum, pattern and required-ness, and the
rules the API server enforces (CEL) enforced again when a spec is parsed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from slimspec_operator.resource.queries import DEFAULT_QUERIES, QUERIES, Into
from slimspec_operator.resource.spec import SlimSpecService, SlimSpecServiceSpec, TuningView
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.types import Sample

from .test_cluster_validation import _DELETE, CASES, _set

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "slimspecservice.yaml").read_text())
SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
PYDANTIC = SlimSpecServiceSpec.model_json_schema(by_alias=True)
KEYS = ("minimum", "maximum", "enum", "pattern", "minLength", "maxLength")


def _resolve(schema: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the schema behind $ref / Optional[...], whether null is allowed)."""
    nullable = False
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        nullable = len(options) < len(schema["anyOf"])
        if len(options) == 1:  # the option may itself be a union (an optional quantity)
            schema = {k: v for k, v in schema.items() if k != "anyOf"} | options[0]
    if "$ref" in schema:
        schema = PYDANTIC["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema, nullable


def _crd_shape(s: dict[str, Any]) -> dict[str, Any]:
    out = {k: s[k] for k in KEYS if k in s}
    out["type"] = "int-or-string" if s.get("x-kubernetes-int-or-string") else s["type"]
    if s.get("exclusiveMinimum"):
        out["exclusiveMinimum"] = out.pop("minimum")
    if s.get("type") == "object":
        out["required"] = sorted(s.get("required") or [])
    return out


def _typed_shape(s: dict[str, Any]) -> dict[str, Any]:
    out = {k: s[k] for k in (*KEYS, "exclusiveMinimum") if k in s}
    if "anyOf" in s:  # only int-or-string quantities are a union of two types
        assert sorted(o["type"] for o in s["anyOf"]) == ["integer", "string"]
        out["type"] = "int-or-string"
    else:
        out["type"] = s["type"]
    if out["type"] == "object":
        out["required"] = sorted(s.get("required") or [])
    return out


def fields(crd: dict[str, Any], typed: dict[str, Any], path: str) -> Iterator[tuple]:
    for key, sub in (crd.get("properties") or {}).items():
        assert key in typed.get("properties", {}), f"{path}.{key} is not in spec.py"
        typed_sub, nullable = _resolve(typed["properties"][key])
        yield f"{path}.{key}", sub, typed_sub, nullable
        yield from fields(sub, typed_sub, f"{path}.{key}")


ALL = list(fields(SPEC, PYDANTIC, "spec"))


@pytest.mark.parametrize(("path", "crd", "typed", "nullable"), ALL, ids=[f[0] for f in ALL])
def test_typed_spec_has_the_crds_types_and_bounds(
    path: str, crd: dict[str, Any], typed: dict[str, Any], nullable: bool
) -> None:
    assert _typed_shape(typed) == _crd_shape(crd), path
    if crd.get("nullable"):
        assert nullable, path


def test_every_typed_field_is_in_the_crd() -> None:
    crd_paths = {p for p, *_ in ALL}

    def typed_paths(schema: dict[str, Any], path: str) -> Iterator[str]:
        for key, sub in (schema.get("properties") or {}).items():
            yield f"{path}.{key}"
            yield from typed_paths(_resolve(sub)[0], f"{path}.{key}")

    assert set(typed_paths(PYDANTIC, "spec")) == crd_paths


# The API server's own checks of a spec (tests/operator/test_cluster_validation.py),
# less those the typed spec leaves to it: metadata.name rules and quantity syntax.
TUNING_BLOCKS = set(TuningView.model_json_schema(by_alias=True)["properties"])
SPEC_CASES = [
    (path, value)
    for path, value, _ in CASES
    if path.startswith("spec.") and not (path == "spec.resources" and "gpu" not in value)
]


@pytest.mark.parametrize(("path", "value"), SPEC_CASES, ids=[p for p, _ in SPEC_CASES])
def test_a_spec_the_api_server_rejects_does_not_parse(path: str, value: Any) -> None:
    body = _set(
        {
            "metadata": {"name": "chat"},
            "spec": {
                "model": {
                    "version": "v1",
                    "target": {"source": "pvc", "pvc": {"claimName": "m"}},
                    "draft": {"source": "pvc", "pvc": {"claimName": "m"}},
                }
            },
        },
        path,
        value,
    )
    with pytest.raises(ValidationError):
        SlimSpecService.from_body(body)
    if value is not _DELETE and path.split(".")[1] in TUNING_BLOCKS:
        with pytest.raises(ValidationError):  # the tuner's view rejects it too
            TuningView.from_spec(body["spec"])


# ------------------------------------------------------------------ the query registry

QUERIES_CRD = SPEC["properties"]["tuning"]["properties"]["queries"]


def test_the_crd_names_exactly_the_registrys_queries() -> None:
    """The CRD's spec.tuning.queries properties are the registry's names, in its order;
    the CRD holds no default of its own (unset = the registry's template)."""
    assert list(QUERIES_CRD["properties"]) == [q.name for q in QUERIES]
    assert QUERIES_CRD.get("default") == {}
    assert all("default" not in s for s in QUERIES_CRD["properties"].values())


def test_the_spec_model_is_the_registry() -> None:
    parsed = TuningView.from_spec({}).tuning.queries
    assert {q.name: parsed.template(q) for q in QUERIES} == DEFAULT_QUERIES
    override = TuningView.from_spec({"tuning": {"queries": {"p99Latency": "up"}}})
    assert override.tuning.queries.template(QUERIES[0]) == "up"


def test_each_query_fills_a_field_of_its_reading() -> None:
    readings = {Into.SAMPLE: Sample, Into.PREDICTIONS: Predictions}
    names = {kind: {f.name for f in dataclasses.fields(cls)} for kind, cls in readings.items()}
    assert [q.name for q in QUERIES if q.field not in names[q.into]] == []
    assert len({(q.into, q.field) for q in QUERIES}) == len(QUERIES)
