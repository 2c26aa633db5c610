"""When the reconciler spends API requests (pure decisions): its timer runs a round
only for a deadline, a retry or a resync, and a Deployment event only when it
says something the plan reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator.rollout.plan import (
    Desired,
    Observed,
    ObservedDeployment,
    Round,
    deployment_news,
    follow_up,
    plan_rollout,
    timer_due,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def dep(h: str, version: str, ready: int = 0, age: float = 0.0) -> ObservedDeployment:
    return ObservedDeployment(f"chat-{h}", h, version, 2, ready, T0 - timedelta(seconds=age))


# ------------------------------------------------------------------ the reconcile timer


def test_the_timer_runs_a_round_only_when_one_is_due() -> None:
    assert timer_due(None, at(0), 1800)  # never reconciled by this process
    idle = Round(at(0))
    assert not timer_due(idle, at(10), 1800)
    assert not timer_due(idle, at(1799), 1800)
    assert timer_due(idle, at(1800), 1800)  # the drift resync
    assert not timer_due(idle, at(10**6), 0)  # resync off
    assert timer_due(Round(at(0), retry=True), at(1), 1800)  # failed or refused
    # a rollout in progress (e.g. traffic switched, the old Deployment still to go):
    # its next step follows from the round's own writes, which no watch reports
    assert timer_due(Round(at(0), busy=True), at(10), 1800)
    waiting = Round(at(0), wake_at=at(60))
    assert not timer_due(waiting, at(59.9), 1800)
    assert timer_due(waiting, at(60), 1800)


@pytest.mark.parametrize(
    ("desired", "observed"),
    [
        (Desired("aaa", "v1", 2, 60), Observed((dep("aaa", "v1", age=10),), "aaa", None, None, T0)),
        (
            Desired("bbb", "v2", 2, 60),
            Observed((dep("aaa", "v1", 2), dep("bbb", "v2", age=10)), "aaa", None, None, T0),
        ),
    ],
    ids=["first-version", "rollout"],
)
def test_a_plan_waiting_for_readiness_wakes_at_its_deadline(
    desired: Desired, observed: Observed
) -> None:
    plan = plan_rollout(desired, observed)
    assert plan.wake_at is not None and at(49) < plan.wake_at <= at(50.01)
    later = Observed(observed.deployments, "aaa", None, None, plan.wake_at)
    after = plan_rollout(desired, later)
    assert after.wake_at is None  # the deadline was acted on: nothing more to wait for
    assert after.progressing.reason in ("ProgressDeadlineExceeded", "RolledBack")


def test_a_settled_plan_waits_for_nothing() -> None:
    observed = Observed((dep("aaa", "v1", ready=2),), "aaa", None, None, T0)
    assert plan_rollout(Desired("aaa", "v1", 2, 60), observed).wake_at is None


def test_a_traffic_switch_asks_for_the_next_round_itself() -> None:
    """The round that switches the Service to the new version leaves the old Deployment
    for the next round, and no watched event starts it (the Service is not watched):
    the timer must (the e2e rollout under load waited 30 min for the resync)."""
    both_ready = (dep("aaa", "v1", ready=2), dep("bbb", "v2", ready=2))
    switching = plan_rollout(
        Desired("bbb", "v2", 2, 60), Observed(both_ready, "aaa", None, None, T0)
    )
    assert switching.progressing.reason == "TrafficSwitched" and follow_up(switching)
    settled = Observed((dep("bbb", "v2", ready=2),), "bbb", None, None, T0)
    assert not follow_up(plan_rollout(Desired("bbb", "v2", 2, 60), settled))
    waiting = Observed((dep("aaa", "v1", ready=2), dep("bbb", "v2")), "aaa", None, None, T0)
    assert not follow_up(plan_rollout(Desired("bbb", "v2", 2, 60), waiting))  # events do


def test_only_deployment_changes_the_plan_reads_are_news() -> None:
    seen = dep("aaa", "v1", ready=1)
    assert deployment_news(None, seen)
    assert not deployment_news(seen, dep("aaa", "v1", ready=1))
    assert deployment_news(seen, dep("aaa", "v1", ready=2))
