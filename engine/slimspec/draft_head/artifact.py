"""The calibration artifact: token ranking, low-rank factors and the ratio table.

Layout of an artifact directory (default: `<draft dir>/slimspec-calibration/`):
  head.safetensors   ranking (V,) int64; optional a (r_max, d), b (V_lr, r_max)
  calibration.json   meta, candidates [(V', r, ratio, agreement, kept)], table

Without an artifact the decoder ranks tokens by a quick count over a slice of the
Python standard library (or by token id when there is no tokenizer: BPE ids
roughly follow merge order, i.e. frequency) and uses subset-only heads.
"""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimspec.draft_head.head import DraftHead, HeadConfig, check_ratio, subset_size_for_ratio

ARTIFACT_DIRNAME = "slimspec-calibration"
FORMAT_VERSION = 1


@dataclass
class CalibrationArtifact:
    ranking: torch.Tensor
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    table: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return int(self.ranking.shape[0])

    def config_for(self, ratio: float, hidden: int) -> HeadConfig:
        """The measured candidate chosen for this ratio (subset-only by formula if none)."""
        best = choose_candidate(self.candidates, check_ratio(ratio))
        if best is None:
            return HeadConfig(subset_size_for_ratio(ratio, self.vocab), None)
        rank = None if best["rank"] is None else int(best["rank"])
        return HeadConfig(int(best["subset_size"]), rank)


RATIO_WINDOW = 0.05


def choose_candidate(candidates: list[dict[str, Any]], ratio: float) -> dict[str, Any] | None:
    """Best-agreement candidate removing between ratio and ratio + 0.05 of the head's work.

    The window keeps the knob meaningful (asking for 0.3 gives about 0.3, not a
    much smaller head that happened to measure as well); within it the measurement
    decides between subset-only and low-rank heads. If nothing falls in the window,
    the least-compressed candidate that still meets the ratio.
    """
    fits = [c for c in candidates if c["ratio"] >= ratio - 1e-9]
    if not fits:
        return None
    window = [c for c in fits if c["ratio"] <= ratio + RATIO_WINDOW]
    if window:
        return max(window, key=lambda c: (c["agreement"], c["ratio"]))
    return min(fits, key=lambda c: c["ratio"])


def save_artifact(art: CalibrationArtifact, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"ranking": art.ranking.to(torch.int64).contiguous()}
    if art.a is not None and art.b is not None:
        tensors["a"] = art.a.float().contiguous()
        tensors["b"] = art.b.float().contiguous()
    save_file(tensors, str(out / "head.safetensors"))
    doc = {
        "format": FORMAT_VERSION,
        "meta": art.meta,
        "candidates": art.candidates,
        "table": art.table,
    }
    (out / "calibration.json").write_text(json.dumps(doc, indent=1))
    return out


def load_artifact(path: str | Path) -> CalibrationArtifact:
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "calibration.json").is_file() or not (p / "head.safetensors").is_file():
        raise FileNotFoundError(
            f"no calibration artifact in {p} (expected calibration.json and head.safetensors)"
        )
    doc = json.loads((p / "calibration.json").read_text())
    if doc.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"calibration artifact {p} has format {doc.get('format')}, expected {FORMAT_VERSION}"
        )
    t = load_file(str(p / "head.safetensors"))
    return CalibrationArtifact(
        ranking=t["ranking"],
        a=t.get("a"),
        b=t.get("b"),
        candidates=doc.get("candidates", []),
        table=doc.get("table", []),
        meta=doc.get("meta", {}),
    )


def find_artifact(draft_path: str | Path | None) -> Path | None:
    if draft_path is None:
        return None
    p = Path(draft_path) / ARTIFACT_DIRNAME
    return p if (p / "calibration.json").is_file() else None


def stdlib_py_files() -> list[Path]:
    """The standard library's own .py files, sorted (a deterministic code corpus)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    files = [
        f for f in root.rglob("*.py") if not any(part in skip for part in f.relative_to(root).parts)
    ]
    return sorted(files)


def stdlib_text(max_chars: int, offset_files: int = 0, stride: int = 1) -> str:
    """Concatenated stdlib source, up to max_chars (files offset_files::stride)."""
    chunks: list[str] = []
    total = 0
    for f in stdlib_py_files()[offset_files::stride]:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(chunks)[:max_chars]


def ranking_from_counts(
    counts: Counter, vocab: int, first: list[int] | tuple[int, ...] = ()
) -> torch.Tensor:
    """Token ids by descending count, ties by id; `first` (e.g. special tokens) forced in front."""
    forced = [t for t in dict.fromkeys(first) if 0 <= t < vocab]
    forced_set = set(forced)
    order = sorted(
        (t for t in range(vocab) if t not in forced_set),
        key=lambda t: (-counts.get(t, 0), t),
    )
    return torch.tensor(forced + order, dtype=torch.long)


def special_token_ids(tokenizer: Any) -> list[int]:
    if tokenizer is None:
        return []
    ids = list(getattr(tokenizer, "all_special_ids", []) or [])
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            ids.append(v)
    return ids


def quick_ranking(vocab: int, tokenizer: Any = None, max_chars: int = 300_000) -> torch.Tensor:
    """A cheap ranking for decoders without a calibration artifact."""
    if tokenizer is None:
        return torch.arange(vocab, dtype=torch.long)
    ids = tokenizer(stdlib_text(max_chars, stride=7), add_special_tokens=False)["input_ids"]
    return ranking_from_counts(Counter(ids), vocab, special_token_ids(tokenizer))


def resolve_artifact(
    calibration: str | Path | CalibrationArtifact | None, vocab: int
) -> CalibrationArtifact | None:
    """The artifact a decoder option names (a directory, or the artifact itself), checked
    against the draft head's `vocab` rows."""
    art = load_artifact(calibration) if isinstance(calibration, (str, Path)) else calibration
    if art is not None and art.vocab != vocab:
        raise ValueError(
            f"calibration artifact ranks {art.vocab} tokens, the draft head has {vocab}"
        )
    return art


def draft_head_for(
    lm_head: Any, art: CalibrationArtifact | None, tokenizer: Any = None
) -> DraftHead:
    """The compressed head of a draft's LM head: ranked and factored by the artifact, or
    by quick_ranking (subsets only) without one."""
    weight = lm_head.weight.detach()
    ranking = art.ranking if art is not None else quick_ranking(weight.shape[0], tokenizer)
    bias = getattr(lm_head, "bias", None)
    return DraftHead(
        weight,
        ranking,
        a=art.a if art is not None else None,
        b=art.b if art is not None else None,
        bias=bias.detach() if bias is not None else None,
    )
