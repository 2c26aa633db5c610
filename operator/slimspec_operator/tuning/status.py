"""status.compression as the tuner reads and writes it (pure).

The tuner keeps in status what must survive an operator restart: the change
history (cooldown, anti-flap), the change being measured and the last verdict
(ratio_effect.Trial / Verdict), the moves backed off and the direction last
measured faster. This module turns those documents into the tuner's types and
back, and builds the whole status.compression after a decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from slimspec_operator.kube.conditions import format_time, parse_time
from slimspec_operator.rollout.reasons import Reason as SeedReason
from slimspec_operator.tuning import predictions as rp
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import BackOff, Basis, EffectMemory, Outcome, Trial, Verdict
from slimspec_operator.tuning.types import Change, Decision, Sample, clean
from slimspec_operator.tuning.verdict import Paired, Window

E = TypeVar("E", bound=StrEnum)

HISTORY_LIMIT = 20  # status.compression.history entries kept
_DIRECTIONS = {"up": fx.UP, "down": fx.DOWN}


def parse(value: Any) -> datetime | None:
    try:
        return parse_time(value) if isinstance(value, str) and value else None
    except ValueError:
        return None


def _num(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _enum(kind: type[E], value: Any) -> E | None:
    """A word read back from status as its enum; None for one this version does not know."""
    try:
        return kind(value)
    except ValueError:
        return None


def _compact(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if v is not None}


# ------------------------------------------------------------------ history


def changes_from_status(compression: Mapping[str, Any]) -> list[Change]:
    """History entries as tuner Changes (oldest first).

    The load at the last raise is also kept in `lastRaise`, at a level the CRD
    does not prune, in case the history items' schema drops `requestRate`.
    """
    last_raise = compression.get("lastRaise") or {}
    out = []
    for h in compression.get("history") or []:
        t = parse(h.get("time"))
        if t is None:
            continue
        rate = h.get("requestRate")
        if rate is None and h.get("time") == last_raise.get("time"):
            rate = last_raise.get("requestRate")
        out.append(
            Change(
                time=t,
                from_ratio=float(h.get("from", 0.0)),
                to_ratio=float(h.get("to", 0.0)),
                reason=str(h.get("reason", "")),
                request_rate=float(rate) if rate is not None else None,
            )
        )
    return out


# ------------------------------------------------------------------ trials


def _trial_doc(t: Trial) -> dict[str, Any]:
    doc = {
        "time": format_time(t.time),
        "from": t.from_ratio,
        "to": t.to_ratio,
        "basis": t.basis,
        "p99BeforeSeconds": _num(t.p99_before),
        "requestRateBefore": _num(t.rate_before),
    }
    if t.origin_ratio is not None:
        doc |= {
            "originRatio": t.origin_ratio,
            "p99OriginSeconds": _num(t.p99_origin),
            "requestRateOrigin": _num(t.rate_origin),
        }
    windows = [_window_doc("before", t.before), _window_doc("after", t.after)]
    if any(windows):
        doc["windows"] = [w for w in windows if w]
    if t.recheck_time is not None:
        doc["recheckTime"] = format_time(t.recheck_time)
    return doc


def _window_doc(role: str, w: Window | None) -> dict[str, Any]:
    if w is None:
        return {}
    return _compact(
        {
            "role": role,
            "ratio": w.ratio,
            "start": format_time(w.start),
            "end": format_time(w.end),
            "secondsPerToken": round(w.mean, 9),
            "parts": [round(x, 9) for x in w.parts],
            "p99Seconds": _num(w.p99),
            "requestRate": _num(w.rate),
        }
    )


def _windows(docs: Any) -> dict[str, Window]:
    """A trial's windows by role; one this version cannot read is left out."""
    out: dict[str, Window] = {}
    for d in docs if isinstance(docs, list) else []:
        if not isinstance(d, Mapping):
            continue
        ratio, mean = _float(d.get("ratio")), _float(d.get("secondsPerToken"))
        start, end = parse(d.get("start")), parse(d.get("end"))
        parts = [_float(x) for x in d.get("parts") or []]
        if ratio is None or mean is None or start is None or end is None or not parts:
            continue
        if any(x is None for x in parts):
            continue
        out[str(d.get("role"))] = Window(
            ratio,
            start,
            end,
            mean,
            tuple(x for x in parts if x is not None),
            _float(d.get("p99Seconds")),
            _float(d.get("requestRate")),
        )
    return out


