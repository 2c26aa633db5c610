"""Persisted traffic counts: a restart or a new replica ranks its head from them.

One safetensors file per draft (counts (V,) float64 and the time they were taken),
by default in the cache volume: $SLIMSPEC_CACHE/traffic/<draft>-<vocab>.safetensors.
Writes go to a temporary file that is renamed over the old one, so a reader (another
replica on the same volume) never sees half a file; the last writer wins.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch

from slimspec.paths import cache_root

log = logging.getLogger("slimspec.ranking")

ENV_PATH = "SLIMSPEC_TRAFFIC_COUNTS"  # a file path, or "none" to keep counts in memory only
OFF = ("", "0", "none", "off", "false")


def default_counts_path(draft_name: str, vocab: int) -> Path:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(draft_name).rstrip("/")).name) or "draft"
    return cache_root() / "traffic" / f"{stem}-{vocab}.safetensors"


def resolve_counts_path(
    option: str | Path | None, draft_name: str | None, vocab: int
) -> Path | None:
    """The counts file: the option, else $SLIMSPEC_TRAFFIC_COUNTS, else the default path
    for a draft loaded by name (None for in-memory models or when switched off)."""
    value = option if option is not None else os.environ.get(ENV_PATH)
    if value is not None:
        return None if str(value).strip().lower() in OFF else Path(value).expanduser()
    return default_counts_path(draft_name, vocab) if draft_name else None


def save_counts(path: Path, counts: torch.Tensor, taken_at: float | None = None) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    meta = {"taken_at": repr(time.time() if taken_at is None else taken_at)}
    save_file({"counts": counts.double().contiguous().cpu()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_counts(path: Path, vocab: int) -> tuple[torch.Tensor, float] | None:
    """(counts, taken_at) from the file, or None (missing, unreadable, other vocabulary:
    logged, never fatal: the head then starts from the calibration ranking)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            counts = f.get_tensor("counts").double()
            taken_at = float((f.metadata() or {}).get("taken_at", path.stat().st_mtime))
    except Exception as exc:  # a corrupt file must not stop the engine
        log.warning("ignoring unreadable traffic counts %s: %s", path, exc)
        return None
    if counts.shape != (vocab,) or not bool(torch.isfinite(counts).all()) or counts.min() < 0:
        log.warning("ignoring traffic counts %s: not %d finite non-negative counts", path, vocab)
        return None
    return counts, taken_at
