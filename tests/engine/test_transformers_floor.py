"""The transformers floor in engine/pyproject.toml is the one the engine checks, and
it is the release that gives models the `cache=` argument the engine passes."""

from __future__ import annotations

import inspect
import tomllib
from importlib.metadata import version

import pytest
from slimspec.transformers_floor import (
    TRANSFORMERS_FLOOR,
    require_transformers,
    transformers_too_old,
)
from slimspec_testbed.tools import REPO_ROOT
from transformers.models.llama.modeling_llama import LlamaModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Model


def test_pyproject_declares_the_floor_the_engine_checks() -> None:
    project = tomllib.loads((REPO_ROOT / "engine" / "pyproject.toml").read_text())["project"]
    (req,) = [d for d in project["dependencies"] if d.startswith("transformers")]
    assert req == f"transformers>={TRANSFORMERS_FLOOR}"


@pytest.mark.parametrize(
    ("installed", "too_old"),
    [("4.57.6", True), ("5.23.0", True), ("5.24.0", False), ("5.24.0.dev0", False),
     ("5.25.1", False), ("6.0.0", False)],
)  # fmt: skip
def test_versions_before_the_floor_are_refused(installed: str, too_old: bool) -> None:
    assert transformers_too_old(installed) is too_old


def test_the_installed_release_passes_and_takes_cache() -> None:
    require_transformers()
    assert not transformers_too_old(version("transformers"))
    for model in (LlamaModel, Qwen2Model):
        assert "cache" in inspect.signature(model.forward).parameters
