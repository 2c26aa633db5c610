"""Health that tells the truth: when the engine cannot recover, liveness fails so that
Kubernetes restarts the pod. Pure decisions over what the service and its scheduler
report; the routes only render them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthPolicy:
    load_attempts: int = 4  # a failed model load is retried this many times in all
    load_backoff_s: float = 2.0  # first wait before a retry; doubles each time
    load_backoff_max_s: float = 60.0
    step_watchdog_s: float = 300.0  # an engine step running longer than this is hung
    max_failed_steps: int = 5  # consecutive engine steps that raised

    def __post_init__(self) -> None:
        if self.load_attempts < 1:
            raise ValueError("load_attempts must be >= 1")
        if self.step_watchdog_s <= 0:
            raise ValueError("step_watchdog_s must be > 0")

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait after the n-th failed load (n >= 1)."""
        return min(self.load_backoff_max_s, self.load_backoff_s * 2 ** (failures - 1))


@dataclass(frozen=True)
class EngineCondition:
    """What liveness looks at."""

    state: str  # EngineService.state
    scheduler_alive: bool
    step_running_s: float
    failed_steps: int


def liveness_problem(c: EngineCondition, policy: HealthPolicy) -> str | None:
    """None while the process can still serve (or is still loading); else why not."""
    if c.state == "failed":
        return "model load failed and is not retried any more"
    if not c.scheduler_alive:
        return "the scheduler thread died"
    if c.step_running_s > policy.step_watchdog_s:
        return (
            f"an engine step has run for {c.step_running_s:.0f} s "
            f"(watchdog {policy.step_watchdog_s:.0f} s)"
        )
    if c.failed_steps >= policy.max_failed_steps:
        return f"the last {c.failed_steps} engine steps failed"
    return None
