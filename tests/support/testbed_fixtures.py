"""pytest fixtures over the test bed package (scripts/testbed/slimspec_testbed).

All fail (never skip) with "run `bash scripts/testbed/install.sh`" when a binary is
missing. The objects they yield are documented in the package's modules.

``kube_cluster`` (session scope; shared by every test module of the run)
    A :class:`~slimspec_testbed.cluster.handle.KubeCluster`
    (``slimspec_testbed.cluster.control_plane`` starts it). With ``SLIMSPEC_TESTBED_DIR``
    set (``python -m slimspec_testbed`` prints it) the run attaches to that cluster
    instead and leaves it running.
``namespace`` (function scope): a fresh namespace name per test, deleted after it.
``pod_driver`` (function scope): a :class:`~slimspec_testbed.cluster.pods.PodDriver`;
    background drivers it started are stopped at test end.
``helm`` (function scope, needs ``kube_cluster``): a :class:`~slimspec_testbed.tools.Helm`;
    ``helm.path`` is the binary, ``helm("install", "rel", chart_dir, "-n", ns)``
    runs it with the cluster's kubeconfig and returns ``CompletedProcess`` (text;
    raises ``subprocess.CalledProcessError`` with stderr in the message on failure
    unless ``check=False``).
``helm_local`` (function scope, no cluster): the same for ``lint``/``template``.
``promtool`` (session): ``Path`` to promtool.
``prometheus_server`` (function): factory ``start(targets, *, scrape_interval="1s",
    rule_files=(), extra_config=None) -> PrometheusServer``
    (:mod:`slimspec_testbed.prometheus`). The server runs on a free loopback port, is
    ready when returned, and is stopped at test end.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from slimspec_testbed.cluster.control_plane import running_cluster
from slimspec_testbed.cluster.handle import KubeCluster, attach_cluster
from slimspec_testbed.cluster.pods import PodDriver
from slimspec_testbed.errors import TestbedError
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer, scrape_config
from slimspec_testbed.tools import Helm, helm_env, tool_path


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test bed error whose message says it all (missing binary, dead component with
    its log) is reported as that message alone, as pytest.fail(pytrace=False) is."""
    report = yield
    excinfo = call.excinfo
    if (
        excinfo is not None
        and isinstance(excinfo.value, TestbedError)
        and not excinfo.value.traceback
        and not item.config.getoption("fulltrace", False)
    ):
        report.longrepr = excinfo.getrepr(style="value")
    return report


# ------------------------------------------------------------------- cluster


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    attach = os.environ.get("SLIMSPEC_TESTBED_DIR")
    if attach:  # reuse a long-running dev cluster; it keeps running afterwards
        yield attach_cluster(Path(attach))
        return
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    kube_cluster.check_alive()
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = kube_cluster.create_namespace(f"{base or 't'}-{uuid.uuid4().hex[:5]}")
    yield name
    kube_cluster.delete_namespace(name)


@pytest.fixture
def pod_driver(kube_cluster: KubeCluster) -> Iterator[PodDriver]:
    driver = kube_cluster.pod_driver()
    yield driver
    driver.stop_all()


# ---------------------------------------------------------------------- helm


@pytest.fixture
def helm(kube_cluster: KubeCluster, tmp_path: Path) -> Helm:
    """helm v3 talking to the test cluster (its kubeconfig in the environment)."""
    return Helm(path=tool_path("helm"), env=helm_env(kube_cluster.env, tmp_path / "helm"))


@pytest.fixture
def helm_local(tmp_path: Path) -> Helm:
    """helm v3 without a cluster, for lint/template/package (starts nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return Helm(path=tool_path("helm"), env=helm_env(env, tmp_path / "helm"))


# ---------------------------------------------------------------- prometheus


@pytest.fixture(scope="session")
def promtool() -> Path:
    return tool_path("promtool")


@pytest.fixture
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusFactory]:
    """Factory: start(targets, scrape_interval="1s", rule_files=(), extra_config=None)."""
    binary = tool_path("prometheus")
    servers: list[PrometheusServer] = []

    def start(
        targets: Sequence[str],
        *,
        scrape_interval: str = "1s",
        rule_files: Sequence[str | os.PathLike[str]] = (),
        extra_config: dict[str, Any] | None = None,
        job: str = "slimspec",
    ) -> PrometheusServer:
        config = scrape_config(targets, scrape_interval, job, rule_files)
        config.update(extra_config or {})
        server = PrometheusServer(binary, tmp_path_factory.mktemp("prometheus"), config)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
