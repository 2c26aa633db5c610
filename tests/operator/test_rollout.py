from datetime import UTC, datetime, timedelta

from slimspec_operator.rollout.plan import (
    ApplyDeployment,
    DeleteDeployment,
    Desired,
    Observed,
    ObservedDeployment,
    ScaleDeployment,
    SwitchService,
    plan_rollout,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def dep(h, version, replicas=2, ready=0, age=0.0):
    return ObservedDeployment(
        name=f"chat-{h}",
        template_hash=h,
        version=version,
        replicas=replicas,
        ready_replicas=ready,
        current_replicas=replicas,
        created_at=T0 - timedelta(seconds=age),
    )


def obs(*deps, service=None, failed=None, failed_version=None):
    return Observed(tuple(deps), service, failed, failed_version, T0)


WANT_A = Desired("aaa", "v1", 2, 60)
WANT_B = Desired("bbb", "v2", 2, 60)


def test_first_create_makes_deployment_and_points_service():
    p = plan_rollout(WANT_A, obs())
    assert p.actions == [ApplyDeployment(2), SwitchService("aaa")]
    assert p.progressing.status and p.progressing.reason == "Creating"
    assert not p.done


def test_steady_state_is_idempotent():
    o = obs(dep("aaa", "v1", ready=2), service="aaa")
    p = plan_rollout(WANT_A, o)
    assert p.actions == [ApplyDeployment(2)]
    assert p.done and not p.progressing.status and not p.degraded.status
    assert plan_rollout(WANT_A, o).actions == p.actions


def test_version_change_starts_new_beside_old_and_keeps_service():
    p = plan_rollout(WANT_B, obs(dep("aaa", "v1", ready=2), service="aaa"))
    assert p.actions == [ApplyDeployment(2)]
    assert not any(isinstance(a, SwitchService | DeleteDeployment) for a in p.actions)
    assert p.serving_version == "v1" and p.rollout_version == "v2"
    assert p.progressing.reason == "RollingOut"


def test_service_switches_only_when_new_is_fully_ready():
    old = dep("aaa", "v1", ready=2)
    part = plan_rollout(WANT_B, obs(old, dep("bbb", "v2", ready=1, age=5), service="aaa"))
    assert SwitchService("bbb") not in part.actions
    full = plan_rollout(WANT_B, obs(old, dep("bbb", "v2", ready=2, age=5), service="aaa"))
    assert SwitchService("bbb") in full.actions
    assert not any(isinstance(a, DeleteDeployment) for a in full.actions)  # old kept this round
    assert full.serving_version == "v2"


def test_stale_deployment_status_does_not_count_as_ready():
    new = ObservedDeployment(
        "chat-bbb", "bbb", "v2", 2, 2, T0, 2, generation=2, observed_generation=1
    )
    p = plan_rollout(WANT_B, obs(dep("aaa", "v1", ready=2), new, service="aaa"))
    assert SwitchService("bbb") not in p.actions


def test_after_switch_old_is_deleted_and_rollout_completes():
    o = obs(dep("aaa", "v1", ready=2), dep("bbb", "v2", ready=2), service="bbb")
    p = plan_rollout(WANT_B, o)
    assert p.actions == [ApplyDeployment(2), DeleteDeployment("chat-aaa")]
    assert p.events[0].reason == "RolloutComplete"
    assert p.progressing.reason == "WaitingForReady"  # done only once the old one is gone
    p2 = plan_rollout(WANT_B, obs(dep("bbb", "v2", ready=2), service="bbb"))
    assert p2.done and p2.progressing.reason == "RolloutComplete"


def test_never_ready_new_version_is_rolled_back_after_deadline():
    old = dep("aaa", "v1", ready=2)
    before = plan_rollout(WANT_B, obs(old, dep("bbb", "v2", ready=1, age=59), service="aaa"))
    assert not before.degraded.status
    p = plan_rollout(WANT_B, obs(old, dep("bbb", "v2", ready=1, age=61), service="aaa"))
    assert p.actions == [DeleteDeployment("chat-bbb")]
    assert p.failed_hash == "bbb" and p.failed_version == "v2"
    assert p.degraded.status and p.degraded.reason == "RolloutFailed"
    assert p.serving_version == "v1" and p.rollout_version is None
    assert p.events[-1].type == "Warning"
    # next rounds do not retry the failed template
    again = plan_rollout(WANT_B, obs(old, service="aaa", failed="bbb", failed_version="v2"))
    assert again.actions == []
    assert again.degraded.status and again.failed_hash == "bbb"


def test_spec_change_after_rollback_retries_and_clears_failure():
    old = dep("aaa", "v1", ready=2)
    want_c = Desired("ccc", "v3", 2, 60)
    p = plan_rollout(want_c, obs(old, service="aaa", failed="bbb", failed_version="v2"))
    assert p.actions == [ApplyDeployment(2)] and not p.degraded.status
    back = plan_rollout(WANT_A, obs(old, service="aaa", failed="bbb", failed_version="v2"))
    assert back.failed_hash is None and back.done


def test_replica_change_during_rollout_scales_old_too():
    want = Desired("bbb", "v2", 3, 60)
    p = plan_rollout(want, obs(dep("aaa", "v1", ready=2), service="aaa"))
    assert ScaleDeployment("chat-aaa", 3) in p.actions and ApplyDeployment(3) in p.actions


def test_intermediate_version_is_dropped():
    want_c = Desired("ccc", "v3", 2, 60)
    o = obs(dep("aaa", "v1", ready=2), dep("bbb", "v2", ready=0), service="aaa")
    p = plan_rollout(want_c, o)
    assert DeleteDeployment("chat-bbb") in p.actions
    assert DeleteDeployment("chat-aaa") not in p.actions


def test_lost_service_bridges_with_a_ready_deployment():
    o = obs(dep("aaa", "v1", ready=2), dep("bbb", "v2", ready=0), service=None)
    p = plan_rollout(WANT_B, o)
    assert p.actions[0] == SwitchService("aaa")
    assert SwitchService("bbb") not in p.actions
    assert DeleteDeployment("chat-aaa") not in p.actions


def test_first_version_never_ready_is_degraded_but_kept():
    p = plan_rollout(WANT_A, obs(dep("aaa", "v1", ready=0, age=120), service="aaa"))
    assert p.actions == [ApplyDeployment(2)]
    assert p.degraded.status and p.degraded.reason == "NotReady"


def test_service_never_selects_a_deployment_without_ready_pods_during_rollout():
    # Walk a rollout through every readiness step; the selected hash always has ready pods.
    old = dep("aaa", "v1", ready=2)
    service = "aaa"
    for ready in (0, 1, 2):
        new = dep("bbb", "v2", ready=ready, age=1)
        p = plan_rollout(WANT_B, obs(old, new, service=service))
        for a in p.actions:
            if isinstance(a, SwitchService):
                service = a.template_hash
        selected = {"aaa": old, "bbb": new}[service]
        assert selected.ready_replicas > 0
    assert service == "bbb"


def test_old_version_without_ready_pods_gives_way_to_any_ready_new_pod():
    down = dep("aaa", "v1", ready=0, age=300)
    p = plan_rollout(WANT_B, obs(down, dep("bbb", "v2", ready=1, age=5), service="aaa"))
    assert SwitchService("bbb") in p.actions


def test_no_rollback_to_a_version_without_ready_pods():
    down = dep("aaa", "v1", ready=0, age=300)
    p = plan_rollout(WANT_B, obs(down, dep("bbb", "v2", ready=0, age=61), service="aaa"))
    assert DeleteDeployment("chat-bbb") not in p.actions and p.failed_hash is None
    assert p.degraded.status and p.degraded.reason == "NotReady"
    assert p.progressing.reason == "ProgressDeadlineExceeded"


def test_template_change_without_version_change_is_a_rollout_too():
    same_version = Desired("bbb", "v1", 2, 60)
    p = plan_rollout(same_version, obs(dep("aaa", "v1", ready=2), service="aaa"))
    assert p.actions == [ApplyDeployment(2)]
    assert "pod template aaa -> bbb" in p.events[0].message


# ---------------------------------------------------------------- model preparation

PREPARING_A = Desired("aaa", "v1", 2, 60, prepared=False)
PREPARING_B = Desired("bbb", "v2", 2, 60, prepared=False)


def test_first_version_waits_for_its_preparation():
    p = plan_rollout(PREPARING_A, obs())
    assert p.actions == []  # no Deployment, no Service until the models are there
    assert p.progressing.status and p.progressing.reason == "PreparingModel"
    assert p.serving_hash is None and not p.degraded.status


def test_old_version_keeps_serving_while_the_new_one_is_prepared():
    o = obs(dep("aaa", "v1", ready=2), service="aaa")
    p = plan_rollout(PREPARING_B, o)
    assert p.actions == []
    assert (p.serving_version, p.rollout_version) == ("v1", "v2")
    assert p.progressing.reason == "PreparingModel"
    # prepared: the rollout starts as usual
    ready = Desired("bbb", "v2", 2, 60, prepared=True)
    assert plan_rollout(ready, o).actions == [ApplyDeployment(2)]


def test_failed_preparation_keeps_the_old_version_and_says_so():
    o = obs(dep("aaa", "v1", ready=2, replicas=1), service="aaa")
    failed = Desired("bbb", "v2", 2, 60, prepared=False, preparation_failed="BackoffLimitExceeded")
    p = plan_rollout(failed, o)
    assert p.actions == [ScaleDeployment("chat-aaa", 2)]  # replicas still follow the spec
    assert p.degraded.status and p.degraded.reason == "PreparationFailed"
    assert "BackoffLimitExceeded" in p.degraded.message and "v2" in p.degraded.message
    assert not p.progressing.status and p.done


def test_an_existing_deployment_needs_no_preparation_check():
    """Once a template's Deployment exists its models were prepared (it is only made
    then); a Job deleted since must not take it down."""
    o = obs(dep("aaa", "v1", ready=2), service="aaa")
    p = plan_rollout(PREPARING_A, o)
    assert p.actions == [ApplyDeployment(2)] and p.done
