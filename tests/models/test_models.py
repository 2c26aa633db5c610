"""slimspec.weights.loading: resolving names and paths, argument errors, tokenizer checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from slimspec.weights import loading
from slimspec.weights.loading import (
    ModelNotFoundError,
    check_tokenizers_compatible,
    load_causal_lm,
    resolve_device,
    resolve_model_path,
    torch_dtype,
)
from slimspec_testbed.models import RealModelPair


class FakeTok:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(missing)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm(str(missing))


def test_file_or_dir_without_config_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model_path(tmp_path / "weights.gguf")
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model_path(tmp_path)


def test_local_dir_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_hub_id_without_hub_says_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never touch the network from a test
    with pytest.raises(ModelNotFoundError, match="hub download failed") as info:
        resolve_model_path("no-such-org/no-such-model")
    assert "qwen2.5-coder-1.5b-instruct" in str(info.value)  # lists the registry names


def test_registry_name_not_cached_without_fetch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the cache"):
        resolve_model_path("gemma-3-270m", fetch=False)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype_names(name: str | torch.dtype, want: torch.dtype) -> None:
    assert torch_dtype(name) == want


@pytest.mark.parametrize("bad", ["int8", "float64", "", torch.int8])
def test_bad_dtype_fails_before_loading(bad: str | torch.dtype, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_causal_lm(tmp_path / "never-looked-at", dtype=bad)


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_tokenizer_check_on_fakes() -> None:
    a = FakeTok({"a": 0, "b": 1, "c": 2})
    assert check_tokenizers_compatible(a, FakeTok({"a": 0, "b": 1, "c": 2}), 4, 4) == 4
    with pytest.raises(ValueError, match="LM head has 4 rows, draft has 5"):
        check_tokenizers_compatible(a, a, 4, 5)
    with pytest.raises(ValueError, match=r"2 ids map to different tokens.*id 1: 'b' vs 'x'"):
        check_tokenizers_compatible(a, FakeTok({"a": 0, "x": 1, "b": 2}), 4, 4)
    with pytest.raises(ValueError, match="only 2 rows"):
        check_tokenizers_compatible(a, a, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_small_real_model_dtype_eval_no_grad(small_real_model: Path, dtype: str) -> None:
    model, tok = load_causal_lm(small_real_model, dtype=dtype, device="cpu")
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert loading.model_vocab_size(model) == 49_152
    assert tok("hello").input_ids


@pytest.mark.slow
def test_registry_name_resolves_to_cache(small_real_model: Path) -> None:
    assert resolve_model_path("smollm2-135m-instruct") == small_real_model
    assert resolve_model_path("SmolLM2-135M-Instruct", fetch=False) == small_real_model


@pytest.mark.slow
def test_smollm2_and_qwen_tokenizers_are_rejected(
    small_real_model: Path, real_model_pair: RealModelPair
) -> None:
    from transformers import AutoTokenizer, PretrainedConfig

    smol = AutoTokenizer.from_pretrained(small_real_model)
    qwen = AutoTokenizer.from_pretrained(real_model_pair.target)
    with pytest.raises(ValueError, match="different vocabularies"):
        check_tokenizers_compatible(qwen, smol, 151_936, 49_152)
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_tokenizers_compatible(qwen, smol, 151_936, 151_936)
    # the real pair passes: same tokenizer, same LM head size
    draft = AutoTokenizer.from_pretrained(real_model_pair.draft)
    t_vocab = PretrainedConfig.from_pretrained(real_model_pair.target).vocab_size
    d_vocab = PretrainedConfig.from_pretrained(real_model_pair.draft).vocab_size
    assert check_tokenizers_compatible(qwen, draft, t_vocab, d_vocab) == 151_936
