"""The tuner's plain types: readings, settings and decisions (pure; the reasons are
reasons.py).

Shared by guards.decide (the guards), ratio_choice.py (choosing and judging a
move) and the glue that builds samples and status from them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from slimspec_operator.contract import DEFAULT_QUALITY_THRESHOLD
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning import verdict as vd
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import Basis, EffectMemory, Outcome, Trial, Verdict

REVERT_REASONS = {
    Outcome.WORSE: Reason.REVERTED_WORSE,
    Outcome.NEUTRAL: Reason.REVERTED_NO_GAIN,
    Outcome.BREACHED: Reason.REVERTED_BREACH,
    Outcome.INCONCLUSIVE: Reason.REVERTED_UNCONFIRMED,
}


def clean(value: float | None) -> float | None:
    """NaN/inf readings count as missing."""
    if value is None or not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class Sample:
    """One evaluation's metric readings. None = no data or NaN for that query."""

    time: datetime
    p99_latency: float | None = None
    request_rate: float | None = None
    kept_acceptance: float | None = None
    mean_accepted_length: float | None = None
    fallback_rate: float | None = None
    queue_depth: float | None = None
    # Cumulative totals over the pods (latency histogram's _sum, generated tokens):
    # the exact mean latency per token between two samples (verdict.py).
    latency_sum: float | None = None
    generated_tokens: float | None = None
    # The engines' per-ratio predictions; None when they export none.
    predictions: Predictions | None = None
    # Set when Prometheus could not be asked at all (unreachable, timeout,
    # HTTP or query error): (reason, message). Readings are then meaningless.
    error: tuple[str, str] | None = None
    # Per-query reason for a missing required reading ("NoData", "NotANumber").
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """One past ratio change (status.compression.history entry)."""

    time: datetime
    from_ratio: float
    to_ratio: float
    reason: str
    request_rate: float | None = None  # load when the change was made


@dataclass(frozen=True)
class TunerSettings:
    latency_target: float = 0.4
    dead_band: float = 0.1  # fraction of the target; also the trials' tolerance
    cooldown: float = 120.0  # seconds between changes; a trial is judged after it
    max_step: float = 0.05
    min_ratio: float = 0.1
    max_ratio: float = 0.5
    min_request_rate: float = 0.1
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD
    # Lowering is the safe side, so it may move faster than raising.
    down_step_factor: float = 2.0
    # Consecutive samples that must agree before a latency-driven move, and
    # samples after the cooldown that a trial's verdict averages.
    confirmations: int = 2
    # No latency-driven move this long after a replica change (capacity first).
    settle_after_scale: float = 120.0
    # A lower move right after a raise needs the load to have fallen by
    # `dead_band` since that raise, or p99 under target*(1 - 2*dead_band),
    # for this many cooldowns (anti-flap).
    reversal_window_cooldowns: float = 10.0
    # A predicted speed-up smaller than this (relative) is not worth a move.
    min_predicted_gain: float = 0.03
    # Among ratios predicted within this (relative) of the fastest, the lowest: the
    # engines' predictions for neighbouring ratios scatter by about this much.
    near_tie: float = 0.01
    # A reverted move waits this many cooldowns, doubling per repeat, up to
    # `backoff_max_factor` times that.
    backoff_cooldowns: float = 10.0
    backoff_max_factor: float = 8.0
    # A paired verdict (verdict.py) trusts no effect on the mean per token smaller
    # than this (relative), whatever its windows' spread; p99 may rise by at most
    # `tail_bands` dead bands under a move kept on the mean (bucket steps are 10-20 %).
    verdict_floor: float = vd.DEFAULT_FLOOR
    tail_bands: float = 2.0

    @property
    def backoff_seconds(self) -> float:
        return max(self.cooldown, 1.0) * self.backoff_cooldowns


@dataclass(frozen=True)
class Decision:
    ratio: float
    changed: bool
    reason: str
    message: str
    metrics_available: bool
    metrics_reason: str = Reason.METRICS_OK
    metrics_message: str = ""
    effect: EffectMemory = field(default_factory=EffectMemory)  # to remember
    verdict: Verdict | None = None  # a trial judged by this decision


def round_ratio(ratio: float) -> float:
    return round(ratio, 4)


def hold(ratio: float, reason: str, message: str, effect: EffectMemory) -> Decision:
    return Decision(ratio, False, reason, message, metrics_available=True, effect=effect)


def unavailable(ratio: float, reason: str, message: str, effect: EffectMemory) -> Decision:
    return Decision(
        ratio,
        changed=False,
        reason=reason,
        message=f"holding at {ratio:g}: {message}",
        metrics_available=False,
        metrics_reason=reason,
        metrics_message=message,
        effect=effect,
    )


