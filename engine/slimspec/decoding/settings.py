"""The decoder's run-time knobs: changed from any thread, read once per step."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

from slimspec.decoding.quality import check_strategy, check_threshold
from slimspec.draft_head.head import check_ratio


def count_setting(
    value: int | None, env: Mapping[str, str], name: str, env_name: str, default: int, zero: str
) -> int:
    """A setting that counts tokens (an int >= 0; 0 means `zero`): value, else
    env[env_name], else default; ValueError naming the argument or the variable."""
    if value is None:
        raw = env.get(env_name, str(default))
        try:
            parsed = int(raw)
        except ValueError:
            parsed = -1
        if parsed < 0:
            raise ValueError(f"{env_name} must be an int >= 0 (0: {zero}), got {raw!r}")
        return parsed
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"{name} must be an int >= 0 or None ({env_name}, default {default}; 0: {zero}), "
            f"got {value!r}"
        )
    return value


def check_num_draft_tokens(k: int | None) -> int | None:
    if k is not None and (not isinstance(k, int) or k < 1):
        raise ValueError(f"num_draft_tokens must be a positive int or None (adaptive), got {k!r}")
    return k


@dataclass(frozen=True)
class StepSettings:
    """The knobs one step runs with: a change made meanwhile applies from the next step."""

    ratio: float  # the compression ratio in force
    threshold: float
    strategy: str
    fixed_k: int | None  # None = adaptive k
    max_draft_tokens: int


class DecoderSettings:
    """Compression ratio, quality threshold, fallback strategy and k, behind one lock.

    `ratio` is the ratio in force, `requested_ratio` what was last asked for: a quality
    fallback lowers the first only.
    """

    def __init__(
        self,
        ratio: float,
        threshold: float,
        strategy: str,
        fixed_k: int | None,
        max_draft_tokens: int,
    ) -> None:
        self._lock = threading.Lock()
        self.ratio = self.requested_ratio = check_ratio(ratio)
        self.threshold = check_threshold(threshold)
        self.strategy = check_strategy(strategy)
        self.fixed_k = check_num_draft_tokens(fixed_k)
        self.max_draft_tokens = max(max_draft_tokens, fixed_k or 1)

    def snapshot(self) -> StepSettings:
        with self._lock:
            return StepSettings(
                self.ratio, self.threshold, self.strategy, self.fixed_k, self.max_draft_tokens
            )

    def request_ratio(self, ratio: float) -> bool:
        """Ask for a ratio; returns whether that changed anything. Re-sending the ratio
        already requested is a no-op, so a settings push that repeats itself does not
        undo a quality fallback; a different value resets it."""
        r = check_ratio(ratio)
        with self._lock:
            if r == self.requested_ratio:
                return False
            self.ratio = self.requested_ratio = r
        return True

    def fall_back(self, from_ratio: float, to_ratio: float) -> None:
        """The quality check lowers the ratio in force, unless a request changed it since."""
        with self._lock:
            if self.ratio == from_ratio:
                self.ratio = to_ratio

    def set_threshold(self, threshold: float) -> None:
        t = check_threshold(threshold)
        with self._lock:
            self.threshold = t

    def set_strategy(self, strategy: str) -> None:
        s = check_strategy(strategy)
        with self._lock:
            self.strategy = s

    def set_num_draft_tokens(self, k: int | None) -> None:
        k = check_num_draft_tokens(k)
        with self._lock:
            self.fixed_k = k
            if k is not None:
                self.max_draft_tokens = max(self.max_draft_tokens, k)
