"""Production mode: cluster-wide, with Kopf peering (crds/kopf-peering.yaml), under
the least-privilege role."""

from __future__ import annotations

from pathlib import Path

import pytest
from slimspec_testbed.cluster.handle import KubeCluster

from .conftest import ROOT, Api, OperatorProcess, sample

pytestmark = pytest.mark.cluster


def test_cluster_wide_with_peering(
    kube_cluster: KubeCluster, operator_kubeconfig: Path, api: Api, tmp_path: Path
):
    kube_cluster.kubectl("apply", "-f", str(ROOT / "crds" / "kopf-peering.yaml"))
    kube_cluster.kubectl("wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev")
    kube_cluster.apply(
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": "slimspec-operator"},
        }
    )
    op = OperatorProcess(
        operator_kubeconfig, None, tmp_path / "op.log", extra=("--peering", "slimspec-operator")
    ).start()
    try:
        api.create(sample(replicas=1))
        api.wait(lambda: api.deployments() or None, what="Deployment (cluster-wide operator)")

        def peers() -> dict:
            obj = api.custom.get_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings", "slimspec-operator"
            )
            return obj.get("status") or {}

        assert api.wait(peers, what="operator registered in the peering object")
        # RBAC denials read 'forbidden: User "system:serviceaccount:..." cannot ...'
        # (other namespaces' leftovers may be terminating: that is not RBAC).
        assert "forbidden: User" not in op.log()
    finally:
        op.stop()
        print(op.log()[-4000:])