def _trial(doc: Any) -> Trial | None:
    if not isinstance(doc, Mapping):
        return None
    t, frm, to = parse(doc.get("time")), _float(doc.get("from")), _float(doc.get("to"))
    p99, rate = _float(doc.get("p99BeforeSeconds")), _float(doc.get("requestRateBefore"))
    if t is None or frm is None or to is None or p99 is None or rate is None:
        return None
    basis = _enum(Basis, doc.get("basis", Basis.PREDICTED))
    if basis is None:
        return None
    o_ratio, o_p99, o_rate = (
        _float(doc.get(k)) for k in ("originRatio", "p99OriginSeconds", "requestRateOrigin")
    )
    trial = Trial(t, frm, to, basis, p99, rate)
    if o_ratio is not None and o_p99 is not None and o_rate is not None:
        trial = replace(trial, origin_ratio=o_ratio, p99_origin=o_p99, rate_origin=o_rate)
    windows = _windows(doc.get("windows"))
    if "before" in windows:  # a paired trial; without its first window it is unjudgeable
        recheck = parse(doc.get("recheckTime"))
        after = windows.get("after")
        if (after is None) != (recheck is None):
            return None
        trial = replace(trial, before=windows["before"], after=after, recheck_time=recheck)
    return trial


def _verdict_doc(v: Verdict) -> dict[str, Any]:
    doc = _trial_doc(v.trial) | {
        "judgedTime": format_time(v.time),
        "outcome": v.outcome,
        "kept": v.keep,
        "p99AfterSeconds": _num(v.p99_after),
        "requestRateAfter": _num(v.rate_after),
        "message": v.message,
    }
    if v.again is not None:
        doc["windows"] = [*doc.get("windows", []), _window_doc("again", v.again)]
    if v.paired is not None:
        doc["meanEffect"] = _num(v.paired.effect)
        doc["meanMargin"] = _num(v.paired.margin) if math.isfinite(v.paired.margin) else None
    return doc


def _verdict(doc: Any) -> Verdict | None:
    trial = _trial(doc)
    if trial is None or not isinstance(doc, Mapping):
        return None
    when = parse(doc.get("judgedTime"))
    after, rate = _float(doc.get("p99AfterSeconds")), _float(doc.get("requestRateAfter"))
    if when is None or after is None or rate is None:
        return None
    outcome, keep = _enum(Outcome, doc.get("outcome")), bool(doc.get("kept", True))
    if outcome is None:
        return None
    again = _windows(doc.get("windows")).get("again")
    message = str(doc.get("message", ""))
    return Verdict(
        trial, when, outcome, keep, after, rate, message, again=again, paired=_paired(doc)
    )


def _paired(doc: Mapping[str, Any]) -> Paired | None:
    """A paired verdict's effect and margin as its status recorded them (the rest of the
    comparison is not kept). Without this the next tick's apply, which writes what it
    read back, dropped meanEffect and meanMargin one tick after the verdict."""
    effect = _float(doc.get("meanEffect"))
    if effect is None:
        return None
    margin = _float(doc.get("meanMargin"))
    return Paired(effect, math.inf if margin is None else margin, math.nan, 0, None, None)


def _backoff_doc(b: BackOff) -> dict[str, Any]:
    return {
        "from": b.from_ratio,
        "direction": fx.direction_name(b.direction),
        "until": format_time(b.until),
        "count": b.count,
        "reason": b.reason,
    }


def _backoffs(docs: Any) -> tuple[BackOff, ...]:
    out = []
    for d in docs if isinstance(docs, list) else []:
        if not isinstance(d, Mapping):
            continue
        frm, until = _float(d.get("from")), parse(d.get("until"))
        direction = _DIRECTIONS.get(str(d.get("direction")))
        if frm is None or until is None or direction is None:
            continue
        count = int(_float(d.get("count")) or 1)
        out.append(BackOff(frm, direction, until, count, str(d.get("reason", ""))))
    return tuple(out)


