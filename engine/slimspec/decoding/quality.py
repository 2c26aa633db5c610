"""Online quality control of the compressed head (pure decisions + a small monitor).

Output is exact whatever the head, so "quality" is how much acceptance the
compressed head keeps relative to the full head. On a sample of draft steps the
decoder also scores the full head (the shadow check); once the target has
verified those positions, each sampled position yields two booleans: would the
compressed head's token match the target's choice, would the full head's. The
kept share is matches(compressed) / matches(full) over a sliding window.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

FALLBACK_STRATEGIES = ("auto", "none")
REASON_QUALITY = "kept_acceptance_below_threshold"
RATIO_LADDER = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # fallback steps


def check_threshold(threshold: float) -> float:
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not 0.0 <= threshold <= 1.0
    ):
        raise ValueError(f"quality threshold must be a number in [0, 1], got {threshold!r}")
    return float(threshold)


def check_strategy(strategy: str) -> str:
    if strategy not in FALLBACK_STRATEGIES:
        raise ValueError(
            f"fallback_strategy must be one of {FALLBACK_STRATEGIES}, got {strategy!r}"
        )
    return strategy


def kept_share(compressed_matches: int, full_matches: int) -> float:
    """Share of the full head's agreement the compressed head keeps (1.0 if it never matched)."""
    if full_matches <= 0:
        return 1.0
    return compressed_matches / full_matches


def next_lower_ratio(current: float, ladder: list[float]) -> float:
    """The largest ratio on the ladder strictly below current (0.0 at the bottom)."""
    lower = [r for r in ladder if r < current - 1e-9]
    return max(lower) if lower else 0.0


def fallback_decision(
    kept: float,
    samples: int,
    threshold: float,
    strategy: str,
    current_ratio: float,
    ladder: list[float],
    min_samples: int,
) -> float | None:
    """New ratio when the kept share is under threshold with enough evidence, else None."""
    if strategy != "auto" or current_ratio <= 0.0 or samples < min_samples:
        return None
    if kept >= threshold:
        return None
    return next_lower_ratio(current_ratio, ladder)


@dataclass
class ShadowSample:
    compressed_match: bool
    full_match: bool


class QualityMonitor:
    """Sliding window of shadow-check outcomes. Thread-safe reads."""

    def __init__(self, window: int = 256) -> None:
        self._window: deque[ShadowSample] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.total_samples = 0

    def add(self, compressed_match: bool, full_match: bool) -> None:
        with self._lock:
            self._window.append(ShadowSample(compressed_match, full_match))
            self.total_samples += 1

    def reset(self) -> None:
        with self._lock:
            self._window.clear()

    @property
    def samples(self) -> int:
        return len(self._window)

    @property
    def kept(self) -> float:
        with self._lock:
            c = sum(s.compressed_match for s in self._window)
            f = sum(s.full_match for s in self._window)
        return kept_share(c, f)


class ShadowCheck:
    """The decoder's shadow check: on which steps to also score the full head, and
    what the samples say about the ratio in force."""

    def __init__(self, every: int = 8, min_samples: int = 64, window: int = 256) -> None:
        self.every = every
        self.min_samples = min_samples
        self.monitor = QualityMonitor(window)
        self._steps = 0

    def due(self, k: int, ratio: float) -> bool:
        """Count a step; True when it should shadow (drafting, compressed, every `every`)."""
        self._steps += 1
        return k > 0 and ratio > 0 and self.every > 0 and self._steps % self.every == 0

    def check(
        self,
        compressed: Tensor,
        full: Tensor,
        target: Tensor,
        threshold: float,
        strategy: str,
        ratio: float,
    ) -> tuple[float, float | None]:
        """Record a step's samples, (B, k) argmaxes of the compressed head, the full head
        and the target at the verified positions. Returns the kept share over the window
        and the ratio to fall back to, if any (the window then starts anew)."""
        c = (compressed == target).flatten().tolist()
        f = (full == target).flatten().tolist()
        for cm, fm in zip(c, f, strict=True):
            self.monitor.add(bool(cm), bool(fm))
        kept = self.monitor.kept
        ladder = sorted({*RATIO_LADDER, ratio})
        new = fallback_decision(
            kept, self.monitor.samples, threshold, strategy, ratio, ladder, self.min_samples
        )
        if new is not None:
            self.monitor.reset()
        return kept, new
