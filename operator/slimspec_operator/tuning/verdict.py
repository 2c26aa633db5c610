"""Verdicts on exact means over alternated windows (pure).

Why: a move's verdict used to compare p99 read from histogram buckets before and
after it. At 3-4 s latencies neighbouring buckets are 10-20 % apart while the
verdict's tolerance was 10 %, so one bucket crossing read as "worse" (a revert) or
hid a real change, and slow drift of the machine read as an effect of the move.

What: the mean latency per generated token, exact, from two counters read as
cumulative totals at every tick (the latency histogram's `_sum` and the generated
tokens; no bucket, no `rate()` extrapolation): over any stretch between two ticks
it is (latency sum now - then) / (tokens now - then). A trial measures three
windows of equal length, alternating the two ratios:

    before (A, the ratio in force)  |  after (B, the new ratio)  |  again (A)

and compares B with the mean of the two A windows. With equal windows at equal
spacing, a drift that is linear in time adds the same to both sides and cancels (a
plain before/after comparison reads all of it as the move's effect). Each window is
cut into parts, one per tick interval; the spread of the parts' means inside the
windows is the noise, pooled over the three windows, and gives the standard error
of B - mean(A) and Student's t for its degrees of freedom. The move is kept only
when B is better by more than the margin (t x standard error, at least
`floor`), undone when worse by more, and otherwise held where it was.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

# Student's t, two-sided 95 % (0.975 quantile), for 1..30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
Z975 = 1.96
# Relative effect a verdict never trusts, whatever the windows say: the drift that
# is not linear in time over a trial (the windows cannot see it).
DEFAULT_FLOOR = 0.03


def t975(dof: int) -> float:
    """Two-sided 95 % Student's t for `dof` degrees of freedom (inf without any)."""
    if dof < 1:
        return math.inf
    return _T975[dof - 1] if dof <= len(_T975) else Z975


@dataclass(frozen=True)
class Point:
    """One tick's readings as the windows use them: cumulative totals over the
    service's pods (None where the engines or the queries give none)."""

    time: datetime
    latency_s: float | None  # sum of request latencies so far (histogram `_sum`)
    tokens: float | None  # generated tokens so far
    p99: float | None = None
    rate: float | None = None

    @property
    def usable(self) -> bool:
        return self.latency_s is not None and self.tokens is not None


@dataclass(frozen=True)
class Window:
    """A stretch of ticks at one ratio: its exact mean latency per generated token,
    the same per tick interval inside it (`parts`), and p99 and the load beside."""

    ratio: float
    start: datetime
    end: datetime
    mean: float  # seconds per generated token over the whole window
    parts: tuple[float, ...]
    p99: float | None = None  # mean of the ticks' p99 (bucketed: shown, and a guard)
    rate: float | None = None  # mean request rate

    @property
    def squares(self) -> float:
        """Sum of squared deviations of the parts from their mean."""
        m = sum(self.parts) / len(self.parts)
        return sum((x - m) ** 2 for x in self.parts)

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


def window(
    points: Sequence[Point],
    ratio: float,
    after: datetime | None,
    parts: int,
    span_s: float,
    latest: bool = False,
) -> Window | None:
    """The window at `ratio` from the points taken strictly after `after` (the tick of
    the switch itself is left out: its totals still hold the old ratio's requests),
    once it has `parts` parts and spans `span_s` seconds; None while it has not.

    `latest`: the last such stretch, ending at the last point (the window before a
    move); else the first, from the first point after the switch. A point without
    totals, or totals that fell (a pod's counters restarted), starts it anew; a tick
    interval without a generated token is no part but keeps the stretch whole.
    """
    usable = [p for p in points if after is None or p.time > after]
    if latest:
        usable = usable[::-1]
    run: list[Point] = []
    for p in usable:
        if not p.usable:
            run = []
            continue
        if run:
            a, b = (p, run[-1]) if latest else (run[-1], p)
            assert a.latency_s is not None and b.latency_s is not None
            assert a.tokens is not None and b.tokens is not None
            if b.latency_s < a.latency_s or b.tokens < a.tokens:
                run = []
        run.append(p)
        chosen = run[::-1] if latest else run
        w = _measure(chosen, ratio)
        if w is not None and len(w.parts) >= parts and w.seconds >= span_s:
            return w
    return None


