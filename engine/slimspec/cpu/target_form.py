"""The form the target's weights are served in on CPU: `target_quantization`.

- `gguf`: the weights' own form. The linear layers, the token embeddings and the LM
  head keep the blocks of the GGUF file the model directory was converted from (Q4_K,
  Q6_K, Q8_0: no requantisation), multiplied inside gguf_kernels' C code; a
  verification reads the file's bytes, not a bf16 copy three times their size. The
  weight values are the ones the dequantised (`none`) target uses; activations are
  quantised to int8 per block for the integer dot products, as llama.cpp does
  (docs/engine.md gives the logit error and the quality cost).
- `int8`: every linear layer's dense weight as Q8_0 blocks (int8 in groups of 32 with
  an fp16 scale), through the same kernels: for a target that comes as safetensors.
- `none`: the dense weights as loaded (bf16/fp32; the reference).
- `auto` (the default): `gguf` where the model directory holds its GGUF, the device is
  the CPU and every weight's block type has a kernel; else `none`. A target served
  dense although a GGUF is there says why in the log.

Norms, biases and attention stay in the model's float dtype, so what decides a token
is computed row by row: a position's logits do not depend on how many rows are
verified beside it (the kernels' integer sums are exact, their float steps fixed).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slimspec.cpu import gguf_kernels, lean_layers, lean_stack, rowwise_attention

log = logging.getLogger(__name__)

AUTO, GGUF, INT8, NONE = "auto", "gguf", "int8", "none"
TARGET_QUANTIZATIONS = (AUTO, GGUF, INT8, NONE)
ENV = "SLIMSPEC_TARGET_QUANTIZATION"
# Rows compared per tensor between the GGUF blocks and the loaded dense weights: a
# wrong name mapping or row order (Llama's q/k permutation) shows at once.
CHECK_ROWS = 4
FORM_ATTR = "_slimspec_target_form"  # where apply() leaves the form on the model


@dataclass(frozen=True)
class TargetForm:
    """What the target is served from: the setting in force and what it means here."""

    quantization: str  # gguf | int8 | none
    detail: str  # block types and counts, the kernel path, or why dense
    weight_bytes: int  # bytes of the served linear, embedding and head weights

    def describe(self) -> str:
        return f"{self.quantization} ({self.detail}; {self.weight_bytes / 1e9:.2f} GB of weights)"


def check_setting(value: str | None) -> str:
    """Normalise a target_quantization value; ValueError naming the allowed ones."""
    text = (value or AUTO).strip().lower()
    if text not in TARGET_QUANTIZATIONS:
        raise ValueError(
            f"target_quantization must be one of {', '.join(TARGET_QUANTIZATIONS)}, got {value!r}"
        )
    return text


def find_gguf(model_dir: Path | None) -> Path | None:
    """The one GGUF file in a model directory (the fetch keeps it there), else None."""
    if model_dir is None or not model_dir.is_dir():
        return None
    files = sorted(model_dir.glob("*.gguf"))
    return files[0] if len(files) == 1 else None


def _dense_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel() * module.weight.element_size()
    return total


def served_form(model: Any) -> TargetForm:
    """The form `apply` put `model` in, or `none` for a model it never touched."""
    form = getattr(model, FORM_ATTR, None)
    return form if isinstance(form, TargetForm) else TargetForm(NONE, "dense weights as loaded", 0)


def apply(model: Any, setting: str | None, model_dir: Path | None) -> TargetForm:
    """Serve `model` (a loaded causal LM) in the form `setting` asks for, in place.

    Raises ValueError where an explicit `gguf` or `int8` cannot be served here (with
    the reason); `auto` falls back to `none` and logs why. A model already put in a
    form (by an earlier call, e.g. the caller of SpeculativeDecoder.from_models) keeps it."""
    setting = check_setting(setting or os.environ.get(ENV))
    earlier = getattr(model, FORM_ATTR, None)
    if isinstance(earlier, TargetForm):
        if setting not in (AUTO, earlier.quantization):
            raise ValueError(
                f"the target is already served as {earlier.quantization}, not {setting}"
            )
        return earlier
    form = _apply(model, setting, model_dir)
    setattr(model, FORM_ATTR, form)
    return form


def _apply(model: Any, setting: str, model_dir: Path | None) -> TargetForm:
    weight = model.get_output_embeddings().weight
    gguf_path = find_gguf(model_dir)
    if setting == AUTO and gguf_path is None:  # nothing to serve from: dense, quietly
        return TargetForm(NONE, "dense weights as loaded", _dense_bytes(model))
    reasons: list[str] = []
    if weight.device.type != "cpu":
        reasons.append(f"the target is on {weight.device}, the block kernels are CPU code")
    elif gguf_kernels.load() is None:
        reasons.append("the GGUF kernels could not be built or loaded (see the log)")
    if setting in (AUTO, GGUF) and not reasons:
        if gguf_path is None:
            reasons.append(f"no single .gguf file beside the model in {model_dir}")
        else:
            try:
                form = _serve_gguf(model, gguf_path)
                _lean_forward(model)
                return form
            except UnsupportedGGUF as exc:
                reasons.append(str(exc))
    if setting == INT8 and not reasons:
        form = _serve_int8(model)
        _lean_forward(model)
        return form
    if setting in (GGUF, INT8):
        raise ValueError(f"target_quantization={setting} cannot be served: {'; '.join(reasons)}")
    detail = "dense weights as loaded"
    if setting == AUTO and gguf_path is not None:
        detail += f"; not its GGUF: {'; '.join(reasons)}"
        log.warning("target served dense although %s is there: %s", gguf_path, "; ".join(reasons))
    return TargetForm(NONE, detail, _dense_bytes(model))


def _lean_forward(model: Any) -> None:
    """The forward of a target whose projections are block layers: grouped projections,
    row-by-row attention, decoder layers without the modules' dispatch, and a decoder
    stack that runs them as one loop."""
    group_projections(model)
    rowwise_attention.use_for(model)
    lean_layers.use_for(model)
    lean_stack.use_for(model)


# Projections that read the same input, by attribute name (Qwen2, Llama and kin).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def group_projections(model: nn.Module) -> int:
    """Put the block layers that read one input (q/k/v, gate/up) in a LinearGroup each:
    one native call computes them together. Returns the number of groups."""
    count = 0
    for module in model.modules():
        for names in SHARED_INPUT:
            layers = [getattr(module, name, None) for name in names]
            linear = [m for m in layers if isinstance(m, gguf_kernels.GGUFLinear)]
            if len(linear) != len(names) or any(m.group is not None for m in linear):
                continue
            block = gguf_kernels.ACTIVATION_BLOCK[linear[0].ggml_type]
            if all(
                m.in_features == linear[0].in_features
                and gguf_kernels.ACTIVATION_BLOCK[m.ggml_type] == block
                for m in linear
            ):
                gguf_kernels.LinearGroup(linear)
                count += 1
    return count


GGUF_MODULES = (gguf_kernels.GGUFLinear, gguf_kernels.GGUFEmbedding)


class UnsupportedGGUF(ValueError):
    """A GGUF this engine cannot serve from its blocks (architecture, tensor types)."""


def _gguf_names(arch: str, n_layers: int) -> Any:
    import gguf

    by_name = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise UnsupportedGGUF(f"GGUF architecture {arch!r} is unknown to the gguf package")
    return gguf.get_tensor_name_map(by_name[arch], n_layers)


def _llama_row_order(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for Llama checkpoints (what transformers'
    GGUF loader does to the dequantised weight, here on whole rows of blocks)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, -1).swapaxes(2, 1).reshape(rows.shape)


def _serve_gguf(model: Any, path: Path) -> TargetForm:
    from slimspec.cpu.gguf_file import open_tensors

    reader = open_tensors(path)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in ("qwen2", "llama"):
        raise UnsupportedGGUF(
            f"GGUF architecture {arch!r} has no block mapping here (qwen2, llama)"
        )
    config = model.config.get_text_config()
    names = _gguf_names(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}

    def tensor_for(module_name: str, suffix: str) -> Any:
        gguf_name = names.get_name(module_name)
        return None if gguf_name is None else tensors.get(f"{gguf_name}.{suffix}")

    head = model.get_output_embeddings()
    plan: list[tuple[nn.Module, str, str, nn.Linear | nn.Embedding, Any]] = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear | nn.Embedding):
                t = tensor_for(full, "weight")
                if t is None and child is head:  # a tied head: the file has no output tensor
                    t = tensors.get("token_embd.weight")
                if t is None:
                    raise UnsupportedGGUF(f"{full}: no tensor for it in {path.name}")
                k = int(t.shape[0])
                if not gguf_kernels.supported(int(t.tensor_type), k):
                    raise UnsupportedGGUF(
                        f"{t.name} is {t.tensor_type.name} with rows of {k}: no kernel for it"
                    )
                plan.append((parent, child_name, full, child, t))
    dtype = head.weight.dtype
    # Read and check every tensor before replacing any module: a file that does not
    # fit leaves the model as it was (auto then serves it dense).
    blocks_by_tensor: dict[str, torch.Tensor] = {}
    for _, _, _, child, t in plan:
        if t.name not in blocks_by_tensor:
            rows = np.array(t.data)  # a copy: the reader's memmap is read-only
            if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                q = "attn_q" in t.name
                heads = config.num_attention_heads if q else config.num_key_value_heads
                rows = _llama_row_order(rows, heads)
            blocks_by_tensor[t.name] = torch.from_numpy(np.ascontiguousarray(rows))
        _check_rows(
            t.name, int(t.tensor_type), blocks_by_tensor[t.name], int(t.shape[0]), child.weight
        )
    types: Counter[str] = Counter()
    # a tied head reads the embedding's blocks: repacked into panels it would hold the
    # table twice, so it keeps the file's layout
    embedded = {t.name for _, _, _, child, t in plan if isinstance(child, nn.Embedding)}
    for parent, child_name, full, child, t in plan:
        ggml_type, k = int(t.tensor_type), int(t.shape[0])
        blocks = blocks_by_tensor[t.name]
        if isinstance(child, nn.Embedding):
            new: nn.Module = gguf_kernels.GGUFEmbedding(ggml_type, blocks, k, dtype)
        else:
            bias_t = tensor_for(full, "bias")
            bias: torch.Tensor | None = child.bias
            if bias_t is not None:  # the file's float32 bias, not its bf16 copy
                bias = torch.from_numpy(np.array(bias_t.data, dtype=np.float32))
            panels = False if t.name in embedded else None
            new = gguf_kernels.GGUFLinear(ggml_type, blocks, k, bias, dtype, panels)
        setattr(parent, child_name, new)
        types[t.tensor_type.name] += 1
    served = {id(m.blocks): m for m in model.modules() if isinstance(m, GGUF_MODULES)}
    total = sum(m.blocks.numel() for m in served.values())
    counts = ", ".join(f"{name} x{n}" for name, n in sorted(types.items()))
    detail = f"{counts} from {path.name}; {gguf_kernels.path()} kernels"
    kept = [
        gguf_kernels.TYPE_NAMES[file_type]
        for file_type, form in gguf_kernels.PANEL_FORMS.items()
        if any(m.ggml_type == form for m in served.values())
    ]
    if kept:
        detail += f"; {' and '.join(kept)} kept in 8-row panels"
    return TargetForm(GGUF, detail, total)


def _check_rows(
    name: str, ggml_type: int, blocks: torch.Tensor, k: int, dense: torch.Tensor
) -> None:
    """The GGUF rows must be the loaded model's rows (the model was converted from them)."""
    n = blocks.shape[0]
    if tuple(dense.shape) != (n, k):
        raise UnsupportedGGUF(f"{name}: {n}x{k} in the GGUF, {tuple(dense.shape)} in the model")
    ids = torch.linspace(0, n - 1, CHECK_ROWS).long()
    ours = gguf_kernels.dequantize_rows(ggml_type, blocks, k, ids)
    theirs = dense[ids].float()
    scale = float(ours.abs().max()) or 1.0
    if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * scale):
        raise UnsupportedGGUF(f"{name}: the GGUF's rows differ from the loaded weights")


def _serve_int8(model: Any) -> TargetForm:
    dtype = model.get_output_embeddings().weight.dtype
    total = 0
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.in_features % 32:
                continue
            blocks = gguf_kernels.q8_0_blocks(child.weight)
            new = gguf_kernels.GGUFLinear(
                gguf_kernels.Q8_0, blocks, child.in_features, child.bias, dtype
            )
            setattr(parent, child_name, new)
            total += blocks.numel()
            count += 1
    detail = f"Q8_0 x{count} made from the dense weights; {gguf_kernels.path()} kernels"
    return TargetForm(INT8, detail, total + _dense_bytes(model))
