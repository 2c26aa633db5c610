"""Latency-driven choice of the compression ratio: a pure function.

`decide(samples, ratio, settings, now, changes, last_replica_change, effect)`
looks at the most recent metric samples, the record of past ratio changes and
what earlier changes were measured to do (`effect`), and returns the ratio to use
next and why. No I/O, no clock: the caller passes `now`.

No direction is assumed. A larger ratio makes the draft's head cheaper but can
cost acceptance, and where the head is a small share of a draft step it is
slower. In this order:

1. a ratio outside the bounds moves into them;
2. no usable metrics: hold (and say why);
3. kept acceptance < threshold: lower fast, ignoring cooldown (quality guard);
4. too little traffic, or settling after a replica change: hold;
5. a change awaiting its verdict is judged once the cooldown has passed, and
   kept or reverted on the p99 measured since (trials.py), or, for a move made for
   speed where the engines export the totals, on the exact mean latency per token
   over alternated windows: new ratio, old ratio again, then the verdict
   (verdict.py);
6. cooldown: hold;
7. the move itself (ratio_choice.py): toward the ratio the engines predict
   fastest, or, without predictions, one step tried and measured; down to the
   lowest allowed ratio where the engines say compression cannot help; headroom
   bought back on the safe side when p99 is well under target.

This module holds the guards; the types and reasons live in tuning/types.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.ratio_choice import choose, judge_trial
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import EffectMemory
from slimspec_operator.tuning.types import (
    Change,
    Decision,
    Sample,
    Situation,
    TunerSettings,
    clean,
    hold,
    metrics_problem,
    move,
    unavailable,
)


def decide(
    samples: Sequence[Sample],
    ratio: float,
    settings: TunerSettings,
    now: datetime,
    changes: Sequence[Change] = (),
    last_replica_change: datetime | None = None,
    effect: EffectMemory | None = None,
) -> Decision:
    """Next compression ratio. `samples` and `changes` are oldest first."""
    s = settings
    low, high = s.min_ratio, s.max_ratio
    effect = effect or EffectMemory()
    effect = replace(
        effect, backoffs=fx.pruned(effect.backoffs, now, s.backoff_seconds, s.backoff_max_factor)
    )
    if ratio < low or ratio > high:
        new = min(max(ratio, low), high)
        msg = f"ratio {ratio:g} outside [{low:g}, {high:g}]"
        return move(ratio, new, Reason.OUTSIDE_BOUNDS, msg, replace(effect, trial=None))

    latest = samples[-1] if samples else None
    problem = metrics_problem(latest)
    if problem is not None or latest is None:
        return unavailable(ratio, *(problem or (PromReason.NO_DATA, "")), effect)
    kept = clean(latest.kept_acceptance)

    # Quality guard: safety first, ignores cooldown, traffic and any trial.
    if kept is not None and kept < s.quality_threshold:
        if ratio <= low:
            msg = f"kept acceptance {kept:.3f} below threshold, at min"
            return hold(ratio, Reason.HOLD_AT_MIN, msg, effect)
        new = max(low, ratio - s.max_step * s.down_step_factor)
        msg = f"kept acceptance {kept:.3f} < {s.quality_threshold:g}"
        return move(ratio, new, Reason.QUALITY_GUARD, msg, replace(effect, trial=None))

    rate = clean(latest.request_rate) or 0.0
    if rate < s.min_request_rate:
        msg = f"request rate {rate:.3g}/s < {s.min_request_rate:g}/s"
        return hold(ratio, Reason.HOLD_LOW_TRAFFIC, msg, effect)
    p99 = clean(latest.p99_latency)
    if p99 is None:
        reason = latest.missing.get("p99Latency", PromReason.NO_DATA)
        return unavailable(ratio, reason, "p99 latency query returned no usable value", effect)

    if last_replica_change is not None:
        since = (now - last_replica_change).total_seconds()
        if since < s.settle_after_scale:
            msg = f"replicas changed {since:.0f}s ago; letting them settle"
            return hold(ratio, Reason.SETTLING_AFTER_SCALE, msg, effect)

    sit = Situation(samples, ratio, s, now, changes, effect, rate, p99, kept, latest.predictions)
    trial = effect.trial
    if trial is not None and abs(trial.in_force - ratio) < 1e-6:
        return judge_trial(sit, trial, last_replica_change)
    if trial is not None:  # the ratio was set by someone else since: nothing to judge
        sit = replace(sit, effect=replace(effect, trial=None))

    last = changes[-1] if changes else None
    if last is not None:
        since = (now - last.time).total_seconds()
        if since < s.cooldown:
            return sit.hold(Reason.HOLD_COOLDOWN, f"last change {since:.0f}s ago")
    return choose(sit)
