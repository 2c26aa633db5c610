"""Convert an assembled GGUF file into a Hugging Face model directory (safetensors).

slimspec.weights.fetch runs this module in a child process
(`python -m slimspec.weights.convert GGUF --out DIR`), so the conversion's memory
peak is returned to the system before the caller loads anything. The weights are
stored in bfloat16: the GGUF weights are 4-8-bit, so nothing of the source is lost.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONVERT_DTYPE = "bfloat16"


def convert_gguf_to_hf(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str = CONVERT_DTYPE,
    vocab_size: int | None = None,
    progress: bool = True,
) -> None:
    """Dequantise a GGUF with transformers and save a safetensors HF directory.

    Raises ValueError when the LM head does not have `vocab_size` rows.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = getattr(torch, dtype)
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    steps = ["tokenizer", "weights (dequantise)", "save"]
    desc = f"convert {gguf_path.name}"
    with tqdm(total=len(steps), desc=desc, disable=not progress, file=sys.stderr) as bar:
        bar.set_postfix_str(steps[0])
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        # transformers may keep GGUF blocks packed; we want plain dense weights
        kwargs: dict[str, Any] = {"quantization_config": GgufConfig(dequantize=True)}
        with torch.no_grad():
            # Any: the GGUF-loaded model's quantizer attributes are not in its static type
            model: Any = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch_dtype, **kwargs
            )
        bar.update()
        bar.set_postfix_str(steps[2])
        rows = model.get_output_embeddings().weight.shape[0]
        if vocab_size is not None and rows != vocab_size:
            raise ValueError(f"{gguf_path.name}: LM head has {rows} rows, expected {vocab_size}")
        # save_pretrained refuses a GGUF-loaded model while it still looks quantised;
        # the weights are plain dequantised tensors by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        bar.update()


def main(argv: Sequence[str] | None = None) -> int:
    """The child process's entry point (not a user command)."""
    parser = argparse.ArgumentParser(prog="python -m slimspec.weights.convert")
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default=CONVERT_DTYPE)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    convert_gguf_to_hf(
        args.gguf, args.out, dtype=args.dtype, vocab_size=args.vocab_size, progress=not args.quiet
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
