"""What the engines predict each compression ratio buys (pure).

The engines export, per ratio they can serve, the predicted speed-up over the
target alone (from their own timings of draft and verify steps and the
acceptance they measure), the kept acceptance measured at that ratio and the
head's share of a draft step, plus whether compression can help at all. The
operator aggregates them over the service's pods (prometheus/queries.py) into one
`Predictions`; this module answers the tuner's questions about them: the
predicted speed-up at any ratio (linear between the exported ones), the fastest
ratio within bounds, and whether compression is worth anything here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise

from slimspec_operator.tuning.reasons import Reason

# Below this share of a draft step, a cheaper head cannot buy a measurable
# speed-up; used to name why compression cannot help when the engines give no reason.
SMALL_HEAD_SHARE = 0.15
_EPS = 1e-9


@dataclass(frozen=True)
class Predictions:
    """The engines' per-ratio predictions, aggregated over the service's pods."""

    speedup: Mapping[float, float] = field(default_factory=dict)  # ratio -> speed-up
    kept: Mapping[float, float] = field(default_factory=dict)  # ratio -> kept acceptance
    head_share: Mapping[float, float] = field(default_factory=dict)  # ratio -> share of a step
    best: float | None = None  # the engines' own fastest ratio (unbounded)
    can_help: bool | None = None  # None: not exported
    reason: str | None = None  # the engines' reason when can_help is False
    ranking_age: float | None = None  # seconds since the head's subset was last ranked
    ranking_coverage: float | None = None  # share of served tokens the subset covers

    @property
    def usable(self) -> bool:
        """Enough to compare ratios: speed-ups at two ratios at least."""
        return len(self.speedup) >= 2


def speedup_at(pred: Predictions, ratio: float) -> float | None:
    """Predicted speed-up at `ratio`, linear between exported ratios; None outside them."""
    return _interpolate(pred.speedup, ratio)


def kept_at(pred: Predictions, ratio: float) -> float | None:
    """Measured kept acceptance at `ratio`: the nearest exported ratio at or above it
    (acceptance falls as the ratio grows, so this errs on the safe side)."""
    above = [r for r in pred.kept if r >= ratio - _EPS]
    return pred.kept[min(above)] if above else None


def _interpolate(points: Mapping[float, float], x: float) -> float | None:
    xs = sorted(points)
    if not xs or x < xs[0] - _EPS or x > xs[-1] + _EPS:
        return None
    for lo, hi in pairwise(xs):
        if lo - _EPS <= x <= hi + _EPS:
            if hi - lo < _EPS:
                return points[lo]
            w = min(max((x - lo) / (hi - lo), 0.0), 1.0)
            return points[lo] * (1.0 - w) + points[hi] * w
    return points[xs[0]]


def candidates(pred: Predictions, low: float, high: float) -> list[float]:
    """Ratios worth comparing in [low, high]: the exported ones and the bounds
    themselves (where the predictions reach them), ascending."""
    out = {round(r, 6) for r in pred.speedup if low - _EPS <= r <= high + _EPS}
    out |= {round(b, 6) for b in (low, high) if speedup_at(pred, b) is not None}
    return sorted(out)


def fastest(
    pred: Predictions,
    low: float,
    high: float,
    near_tie: float,
    allowed: Callable[[float], bool] = lambda _: True,
) -> float | None:
    """The fastest allowed ratio in [low, high]; among those within `near_tie`
    (relative) of the fastest, the lowest, since a lower ratio keeps more acceptance
    on traffic the head was not ranked on. Only a near tie: each ratio's speed-up
    already counts the acceptance measured at it, so a wider band gives away speed
    the engines predict (a 3 % band took 0.3 -> 0.7 where 0.95 was predicted +6 %)."""
    scored = [(r, speedup_at(pred, r)) for r in candidates(pred, low, high) if allowed(r)]
    scored_ok = [(r, s) for r, s in scored if s is not None]
    if not scored_ok:
        return None
    top = max(s for _, s in scored_ok)
    return min(r for r, s in scored_ok if s >= top / (1.0 + near_tie))


def predicted_gain(pred: Predictions, frm: float, to: float) -> float | None:
    """Relative predicted speed-up of `to` over `frm` (0.1 = 10 % faster)."""
    a, b = speedup_at(pred, frm), speedup_at(pred, to)
    if a is None or b is None or a <= 0:
        return None
    return b / a - 1.0


def effectiveness(
    pred: Predictions | None, low: float, high: float, min_gain: float, near_tie: float
) -> tuple[str, str, str]:
    """(status, reason, message) of the CompressionEffective condition."""
    if pred is None or (pred.can_help is None and not pred.usable):
        return (
            "Unknown",
            Reason.NO_PREDICTIONS,
            "the engines export no per-ratio predictions; each change is tried and measured",
        )
    if pred.can_help is False:
        return "False", cannot_help_reason(pred), _cannot_help_message(pred)
    if not pred.usable:
        return "True", Reason.PREDICTED_GAIN, "the engines say compression can help"
    best = fastest(pred, low, high, near_tie)
    base = speedup_at(pred, low)
    top = speedup_at(pred, best) if best is not None else None
    if best is None or base is None or top is None or top < base * (1.0 + min_gain):
        return (
            "False",
            Reason.NO_PREDICTED_GAIN,
            f"no ratio in [{low:g}, {high:g}] is predicted at least {min_gain:.0%} faster "
            f"than {low:g}",
        )
    return (
        "True",
        Reason.PREDICTED_GAIN,
        f"ratio {best:g} predicted {top:.2f}x the target alone, {base:.2f}x at {low:g}",
    )


def cannot_help_reason(pred: Predictions) -> str:
    """The engines' reason, else one read off the head share at the full head."""
    if pred.reason:
        return pred.reason
    share = _interpolate(pred.head_share, 0.0)
    if share is not None and share < SMALL_HEAD_SHARE:
        return Reason.HEAD_SHARE_TOO_SMALL
    return Reason.NO_PREDICTED_GAIN


def _cannot_help_message(pred: Predictions) -> str:
    share = _interpolate(pred.head_share, 0.0)
    said = "the engines say no ratio is faster than the full head"
    if share is not None:
        said += f" (the head is {share:.0%} of a draft step)"
    return said + "; holding the lowest allowed ratio (or the one predicted fastest)"
