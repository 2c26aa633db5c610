"""The Kopf glue's per-resource memory: one reconcile at a time per resource, and
nothing kept for a resource once it is gone (an operator that watches many
short-lived resources must not grow without bound)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from slimspec_operator.rollout import handlers

LOG = logging.getLogger(__name__)


class GoneKube:
    """The API client's one read a deleted resource gets: 404."""

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return None


def _body(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "ml", "uid": uid}}


def test_a_deleted_resource_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "shared", GoneKube)
    # What a live resource's rounds left (a ratio written, a generation reconciled).
    monkeypatch.setitem(handlers._written_ratio, "uid-1", 0.3)
    monkeypatch.setitem(handlers._reconciled_generation, "uid-1", 2)
    handlers.run(_body("uid-1"), LOG)
    assert "uid-1" not in handlers._written_ratio
    assert "uid-1" not in handlers._reconciled_generation
    assert handlers._locks == {}


def test_rounds_of_one_resource_take_turns_and_then_free_their_lock() -> None:
    inside: list[str] = []
    overlaps: list[bool] = []

    def round_of(uid: str) -> None:
        with handlers._exclusive(uid):
            overlaps.append(uid in inside)
            inside.append(uid)
            time.sleep(0.02)
            inside.remove(uid)

    threads = [threading.Thread(target=round_of, args=(u,)) for u in ("a", "a", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert overlaps == [False] * 4  # never two rounds of one resource at once
    assert handlers._locks == {}


def test_a_failed_round_frees_its_lock() -> None:
    with pytest.raises(RuntimeError), handlers._exclusive("uid-2"):
        raise RuntimeError("round failed")
    assert handlers._locks == {}


def test_a_deletion_event_forgets_the_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(handlers._written_ratio, "uid-3", 0.3)
    monkeypatch.setitem(handlers._reconciled_generation, "uid-3", 1)
    going = {"metadata": {"uid": "uid-3", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert handlers._gone(going, type="MODIFIED")
    assert handlers._gone({"metadata": {"uid": "uid-3"}}, type="DELETED")
    assert not handlers._gone({"metadata": {"uid": "uid-3"}}, type="MODIFIED")
    handlers.on_gone(going)
    assert "uid-3" not in handlers._written_ratio
    assert "uid-3" not in handlers._reconciled_generation
