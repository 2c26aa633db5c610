"""The refusal to adopt (pure): an object is writable only when absent or controlled
by this resource (same UID)."""

from __future__ import annotations

from typing import Any

from slimspec_operator.kube.ownership import Conflict, conflict_message, conflicts, owned_by


def obj(*refs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "x", "ownerReferences": list(refs)}}


def ref(uid: str, controller: bool = True, kind: str = "SlimSpecService", name: str = "chat"):
    return {"apiVersion": "v1", "kind": kind, "name": name, "uid": uid, "controller": controller}


def test_owned_only_with_our_controller_reference() -> None:
    assert owned_by(obj(ref("u1")), "u1")
    assert not owned_by(obj(ref("u2")), "u1")  # another resource of the same name, earlier
    assert not owned_by(obj(ref("u1", controller=False)), "u1")  # owner, not controller
    assert not owned_by(obj(), "u1")
    assert not owned_by(obj(ref("")), "")  # no UID matches nothing


def test_conflicts_name_every_foreign_object() -> None:
    found = [
        ("Service", "chat", {"metadata": {"name": "chat"}}),
        ("ConfigMap", "chat-runtime", None),  # absent: ours to create
        ("Role", "chat-engine", obj(ref("u1"))),  # ours
        ("Deployment", "chat-abc", obj(ref("x", kind="ReplicaSet", name="rs"))),
    ]
    assert conflicts(found, "u1") == [
        Conflict("Service", "chat", "it has no controller"),
        Conflict("Deployment", "chat-abc", "controlled by ReplicaSet rs"),
    ]
    assert conflicts(found[1:3], "u1") == []
    text = conflict_message(conflicts(found, "u1"))
    assert "Service chat exists and is not owned by this SlimSpecService" in text
    assert "Deployment chat-abc" in text and "changes nothing" in text


def test_long_lists_are_cut() -> None:
    many = [Conflict("ConfigMap", f"c{i}", "it has no controller") for i in range(5)]
    text = conflict_message(many)
    assert "c2" in text and "c3" not in text and "and 2 more" in text


def test_the_names_a_round_may_write() -> None:
    from slimspec_operator.resource.spec import SlimSpecService
    from slimspec_operator.rollout.model_prep import preparation
    from slimspec_operator.rollout.reconcile import writable_names

    from .helpers import body

    s = SlimSpecService.from_body(body())
    kinds = {k for k, _ in writable_names(s, preparation(s))}
    assert kinds == {
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "PodDisruptionBudget",
    }
    # a budget turned off: someone else's PodDisruptionBudget of that name is no conflict
    off = SlimSpecService.from_body(body(disruptionBudget={"enabled": False}))
    assert "PodDisruptionBudget" not in {k for k, _ in writable_names(off, None)}
    # model preparation adds its Job and the cache claim (unless the spec names a claim)
    cal = SlimSpecService.from_body(body(calibration={"enabled": True}))
    names = dict(writable_names(cal, preparation(cal)))
    assert names["PersistentVolumeClaim"] == "chat-model-cache"
    assert names["Job"].startswith("chat-prep-")
    given = SlimSpecService.from_body(
        body(calibration={"enabled": True}, modelCache={"claimName": "shared"})
    )
    assert "PersistentVolumeClaim" not in dict(writable_names(given, preparation(given)))
