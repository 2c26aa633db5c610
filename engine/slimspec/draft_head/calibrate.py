"""Calibrate the compressed draft head: ranking, low-rank factors, ratio table.

The command line is slimspec.calibrate (`slimspec calibrate` / `python -m slimspec.calibrate`).
1. Count tokens on a corpus (default: the Python standard library's .py files)
   and rank the vocabulary by frequency (special tokens first).
2. Collect the draft's final hidden states on calibration sequences and fit an
   activation-aware low-rank factorisation of the ranked head rows (head.py);
   optionally (--distill-steps N) refine it by a short distillation from the full
   head, kept only if it raises the held-out agreement of the low-rank candidates.
3. Score every candidate head (V', r) on held-out sequences: agreement of its
   argmax with the reference token (the target's greedy choice when a target is
   given, else the full draft head's), and keep the best candidate per ratio.
The artifact is written next to the draft by default (<draft>/slimspec-calibration),
where the decoder finds it by itself.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from slimspec.draft_head.artifact import (
    CalibrationArtifact,
    choose_candidate,
    ranking_from_counts,
    special_token_ids,
    stdlib_text,
)
from slimspec.draft_head.head import (
    DraftHead,
    HeadConfig,
    distill_low_rank,
    fit_activation_aware,
    low_rank_kl,
    low_rank_logits,
)

TABLE_RATIOS = [round(0.05 * i, 2) for i in range(20)]  # 0.0 .. 0.95


def _base(model: Any) -> Any:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@torch.inference_mode()
def final_hidden(model: Any, sequences: list[list[int]]) -> torch.Tensor:
    """(N, d) final hidden states (the LM head's input) at every position."""
    base = _base(model)
    dev = model.get_output_embeddings().weight.device
    out = [base(input_ids=torch.tensor([s], device=dev)).last_hidden_state[0] for s in sequences]
    return torch.cat(out).float().cpu()


@torch.inference_mode()
def greedy_next(model: Any, sequences: list[list[int]]) -> torch.Tensor:
    """(N,) the model's argmax next token at every position."""
    dev = model.get_output_embeddings().weight.device
    out = [model(input_ids=torch.tensor([s], device=dev)).logits[0].argmax(-1) for s in sequences]
    return torch.cat(out).cpu()


def split_sequences(ids: list[int], seq_len: int, n_tokens: int) -> list[list[int]]:
    n = max(1, min(len(ids), n_tokens) // seq_len)
    return [
        ids[i * seq_len : (i + 1) * seq_len]
        for i in range(n)
        if ids[i * seq_len : (i + 1) * seq_len]
    ]


def candidate_sizes(vocab: int) -> list[int]:
    sizes = {vocab}
    sizes.update(int(vocab * f / 100) for f in range(5, 100, 5))
    sizes.update(
        s for s in (1024, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536) if s < vocab
    )
    return sorted(s for s in sizes if s >= 1)


def candidate_ranks(hidden: int) -> list[int]:
    ranks = {max(1, (hidden * f // 8) // 8 * 8) for f in (1, 2, 4, 6)}
    return sorted(r for r in ranks if 0 < r < hidden)


def agreement_prefix(
    logits: torch.Tensor, ranking: torch.Tensor, sizes: list[int], ref: torch.Tensor
):
    """{V': agreement} where logits (N, n) are over ranking[:n] and V' <= n."""
    out = {}
    for s in sizes:
        if s <= logits.shape[1]:
            tok = ranking[logits[:, :s].argmax(dim=1)]
            out[s] = (tok == ref).float().mean().item()
    return out


def build_table(candidates: list[dict[str, Any]], full_agreement: float) -> list[dict[str, Any]]:
    table = []
    for r in TABLE_RATIOS:
        best = choose_candidate(candidates, r)
        if best is None:
            continue
        table.append(
            {
                "compression_ratio": r,
                "subset_size": best["subset_size"],
                "rank": best["rank"],
                "head_ratio": best["ratio"],
                "agreement": best["agreement"],
                "kept": best["agreement"] / full_agreement if full_agreement > 0 else 1.0,
            }
        )
    return table


def calibrate(
    draft: Any,
    corpus_ids: list[int],
    eval_ids: list[int],
    *,
    target: Any = None,
    tokenizer: Any = None,
    count_ids: list[int] | None = None,
    seq_len: int = 256,
    fit_tokens: int = 4096,
    eval_tokens: int = 1024,
    lowrank_rows: int = 65536,
    distill_steps: int = 0,
    meta: dict[str, Any] | None = None,
    log=print,
) -> CalibrationArtifact:
    """Build a calibration artifact from token streams (fit on corpus_ids, score on eval_ids)."""
    t0 = time.perf_counter()
    w = draft.get_output_embeddings().weight.detach().float().cpu()
    vocab, hidden = w.shape
    counts = Counter(count_ids if count_ids is not None else corpus_ids)
    ranking = ranking_from_counts(counts, vocab, special_token_ids(tokenizer))
    log(f"ranked {vocab} tokens from {sum(counts.values())} counted ({len(counts)} distinct)")

    fit_seqs = split_sequences(corpus_ids, seq_len, fit_tokens)
    eval_seqs = split_sequences(eval_ids, seq_len, eval_tokens)
    h_fit = final_hidden(draft, fit_seqs)
    h_eval = final_hidden(draft, eval_seqs)
    ref_source = "target" if target is not None else "draft_full_head"
    # reference token: the target's greedy choice, else the full draft head's
    ref = greedy_next(target, eval_seqs) if target is not None else (h_eval @ w.T).argmax(1)
    log(f"hidden: fit {tuple(h_fit.shape)}, eval {tuple(h_eval.shape)}; reference {ref_source}")

    ranks = candidate_ranks(hidden)
    n_lr = min(vocab, lowrank_rows)
    ranked_w = w.index_select(0, ranking)
    a = b = None
    if ranks:
        a, b = fit_activation_aware(ranked_w[:n_lr], h_fit, max(ranks))
        log(f"activation-aware low-rank fit: rows {n_lr}, max rank {max(ranks)}")

    sizes = candidate_sizes(vocab)
    distill_meta: dict[str, Any] | None = None
    if ranks and distill_steps > 0 and a is not None and b is not None:
        a, b, distill_meta = _distill_if_better(
            a, b, ranked_w[:n_lr], h_fit, h_eval, ranks, distill_steps, ranking[:n_lr], ref
        )
        log(f"distillation: {distill_meta}")
    head = DraftHead(w, ranking, a=a, b=b)
    candidates: list[dict[str, Any]] = []
    full_logits = h_eval @ head.ranked_weight.T
    for s, agr in agreement_prefix(full_logits, ranking, sizes, ref).items():
        cfg = HeadConfig(s, None)
        candidates.append(
            {"subset_size": s, "rank": None, "ratio": cfg.ratio(hidden, vocab), "agreement": agr}
        )
    del full_logits
    full_agreement = next(c["agreement"] for c in candidates if c["subset_size"] == vocab)
    for r in ranks:
        lr_logits = head.logits(h_eval, HeadConfig(n_lr, r))
        for s, agr in agreement_prefix(
            lr_logits, ranking, [x for x in sizes if x <= n_lr], ref
        ).items():
            cfg = HeadConfig(s, r)
            ratio = cfg.ratio(hidden, vocab)
            if ratio > 0:
                candidates.append({"subset_size": s, "rank": r, "ratio": ratio, "agreement": agr})
    for c in candidates:
        c["kept"] = c["agreement"] / full_agreement if full_agreement > 0 else 1.0
    table = build_table(candidates, full_agreement)
    meta = dict(meta or {})
    meta.update(
        {
            "vocab": vocab,
            "hidden": hidden,
            "reference": ref_source,
            "full_head_agreement": full_agreement,
            "fit_tokens": int(h_fit.shape[0]),
            "eval_tokens": int(h_eval.shape[0]),
            "lowrank_rows": n_lr if ranks else 0,
            "distillation": distill_meta,
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )
    return CalibrationArtifact(ranking, a, b, candidates, table, meta)


def _mean_lowrank_agreement(
    a: torch.Tensor,
    b: torch.Tensor,
    h: torch.Tensor,
    ranks: list[int],
    ranking: torch.Tensor,
    ref: torch.Tensor,
) -> float:
    vals = [
        (ranking[low_rank_logits(h, a, b, r).argmax(1)] == ref).float().mean().item() for r in ranks
    ]
    return sum(vals) / len(vals)


def _distill_if_better(
    a: torch.Tensor,
    b: torch.Tensor,
    ranked_w: torch.Tensor,
    h_fit: torch.Tensor,
    h_eval: torch.Tensor,
    ranks: list[int],
    steps: int,
    ranking: torch.Tensor,
    ref: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Distil (a, b) on the fit states; keep the result only if held-out agreement rises."""
    t0 = time.perf_counter()
    a2, b2 = distill_low_rank(a, b, ranked_w, h_fit, ranks, steps=steps)
    before = _mean_lowrank_agreement(a, b, h_eval, ranks, ranking, ref)
    after = _mean_lowrank_agreement(a2, b2, h_eval, ranks, ranking, ref)
    r = min(ranks)
    info = {
        "steps": steps,
        "mean_lowrank_agreement_before": before,
        "mean_lowrank_agreement_after": after,
        f"held_out_kl_rank_{r}_before": low_rank_kl(a, b, ranked_w, h_eval, r),
        f"held_out_kl_rank_{r}_after": low_rank_kl(a2, b2, ranked_w, h_eval, r),
        "kept": after > before,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return (a2, b2, info) if after > before else (a, b, info)


def corpus_token_ids(tokenizer: Any, corpus: str, chars: int, offset_files: int, stride: int):
    if corpus == "stdlib":
        text = stdlib_text(chars, offset_files=offset_files, stride=stride)
    else:
        p = Path(corpus)
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        text = "\n".join(f.read_text(errors="ignore") for f in files if f.is_file())
        text = text[offset_files * 1000 :][:chars] if stride > 1 else text[:chars]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
