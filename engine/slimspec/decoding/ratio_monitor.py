"""The decoder's measurements of what each ratio costs and buys, and its latest report.

Measured: the head's time per ratio (micro-timed at warm-up for a few batch sizes,
each run from a cold cache as in service, then scaled by what the head at the ratio in
force takes in service), the draft body's time per forward (a draft forward minus its
head), the rest of a step (its wall time minus the draft phase and the verification),
the decoder-wide acceptance and, from the shadow check, the kept acceptance of every
ratio. ratio_model.py turns these into the per-ratio predictions the server exports and
the operator's tuner reads.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from slimspec.decoding.adaptive import AcceptanceEstimate
from slimspec.decoding.quality import RATIO_LADDER
from slimspec.decoding.ratio_model import (
    PRIOR_KEPT_SE,
    Acceptance,
    Assessment,
    RatioPoint,
    StepCosts,
    assess,
    kept_standard_error,
    material_change,
    predict,
)
from slimspec.draft_head.head import DraftHead, HeadConfig

log = logging.getLogger("slimspec.ratios")

REPORT_EVERY = 16  # steps between two predictions
MATERIAL_CHANGE = 0.05  # a predicted speed-up moving by this much (relative) is logged
MICRO_ROWS = (1, 8)  # batch sizes the head is micro-timed at


@dataclass(frozen=True)
class RatioReport:
    """One prediction of every served ratio, as the server exports it."""

    points: Mapping[float, RatioPoint]
    kept_measured: Mapping[float, float]  # the shadow check's kept share, measured ratios only
    assessment: Assessment
    rows: int
    alpha_full: float
    created: float = field(default_factory=time.time)


def cache_flush(head: DraftHead) -> Callable[[], None] | None:
    """A read of as many bytes as the head's rows hold in the draft dtype, about what a
    draft forward (body and head) streams through the caches between two head calls in
    service; None off the CPU.

    Why: timed back to back, a head reads its rows from a warm cache. On a Xeon with a
    260 MB L3 the ratio-0.9 head then took half its service time and the full head
    0.85-1.0 of it, so the one service scale HeadTimes learns could not fit both: learnt
    at 0.9 (about 2.1), it put the full head at 1.7x its real time and the gain of 0.9
    over 0 at +10-14% where +3% was served. Timed after this read, the scale learnt at
    0.9 is 1.1-1.3 and that prediction +7-9% (the rest of the gap is not the head's).
    """
    w = head.ranked_weight
    if w.device.type != "cpu":
        return None
    buf = torch.ones(max(1, w.numel() * w.element_size() // 8), dtype=torch.int64)

    def flush() -> None:
        buf.sum()  # the read is the point, the sum is thrown away

    return flush


def time_heads(
    head: DraftHead,
    cfgs: Mapping[float, HeadConfig],
    rows: int,
    clock: Callable[[], float],
    reps: int = 3,
    flush: Callable[[], None] | None = None,
) -> dict[float, float]:
    """Seconds of one scoring of `rows` hidden states by each ratio's head (the least of
    `reps` runs after one untimed call: a micro-benchmark's noise only ever adds), each
    timed run after `flush` where given (cache_flush: cold, as in service)."""
    dtype = head.ranked_weight.dtype
    h = torch.randn(rows, head.hidden, device=head.ranked_weight.device).to(dtype)
    out = {}
    with torch.inference_mode():
        for r, cfg in cfgs.items():
            head.logits(h, cfg)
            best = float("inf")
            for _ in range(reps):
                if flush is not None:
                    flush()
                t0 = clock()
                head.logits(h, cfg)
                best = min(best, clock() - t0)
            out[r] = best
    return out


class HeadTimes:
    """Head seconds per ratio: micro-timings at a few batch sizes, interpolated in the
    number of rows, times a scale learnt online from the head at the ratio in force
    (the machine's speed drifts; the micro-timing was taken once)."""

    def __init__(self) -> None:
        self.micro: dict[int, dict[float, float]] = {}
        self.scale = 1.0

    def set_micro(self, rows: int, times: Mapping[float, float]) -> None:
        self.micro[rows] = dict(times)

    def at(self, rows: int) -> dict[float, float]:
        """Unscaled micro-timings for `rows` rows (linear between measured row counts)."""
        if not self.micro:
            return {}
        known = sorted(self.micro)
        if rows <= known[0] or len(known) == 1:
            lo = hi = known[0] if rows <= known[0] else known[-1]
        elif rows >= known[-1]:
            lo, hi = known[-2], known[-1]
        else:
            i = bisect.bisect_left(known, rows)
            lo, hi = known[i - 1], known[i]
        if lo == hi:
            return dict(self.micro[lo])
        w = (rows - lo) / (hi - lo)
        return {
            r: max(0.0, (1 - w) * self.micro[lo][r] + w * self.micro[hi][r])
            for r in self.micro[lo]
            if r in self.micro[hi]
        }

    def scaled(self, rows: int) -> dict[float, float]:
        return {r: s * self.scale for r, s in self.at(rows).items()}

    def refine(self, rows: int, ratio: float, seconds: float) -> None:
        micro = self.at(rows).get(ratio)
        if micro and micro > 0 and seconds > 0:
            self.scale = 0.9 * self.scale + 0.1 * min(10.0, max(0.1, seconds / micro))


class RatioMonitor:
    """Collects the measurements and makes a RatioReport every REPORT_EVERY steps."""

    def __init__(self, ratios: Sequence[float] = RATIO_LADDER) -> None:
        self.ratios = tuple(ratios)
        self.heads = HeadTimes()
        self.body: dict[int, float] = {}  # rows -> seconds per draft forward without head
        # rows -> seconds per step that are neither draft nor verification (running EMA)
        self.other: dict[int, float] = {}
        self.acceptance = AcceptanceEstimate(decay=0.98)
        self.report: RatioReport | None = None
        self.rows = 1
        self._steps = 0
        self._logged: dict[float, float] | None = None
        self._logged_best: tuple[float, bool] | None = None

    def measure_heads(
        self,
        head: DraftHead,
        cfg_for: Callable[[float], HeadConfig],
        clock: Callable[[], float],
        rows: Sequence[int] = MICRO_ROWS,
    ) -> None:
        cfgs = {r: cfg_for(r) for r in self.ratios}
        flush = cache_flush(head)
        for n in rows:
            self.heads.set_micro(n, time_heads(head, cfgs, n, clock, flush=flush))

    def observe(
        self,
        rows: int,
        ratio: float,
        forward_s: float | None,
        head_s: float | None,
        accepted: Sequence[int],
        k: int,
        other_s: float | None = None,
    ) -> bool:
        """One step: rows, the ratio in force, a draft forward's seconds and its head's
        (None when not timed), each row's accepted drafts of k, and the step's seconds
        that were neither draft nor verification (None when not measured). True when a
        new report is due."""
        self.rows = rows
        if k > 0:
            for a in accepted:
                self.acceptance.update(a, k)
        if head_s is not None:
            self.heads.refine(rows, ratio, head_s)
        if forward_s is not None:
            head = head_s if head_s is not None else self.heads.scaled(rows).get(ratio, 0.0)
            body = max(0.0, forward_s - head)
            old = self.body.get(rows)
            self.body[rows] = body if old is None else 0.8 * old + 0.2 * body
        if other_s is not None:
            other = max(0.0, other_s)  # clock jitter can make the difference negative
            old = self.other.get(rows)
            self.other[rows] = other if old is None else 0.8 * old + 0.2 * other
        self._steps += 1
        return self._steps % REPORT_EVERY == 0

    def body_seconds(self, rows: int) -> float | None:
        if not self.body:
            return None
        nearest = min(self.body, key=lambda n: (abs(n - rows), n))
        return self.body[nearest]

    def other_seconds(self, rows: int) -> float:
        """The measured rest of a step at the row count nearest `rows` (0 before any)."""
        if not self.other:
            return 0.0
        nearest = min(self.other, key=lambda n: (abs(n - rows), n))
        return self.other[nearest]

    def refresh(
        self,
        ratio_in_force: float,
        verify_line: tuple[float, float] | None,
        measured: Mapping[float, tuple[float, int]],
        prior_kept: Mapping[float, float],
        k_max: int,
        fixed_k: int | None,
        k_min: int = 1,
        single_s: float | None = None,
    ) -> RatioReport | None:
        """A new report from what was measured (None while something is missing).
        k_min 0: adaptive k may run plain target steps (single_s each, measured)."""
        body = self.body_seconds(self.rows)
        heads = self.heads.scaled(self.rows)
        if verify_line is None or body is None or not heads:
            return self.report
        kept = {0.0: 1.0}
        se = {0.0: 0.0}
        for r in heads:
            if r in measured:
                kept[r] = measured[r][0]
                se[r] = kept_standard_error(*measured[r])
            elif r > 0:
                kept[r] = prior_kept.get(r, 1.0)
                se[r] = PRIOR_KEPT_SE
        # the rows' acceptance is the ratio in force's: divide its kept share out
        alpha_full = self.acceptance.alpha / max(0.05, kept.get(ratio_in_force, 1.0))
        acc = Acceptance(alpha_full, kept, se)
        other = self.other_seconds(self.rows)
        costs = StepCosts(self.rows, body, heads, verify_line, other, single_s, k_min)
        points = predict(costs, acc, k_max, fixed_k)
        free = predict(costs, Acceptance(alpha_full, {}, dict.fromkeys(heads, 0.0)), k_max, fixed_k)
        self.report = RatioReport(
            points,
            {r: kept[r] for r in measured if r in kept},
            assess(points, free),
            self.rows,
            alpha_full,
        )
        self._log_if_changed(self.report)
        return self.report

    def _log_if_changed(self, rep: RatioReport) -> None:
        speedups = {r: p.speedup for r, p in rep.points.items()}
        best = (rep.assessment.best, rep.assessment.can_help)
        if (
            self._logged is not None
            and best == self._logged_best
            and not material_change(self._logged, speedups, MATERIAL_CHANGE)
        ):
            return
        self._logged, self._logged_best = speedups, best
        log.info("%s", describe(rep))


def describe(rep: RatioReport) -> str:
    """One log line: per ratio the predicted speed-up, accepted length and head share."""
    parts = [
        f"{r:g}: {p.speedup:.2f}x (k={p.k}, len {p.accepted_length:.2f}, head {p.head_share:.0%}"
        + (f", kept {rep.kept_measured[r]:.3f}" if r in rep.kept_measured else "")
        + ")"
        for r, p in sorted(rep.points.items())
    ]
    a = rep.assessment
    return (
        f"ratio predictions for {rep.rows} row(s), full-head acceptance {rep.alpha_full:.2f}: "
        + "; ".join(parts)
        + f" -> best {a.best:g}, compression can help: {'yes' if a.can_help else 'no'}"
        + f" ({a.reason})"
    )
