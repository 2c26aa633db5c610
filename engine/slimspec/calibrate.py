"""`slimspec calibrate` / `python -m slimspec.calibrate`: calibrate a draft's compressed head.

    python -m slimspec.calibrate --draft DIR [--target DIR] [--out DIR]

Writes the artifact next to the draft by default (<draft>/slimspec-calibration), where
the decoder finds it by itself. How it is built: slimspec.draft_head.calibrate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from slimspec.draft_head.artifact import ARTIFACT_DIRNAME, save_artifact
from slimspec.draft_head.calibrate import calibrate, corpus_token_ids


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="slimspec calibrate",
        description="Calibrate the compressed draft head: ranking, low-rank factors, ratio table.",
    )
    ap.add_argument("--draft", required=True, help="draft model directory (or registry name)")
    ap.add_argument("--target", help="target model: reference tokens for the measured acceptance")
    ap.add_argument("--out", help=f"artifact directory (default: <draft>/{ARTIFACT_DIRNAME})")
    ap.add_argument("--corpus", default="stdlib", help="'stdlib' or a text file/directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--count-chars", type=int, default=3_000_000, help="corpus chars for counting")
    ap.add_argument("--fit-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lowrank-rows", type=int, default=65536)
    ap.add_argument(
        "--distill-steps",
        type=int,
        default=0,
        help="refine the low-rank factors by N Adam steps of distillation from the full head "
        "(kept only if held-out agreement rises)",
    )
    args = ap.parse_args(argv)

    from slimspec.weights.loading import (
        check_same_vocabulary,
        load_causal_lm,
        resolve_model_path,
    )

    try:
        draft_dir = resolve_model_path(args.draft)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    draft, tok = load_causal_lm(args.draft, dtype=args.dtype, device=args.device)
    target = None
    if args.target:
        target, ttok = load_causal_lm(args.target, dtype=args.dtype, device=args.device)
        check_same_vocabulary(ttok, tok)
    torch.manual_seed(0)
    count_ids = corpus_token_ids(tok, args.corpus, args.count_chars, 0, 1)
    # fit and evaluation on files the count saw at different strides: eval is held out from fit
    fit_ids = corpus_token_ids(tok, args.corpus, 8 * args.fit_tokens + 10_000, 1, 5)
    eval_ids = corpus_token_ids(tok, args.corpus, 8 * args.eval_tokens + 10_000, 3, 5)
    art = calibrate(
        draft,
        fit_ids,
        eval_ids,
        target=target,
        tokenizer=tok,
        count_ids=count_ids,
        seq_len=args.seq_len,
        fit_tokens=args.fit_tokens,
        eval_tokens=args.eval_tokens,
        lowrank_rows=args.lowrank_rows,
        distill_steps=args.distill_steps,
        meta={"draft": str(args.draft), "target": args.target, "corpus": args.corpus},
        log=lambda m: print(m, file=sys.stderr),
    )
    out = Path(args.out) if args.out else Path(draft_dir) / ARTIFACT_DIRNAME
    save_artifact(art, out)
    print(json.dumps({"artifact": str(out), "table": art.table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
