"""API servers with the SlimSpecService CRD installed, for the CRD's validation tests.

``crd_server`` (function scope, parametrized ``pinned`` / ``floor``): a
:class:`CrdServer` on the test bed's pinned kube-apiserver (the shared ``kube_cluster``)
or on the kube-apiserver of the oldest Kubernetes the chart supports
(K8S_FLOOR_VERSION in scripts/testbed/versions.sh, built by
``scripts/testbed/install-floor.sh``; etcd + API server only). A test that takes it
runs once on each, so every rule is shown to work where the chart says it does.
``floor_cluster`` (session scope): that floor control plane, started on first use.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from slimspec_testbed.cluster.control_plane import running_cluster
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import pinned_versions

CRD = Path(__file__).resolve().parents[2] / "crds" / "slimspecservice.yaml"
CRD_NAME = "slimspecservices.slimspec.io"


@dataclass
class CrdServer:
    """One API server with the CRD established and a namespace to create objects in."""

    version: str
    cluster: KubeCluster
    namespace: str

    def dry_run_create(self, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        """`kubectl create --dry-run=server`: full validation, nothing stored."""
        return self.cluster.kubectl(
            "create",
            "--dry-run=server",
            "-n",
            self.namespace,
            "-o",
            "yaml",
            "-f",
            "-",
            input=yaml.safe_dump(body),
            check=False,
        )


def install_crd(cluster: KubeCluster) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


def _validation_namespace(cluster: KubeCluster) -> str:
    """A plain namespace (no wait for its ServiceAccount: the floor runs no controllers)."""
    name = f"crd-validation-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    return name


@pytest.fixture(scope="session")
def floor_cluster() -> Iterator[KubeCluster]:
    with running_cluster(pinned_versions()["K8S_FLOOR_VERSION"], controllers=False) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _crd_servers() -> Iterator[dict[str, CrdServer]]:
    servers: dict[str, CrdServer] = {}  # one per API server, made on first use
    yield servers
    for server in servers.values():  # matters only for an attached dev cluster
        server.cluster.kubectl(
            "delete",
            "namespace",
            server.namespace,
            "--wait=false",
            "--request-timeout=5s",
            check=False,
        )


@pytest.fixture(params=["pinned", "floor"])
def crd_server(
    request: pytest.FixtureRequest, _crd_servers: dict[str, CrdServer]
) -> Iterator[CrdServer]:
    which = str(request.param)
    if which not in _crd_servers:
        cluster_fixture = "kube_cluster" if which == "pinned" else "floor_cluster"
        cluster: KubeCluster = request.getfixturevalue(cluster_fixture)
        install_crd(cluster)
        versions = pinned_versions()
        version = versions["K8S_VERSION" if which == "pinned" else "K8S_FLOOR_VERSION"]
        _crd_servers[which] = CrdServer(version, cluster, _validation_namespace(cluster))
    server = _crd_servers[which]
    server.cluster.check_alive()
    yield server
