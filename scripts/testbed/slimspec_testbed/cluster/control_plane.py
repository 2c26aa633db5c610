"""A real Kubernetes control plane on loopback: etcd + kube-apiserver +
kube-controller-manager, built by ``scripts/testbed/install.sh`` (no kubelet, no
scheduler: pods are moved through their lifecycle by
:class:`~slimspec_testbed.cluster.pods.PodDriver`).

``with running_cluster() as cluster:`` starts one in a fresh temp dir, yields its
:class:`~slimspec_testbed.cluster.handle.KubeCluster` and always stops it. Component logs are
``<workdir>/{etcd,kube-apiserver,kube-controller-manager}.log``;
``SLIMSPEC_TESTBED_KEEP=1`` keeps the temp dir (certs, logs) afterwards.

Standalone: ``python -m slimspec_testbed`` starts a cluster, prints ``KUBECONFIG=...``
and ``SLIMSPEC_TESTBED_DIR=...`` and runs until Ctrl-C; with ``SLIMSPEC_TESTBED_DIR``
set, the tests' ``kube_cluster`` attaches to that cluster instead of starting one
(fast edit-test loop; a terminating-pod reaper runs only in the process that started
the cluster).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

from kubernetes import client

from slimspec_testbed.cluster.handle import SA_ISSUER, KubeCluster, https_ok
from slimspec_testbed.cluster.pki import make_pki, write_kubeconfig
from slimspec_testbed.cluster.pods import Reaper
from slimspec_testbed.cluster.processes import Component, poll, spawn
from slimspec_testbed.errors import TestbedError, fail
from slimspec_testbed.tools import free_port, tool_path

ADMIN_TOKEN = "slimspec-admin-token"  # throwaway loopback cluster
KCM_TOKEN = "slimspec-kcm-token"
CONTROLLERS = "*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service"
WORKDIR_PREFIX = "slimspec-kube-"


def _start_etcd(workdir: Path) -> tuple[Component, str]:
    client_port, peer_port = free_port(), free_port()
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    comp = spawn(
        "etcd",
        [
            tool_path("etcd"),
            f"--data-dir={workdir / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
        workdir,
    )
    return comp, client_url


def _start_apiserver(
    workdir: Path, etcd_url: str, k8s_version: str | None = None, extra_args: Sequence[str] = ()
) -> tuple[Component, str]:
    pki = workdir / "pki"
    (workdir / "tokens.csv").write_text(
        f'{ADMIN_TOKEN},slimspec-admin,uid-admin,"system:masters"\n'
        f'{KCM_TOKEN},system:kube-controller-manager,uid-kcm,"system:masters"\n'
    )
    port = free_port()
    comp = spawn(
        "kube-apiserver",
        [
            tool_path("kube-apiserver", k8s_version),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'server.crt'}",
            f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24",
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
            *extra_args,
        ],
        workdir,
    )
    return comp, f"https://127.0.0.1:{port}"


def _start_controller_manager(workdir: Path, server: str) -> Component:
    pki = workdir / "pki"
    kcfg = write_kubeconfig(
        workdir / "kcm.kubeconfig", server, pki / "ca.crt", KCM_TOKEN, "kube-controller-manager"
    )
    return spawn(
        "kube-controller-manager",
        [
            tool_path("kube-controller-manager"),
            f"--kubeconfig={kcfg}",
            "--leader-elect=false",
            "--secure-port=0",
            f"--controllers={CONTROLLERS}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--use-service-account-credentials=false",
            "--v=1",
        ],
        workdir,
    )


def _ensure_fake_node(cluster: KubeCluster) -> None:
    """A Ready Node for pods to be bound to (EndpointSlices need the pod's Node)."""
    now = datetime.now(UTC)
    node = client.V1Node(
        metadata=client.V1ObjectMeta(
            name=cluster.node_name, labels={"kubernetes.io/hostname": cluster.node_name}
        )
    )
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_node(node)
        status = {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "fake node of the SlimSpec test bed",
                        "lastHeartbeatTime": now.isoformat(),
                        "lastTransitionTime": now.isoformat(),
                    }
                ],
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "capacity": {"cpu": "64", "memory": "256Gi", "pods": "500"},
                "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "500"},
            }
        }
        core.patch_node_status(cluster.node_name, status)


