"""A tiny random model directory whose weights come from a GGUF file beside it.

What the fetch leaves for a registry model (config.json, safetensors and the GGUF they
were converted from), in miniature: the linear layers are random Q4_K and Q6_K blocks,
the token table Q8_0 blocks of the model's own initial weights, norms and biases
float32; the safetensors hold the same values dequantised. For Llama the q/k rows are
written permuted, as llama.cpp's converter writes them, so serving from the file must
undo that. Hidden size 256: the K-quants' rows are whole 256-value blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants

from tests.support.tiny_models import tiny_model

HIDDEN = 256
Q4_K, Q6_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0
# Which block type each kind of weight gets (Q4_K_M-like: v, down and the head in Q6_K).
TYPE_BY_ROLE = {"token_embd": Q8_0, "attn_v": Q6_K, "ffn_down": Q6_K, "output": Q6_K}


def random_k_blocks(ggml_type: GGMLQuantizationType, n: int, k: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K rows whose values are about N(0, 0.1)-sized."""
    nb = k // 256
    size = 144 if ggml_type == Q4_K else 210
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    if ggml_type == Q4_K:  # d and dmin: values d*sc*q - dmin*m, roughly centred
        raw[:, :, 0:2] = np.full((n, nb, 1), 2e-4, np.float16).view(np.uint8)
        raw[:, :, 2:4] = np.full((n, nb, 1), 1.5e-3, np.float16).view(np.uint8)
    else:  # Q6_K: d*sc*(q-32), sc signed
        raw[:, :, 208:210] = np.full((n, nb, 1), 1e-4, np.float16).view(np.uint8)
    return raw.reshape(n, nb * size)


def llama_permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for Llama checkpoints."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(rows.shape)
    )


def write_tiny_gguf_model(
    out: Path, arch: str = "qwen2", seed: int = 0, tied: bool = False
) -> Path:
    """Write the model directory (config, safetensors, tiny.gguf) to `out`; return it.
    tied: the head is the token table (Q6_K blocks then), the file has no output tensor."""
    rng = np.random.default_rng(seed)
    model = tiny_model(arch, seed=seed, hidden=HIDDEN)
    config = model.config
    if tied:
        config.tie_word_embeddings = True
        model.tie_weights()
    arch_id = {name: a for a, name in MODEL_ARCH_NAMES.items()}[arch]
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    out.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out / "tiny.gguf"), arch)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                continue
            if tied and module is model.get_output_embeddings():
                continue  # the token table's blocks serve it
            base = names.get_name(module_name)
            role = base.split(".")[-1]
            ggml_type = Q6_K if tied and role == "token_embd" else TYPE_BY_ROLE.get(role, Q4_K)
            n, k = module.weight.shape
            if ggml_type == Q8_0:
                blocks = quants.quantize(module.weight.float().numpy(), Q8_0)
            else:
                blocks = random_k_blocks(ggml_type, n, k, rng)
            dense = quants.dequantize(blocks, ggml_type).reshape(n, k)
            module.weight.copy_(torch.from_numpy(dense))
            stored = blocks
            if arch == "llama" and role in ("attn_q", "attn_k"):
                heads = (
                    config.num_attention_heads if role == "attn_q" else config.num_key_value_heads
                )
                stored = llama_permute(blocks, heads)
            writer.add_tensor(f"{base}.weight", stored, raw_dtype=ggml_type)
            if getattr(module, "bias", None) is not None:
                module.bias.copy_(torch.randn(n) * 0.05)
                writer.add_tensor(f"{base}.bias", module.bias.float().numpy())
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                module_name = param_name[: -len(".weight")]
                writer.add_tensor(f"{names.get_name(module_name)}.weight", param.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(out)
    return out
