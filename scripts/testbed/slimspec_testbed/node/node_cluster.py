"""A real Kubernetes cluster of one or two nodes for the end-to-end tests.

``scripts/testbed/node.sh up`` makes a private network + mount namespace with the
pods' bridge (the node IP), starts the node's containerd and imports the test bed's
images into it (by content tag). This module then starts a control plane *inside the
first node's network namespace* — etcd, kube-apiserver (Node + RBAC authorization,
NodeRestriction), kube-controller-manager (node lifecycle included), kube-scheduler —
each with the identity a real cluster gives it, and ``node.sh start`` adds kubelet and
kube-proxy. Pods run for real: images from the node's containerd, CNI bridge
addresses, probes by kubelet, Services through kube-proxy's iptables rules. With
``nodes=2`` a second node (its own namespaces, containerd, kubelet and kube-proxy) is
joined to the first by a veth pair (``node.sh link``); its kubelet reaches the API
server at the first node's IP, and each node routes the other's pod range.

``with running_node_cluster(nodes=2) as node:`` yields a :class:`NodeCluster`:

- ``.cluster``: a :class:`~slimspec_testbed.cluster.handle.KubeCluster` (admin kubeconfig,
  ``kubectl``, ``apply``, ``api_client``, ``create_namespace`` ...). Its API server
  listens on 127.0.0.1 *of the node's namespace*: use it inside ``node.entered()``.
- ``.entered()``: a context manager that puts the calling thread into the node's
  network namespace (pod IPs, Service ClusterIPs, the API server).
- ``.images``: the :class:`~slimspec_testbed.node.images.ImageTags` the node holds.
- ``.node_name``, ``.node_ip``, ``.node_dir`` (logs: ``logs/*.log``): the first node;
  ``.nodes``: every node (:class:`Node`: ``name``, ``ip``, ``dir``); ``.logs()``.

Nothing is routed off the machine: a namespace has only ``lo``, the bridge and the
link to the other node.
Tear-down removes processes, mounts, interfaces, iptables rules and cgroups; a
watchdog does it when the owning process dies, and the next ``up`` cleans up after a
killed watchdog (``node.sh``). ``SLIMSPEC_TESTBED_KEEP=1`` keeps the node's directory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from slimspec_testbed.cluster.handle import SA_ISSUER, KubeCluster, https_ok
from slimspec_testbed.cluster.pki import (
    FRONT_PROXY_CLIENT,
    make_front_proxy_pki,
    make_pki,
    write_kubeconfig,
)
from slimspec_testbed.cluster.processes import Component, poll, spawn
from slimspec_testbed.errors import TestbedError, fail
from slimspec_testbed.node.images import ImageTags, image_tags
from slimspec_testbed.node.netns import NetworkNamespace
from slimspec_testbed.tools import REPO_ROOT, cache_dir, pinned_versions, tool_path

NODE_SCRIPT = REPO_ROOT / "scripts" / "testbed" / "node.sh"
RUN_PREFIX = "slimspec-node-"
ETCD_PORT, ETCD_PEER_PORT, APISERVER_PORT = 2379, 2380, 6443
LOCAL_SERVER = f"https://127.0.0.1:{APISERVER_PORT}"
NODE_HINT = "run `bash scripts/testbed/install.sh` and `bash scripts/testbed/images.sh`"
# Controllers of a real single-node cluster without a cloud: node lifecycle on (it
# removes the new node's not-ready taint); no pod CIDR allocation (the CNI config
# has the range), no cloud routes or load balancers.
CONTROLLERS = "*,-nodeipam,-cloud-node-lifecycle,-route,-service"

# name -> (token, user, groups): the identities a kubeadm cluster gives its parts.
IDENTITIES = {
    "admin": ("slimspec-admin-token", "slimspec-admin", "system:masters"),
    "kcm": ("slimspec-kcm-token", "system:kube-controller-manager", ""),
    "scheduler": ("slimspec-scheduler-token", "system:kube-scheduler", ""),
    "kube-proxy": ("slimspec-proxy-token", "system:kube-proxy", ""),
}


def node_binary(name: str) -> Path:
    path = cache_dir() / "k8s" / f"{pinned_versions()['K8S_VERSION']}-node" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        fail(f"test bed binary {name!r} not found at {path}: {NODE_HINT}", traceback=False)
    return path


def read_state(node_dir: Path) -> dict[str, str]:
    lines = (node_dir / "state.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@dataclass(frozen=True)
class Node:
    """One node of the cluster: its Kubernetes name, IP and run directory."""

    name: str
    ip: str
    dir: Path


@dataclass
class NodeCluster:
    """Handle on a running real-node cluster; see the module docstring."""

    cluster: KubeCluster
    node_dir: Path
    netns: NetworkNamespace
    images: ImageTags
    node_name: str
    node_ip: str
    timings: dict[str, float] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)

    def entered(self) -> contextlib.AbstractContextManager[None]:
        return self.netns.entered()

    def node_exec(
        self, *argv: str, check: bool = True, timeout: float = 60, node: int = 0
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside a node's network + mount namespace (the first's by default)."""
        node_dir = self.nodes[node].dir if self.nodes else self.node_dir
        return _run_node_script("exec", str(node_dir), *argv, check=check, timeout=timeout)

    def logs(self, chars: int = 3000) -> str:
        parts = [self.cluster.logs()]
        for node in self.nodes:
            for path in sorted((node.dir / "logs").glob("*.log")):
                text = path.read_text(errors="replace")[-chars:]
                parts.append(f"--- {node.name}: {path.name} ---\n{text}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        dead = [c.name for c in self.cluster.components if not c.alive()]
        dead += [
            f"{node.name}: {name}"
            for node in self.nodes
            for name in ("containerd", "kubelet", "kube-proxy")
            if not _pid_file_alive(node.dir / f"{name}.pid")
        ]
        if dead:
            fail(f"real node component(s) died: {dead}\n{self.logs()}", traceback=False)


def _pid_file_alive(path: Path) -> bool:
    try:
        os.kill(int(path.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def _run_node_script(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["bash", str(NODE_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and proc.returncode != 0:
        fail(f"node.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


# ------------------------------------------------------------------ control plane


def _in_ns(holder: int) -> list[str]:
    return ["nsenter", "-t", str(holder), "-n", "--"]


def _kubelet_token(node_name: str) -> str:
    return f"{node_name}-kubelet-token"


def _write_tokens(workdir: Path, node_names: list[str]) -> None:
    rows = [
        f'{tok},{user},uid-{name},"{groups}"' for name, (tok, user, groups) in IDENTITIES.items()
    ]
    # Each kubelet's identity: the Node authorizer and NodeRestriction key on it.
    rows += [
        f'{_kubelet_token(n)},system:node:{n},uid-kubelet-{n},"system:nodes"' for n in node_names
    ]
    (workdir / "tokens.csv").write_text("\n".join(rows) + "\n")


def _kubeconfig(workdir: Path, name: str) -> Path:
    token, user, _ = IDENTITIES[name]
    return write_kubeconfig(
        workdir / f"{name}.kubeconfig", LOCAL_SERVER, workdir / "pki" / "ca.crt", token, user
    )


def _start_control_plane(
    workdir: Path, holder: int, node_ip: str, service_cidr: str
) -> list[Component]:
    pki = workdir / "pki"
    ns = _in_ns(holder)
    etcd_url = f"http://127.0.0.1:{ETCD_PORT}"
    peer_url = f"http://127.0.0.1:{ETCD_PEER_PORT}"
    etcd = spawn(
        "etcd",
        [
            *ns, tool_path("etcd"), f"--data-dir={workdir / 'etcd'}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
        ],
        workdir,
    )  # fmt: skip
    apiserver = spawn(
        "kube-apiserver",
        [
            *ns, tool_path("kube-apiserver"), f"--etcd-servers={etcd_url}",
            # Inside the node's namespace: loopback for the parts and the tests, the
            # node IP for pods (the `kubernetes` Service's endpoint).
            "--bind-address=0.0.0.0", f"--advertise-address={node_ip}",
            f"--secure-port={APISERVER_PORT}", f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'server.crt'}", f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={workdir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-issuer={SA_ISSUER}", f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={service_cidr}", "--allow-privileged=true",
            # The aggregation layer, as kubeadm configures it: extension API servers
            # (KEDA's external metrics) get requests with the caller in headers,
            # signed by the front proxy's own CA.
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--profiling=false", "--v=1",
        ],
        workdir,
    )  # fmt: skip
    kcm = spawn(
        "kube-controller-manager",
        [
            *ns, tool_path("kube-controller-manager"),
            f"--kubeconfig={_kubeconfig(workdir, 'kcm')}",
            "--leader-elect=false", "--secure-port=0", f"--controllers={CONTROLLERS}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            "--use-service-account-credentials=true",
            # A test bed: notice a lost node and evict its pods sooner than a cloud.
            "--node-monitor-grace-period=20s", "--v=1",
        ],
        workdir,
    )  # fmt: skip
    scheduler = spawn(
        "kube-scheduler",
        [
            *ns, node_binary("kube-scheduler"), f"--kubeconfig={_kubeconfig(workdir, 'scheduler')}",
            "--leader-elect=false", "--secure-port=0", "--v=1",
        ],
        workdir,
    )  # fmt: skip
    return [etcd, apiserver, kcm, scheduler]


def _alive_or_fail(comp: Component) -> bool:
    if not comp.alive():
        fail(f"{comp.name} exited with {comp.proc.returncode}:\n{comp.log_tail()}")
    return True


def _node_ready(core: client.CoreV1Api, name: str) -> bool:
    node: Any = core.read_node(name)
    conds = {c.type: c.status for c in node.status.conditions or []}
    taints = {t.key for t in node.spec.taints or []}
    return conds.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints


def _up(node_dir: Path, index: int, timings: dict[str, float]) -> dict[str, str]:
    t0 = time.monotonic()
    # The first run imports several GB of images: allow for it (and for the node lock).
    up = _run_node_script("up", str(node_dir), str(os.getpid()), str(index), timeout=3600)
    timings[f"node{index}_up_s" if index else "node_up_s"] = time.monotonic() - t0
    (node_dir / "logs" / "node-up.log").write_text(up.stdout + up.stderr)
    return read_state(node_dir)


def _start(node_dirs: list[Path], timings: dict[str, float]) -> NodeCluster:
    states = [_up(d, i, timings) for i, d in enumerate(node_dirs)]
    if len(node_dirs) == 2:
        _run_node_script("link", *map(str, node_dirs))
    nodes = [
        Node(st["NODE_NAME"], st["NODE_IP"], d) for st, d in zip(states, node_dirs, strict=True)
    ]
    first = nodes[0]
    holder = int(states[0]["HOLDER_PID"])
    netns = NetworkNamespace(holder)
    workdir = first.dir / "control-plane"
    workdir.mkdir()
    make_pki(workdir / "pki", server_ips=(first.ip,))
    make_front_proxy_pki(workdir / "pki")
    _write_tokens(workdir, [n.name for n in nodes])
    t1 = time.monotonic()
    components = _start_control_plane(workdir, holder, first.ip, states[0]["SERVICE_CIDR"])
    etcd, apiserver, kcm, scheduler = components
    ca_file = workdir / "pki" / "ca.crt"
    admin_token = IDENTITIES["admin"][0]
    kubeconfig = _kubeconfig(workdir, "admin")
    cluster = KubeCluster(workdir, LOCAL_SERVER, ca_file, admin_token, kubeconfig, components)
    cluster.node_name = first.name
    with netns.entered():
        poll(
            lambda: (
                _alive_or_fail(apiserver)
                and _alive_or_fail(etcd)
                and https_ok(f"{LOCAL_SERVER}/readyz", ca_file, admin_token)
            ),
            90,
            "kube-apiserver /readyz (in the node's namespace)",
        )
        timings["control_plane_s"] = time.monotonic() - t1
        proxy_token, proxy_user, _ = IDENTITIES["kube-proxy"]
        for node in nodes:
            # The first node's parts share its namespace (loopback); the others come
            # over the link to the first node's IP.
            server = LOCAL_SERVER if node is first else f"https://{first.ip}:{APISERVER_PORT}"
            write_kubeconfig(
                node.dir / "kubelet.kubeconfig", server, ca_file, _kubelet_token(node.name),
                f"system:node:{node.name}",
            )  # fmt: skip
            write_kubeconfig(
                node.dir / "kube-proxy.kubeconfig", server, ca_file, proxy_token, proxy_user
            )
        t2 = time.monotonic()
        for node in nodes:
            _run_node_script("start", str(node.dir), timeout=120)
        with cluster.api_client() as api:
            core = client.CoreV1Api(api)
            names = [n.name for n in nodes]
            poll(
                lambda: (
                    all(_alive_or_fail(c) for c in (kcm, scheduler))
                    and all(_node_ready(core, n) for n in names)
                ),
                120,
                f"nodes {names} Ready without the not-ready taint",
            )
            poll(
                lambda: core.read_namespaced_service_account("default", "default"),
                60,
                "the default ServiceAccount (controller-manager running)",
            )
        timings["kubelet_to_ready_s"] = time.monotonic() - t2
    return NodeCluster(
        cluster=cluster,
        node_dir=first.dir,
        netns=netns,
        images=image_tags(),
        node_name=first.name,
        node_ip=first.ip,
        timings=timings,
        nodes=nodes,
    )


def _down(node_dir: Path) -> None:
    _run_node_script("down", str(node_dir), check=False, timeout=300)


@contextlib.contextmanager
def running_node_cluster(nodes: int = 1) -> Iterator[NodeCluster]:
    """Bring up `nodes` (1 or 2) nodes and the control plane, yield them, always tear it
    all down."""
    if nodes not in (1, 2):
        raise ValueError(f"nodes={nodes}: the test bed runs one or two nodes")
    node_dirs = [Path(tempfile.mkdtemp(prefix=RUN_PREFIX)) for _ in range(nodes)]
    timings: dict[str, float] = {}
    node: NodeCluster | None = None
    try:
        node = _start(node_dirs, timings)
    except BaseException as exc:
        logs = "\n".join(_collect_logs(d) for d in node_dirs)
        for d in reversed(node_dirs):
            _down(d)  # the control plane too: it runs in the first node's namespace
        if isinstance(exc, TestbedError):
            fail(f"{exc}\nlogs of the node run {node_dirs}:\n{logs}", traceback=False)
        raise
    try:
        yield node
    finally:
        node.cluster.stop()
        for d in reversed(node_dirs):
            _down(d)


def _collect_logs(node_dir: Path, chars: int = 2500) -> str:
    parts = []
    for path in sorted(node_dir.glob("**/*.log")):
        parts.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(parts)