def start_cluster(
    workdir: Path,
    k8s_version: str | None = None,
    controllers: bool = True,
    apiserver_args: Sequence[str] = (),
) -> KubeCluster:
    """Start etcd, kube-apiserver and kube-controller-manager; stop all on failure.

    ``k8s_version``: that version's kube-apiserver instead of the pinned one.
    ``controllers=False``: etcd and the API server only (no controller-manager, no
    Node, no reaper), enough to install CRDs and check their validation.
    ``apiserver_args``: extra kube-apiserver flags (e.g. an audit log).
    """
    names = ["etcd", "kube-apiserver"] + (["kube-controller-manager"] if controllers else [])
    binaries = [tool_path(n, k8s_version) for n in names]
    del binaries  # looked up first so a missing one fails before anything starts
    make_pki(workdir / "pki")
    components: list[Component] = []
    cluster: KubeCluster | None = None
    try:
        etcd, etcd_url = _start_etcd(workdir)
        components.append(etcd)
        poll(lambda: _alive_or_fail(etcd) and _http_ok(f"{etcd_url}/health"), 30, "etcd /health")
        apiserver, server = _start_apiserver(workdir, etcd_url, k8s_version, apiserver_args)
        components.append(apiserver)
        ca_file = workdir / "pki" / "ca.crt"
        poll(
            lambda: (
                _alive_or_fail(apiserver) and https_ok(f"{server}/readyz", ca_file, ADMIN_TOKEN)
            ),
            90,
            "kube-apiserver /readyz",
        )
        kubeconfig = write_kubeconfig(
            workdir / "admin.kubeconfig", server, ca_file, ADMIN_TOKEN, "slimspec-admin"
        )
        cluster = KubeCluster(workdir, server, ca_file, ADMIN_TOKEN, kubeconfig, components)
        if not controllers:
            return cluster
        kcm = _start_controller_manager(workdir, server)
        components.append(kcm)
        _wait_controllers(cluster, kcm)
        _ensure_fake_node(cluster)
        cluster.reaper = Reaper(cluster)
        return cluster
    except BaseException as exc:
        logs = "\n".join(f"--- {c.name} ---\n{c.log_tail()}" for c in components)
        for comp in reversed(components):
            comp.stop()
        if isinstance(exc, TestbedError):
            fail(f"{exc}\ncomponent logs (workdir {workdir}):\n{logs}", traceback=False)
        raise


def _alive_or_fail(comp: Component) -> bool:
    if not comp.alive():
        fail(f"{comp.name} exited with {comp.proc.returncode}:\n{comp.log_tail()}")
    return True


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait_controllers(cluster: KubeCluster, kcm: Component) -> None:
    """The serviceaccount controller creating default/default proves KCM runs."""
    with cluster.api_client() as api:
        core = client.CoreV1Api(api)
        poll(
            lambda: (
                _alive_or_fail(kcm) and core.read_namespaced_service_account("default", "default")
            ),
            60,
            "kube-controller-manager (default ServiceAccount in namespace default)",
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_workdirs() -> None:
    """Delete temp dirs of earlier runs whose owner died (etcd preallocates 64 MB each)."""
    if os.environ.get("SLIMSPEC_TESTBED_KEEP") == "1":
        return
    for old in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            owner = int((old / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if not _pid_alive(owner):
            shutil.rmtree(old, ignore_errors=True)


def _workdir() -> Path:
    remove_stale_workdirs()
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (workdir / "owner.pid").write_text(str(os.getpid()))
    return workdir


@contextlib.contextmanager
def running_cluster(
    k8s_version: str | None = None, controllers: bool = True, apiserver_args: Sequence[str] = ()
) -> Iterator[KubeCluster]:
    """Start a cluster, yield it, always stop it (and remove its temp dir).

    A failed start keeps its temp dir for the logs (removed by a later run).
    Arguments as for :func:`start_cluster`.
    """
    for attempt in range(3):
        workdir = _workdir()
        try:
            cluster = start_cluster(workdir, k8s_version, controllers, apiserver_args)
            break
        except TestbedError as exc:
            # free_port() races with other processes: a taken port is worth a retry.
            if attempt == 2 or "address already in use" not in str(exc):
                raise
    try:
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("SLIMSPEC_TESTBED_KEEP") != "1":
            shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    """Run a cluster by hand: prints KUBECONFIG and waits for Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up on TERM too
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with &
    with running_cluster() as cluster:
        print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(f"export SLIMSPEC_TESTBED_DIR={cluster.workdir}  # pytest reuses it", flush=True)
        print(f"# server {cluster.server}; logs in {cluster.workdir}; Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
