"""Blue/green model rollout as a pure plan (after KubeAI's pod_plan.go).

Input: the Deployments this resource owns, the template hash the Service
selects, the hash of a rollout that already failed, and the clock. Output: the
next actions plus what the status should say. Running the plan twice on the
same state gives the same actions, so the caller can re-run it on every event
and timer tick and after an operator restart (state lives in the cluster: the
Deployments' hashes and creation times, the Service selector, the status).

Order of a rollout from hash A (served) to B (desired):
1. create Deployment B beside A, both at spec.replicas;
2. when B has all replicas ready, point the Service at B (A still serving
   until this moment, so the Service never selects zero ready pods);
3. next round: delete A (its pods drain through their preStop hook);
4. if B is not ready within rollout.readyTimeoutSeconds: delete B, keep A,
   remember B's hash as failed (Degraded) and do not retry it until the spec
   changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from slimspec_operator.rollout.reasons import Reason


@dataclass(frozen=True)
class ObservedDeployment:
    name: str
    template_hash: str
    version: str
    replicas: int  # spec.replicas
    ready_replicas: int  # status.readyReplicas
    created_at: datetime
    current_replicas: int = 0  # status.replicas
    generation: int = 1
    observed_generation: int = 1
    preparation_key: str = ""  # the model preparation this template runs on ("" = none)
    artifact: str = ""  # its calibration artifact ("" = not calibrated by the operator)

    def ready_for(self, replicas: int) -> bool:
        """All wanted replicas ready, judged on status the controller has caught up with."""
        fresh = self.observed_generation >= self.generation
        return fresh and self.ready_replicas >= replicas


@dataclass(frozen=True)
class Desired:
    template_hash: str
    version: str
    replicas: int
    ready_timeout_s: float
    # Model preparation (downloads, calibration) the template needs first: its
    # Deployment is created only once this is done (model_prep.py).
    prepared: bool = True
    preparation_failed: str | None = None  # why the preparation Job failed


@dataclass(frozen=True)
class Observed:
    deployments: tuple[ObservedDeployment, ...]
    service_hash: str | None  # hash the Service selects; None when there is no Service
    failed_hash: str | None  # a rollout that was rolled back (from status)
    failed_version: str | None
    now: datetime


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class ApplyDeployment:
    """Create or update the desired Deployment (the caller builds the manifest)."""

    replicas: int


@dataclass(frozen=True)
class ScaleDeployment:
    """Set the replicas of a Deployment the plan keeps but does not build."""

    name: str
    replicas: int


@dataclass(frozen=True)
class SwitchService:
    """Point the Service at the pods of this pod template: the traffic switch (the
    pods it selected until now keep serving up to this moment)."""

    template_hash: str


@dataclass(frozen=True)
class DeleteDeployment:
    """Remove a Deployment the plan no longer keeps. Its pods drain through their
    preStop hook; the garbage collector takes its ReplicaSets and pods."""

    name: str


Action = ApplyDeployment | ScaleDeployment | SwitchService | DeleteDeployment


@dataclass(frozen=True)
class Cond:
    status: bool
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    serving_hash: str | None = None
    serving_version: str | None = None
    rollout_version: str | None = None  # set while a new version is being brought up
    failed_hash: str | None = None
    failed_version: str | None = None
    progressing: Cond = Cond(False, Reason.UNKNOWN, "")
    degraded: Cond = Cond(False, Reason.AS_EXPECTED, "")
    events: list[Event] = field(default_factory=list)
    done: bool = False  # nothing left to wait for
    # When this plan would change with nothing else changing: the ready deadline of
    # the Deployment it waits for. Every other change arrives as a watch event.
    wake_at: datetime | None = None


def _age(d: ObservedDeployment, now: datetime) -> float:
    return (now - d.created_at).total_seconds()


def _deadline(d: ObservedDeployment, desired: Desired) -> datetime:
    """The first moment at which `d` counts as not ready in time (`_age` > timeout)."""
    return d.created_at + timedelta(seconds=desired.ready_timeout_s, milliseconds=1)


def plan_rollout(desired: Desired, observed: Observed) -> Plan:
    by_hash = {d.template_hash: d for d in observed.deployments}
    new = by_hash.get(desired.template_hash)
    serving = by_hash.get(observed.service_hash) if observed.service_hash else None
    p = Plan(failed_hash=observed.failed_hash, failed_version=observed.failed_version)

    if serving is None:
        # Nothing served (first create, or the served Deployment vanished). Bridge
        # with any other Deployment that has ready pods while the desired one starts.
        bridges = sorted(
            (
                d
                for d in observed.deployments
                if d.template_hash != desired.template_hash
                and d.template_hash != observed.failed_hash
                and d.ready_replicas > 0
            ),
            key=lambda d: (-d.ready_replicas, d.name),
        )
        if bridges and not (new and new.ready_replicas > 0):
            serving = bridges[0]
            p.actions.append(SwitchService(serving.template_hash))

    if new is None and not desired.prepared and desired.template_hash != observed.failed_hash:
        return _preparing(desired, observed, serving, p)
    if serving is None or serving.template_hash == desired.template_hash:
        return _steady(desired, observed, new, p)
    if desired.template_hash == observed.failed_hash:
        return _rolled_back(desired, observed, serving, p)
    return _rolling(desired, observed, serving, new, p)


def _delete_others(observed: Observed, keep: set[str], p: Plan) -> None:
    for d in observed.deployments:
        if d.template_hash not in keep:
            p.actions.append(DeleteDeployment(d.name))


def _preparing(
    desired: Desired, observed: Observed, serving: ObservedDeployment | None, p: Plan
) -> Plan:
    """The desired template's models are still being prepared (or that failed): keep
    what serves, serving, and create nothing for the new template yet."""
    keep = {serving.template_hash} if serving is not None else set()
    if serving is not None:
        if serving.replicas != desired.replicas:
            p.actions.append(ScaleDeployment(serving.name, desired.replicas))
        p.serving_hash, p.serving_version = serving.template_hash, serving.version
        if serving.version != desired.version:
            p.rollout_version = desired.version
    _delete_others(observed, keep, p)
    if desired.preparation_failed is not None:
        text = f"preparing {desired.version} failed: {desired.preparation_failed}"
        p.progressing = Cond(False, Reason.PREPARATION_FAILED, text)
        p.degraded = Cond(True, Reason.PREPARATION_FAILED, text)
        p.done = True
    else:
        p.progressing = Cond(
            True, Reason.PREPARING_MODEL, f"preparing the models of {desired.version}"
        )
    return p


def _steady(desired: Desired, observed: Observed, new: ObservedDeployment | None, p: Plan) -> Plan:
    """The desired template is (or is about to be) the one served."""
    p.actions.append(ApplyDeployment(desired.replicas))
    if observed.service_hash != desired.template_hash:
        p.actions.append(SwitchService(desired.template_hash))
    olds = [d for d in observed.deployments if d.template_hash != desired.template_hash]
    _delete_others(observed, {desired.template_hash}, p)
    if olds and observed.service_hash == desired.template_hash:
        p.events.append(
            Event(
                "Normal",
                Reason.ROLLOUT_COMPLETE,
                f"serving {desired.version}; removed {', '.join(d.name for d in olds)}",
            )
        )
    p.serving_hash = desired.template_hash
    p.serving_version = desired.version
    p.failed_hash = p.failed_version = None
    if new is None:
        p.events.append(
            Event("Normal", Reason.CREATING, f"creating Deployment for {desired.version}")
        )
        p.progressing = Cond(True, Reason.CREATING, f"creating Deployment for {desired.version}")
        return p
    ready = new.ready_for(desired.replicas)
    msg = f"{new.ready_replicas}/{desired.replicas} replicas of {desired.version} ready"
    if ready and not olds:
        p.progressing = Cond(False, Reason.ROLLOUT_COMPLETE, msg)
        p.done = True
    elif _age(new, observed.now) > desired.ready_timeout_s and not ready:
        # Nothing older to fall back to: keep trying, but say so.
        p.progressing = Cond(False, Reason.PROGRESS_DEADLINE_EXCEEDED, msg)
        p.degraded = Cond(
            True,
            Reason.NOT_READY,
            f"{msg} after {desired.ready_timeout_s:.0f}s and no older version to serve",
        )
    else:
        p.progressing = Cond(True, Reason.WAITING_FOR_READY, msg)
        p.wake_at = _deadline(new, desired)
    return p


def _rolled_back(
    desired: Desired, observed: Observed, serving: ObservedDeployment, p: Plan
) -> Plan:
    """The desired template failed before; keep serving the old one until the spec changes."""
    if serving.replicas != desired.replicas:
        p.actions.append(ScaleDeployment(serving.name, desired.replicas))
    _delete_others(observed, {serving.template_hash}, p)
    p.serving_hash = serving.template_hash
    p.serving_version = serving.version
    p.progressing = Cond(
        False, Reason.ROLLED_BACK, f"rolled back to {serving.version}; change the spec to retry"
    )
    p.degraded = Cond(
        True,
        Reason.ROLLOUT_FAILED,
        f"version {desired.version} did not become ready within "
        f"{desired.ready_timeout_s:.0f}s; serving {serving.version}",
    )
    p.done = True
    return p


def _rolling(
    desired: Desired,
    observed: Observed,
    serving: ObservedDeployment,
    new: ObservedDeployment | None,
    p: Plan,
) -> Plan:
    """Old template serving, new one coming up beside it."""
    p.actions.append(ApplyDeployment(desired.replicas))
    if serving.replicas != desired.replicas:
        p.actions.append(ScaleDeployment(serving.name, desired.replicas))
    # Intermediate versions (A -> B -> C before B finished) serve nothing: drop them.
    _delete_others(observed, {serving.template_hash, desired.template_hash}, p)
    p.serving_hash = serving.template_hash
    p.serving_version = serving.version
    p.rollout_version = desired.version
    change = f"{serving.version} -> {desired.version}"
    if serving.version == desired.version:  # image, resources, ... or an operator upgrade
        change = f"{desired.version} (pod template {serving.template_hash} -> "
        change += f"{desired.template_hash})"
    if new is None:
        p.events.append(Event("Normal", Reason.ROLLOUT_STARTED, f"rolling out {change}"))
        p.progressing = Cond(True, Reason.ROLLING_OUT, f"{change}: creating Deployment")
        return p
    msg = f"{change}: {new.ready_replicas}/{desired.replicas} new replicas ready"
    # An old version with no ready pod serves nobody: any ready new pod is better,
    # and rolling back to it would help nobody either.
    old_down = serving.ready_replicas == 0
    if (new.ready_for(desired.replicas) or old_down) and new.ready_replicas > 0:
        p.actions.append(SwitchService(desired.template_hash))
        p.serving_hash = desired.template_hash
        p.serving_version = desired.version
        p.events.append(
            Event("Normal", Reason.TRAFFIC_SWITCHED, f"{change}: Service now selects new")
        )
        p.progressing = Cond(True, Reason.TRAFFIC_SWITCHED, msg)
    elif new.ready_for(desired.replicas) and desired.replicas == 0:
        p.actions.append(SwitchService(desired.template_hash))
        p.serving_hash = desired.template_hash
        p.serving_version = desired.version
        p.progressing = Cond(True, Reason.TRAFFIC_SWITCHED, msg + " (scaled to zero)")
    elif _age(new, observed.now) > desired.ready_timeout_s and old_down:
        p.progressing = Cond(False, Reason.PROGRESS_DEADLINE_EXCEEDED, msg)
        p.degraded = Cond(
            True,
            Reason.NOT_READY,
            f"{msg} after {desired.ready_timeout_s:.0f}s; {serving.version} has no ready "
            "pods either, so there is nothing to roll back to",
        )
    elif _age(new, observed.now) > desired.ready_timeout_s:
        p.actions = [a for a in p.actions if not isinstance(a, ApplyDeployment)]
        p.actions.append(DeleteDeployment(new.name))
        p.rollout_version = None
        p.failed_hash = desired.template_hash
        p.failed_version = desired.version
        text = (
            f"version {desired.version} did not become ready within "
            f"{desired.ready_timeout_s:.0f}s; serving {serving.version}"
        )
        p.events.append(Event("Warning", Reason.ROLLED_BACK, text))
        p.progressing = Cond(False, Reason.ROLLED_BACK, text)
        p.degraded = Cond(True, Reason.ROLLOUT_FAILED, text)
        p.done = True
    else:
        p.progressing = Cond(True, Reason.ROLLING_OUT, msg)
        p.wake_at = _deadline(new, desired)
    return p


# ---------------------------------------------------------------- when to reconcile


@dataclass(frozen=True)
class Round:
    """What the last reconcile of one resource left behind, for the timer to judge."""

    at: datetime  # when it ran
    wake_at: datetime | None = None  # its plan's deadline (Plan.wake_at)
    retry: bool = False  # it failed or was refused: the cluster may heal without an event
    # The next step follows from this round's own write that no watch reports (the
    # Service switched to the new version: the old Deployment goes next round).
    busy: bool = False


def follow_up(plan: Plan | None) -> bool:
    """Whether the round's plan needs another round that no watched event will start:
    it switched the Service (not watched), and the old version is removed next."""
    return plan is not None and plan.progressing.reason == Reason.TRAFFIC_SWITCHED


def timer_due(last: Round | None, now: datetime, resync_s: float) -> bool:
    """Whether a timer tick reconciles: never reconciled here, a retry, a deadline
    passed, or a drift resync due (resync_s <= 0: never). Everything else is
    watch-driven (spec changes, owned Deployments and Jobs), so an idle resource
    costs no API request."""
    if last is None or last.retry or last.busy:
        return True
    if last.wake_at is not None and now >= last.wake_at:
        return True
    return resync_s > 0 and (now - last.at).total_seconds() >= resync_s


def deployment_news(before: ObservedDeployment | None, now: ObservedDeployment) -> bool:
    """Whether a Deployment event says anything the plan reads (readiness, replicas,
    generations, labels); status churn of other fields does not count."""
    return before != now
