"""A simulated engine for the tuning tests: its p99 latency is a function of the
compression ratio and the load, and it predicts per ratio what the metric
contract says an engine exports.

Three kinds, the three cases the tuner must handle:
- `helps`: a head-heavy draft (a bf16 draft with a large head share): a larger
  ratio makes a draft step cheaper, p99 falls with the ratio;
- `hurts`: the default CPU engine (int4 draft, the head a small share of a draft
  step): a larger ratio buys no time and costs acceptance, p99 rises with it;
- `neutral`: the ratio changes nothing measurable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.reasons import Reason

Kind = Literal["helps", "hurts", "neutral"]
GRID = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 ... 0.95, as engines export


@dataclass(frozen=True)
class Plant:
    kind: Kind
    base: float = 0.3  # p99 (s) at ratio 0 and load 1
    slope: float = 0.6  # relative change of p99 per unit of ratio

    def factor(self, ratio: float) -> float:
        kind = self.kind
        if kind == "helps":
            return 1.0 - self.slope * ratio
        if kind == "hurts":
            return 1.0 + self.slope * ratio
        return 1.0

    def p99(self, ratio: float, load: float = 1.0) -> float:
        return self.base * load * self.factor(ratio)

    def speedup(self, ratio: float) -> float:
        """Predicted tokens/s over the target alone (2x at the full head)."""
        return 2.0 / self.factor(ratio)

    def head_share(self, ratio: float) -> float:
        return (0.45 if self.kind == "helps" else 0.08) * (1.0 - ratio)

    def kept(self, ratio: float) -> float:
        return 1.0 - 0.04 * ratio

    def can_help(self) -> bool:
        return self.kind == "helps"

    def predictions(self, claims: Kind | None = None) -> Predictions:
        """What the engines export; `claims` makes them predict another kind (wrong)."""
        said = self if claims is None else Plant(claims)
        helps = said.can_help()
        why = Reason.HEAD_SHARE_TOO_SMALL if said.kind == "hurts" else Reason.NO_PREDICTED_GAIN
        return Predictions(
            speedup={r: said.speedup(r) for r in GRID},
            kept={r: self.kept(r) for r in GRID},
            head_share={r: said.head_share(r) for r in GRID},
            best=max(GRID, key=said.speedup) if helps else 0.0,
            can_help=helps,
            reason=None if helps else why,
        )
