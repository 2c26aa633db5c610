"""Zero-downtime model rollouts driven through pod readiness, against a real API
server with the operator running as a subprocess. A background monitor checks,
every 50 ms, that the Service always selects at least one ready pod."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.cluster.pods import PodDriver

from .conftest import HASH, Api, OperatorProcess, ServingMonitor, sample

pytestmark = pytest.mark.cluster

SELECTOR = "app.kubernetes.io/instance=chat"
VERSION = "slimspec.io/model-version"


def gated(version: str, gate: threading.Event):
    """Pods of `version` become ready only once `gate` is set; others at once."""
    return lambda pod: pod.metadata.labels.get(VERSION) != version or gate.is_set()


def start_v1(api: Api, timeout_s: int = 60) -> str:
    api.create(sample(replicas=2, rollout={"readyTimeoutSeconds": timeout_s}))
    api.wait(lambda: api.condition("Ready").get("status") == "True", what="v1 Ready")
    api.wait(lambda: api.condition("Progressing").get("reason") == "RolloutComplete")
    return api.service_selector()[HASH]


def versions(api: Api) -> dict[str, int]:
    return {d.metadata.labels[VERSION]: d.status.ready_replicas or 0 for d in api.deployments()}


def v2_model() -> dict:
    return sample(version="v2")["spec"]["model"]


def test_rollout_keeps_old_serving_until_new_is_ready(
    operator: OperatorProcess, api: Api, namespace: str, pod_driver: PodDriver
):
    gate = threading.Event()
    with pod_driver.start(namespace, SELECTOR, ready=gated("v2", gate)):
        old_hash = start_v1(api)
        with ServingMonitor(api) as monitor:
            api.patch_spec({"model": v2_model()})
            api.wait(lambda: "v2" in versions(api), what="v2 Deployment beside v1")
            api.wait(lambda: api.get()["status"].get("rolloutVersion") == "v2")
            time.sleep(3)  # several reconcile rounds with v2 not ready
            assert api.service_selector()[HASH] == old_hash
            assert versions(api) == {"v1": 2, "v2": 0}
            st = api.get()["status"]
            assert st["servedVersion"] == "v1"
            assert api.condition("Progressing")["reason"] == "RollingOut"
            assert api.condition("Ready")["status"] == "True"

            gate.set()  # v2 pods become ready
            api.wait(lambda: versions(api) == {"v2": 2}, what="v1 removed after the switch")
            api.wait(lambda: api.condition("Progressing").get("reason") == "RolloutComplete")
            time.sleep(0.5)
        new_hash = api.service_selector()[HASH]
        assert new_hash != old_hash
        st = api.get()["status"]
        assert st["servedVersion"] == "v2" and "rolloutVersion" not in st
        assert api.condition("Degraded")["status"] == "False"
        assert monitor.samples > 20
        assert monitor.violations == []
        reasons = [e.reason for e in api.core.list_namespaced_event(namespace).items]
        for r in ("RolloutStarted", "TrafficSwitched", "RolloutComplete"):
            assert r in reasons


def test_never_ready_version_is_rolled_back(
    kube_cluster: KubeCluster,
    operator: OperatorProcess,
    api: Api,
    namespace: str,
    pod_driver: PodDriver,
):
    never = threading.Event()
    with pod_driver.start(namespace, SELECTOR, ready=gated("v2", never)):
        old_hash = start_v1(api, timeout_s=4)
        with ServingMonitor(api) as monitor:
            api.patch_spec({"model": v2_model()})
            api.wait(lambda: "v2" in versions(api), what="v2 Deployment")
            api.wait(
                lambda: api.condition("Degraded").get("reason") == "RolloutFailed",
                timeout=30,
                what="Degraded=RolloutFailed",
            )
            api.wait(lambda: versions(api) == {"v1": 2}, what="v2 Deployment deleted")
            time.sleep(3)  # later rounds do not retry the failed version
            assert versions(api) == {"v1": 2}
            assert monitor.violations == []
        assert api.service_selector()[HASH] == old_hash
        st = api.get()["status"]
        assert st["servedVersion"] == "v1" and st["failedVersion"] == "v2"
        assert "rolloutVersion" not in st
        assert api.condition("Ready")["status"] == "True"
        assert api.condition("Progressing")["reason"] == "RolledBack"
        assert "v2 did not become ready" in api.condition("Degraded")["message"]
        warnings = [
            e for e in api.core.list_namespaced_event(namespace).items if e.reason == "RolledBack"
        ]
        assert warnings and warnings[0].type == "Warning"

        # kubectl shows it
        out = kube_cluster.kubectl("get", "ssvc", "chat", "-n", namespace).stdout
        assert out.splitlines()[1].split()[1:4] == ["True", "v2", "v1"]

        # retry the same version by hand: drop the failure record from status
        kube_cluster.kubectl(
            "patch",
            "ssvc",
            "chat",
            "-n",
            namespace,
            "--subresource=status",
            "--type=json",
            "-p",
            '[{"op": "remove", "path": "/status/failedTemplateHash"}]',
        )
        api.wait(lambda: "v2" in versions(api), what="v2 retried")

        # going back to v1 in the spec ends it and clears Degraded, v1 never stopped
        api.patch_spec({"model": sample()["spec"]["model"]})
        api.wait(lambda: versions(api) == {"v1": 2}, what="v2 dropped")
        api.wait(lambda: api.condition("Degraded").get("status") == "False")
        assert "failedVersion" not in api.get()["status"]
        assert api.service_selector()[HASH] == old_hash
        assert monitor.violations == []


def test_operator_restart_mid_rollout_resumes_and_completes(
    operator: OperatorProcess, api: Api, namespace: str, pod_driver: PodDriver
):
    gate = threading.Event()
    with pod_driver.start(namespace, SELECTOR, ready=gated("v2", gate)):
        old_hash = start_v1(api)
        with ServingMonitor(api) as monitor:
            api.patch_spec({"model": v2_model()})
            api.wait(lambda: "v2" in versions(api), what="v2 Deployment")
            operator.stop(signal.SIGKILL)  # crash, no cleanup
            gate.set()
            time.sleep(2)  # v2 ready while no operator runs: nothing switches
            assert api.service_selector()[HASH] == old_hash
            operator.start()
            api.wait(lambda: versions(api) == {"v2": 2}, timeout=45, what="rollout finished")
            api.wait(lambda: api.condition("Progressing").get("reason") == "RolloutComplete")
        assert monitor.violations == []
        assert api.get()["status"]["servedVersion"] == "v2"
        assert api.service_selector()[HASH] != old_hash