def _measure(run: Sequence[Point], ratio: float) -> Window | None:
    """The window over consecutive usable points, oldest first."""
    if len(run) < 2:
        return None
    pieces: list[float] = []
    for a, b in itertools.pairwise(run):
        d_tok = (b.tokens or 0.0) - (a.tokens or 0.0)
        if d_tok > 0:
            pieces.append(((b.latency_s or 0.0) - (a.latency_s or 0.0)) / d_tok)
    first, last = run[0], run[-1]
    d_tok = (last.tokens or 0.0) - (first.tokens or 0.0)
    if not pieces or d_tok <= 0:
        return None
    mean = ((last.latency_s or 0.0) - (first.latency_s or 0.0)) / d_tok
    p99s = [p.p99 for p in run[1:] if p.p99 is not None and math.isfinite(p.p99)]
    rates = [p.rate for p in run[1:] if p.rate is not None and math.isfinite(p.rate)]
    return Window(
        ratio,
        first.time,
        last.time,
        mean,
        tuple(pieces),
        sum(p99s) / len(p99s) if p99s else None,
        sum(rates) / len(rates) if rates else None,
    )


@dataclass(frozen=True)
class Paired:
    """B (the new ratio) against the mean of the two A windows around it."""

    effect: float  # relative: mean(B) / mean(A) - 1 (negative: the new ratio is faster)
    margin: float  # relative: what the effect must exceed, either way
    se: float  # relative standard error of the effect
    dof: int
    p99_change: float | None  # relative, p99 of B against the mean of A's
    rate_change: float | None  # relative, the load


def compare(before: Window, after: Window, again: Window, floor: float = DEFAULT_FLOOR) -> Paired:
    """The effect of the move and its margin: t x the standard error of
    mean(B) - (mean(A1) + mean(A2)) / 2, from the parts' spread pooled over the
    three windows, and never under `floor`."""
    a = (before.mean + again.mean) / 2.0
    windows = (before, after, again)
    dof = sum(len(w.parts) - 1 for w in windows)
    if dof >= 1 and a > 0:
        s2 = sum(w.squares for w in windows) / dof
        var = s2 / len(after.parts) + (s2 / len(before.parts) + s2 / len(again.parts)) / 4.0
        se = math.sqrt(var) / a
    else:
        se = math.inf
    effect = after.mean / a - 1.0 if a > 0 else 0.0
    return Paired(
        effect=effect,
        margin=max(t975(dof) * se, floor),
        se=se,
        dof=dof,
        p99_change=_change(after.p99, before.p99, again.p99),
        rate_change=_change(after.rate, before.rate, again.rate),
    )


def _change(b: float | None, a1: float | None, a2: float | None) -> float | None:
    if b is None or a1 is None or a2 is None or a1 + a2 <= 0:
        return None
    return b / ((a1 + a2) / 2.0) - 1.0


# What a comparison says (trials.Outcome holds the words; this module stays below it).
BETTER, WORSE, HELD, WITH_LOAD = "better", "worse", "held", "withLoad"


def rule(p: Paired, load_band: float, tail_band: float) -> tuple[str, str]:
    """(what, why) of a paired comparison.

    worse: the mean per token up by more than the margin while the load did not rise
    by more than `load_band` (more load would explain it); better: down by more than
    the margin while the load did not fall by more than that, and p99 (bucketed, so
    only a gross rise counts) not up by more than `tail_band`; held: within the
    margin, or better on the mean with a tail that grew; otherwise it moved with the
    load.
    """
    up = p.rate_change is not None and p.rate_change > load_band
    down = p.rate_change is not None and p.rate_change < -load_band
    said = f"mean per token {p.effect:+.1%} (margin ±{p.margin:.1%}, {p.dof} dof)"
    if p.effect > p.margin and not up:
        return WORSE, f"{said}: slower while the load did not rise"
    if p.effect < -p.margin and not down:
        if p.p99_change is not None and p.p99_change > tail_band:
            return HELD, f"{said}, but p99 {p.p99_change:+.0%}: held"
        return BETTER, f"{said}: faster while the load did not fall"
    if abs(p.effect) <= p.margin:
        return HELD, f"{said}: within the margin, held"
    return WITH_LOAD, f"{said}: moved with the load"
