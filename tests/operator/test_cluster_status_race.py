"""Status writes are conditional on the resourceVersion the reconciler read, against a
real API server: a write that lands between our read and our status write (a user's
`kubectl patch --subresource=status`, the tuner) is never overwritten from the stale
read, and the handler plans again from what is there now.

The reconciler runs in-process here (admin credentials) so the test can put the other
write exactly inside that window instead of hoping for the timing."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from slimspec_operator.kube import client as kube_module
from slimspec_operator.kube.client import FIELD_MANAGER, ApiError, Kube
from slimspec_operator.rollout import handlers
from slimspec_operator.rollout.reconcile import reconcile

from .conftest import Api, G, P, V, sample

pytestmark = pytest.mark.cluster


class RacingKube(Kube):
    """Kube that lets another writer change the object's status just before our
    first status write (once)."""

    def __init__(self, api: Api) -> None:
        super().__init__(api.client)
        self.admin = api
        self.raced = False

    def apply(
        self,
        manifest: Mapping[str, Any],
        subresource: str | None = None,
        *,
        manager: str = FIELD_MANAGER,
    ) -> dict[str, Any]:
        if subresource == "status" and not self.raced:
            self.raced = True
            self.admin.custom.patch_namespaced_custom_object_status(
                G, V, self.admin.ns, P, "chat", {"status": {"failedVersion": "set-by-user"}}
            )
        return super().apply(manifest, subresource, manager=manager)


def test_status_write_from_a_stale_read_conflicts_and_keeps_the_other_write(
    operator_kubeconfig: Path, api: Api, namespace: str
):
    api.create(sample(replicas=1))
    kube = RacingKube(api)
    with pytest.raises(ApiError) as err:
        reconcile(kube, api.get(), datetime.now(UTC))
    assert err.value.status == 409
    status = api.get().get("status", {})
    assert status.get("failedVersion") == "set-by-user"
    assert "observedGeneration" not in status  # nothing of the stale plan landed


def test_handler_replans_after_a_conflict(
    operator_kubeconfig: Path,
    api: Api,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
):
    api.create(sample(replicas=1))
    stale = api.get()
    monkeypatch.setattr(kube_module, "_shared", RacingKube(api))
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(handlers, "_event_sink", lambda fresh, logger: lambda *e: events.append(e))
    handlers.run(stale, logging.getLogger("test"))
    svc = api.get()
    assert svc["status"]["observedGeneration"] == svc["metadata"]["generation"]
    assert svc["status"]["failedVersion"] == "set-by-user"  # read, not overwritten
    assert [d.metadata.labels["slimspec.io/model-version"] for d in api.deployments()] == ["v1"]
    assert ("Normal", "Creating", "creating Deployment for v1") in events
