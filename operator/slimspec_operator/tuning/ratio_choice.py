"""Which way to move the ratio, and whether the last move stays (pure).

Called by guards.decide once the data is usable, the quality guard has had its
say and neither traffic nor a replica change holds the ratio. Two sources of
direction, never an assumed one:

- the engines' predictions (predictions.py): the ratio predicted fastest
  within bounds, a lower ratio predicted no slower, and whether compression can
  help at all;
- without them, the measured effect: one step tried (the direction last
  measured faster first, else down, the safe side, then up), kept only if the
  samples after the cooldown say so.

Every latency move is a trial that `judge_trial` keeps or reverts after the
cooldown (trials.py). A move made for speed, where the engines export the totals
for the exact mean per token, is a paired trial: measured at the new ratio, then
back at the old one, and kept (moved again) only when the new ratio was faster by
more than the margin (verdict.py). A lowering because compression cannot help is
paired too, and kept unless the lower ratio was slower by more than the margin.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from slimspec_operator.tuning import predictions as rp
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning import verdict as vd
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import DOWN, UP, Basis, Outcome, Trial
from slimspec_operator.tuning.types import (
    REVERT_REASONS,
    Decision,
    Situation,
    move,
    points,
    recent_p99,
    recent_raise_still_needed,
)

_EPS = 1e-6


def judge_trial(sit: Situation, trial: Trial, last_replica_change: datetime | None) -> Decision:
    """Keep or revert the change in trial, once the cooldown has passed and
    `confirmations` samples have been taken since."""
    if trial.paired:
        return _judge_paired(sit, trial, last_replica_change)
    s = sit.s
    since = (sit.now - trial.time).total_seconds()
    what = f"{trial.from_ratio:g} -> {trial.to_ratio:g}"
    if since < s.cooldown:
        return sit.hold(Reason.HOLD_MEASURING, f"measuring {what}: {since:.0f}s of {s.cooldown:g}s")
    after_cooldown = [x for x in sit.samples if (x.time - trial.time).total_seconds() >= s.cooldown]
    p99s = recent_p99(after_cooldown, s.confirmations)
    if len(p99s) < s.confirmations:
        return sit.hold(
            Reason.HOLD_MEASURING, f"measuring {what}: {len(p99s)}/{s.confirmations} samples"
        )
    changed = last_replica_change is not None and last_replica_change > trial.time
    v = fx.judge(
        trial, p99s, sit.rate, sit.now, s.latency_target, s.dead_band, s.dead_band, changed
    )
    effect = sit.effect.learnt(v)
    if v.keep:
        return replace(sit.hold(Reason.CONFIRMED, v.message), effect=effect, verdict=v)
    back = trial.from_ratio if v.revert_to is None else v.revert_to
    effect = _backed_off(sit, effect, trial, v, back)
    back = min(max(back, s.min_ratio), s.max_ratio)
    decision = move(sit.ratio, back, REVERT_REASONS[v.outcome], v.message, effect)
    return replace(decision, verdict=v)


def _backed_off(
    sit: Situation, effect: fx.EffectMemory, trial: Trial, v: fx.Verdict, back: float
) -> fx.EffectMemory:
    """effect with the move from `back` backed off (an inconclusive trial: unchanged)."""
    if v.outcome == Outcome.INCONCLUSIVE:
        return effect
    s = sit.s
    backoffs = fx.with_backoff(
        effect.backoffs,
        back,
        trial.direction,
        sit.now,
        v.outcome,
        s.backoff_seconds,
        s.backoff_max_factor,
    )
    return replace(effect, backoffs=backoffs)


def _judge_paired(sit: Situation, trial: Trial, last_replica_change: datetime | None) -> Decision:
    """A paired trial, tick by tick: measure the new ratio's window, go back to the
    old ratio and measure it again, then the verdict (trials.judge_paired). Each
    window is as long as the one before the move: `confirmations` tick intervals
    and at least `cooldown` seconds, from the first tick after the switch."""
    s = sit.s
    what = f"{trial.from_ratio:g} -> {trial.to_ratio:g}"
    pts = points(sit.samples)
    if trial.after is None:
        after = vd.window(pts, trial.to_ratio, trial.time, s.confirmations, s.cooldown)
        if after is None:
            return _window_overdue(sit, trial) or sit.hold(
                Reason.HOLD_MEASURING, f"measuring {what}: at {trial.to_ratio:g}"
            )
        t = replace(trial, after=after, recheck_time=sit.now)
        msg = (
            f"measuring {what}: {after.mean * 1e3:.2f} ms/token at {trial.to_ratio:g}; "
            f"back to {trial.from_ratio:g} to measure it again"
        )
        return move(sit.ratio, trial.from_ratio, Reason.RECHECK, msg, replace(sit.effect, trial=t))
    again = vd.window(pts, trial.from_ratio, trial.recheck_time, s.confirmations, s.cooldown)
    if again is None:
        return _window_overdue(sit, trial) or sit.hold(
            Reason.HOLD_MEASURING, f"measuring {what}: at {trial.from_ratio:g} again"
        )
    changed = last_replica_change is not None and last_replica_change > trial.time
    v = fx.judge_paired(
        trial, again, sit.now, s.dead_band, s.tail_bands * s.dead_band, s.verdict_floor, changed
    )
    effect = sit.effect.learnt(v)
    if v.keep:
        decision = move(sit.ratio, trial.to_ratio, Reason.CONFIRMED, v.message, effect)
        return replace(decision, verdict=v)
    effect = _backed_off(sit, effect, trial, v, trial.from_ratio)
    # Already back at from_ratio: "not kept" is a hold there.
    decision = sit.hold(REVERT_REASONS[v.outcome], v.message)
    return replace(decision, effect=effect, verdict=v)


def _window_overdue(sit: Situation, trial: Trial) -> Decision | None:
    """A window that has not come together in 10 cooldowns (samples gone, no tokens,
    a cooldown longer than the samples kept) will not: the trial ends unjudged, not
    backed off; back at the old ratio, except a lowering on the safe side, which stays."""
    started = trial.recheck_time or trial.time
    waited = (sit.now - started).total_seconds()
    if waited <= sit.s.backoff_seconds:
        return None
    v = fx.unjudged(trial, sit.now, sit.rate, f"no complete window in {waited:.0f}s")
    effect = sit.effect.learnt(v)
    if v.keep:
        if trial.after is None:  # still at the new ratio
            return replace(sit.hold(Reason.CONFIRMED, v.message), effect=effect, verdict=v)
        decision = move(sit.ratio, trial.to_ratio, Reason.CONFIRMED, v.message, effect)
        return replace(decision, verdict=v)
    reason = REVERT_REASONS[Outcome.INCONCLUSIVE]
    if trial.after is None:  # still at the new ratio
        return replace(move(sit.ratio, trial.from_ratio, reason, v.message, effect), verdict=v)
    return replace(sit.hold(reason, v.message), effect=effect, verdict=v)


def choose(sit: Situation) -> Decision:
    """The move (or hold) once nothing else holds the ratio."""
    direction = _latency_direction(sit)
    pred = sit.predictions
    if pred is not None and pred.can_help is False:
        return _cannot_help(sit, pred)
    if pred is not None and pred.usable and rp.speedup_at(pred, sit.ratio) is not None:
        no_slower = _lower_no_slower(sit, pred)
        if no_slower is not None:
            return no_slower
        if isinstance(direction, Decision):
            return direction
        if direction == UP:
            return _toward_fastest(sit, pred)
        return _lower_for_headroom(sit, pred)
    if isinstance(direction, Decision):
        return direction
    if direction == UP:
        return _measured_step(sit)
    return _lower_for_headroom(sit, None)


def _latency_direction(sit: Situation) -> int | Decision:
    """UP when the last samples are all over target (p99 must come down), DOWN when
    all are under the band (headroom), else the hold that says why not."""
    s = sit.s
    lower_edge = s.latency_target * (1.0 - s.dead_band)
    recent = recent_p99(sit.samples, s.confirmations)
    confirming = f"p99 {sit.p99:.3f}s; waiting for {s.confirmations} samples"
    if recent and all(x > s.latency_target for x in recent):
        direction = UP
    elif recent and all(x < lower_edge for x in recent):
        direction = DOWN
    elif sit.p99 > s.latency_target or sit.p99 < lower_edge:
        return sit.hold(Reason.HOLD_CONFIRMING, confirming)
    else:
        band = f"p99 {sit.p99:.3f}s within [{lower_edge:.3f}, {s.latency_target:g}]s"
        return sit.hold(Reason.HOLD_BAND, band)
    if len(recent) < s.confirmations:
        return sit.hold(Reason.HOLD_CONFIRMING, confirming)
    return direction


def _cannot_help(sit: Situation, pred: rp.Predictions) -> Decision:
    """The engines say no ratio beats the full head beyond their uncertainty: go
    to the lowest allowed ratio (or the engines' best, if they name a higher one)
    and stay there; never raise. A step down that the engines' own point
    predictions put slower than here (beyond a near tie) is not taken: "cannot
    help" means no gain proven, and the ratio changes only speed, never the output,
    so there is nothing safer to buy with a slower step."""
    s = sit.s
    best = pred.best if pred.best is not None else s.min_ratio
    desired = min(max(best, s.min_ratio), s.max_ratio)
    reason = rp.cannot_help_reason(pred)
    if sit.ratio > desired + _EPS:
        if (b := sit.blocked(DOWN)) is not None:
            return _backing_off(sit, b)
        new = max(desired, sit.ratio - sit.down_step)
        here, there = rp.speedup_at(pred, sit.ratio), rp.speedup_at(pred, new)
        if here is not None and there is not None and there * (1.0 + s.near_tie) < here:
            return sit.hold(
                Reason.CANNOT_HELP,
                f"compression cannot help here ({reason}); not raising, and not lowering: "
                f"{new:g} is predicted {there:.2f}x against {here:.2f}x at {sit.ratio:g}",
            )
        msg = f"compression cannot help here ({reason}); lowering toward {desired:g}"
        # paired where the totals exist: kept unless measured slower (trials.judge_paired)
        return sit.trial(new, Reason.CANNOT_HELP, msg, Basis.ENGINES_CANNOT_HELP, paired=True)
    return sit.hold(Reason.CANNOT_HELP, f"compression cannot help here ({reason}); not raising")


def _lower_no_slower(sit: Situation, pred: rp.Predictions) -> Decision | None:
    """A lower ratio predicted at least as fast keeps more acceptance for free."""
    if sit.ratio <= sit.s.min_ratio + _EPS or sit.blocked(DOWN) is not None:
        return None
    here = rp.speedup_at(pred, sit.ratio)
    new = max(sit.s.min_ratio, sit.ratio - sit.down_step)
    there = rp.speedup_at(pred, new)
    if here is None or there is None or there < here:
        return None
    msg = f"{new:g} predicted {there:.2f}x vs {here:.2f}x at {sit.ratio:g}: no slower, safer"
    return sit.trial(new, Reason.NO_SLOWER, msg, Basis.PREDICTED)


def _toward_fastest(sit: Situation, pred: rp.Predictions) -> Decision:
    """p99 over target: one step toward the ratio predicted fastest."""
    s, ratio = sit.s, sit.ratio

    def allowed(r: float) -> bool:
        if r > ratio + _EPS:
            kept = _kept_for_raise(sit, pred, r)
            return kept is not None and kept >= s.quality_threshold and sit.blocked(UP) is None
        return r >= ratio - _EPS or sit.blocked(DOWN) is None

    here = rp.speedup_at(pred, ratio) or 0.0
    best = rp.fastest(pred, s.min_ratio, s.max_ratio, s.near_tie, allowed)
    gain = rp.predicted_gain(pred, ratio, best) if best is not None else None
    if best is None or gain is None or gain < s.min_predicted_gain:
        return _why_not_faster(sit, pred, here)
    top = rp.speedup_at(pred, best) or 0.0
    msg = (
        f"p99 {sit.p99:.3f}s > target {s.latency_target:g}s; {best:g} predicted "
        f"{top:.2f}x vs {here:.2f}x at {ratio:g}"
    )
    new = min(best, ratio + s.max_step) if best > ratio else max(best, ratio - sit.down_step)
    return sit.trial(new, Reason.ABOVE_TARGET, msg, Basis.PREDICTED, paired=True)


def _kept_for_raise(sit: Situation, pred: rp.Predictions, r: float) -> float | None:
    """The kept acceptance a raise to `r` is judged on: the engines' measurement at
    `r` where they export one, else the reading at the ratio in force (none at ratio
    0, where no subset is checked: a raise from 0 needs the engines' measurement)."""
    kept = rp.kept_at(pred, r)
    return kept if kept is not None else sit.kept


def _why_not_faster(sit: Situation, pred: rp.Predictions, here: float) -> Decision:
    """The hold when p99 is over target and no allowed ratio is predicted faster."""
    s = sit.s
    best = rp.fastest(pred, s.min_ratio, s.max_ratio, s.near_tie)
    gain = rp.predicted_gain(pred, sit.ratio, best) if best is not None else None
    if best is not None and gain is not None and gain >= s.min_predicted_gain:
        direction = UP if best > sit.ratio else DOWN
        if (b := sit.blocked(direction)) is not None:
            return _backing_off(sit, b)
        if direction == UP and _kept_for_raise(sit, pred, best) is None:
            return sit.hold(Reason.HOLD_QUALITY_UNKNOWN, "no kept-acceptance reading; not raising")
        return sit.hold(
            Reason.NO_PREDICTED_GAIN,
            f"{best:g} predicted faster but its measured kept acceptance "
            f"{rp.kept_at(pred, best)} is under {s.quality_threshold:g}",
        )
    return sit.hold(
        Reason.NO_PREDICTED_GAIN,
        f"p99 {sit.p99:.3f}s > target {s.latency_target:g}s but no ratio in "
        f"[{s.min_ratio:g}, {s.max_ratio:g}] is predicted {s.min_predicted_gain:.0%} faster "
        f"than {sit.ratio:g} ({here:.2f}x); capacity has to answer",
    )


def _measured_step(sit: Situation) -> Decision:
    """p99 over target, no predictions: try one step and let the verdict decide.
    While a recent trial says which direction is faster, only that one; else
    down (the safe side), then up."""
    s, ratio = sit.s, sit.ratio
    faster = sit.effect.faster_known(sit.now, s.backoff_seconds * s.backoff_max_factor)
    order = [faster] if faster is not None else [DOWN, UP]
    why: list[str] = [] if faster is None else [f"{fx.direction_name(faster)} measured faster"]
    reasons: list[str] = []
    for d in order:
        if d == DOWN and ratio <= s.min_ratio + _EPS:
            why.append("at min")
            reasons.append(Reason.HOLD_AT_MIN)
            continue
        if d == UP and ratio >= s.max_ratio - _EPS:
            why.append("at max")
            reasons.append(Reason.HOLD_AT_MAX)
            continue
        if (b := sit.blocked(d)) is not None:
            why.append(f"{fx.direction_name(d)} backed off until {b.until:%H:%M:%S}")
            reasons.append(Reason.HOLD_BACKING_OFF)
            continue
        if d == UP and sit.kept is None:
            why.append("no kept-acceptance reading to raise on")
            reasons.append(Reason.HOLD_QUALITY_UNKNOWN)
            continue
        new = ratio + s.max_step if d == UP else ratio - sit.down_step
        new = min(max(new, s.min_ratio), s.max_ratio)
        msg = (
            f"p99 {sit.p99:.3f}s > target {s.latency_target:g}s; no predictions: "
            f"trying {new:g} and measuring"
        )
        return sit.trial(new, Reason.ABOVE_TARGET, msg, Basis.MEASURED, paired=True)
    reason = next(
        (r for r in (Reason.HOLD_BACKING_OFF, Reason.HOLD_QUALITY_UNKNOWN) if r in reasons),
        reasons[0],
    )
    return sit.hold(reason, f"p99 {sit.p99:.3f}s above target; " + ", ".join(why))


def _lower_for_headroom(sit: Situation, pred: rp.Predictions | None) -> Decision:
    """p99 well under target: buy back the safe side, unless that would cross
    the target (predicted) or undo a raise the load still needs (anti-flap)."""
    s, ratio = sit.s, sit.ratio
    if ratio <= s.min_ratio + _EPS:
        return sit.hold(Reason.HOLD_AT_MIN, f"p99 {sit.p99:.3f}s below target, at min")
    if (b := sit.blocked(DOWN)) is not None:
        return _backing_off(sit, b)
    new = max(s.min_ratio, ratio - sit.down_step)
    if pred is not None:
        here, there = rp.speedup_at(pred, ratio), rp.speedup_at(pred, new)
        if here is not None and there is not None and there > 0:
            expected = sit.p99 * here / there
            if expected > s.latency_target:
                return sit.hold(
                    Reason.HOLD_WOULD_BREACH,
                    f"{new:g} predicted {there:.2f}x vs {here:.2f}x: p99 about "
                    f"{expected:.3f}s, over the target {s.latency_target:g}s",
                )
    # Headroom of twice the dead band: the raise is clearly no longer needed.
    far_below = sit.p99 < s.latency_target * (1.0 - 2.0 * s.dead_band)
    blocker = None if far_below else recent_raise_still_needed(sit.changes, sit.rate, s, sit.now)
    if blocker is not None:
        return sit.hold(
            Reason.HOLD_LOAD_NOT_LOWER,
            f"raised to {blocker.to_ratio:g} at {blocker.time:%H:%M:%S} under load "
            f"{blocker.request_rate} req/s; load now {sit.rate:.3g} req/s",
        )
    lower_edge = s.latency_target * (1.0 - s.dead_band)
    msg = f"p99 {sit.p99:.3f}s < {lower_edge:.3f}s"
    return sit.trial(new, Reason.BELOW_TARGET, msg, Basis.HEADROOM)


def _backing_off(sit: Situation, b: fx.BackOff) -> Decision:
    return sit.hold(
        Reason.HOLD_BACKING_OFF,
        f"moving {fx.direction_name(b.direction)} from {b.from_ratio:g} was reverted "
        f"({b.reason}, {b.count}x); not before {b.until:%H:%M:%S}",
    )
