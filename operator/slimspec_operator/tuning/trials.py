"""Each ratio change as a trial, judged on what happened after it (pure).

The tuner does not assume which way the ratio moves latency: whether a larger
ratio is faster depends on the head's share of a draft step and on how much
acceptance the smaller head loses on the traffic at hand. So a change made to
speed the service up (or to buy headroom) is a `Trial`: p99 and the request rate
before it are recorded, and once the cooldown has passed `judge` compares them
with the samples taken since. A change that made latency worse is reverted and
the same move is backed off (`BackOff`), for longer each time it fails again.

Where the engines export the counters for it, a move made to speed the service up,
and a lowering the engines ask for because compression cannot help, is judged
instead on the exact mean latency per generated token over alternated windows
(verdict.py): the trial then also goes back to the old ratio for a second window
before its verdict (`Trial.before`, `after`, `recheck_time`; `judge_paired`). The
move for speed is kept only when faster by more than the margin; the lowering
unless slower by more.

Everything here is plain data and arithmetic; guards.decide calls it and the
status documents carry it between ticks (status.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum, unique

from slimspec_operator.tuning import verdict as vd
from slimspec_operator.tuning.verdict import Paired, Window

UP, DOWN = 1, -1


@unique
class Basis(StrEnum):
    """Why a change was made (Trial.basis)."""

    PREDICTED = "predicted"  # the engines' predictions chose it
    MEASURED = "measured"  # no predictions: one step tried, kept only if it helps
    HEADROOM = "headroom"  # p99 well under target: lowered, the safe side
    # The engines say compression cannot help: lowered (the decision's reason is
    # Reason.CANNOT_HELP, a different word in a different list).
    ENGINES_CANNOT_HELP = "cannotHelp"


@unique
class Outcome(StrEnum):
    """What the samples after the change showed (Verdict.outcome)."""

    IMPROVED = "Improved"
    NEUTRAL = "Neutral"
    WORSE = "Worse"
    BREACHED = "TargetBreached"
    INCONCLUSIVE = "Inconclusive"


BACKOFFS_KEPT = 8
_EPS = 1e-6


@dataclass(frozen=True)
class Trial:
    """A change awaiting its verdict.

    Steps in one direction, each kept, form a chain; `origin_*` is where the
    chain started, so steps each too small to measure cannot add up to a slower
    service unnoticed.
    """

    time: datetime
    from_ratio: float
    to_ratio: float
    basis: Basis
    p99_before: float  # mean of the samples that decided the change
    rate_before: float  # request rate when it was made
    origin_ratio: float | None = None  # None: this change starts its chain
    p99_origin: float | None = None
    rate_origin: float | None = None
    # A paired trial (verdict.py): the window at from_ratio before the move, the one
    # at to_ratio after it, and when the ratio went back to from_ratio to measure it
    # again. None for a trial judged on p99 alone.
    before: Window | None = None
    after: Window | None = None
    recheck_time: datetime | None = None

    @property
    def direction(self) -> int:
        return UP if self.to_ratio > self.from_ratio else DOWN

    @property
    def paired(self) -> bool:
        return self.before is not None

    @property
    def safe_side(self) -> bool:
        """A lowering the engines asked for (compression cannot help): a paired
        verdict keeps it unless it was measured slower."""
        return self.basis == Basis.ENGINES_CANNOT_HELP and self.direction == DOWN

    @property
    def in_force(self) -> float:
        """The ratio this trial has set now (back at from_ratio while rechecking)."""
        return self.from_ratio if self.recheck_time is not None else self.to_ratio

    @property
    def origin(self) -> tuple[float, float, float]:
        """(ratio, p99, request rate) where the chain started."""
        if self.origin_ratio is None or self.p99_origin is None or self.rate_origin is None:
            return self.from_ratio, self.p99_before, self.rate_before
        return self.origin_ratio, self.p99_origin, self.rate_origin

    def next(self, time: datetime, to_ratio: float, p99: float, rate: float) -> Trial:
        """The next step of this chain (after this one was kept)."""
        origin_ratio, p99_origin, rate_origin = self.origin
        return Trial(
            time, self.to_ratio, to_ratio, self.basis, p99, rate,
            origin_ratio, p99_origin, rate_origin,
        )  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    trial: Trial
    time: datetime
    outcome: Outcome
    keep: bool
    p99_after: float
    rate_after: float
    message: str
    revert_to: float | None = None  # the ratio to go back to when not kept
    again: Window | None = None  # a paired trial's second window at from_ratio
    paired: Paired | None = None  # and its comparison


@dataclass(frozen=True)
class BackOff:
    """A move (from a ratio, in a direction) not to try again before `until`."""

    from_ratio: float
    direction: int
    until: datetime
    count: int  # reverts of this move in a row; each doubles the wait
    reason: str


@dataclass(frozen=True)
class EffectMemory:
    """The trial in progress, the last verdict, the moves backed off, and the
    direction the last conclusive trial found faster (and when)."""

    trial: Trial | None = None
    last: Verdict | None = None
    backoffs: tuple[BackOff, ...] = ()
    faster: int | None = None
    faster_time: datetime | None = None

    def learnt(self, verdict: Verdict) -> EffectMemory:
        """After `verdict`: no trial, the verdict remembered, and the faster
        direction updated when the verdict says which it is."""
        faster, when = self.faster, self.faster_time
        if verdict.outcome == Outcome.IMPROVED:
            faster, when = verdict.trial.direction, verdict.time
        elif verdict.outcome in (Outcome.WORSE, Outcome.BREACHED):
            faster, when = -verdict.trial.direction, verdict.time
        return EffectMemory(None, verdict, self.backoffs, faster, when)

    def faster_known(self, now: datetime, max_age_seconds: float) -> int | None:
        """The direction measured faster, while that measurement is recent."""
        if self.faster is None or self.faster_time is None:
            return None
        if (now - self.faster_time).total_seconds() > max_age_seconds:
            return None
        return self.faster


def direction_name(direction: int) -> str:
    return "up" if direction == UP else "down"


def _compare(after: float, before: float, rate_before: float, rate_after: float,
             tolerance: float, load_band: float) -> tuple[Outcome, str]:  # fmt: skip
    change = after / max(before, _EPS) - 1.0
    load_up = rate_after > rate_before * (1.0 + load_band)
    load_down = rate_after < rate_before * (1.0 - load_band)
    if change > tolerance and not load_up:
        return Outcome.WORSE, "p99 rose while the load did not"
    if change < -tolerance and not load_down:
        return Outcome.IMPROVED, "p99 fell while the load did not"
    if abs(change) <= tolerance:
        return Outcome.NEUTRAL, f"p99 moved less than {tolerance:.0%}"
    return Outcome.INCONCLUSIVE, "p99 moved with the load"


def judge(
    trial: Trial,
    p99_after: Sequence[float],
    rate_after: float,
    now: datetime,
    target: float,
    tolerance: float,
    load_band: float,
    replicas_changed: bool = False,
) -> Verdict:
    """Keep or revert `trial`, from the p99s measured since the cooldown.

    Worse = p99 up by more than `tolerance` (relative) while the request rate did
    not grow by more than `load_band` (more load would explain it), against the
    p99 before this step or before the first step of its chain (then the whole
    chain is undone). Improved = p99 down by more than `tolerance` while the rate
    did not fall by more than `load_band`. A change to buy headroom is reverted
    only when p99 crossed the target; a step tried without predictions is kept
    only when it improved p99.
    """
    after = sum(p99_after) / len(p99_after)
    revert_to = trial.from_ratio
    if replicas_changed:
        outcome, why = Outcome.INCONCLUSIVE, "the replica count changed during the trial"
    elif trial.basis == Basis.HEADROOM:
        outcome, why = _compare(
            after, trial.p99_before, trial.rate_before, rate_after, tolerance, load_band
        )
        if after > target:
            outcome, why = Outcome.BREACHED, f"p99 rose over the target {target:g}s"
    else:
        outcome, why = _compare(
            after, trial.p99_before, trial.rate_before, rate_after, tolerance, load_band
        )
        origin_ratio, p99_origin, rate_origin = trial.origin
        chain, _ = _compare(after, p99_origin, rate_origin, rate_after, tolerance, load_band)
        if outcome != Outcome.WORSE and chain == Outcome.WORSE and origin_ratio != trial.from_ratio:
            outcome, revert_to = Outcome.WORSE, origin_ratio
            why = f"p99 rose since the first step of these, from {origin_ratio:g}"
    if trial.basis == Basis.HEADROOM:
        keep = outcome != Outcome.BREACHED
    elif trial.basis == Basis.MEASURED and trial.direction == UP:
        keep = outcome == Outcome.IMPROVED  # a larger ratio must earn its risk to acceptance
    else:
        keep = outcome != Outcome.WORSE
    change = after / max(trial.p99_before, _EPS) - 1.0
    message = (
        f"{trial.from_ratio:g} -> {trial.to_ratio:g}: p99 {trial.p99_before:.3f}s -> "
        f"{after:.3f}s ({change:+.0%}), load {trial.rate_before:.3g} -> {rate_after:.3g} "
        f"req/s: {why}"
    )
    return Verdict(
        trial, now, outcome, keep, after, rate_after, message, None if keep else revert_to
    )


_OUTCOMES = {
    vd.BETTER: Outcome.IMPROVED,
    vd.WORSE: Outcome.WORSE,
    vd.HELD: Outcome.NEUTRAL,
    vd.WITH_LOAD: Outcome.INCONCLUSIVE,
}


def judge_paired(
    trial: Trial,
    again: Window,
    now: datetime,
    load_band: float,
    tail_band: float,
    floor: float = vd.DEFAULT_FLOOR,
    replicas_changed: bool = False,
) -> Verdict:
    """Keep a paired trial only when its ratio was faster by more than the margin
    (verdict.rule), with the second window at the old ratio in hand. The ratio is
    then back at from_ratio, so "not kept" (worse, held, inconclusive) leaves it
    there; kept moves it to to_ratio again."""
    assert trial.before is not None and trial.after is not None
    p = vd.compare(trial.before, trial.after, again, floor)
    what, why = vd.rule(p, load_band, tail_band)
    outcome = _OUTCOMES[what]
    if replicas_changed:
        outcome, why = Outcome.INCONCLUSIVE, "the replica count changed during the trial"
    # A move for speed must earn its place; a lowering on the safe side (the engines
    # say compression cannot help) stays unless it was measured slower.
    keep = outcome != Outcome.WORSE if trial.safe_side else outcome == Outcome.IMPROVED
    ms = 1e3
    message = (
        f"{trial.from_ratio:g} -> {trial.to_ratio:g}: {trial.after.mean * ms:.2f} ms/token "
        f"against {trial.before.mean * ms:.2f} and {again.mean * ms:.2f} at "
        f"{trial.from_ratio:g} before and after: {why}"
    )
    return Verdict(
        trial,
        now,
        outcome,
        keep,
        trial.after.p99 if trial.after.p99 is not None else trial.p99_before,
        trial.after.rate if trial.after.rate is not None else trial.rate_before,
        message,
        None if keep else trial.from_ratio,
        again,
        p,
    )


def unjudged(trial: Trial, now: datetime, rate: float, why: str) -> Verdict:
    """A paired trial ended without its windows: inconclusive; not kept, unless it
    lowered the ratio on the safe side."""
    keep = trial.safe_side
    message = f"{trial.from_ratio:g} -> {trial.to_ratio:g}: {why}" + (
        "; a lowering on the safe side stays" if keep else ""
    )
    revert_to = None if keep else trial.from_ratio
    return Verdict(
        trial, now, Outcome.INCONCLUSIVE, keep, trial.p99_before, rate, message, revert_to
    )


def blocked(
    backoffs: Sequence[BackOff], ratio: float, direction: int, now: datetime
) -> BackOff | None:
    """The back-off that forbids moving `direction` from `ratio` now, if any."""
    for b in backoffs:
        if b.direction == direction and abs(b.from_ratio - ratio) < _EPS and now < b.until:
            return b
    return None


def with_backoff(
    backoffs: Sequence[BackOff],
    from_ratio: float,
    direction: int,
    now: datetime,
    reason: str,
    base_seconds: float,
    max_factor: float,
) -> tuple[BackOff, ...]:
    """`backoffs` plus a reverted move, waiting twice as long as the last time
    it failed (up to `max_factor` times `base_seconds`)."""
    same = [
        b for b in backoffs if b.direction == direction and abs(b.from_ratio - from_ratio) < _EPS
    ]
    count = (same[0].count + 1) if same else 1
    wait = min(base_seconds * 2.0 ** (count - 1), base_seconds * max_factor)
    new = BackOff(from_ratio, direction, now + timedelta(seconds=wait), count, reason)
    forget = timedelta(seconds=base_seconds * max_factor)
    kept = [b for b in backoffs if b not in same and now - b.until < forget]
    return (*kept, new)[-BACKOFFS_KEPT:]


def pruned(
    backoffs: Sequence[BackOff], now: datetime, base_seconds: float, max_factor: float
) -> tuple[BackOff, ...]:
    """Back-offs still worth remembering (an expired one keeps its count a while)."""
    forget = timedelta(seconds=base_seconds * max_factor)
    return tuple(b for b in backoffs if now - b.until < forget)