def effect_from_status(compression: Mapping[str, Any]) -> EffectMemory:
    """The trial in progress, last verdict, back-offs and measured direction."""
    faster = compression.get("measuredFaster") or {}
    direction = _DIRECTIONS.get(str(faster.get("direction"))) if faster else None
    return EffectMemory(
        trial=_trial(compression.get("trial")),
        last=_verdict(compression.get("lastTrial")),
        backoffs=_backoffs(compression.get("backoff")),
        faster=direction,
        faster_time=parse(faster.get("time")) if direction is not None else None,
    )


def effect_status(effect: EffectMemory) -> dict[str, Any]:
    """The status fields that carry `effect` (a field absent here is removed by the apply)."""
    out: dict[str, Any] = {}
    if effect.trial is not None:
        out["trial"] = _compact(_trial_doc(effect.trial))
    if effect.last is not None:
        out["lastTrial"] = _compact(_verdict_doc(effect.last))
    if effect.backoffs:
        out["backoff"] = [_backoff_doc(b) for b in effect.backoffs]
    if effect.faster is not None and effect.faster_time is not None:
        out["measuredFaster"] = {
            "direction": fx.direction_name(effect.faster),
            "time": format_time(effect.faster_time),
        }
    return out


# ------------------------------------------------------------------ predictions


def predictions_status(pred: rp.Predictions, ratio: float) -> dict[str, Any]:
    rows = []
    for r in sorted(set(pred.speedup) | set(pred.kept) | set(pred.head_share)):
        row = {
            "ratio": r,
            "speedup": _num(pred.speedup.get(r)),
            "keptAcceptance": _num(pred.kept.get(r)),
            "headShare": _num(pred.head_share.get(r)),
        }
        rows.append(_compact(row))
    doc = {
        "canHelp": pred.can_help,
        "reason": rp.cannot_help_reason(pred) if pred.can_help is False else None,
        "bestRatio": _num(pred.best),
        "speedupAtRatio": _num(rp.speedup_at(pred, ratio)),
        "rankingAgeSeconds": _num(pred.ranking_age),
        "rankingCoverage": _num(pred.ranking_coverage),
        "ratios": rows or None,
    }
    return _compact(doc)


# ------------------------------------------------------------------ the document


def compression_status(
    old: Mapping[str, Any],
    ratio: float,
    decision: Decision,
    sample: Sample,
    now: datetime,
    dry_run: bool,
) -> dict[str, Any]:
    """status.compression after a decision: history grows only on a change."""
    history = list(old.get("history") or [])
    out: dict[str, Any] = {
        "ratio": ratio,
        "reason": old.get("reason", SeedReason.INITIAL),
        "history": history,
    }
    for key in ("lastChangeTime", "lastRaise"):
        if old.get(key):
            out[key] = old[key]
    if decision.changed and not dry_run:
        entry = {
            "time": format_time(now),
            "from": ratio,
            "to": decision.ratio,
            "reason": decision.reason,
            "requestRate": _num(sample.request_rate),
            "p99LatencySeconds": _num(sample.p99_latency),
        }
        raised = decision.reason == Reason.ABOVE_TARGET and decision.ratio > ratio
        if raised and sample.request_rate is not None:
            out["lastRaise"] = {"time": entry["time"], "requestRate": entry["requestRate"]}
        out.update(
            ratio=decision.ratio,
            reason=decision.reason,
            lastChangeTime=format_time(now),
            history=[*history, _compact(entry)][-HISTORY_LIMIT:],
        )
    # A dry run changes nothing, so it measures nothing either: the old record stands.
    out |= effect_status(effect_from_status(old) if dry_run else decision.effect)
    out["lastDecision"] = {
        "time": format_time(now),
        "reason": decision.reason,
        "message": decision.message,
        "dryRun": dry_run,
        **({"proposedRatio": decision.ratio} if dry_run and decision.changed else {}),
    }
    observed = {
        "p99LatencySeconds": _num(clean(sample.p99_latency)),
        "requestRate": _num(clean(sample.request_rate)),
        "keptAcceptance": _num(clean(sample.kept_acceptance)),
        "meanAcceptedLength": _num(clean(sample.mean_accepted_length)),
        "fallbackRate": _num(clean(sample.fallback_rate)),
    }
    out["observed"] = _compact(observed)
    if sample.predictions is not None:
        out["predictions"] = predictions_status(sample.predictions, out["ratio"])
    elif sample.error is not None and old.get("predictions"):
        out["predictions"] = old["predictions"]  # Prometheus down: keep the last reading
    return out
