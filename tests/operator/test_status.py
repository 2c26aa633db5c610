from datetime import UTC, datetime

from slimspec_operator.resource.spec import SlimSpecService, ratio_in_force
from slimspec_operator.rollout.observe import observe_deployment, service_hash
from slimspec_operator.rollout.plan import Cond, Observed, ObservedDeployment, Plan
from slimspec_operator.rollout.status import build_status, compression_patch

from .helpers import body

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def svc(status=None, **spec):
    b = body(**spec)
    if status is not None:
        b["status"] = status
    return SlimSpecService.from_body(b)


def observed(ready: int) -> Observed:
    d = ObservedDeployment("chat-aaa", "aaa", "v1", 2, ready, T0, current_replicas=2)
    return Observed((d,), "aaa", None, None, T0)


def plan(**kw) -> Plan:
    p = Plan(serving_hash="aaa", serving_version="v1")
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def test_status_fields_and_ready_condition():
    st = build_status(svc(), plan(), observed(2), T0)
    assert st["observedGeneration"] == 3
    assert (st["replicas"], st["readyReplicas"]) == (2, 2)
    assert st["servedVersion"] == "v1" and st["templateHash"] == "aaa"
    assert "rolloutVersion" not in st and "failedVersion" not in st
    c = conds(st)
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "AllReplicasReady"
    assert set(c) == {"Ready", "Progressing", "Degraded"}


def test_partial_and_zero_ready():
    assert conds(build_status(svc(), plan(), observed(1), T0))["Ready"]["reason"] == (
        "PartiallyReady"
    )
    zero = conds(build_status(svc(), plan(), observed(0), T0))["Ready"]
    assert zero["status"] == "False" and zero["reason"] == "NoReadyReplicas"
    scaled = conds(build_status(svc(replicas=0), plan(), observed(0), T0))["Ready"]
    assert scaled["reason"] == "ScaledToZero"


def test_failure_and_rollout_fields_and_tuner_condition_left_out():
    prior = {"conditions": [{"type": "MetricsAvailable", "status": "True", "reason": "x"}]}
    p = plan(
        rollout_version="v2",
        failed_hash="bbb",
        failed_version="v0",
        degraded=Cond(True, "RolloutFailed", "v0 never ready"),
    )
    st = build_status(svc(status=prior), p, observed(2), T0)
    assert st["rolloutVersion"] == "v2"
    assert (st["failedTemplateHash"], st["failedVersion"]) == ("bbb", "v0")
    assert conds(st)["Degraded"]["reason"] == "RolloutFailed"
    assert "MetricsAvailable" not in conds(st)  # owned by the tuner


def test_compression_status_seed():
    # tuning off: mirror the spec ratio
    assert compression_patch(svc(), 0.3, "t")["reason"] == "Spec"
    assert compression_patch(svc(status={"compression": {"ratio": 0.3}}), 0.3, "t") is None
    # tuning on: initialise once, then leave it to the tuner
    on = {"tuning": {"enabled": True}}
    assert compression_patch(svc(**on), 0.3, "t") == {
        "ratio": 0.3,
        "reason": "Initial",
        "lastChangeTime": "t",
    }
    assert compression_patch(svc(status={"compression": {"ratio": 0.2}}, **on), 0.2, "t") is None


def test_ratio_in_force():
    assert ratio_in_force(svc(status={"compression": {"ratio": 0.2}})) == 0.3  # tuning off
    on = {"tuning": {"enabled": True}}
    assert ratio_in_force(svc(**on)) == 0.3
    assert ratio_in_force(svc(status={"compression": {"ratio": 0.2}}, **on)) == 0.2
    assert ratio_in_force(svc(status={"compression": {"ratio": 0.01}}, **on)) == 0.1


def test_observe_deployment_and_service_hash():
    d = observe_deployment(
        {
            "metadata": {
                "name": "chat-aaa",
                "labels": {"slimspec.io/template-hash": "aaa", "slimspec.io/model-version": "v1"},
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "generation": 2,
            },
            "spec": {"replicas": 3},
            "status": {"readyReplicas": 1, "replicas": 3, "observedGeneration": 2},
        }
    )
    assert (d.template_hash, d.version, d.replicas, d.ready_replicas) == ("aaa", "v1", 3, 1)
    assert d.created_at == T0 and d.ready_for(1) and not d.ready_for(2)
    assert service_hash({"spec": {"selector": {"slimspec.io/template-hash": "aaa"}}}) == "aaa"
    assert service_hash(None) is None


def test_url_and_models_status():
    from slimspec_operator.rollout.model_prep import preparation
    from slimspec_operator.rollout.status import PrepStatus

    s = svc(calibration={"enabled": True})
    st = build_status(s, plan(), observed(2), T0)
    assert st["url"] == "http://chat.ml.svc:8080"
    assert "models" not in st  # the served Deployment predates any preparation

    prep = preparation(s)
    assert prep is not None
    running = build_status(s, plan(), observed(2), T0, PrepStatus(prep, "Running"))
    assert running["models"] == [
        {
            "version": "v1",
            "key": prep.key,
            "job": prep.job_name,
            "state": "Running",
            "calibration": "Pending",
            "artifact": prep.artifact,
        }
    ]
    done = build_status(s, plan(), observed(2), T0, PrepStatus(prep, "Succeeded"))
    assert done["models"][0]["calibration"] == "Calibrated"
    failed = build_status(
        s, plan(), observed(2), T0, PrepStatus(prep, "Failed", "DeadlineExceeded")
    )
    assert failed["models"][0]["message"] == "DeadlineExceeded"


def test_served_version_keeps_its_preparation_in_status():
    d = ObservedDeployment(
        "chat-aaa",
        "aaa",
        "v1",
        2,
        2,
        T0,
        preparation_key="k1",
        artifact="/models/cache/calibration/k1",
    )
    st = build_status(svc(), plan(), Observed((d,), "aaa", None, None, T0), T0)
    assert st["models"] == [
        {
            "version": "v1",
            "key": "k1",
            "job": "chat-prep-k1",
            "state": "Succeeded",
            "calibration": "Calibrated",
            "artifact": "/models/cache/calibration/k1",
        }
    ]


def test_refused_round_keeps_ready_and_says_why():
    from slimspec_operator.rollout.status import refused

    st = build_status(svc(), plan(), observed(2), T0)
    out = refused(st, "ResourceConflict", "Service chat exists ...", 3, T0)
    c = conds(out)
    assert c["Ready"]["status"] == "True"  # the pods still serve
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ResourceConflict")
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "ResourceConflict")
    assert out["selector"] == st["selector"]  # fields the reconciler owns stay
    bare = refused({}, "InvalidSpec", "bad", 4, T0)
    assert conds(bare)["Ready"]["status"] == "False" and bare["observedGeneration"] == 4