def move(ratio: float, new: float, reason: str, message: str, effect: EffectMemory) -> Decision:
    return Decision(
        ratio=round_ratio(new),
        changed=round_ratio(new) != round_ratio(ratio),
        reason=reason,
        message=message,
        metrics_available=True,
        effect=effect,
    )


def metrics_problem(sample: Sample | None) -> tuple[str, str] | None:
    """Why the latest sample cannot be used, or None when it can."""
    if sample is None:
        return PromReason.NO_DATA, "no metrics sample taken yet"
    if sample.error is not None:
        return sample.error
    if clean(sample.request_rate) is None:
        reason = sample.missing.get("requestRate", PromReason.NO_DATA)
        return reason, "request rate query returned no usable value"
    return None


@dataclass(frozen=True)
class Situation:
    """What one decision knows once the data is usable (passed to the choosers)."""

    samples: Sequence[Sample]
    ratio: float
    s: TunerSettings
    now: datetime
    changes: Sequence[Change]
    effect: EffectMemory
    rate: float
    p99: float
    kept: float | None
    predictions: Predictions | None

    @property
    def down_step(self) -> float:
        return self.s.max_step * self.s.down_step_factor

    def blocked(self, direction: int) -> fx.BackOff | None:
        return fx.blocked(self.effect.backoffs, self.ratio, direction, self.now)

    def hold(self, reason: str, message: str) -> Decision:
        return hold(self.ratio, reason, message, self.effect)

    def trial(
        self, new: float, reason: str, message: str, basis: Basis, paired: bool = False
    ) -> Decision:
        """A move to be judged after the cooldown; it continues the chain of the
        last kept step when that went the same way, from here, just before.

        `paired` (a move made for speed): where the samples carry the totals for the
        exact mean per token, the trial is judged on alternated windows (verdict.py),
        and the move waits until the window before it is complete."""
        before = None
        pts = points(self.samples)
        if paired and pts and pts[-1].usable:  # both totals read: the exact mean exists
            last_change = self.changes[-1].time if self.changes else None
            before = vd.window(
                pts,
                self.ratio,
                last_change,
                self.s.confirmations,
                self.s.cooldown,
                latest=True,
            )
            if before is None:
                return self.hold(
                    Reason.HOLD_MEASURING,
                    f"measuring {self.ratio:g} before moving to {round_ratio(new):g}: "
                    f"{self.s.confirmations} intervals over {self.s.cooldown:g}s since the "
                    "last change",
                )
        recent = recent_p99(self.samples, self.s.confirmations) or [self.p99]
        p99_before, to = sum(recent) / len(recent), round_ratio(new)
        t = Trial(self.now, self.ratio, to, basis, p99_before, self.rate)
        last = self.effect.last
        if (
            last is not None
            and last.keep
            and last.trial.basis == basis != Basis.HEADROOM
            and last.trial.direction == t.direction
            and abs(last.trial.to_ratio - self.ratio) < 1e-6
            and (self.now - last.time).total_seconds() <= 2 * max(self.s.cooldown, 1.0)
        ):
            t = last.trial.next(self.now, to, p99_before, self.rate)
        if before is not None:
            t = replace(t, before=before)
        return move(self.ratio, new, reason, message, replace(self.effect, trial=t))


def points(samples: Sequence[Sample]) -> list[vd.Point]:
    """Samples as the windows read them (a failed one carries no totals)."""
    out = []
    for x in samples:
        ok = x.error is None
        out.append(
            vd.Point(
                x.time,
                clean(x.latency_sum) if ok else None,
                clean(x.generated_tokens) if ok else None,
                clean(x.p99_latency) if ok else None,
                clean(x.request_rate) if ok else None,
            )
        )
    return out


def recent_p99(samples: Sequence[Sample], count: int) -> list[float]:
    """p99 of the last `count` samples, stopping at the first gap (error or no reading)."""
    out: list[float] = []
    for x in reversed(samples):
        p99 = clean(x.p99_latency)
        if len(out) == count or x.error is not None or p99 is None:
            break
        out.append(p99)
    return out


def recent_raise_still_needed(
    changes: Sequence[Change], rate: float, s: TunerSettings, now: datetime
) -> Change | None:
    """A recent latency raise whose load has not fallen since: lowering would undo it."""
    window = timedelta(seconds=s.cooldown * s.reversal_window_cooldowns)
    for c in reversed(changes):
        if now - c.time > window:
            return None
        if c.reason != Reason.ABOVE_TARGET or c.to_ratio <= c.from_ratio:
            continue
        if c.request_rate is None or rate > c.request_rate * (1.0 - s.dead_band):
            return c
        return None
    return None
