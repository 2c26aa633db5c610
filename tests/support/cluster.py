"""A real Kubernetes control plane on loopback for tests: etcd + kube-apiserver +
kube-controller-manager, built by ``scripts/testbed/install.sh`` (no kubelet, no
scheduler: pods are moved through their lifecycle by :class:`PodDriver`).

Fixtures (all fail, never skip, when binaries are missing)
----------------------------------------------------------
``kube_cluster`` (session scope; shared by every test module of the run)
    A :class:`KubeCluster`:

    - ``.server`` API URL (``https://127.0.0.1:<port>``); ``.kubeconfig`` admin
      kubeconfig (bearer token, ``system:masters``); ``.token``; ``.ca_file``.
    - ``.env``: a full environment for subprocesses (``os.environ`` plus
      ``KUBECONFIG`` and the test bed's bin dir first on ``PATH``: kubectl, helm).
      Run kopf / the operator with it.
    - ``.api_client(token=None)``: a new ``kubernetes.client.ApiClient`` (admin, or
      the given bearer token); close it or use it as a context manager.
    - ``.kubectl(*args, check=True, input=None)``: ``CompletedProcess`` (text).
    - ``.apply(yaml_text | dict | list_of_dicts, namespace="")``: ``kubectl apply``.
    - ``.create_namespace(name=None)`` -> name (waits for its ``default``
      ServiceAccount, so pods can be created right away); ``.delete_namespace(name)``.
    - ``.service_account_token(ns, sa, create=True)`` -> token (TokenRequest API);
      ``.service_account_kubeconfig(ns, sa, create=True)`` -> ``Path`` of a
      kubeconfig for that ServiceAccount (least-privilege RBAC tests).
    - ``.pod_driver()`` -> :class:`PodDriver` (see below).
    - ``.wait_for(fn, timeout=30, what="...")`` polls ``fn()`` until truthy and
      returns its value; ``.wait_deployment_available(ns, name, timeout=60)``.
    - ``.node_name``: the fake Node pods get bound to (``slimspec-fake-node``).
``namespace`` (function scope): a fresh namespace name per test, deleted after it.
``pod_driver`` (function scope): a :class:`PodDriver`; background drivers it
    started are stopped at test end.

PodDriver (plays kubelet for pods matching a namespace + label selector)
    - ``.mark(ns, selector="", ready=True)`` one pass: binds unscheduled pods to the
      fake node and patches ``pods/status`` (phase Running, podIP, Ready/
      ContainersReady conditions = ``ready``, container statuses); pods being
      deleted are removed (grace 0) as a kubelet would. Returns changed pod names.
      ``ready`` may be a callable ``(V1Pod) -> bool`` (e.g. new version never ready).
    - ``.start(ns, selector="", ready=True, interval=0.2)`` -> handle with
      ``.stop()``: does ``mark`` in a background thread until stopped, so
      Deployment rollouts driven by an operator complete. Also usable as a
      context manager: ``with pod_driver.start(ns): ...``.

Environment: ``SLIMSPEC_TESTBED_KEEP=1`` keeps the temp dir (certs, logs) after the
run; component logs are ``<workdir>/{etcd,kube-apiserver,kube-controller-manager}.log``.
Standalone: ``python -m tests.support.cluster`` starts a cluster, prints
``KUBECONFIG=...`` and ``SLIMSPEC_TESTBED_DIR=...`` and runs until Ctrl-C; with
``SLIMSPEC_TESTBED_DIR`` set, ``kube_cluster`` attaches to that cluster instead of
starting one (fast edit-test loop; a terminating-pod reaper runs only in the
process that started the cluster).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

pytest.register_assert_rewrite("tests.support.tools")  # loaded as a plugin after us

from tests.support.tools import cache_dir, free_port, run_checked, tool_path  # noqa: E402

T = TypeVar("T")

ADMIN_TOKEN = "slimspec-admin-token"  # throwaway loopback cluster
KCM_TOKEN = "slimspec-kcm-token"
FAKE_NODE = "slimspec-fake-node"
CONTROLLERS = "*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-route,-service"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


# ----------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """Child pre-exec: SIGKILL when pytest dies, so no control plane outlives it.

    Not SIGTERM: kube-apiserver can hang in graceful shutdown once etcd is gone.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _spawn(name: str, argv: Sequence[str | os.PathLike[str]], workdir: Path) -> Component:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,  # only calls prctl
        )
    return Component(name, proc, log_path)


def _poll(fn: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call fn until it returns something truthy; pytest.fail after timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # keep the last error for the failure message
            last_error = exc
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")
        time.sleep(interval)


# ---------------------------------------------------------------------- certs


def _openssl(*args: str, cwd: Path) -> None:
    run_checked(["openssl", *args], cwd=cwd, timeout=60)


def make_pki(pki: Path) -> None:
    """CA, API serving cert (127.0.0.1/localhost) and service-account key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=pki)
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-days", "30", "-subj",
        "/CN=slimspec-testbed-ca", "-out", "ca.crt", cwd=pki,
    )  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "server.key", cwd=pki)
    _openssl(
        "req", "-new", "-key", "server.key", "-subj", "/CN=kube-apiserver", "-out",
        "server.csr", cwd=pki,
    )  # fmt: skip
    (pki / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "30", "-extfile", "server.ext", "-out", "server.crt",
        cwd=pki,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "slimspec",
                "cluster": {"server": server, "certificate-authority": str(ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": "slimspec", "user": user}}],
        "current-context": user,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


# -------------------------------------------------------------------- cluster


@dataclass
class KubeCluster:
    """Handle on a running test control plane; see the module docstring."""

    workdir: Path
    server: str
    ca_file: Path
    token: str
    kubeconfig: Path
    components: list[Component] = field(default_factory=list)
    node_name: str = FAKE_NODE
    reaper: Reaper | None = None

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{cache_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def api_client(self, token: str | None = None) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = self.server
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.api_key = {"authorization": token or self.token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        argv: list[str | os.PathLike[str]] = [
            tool_path("kubectl"),
            f"--kubeconfig={self.kubeconfig}",
            *args,
        ]
        return run_checked(argv, env=self.env, check=check, input=input, timeout=timeout)

    def apply(
        self, manifests: str | dict[str, Any] | list[dict[str, Any]], namespace: str = ""
    ) -> str:
        """kubectl apply of YAML text or manifest dicts; returns kubectl's output."""
        if isinstance(manifests, str):
            text = manifests
        else:
            text = yaml.safe_dump_all(manifests if isinstance(manifests, list) else [manifests])
        ns_args = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns_args, "-f", "-", input=text).stdout

    def wait_for(self, fn: Callable[[], T], timeout: float = 30, what: str = "condition") -> T:
        return _poll(fn, timeout, what, interval=0.2)

    # -- namespaces and identities

    def create_namespace(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:8]}"
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
            # Pod admission needs the namespace's default ServiceAccount.
            self.wait_for(
                lambda: core.read_namespaced_service_account("default", name),
                what=f"default ServiceAccount in namespace {name}",
            )
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete without waiting; pods are force-removed since no kubelet will."""
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            with contextlib.suppress(ApiException):
                core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
            with contextlib.suppress(ApiException):
                core.delete_namespace(name)

    def service_account_token(
        self, namespace: str, name: str, *, create: bool = True, seconds: int = 86400
    ) -> str:
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            if create:
                sa = client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
                try:
                    core.create_namespaced_service_account(namespace, sa)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[SA_ISSUER], expiration_seconds=seconds)
            )
            resp = core.create_namespaced_service_account_token(name, namespace, request)
            return str(resp.status.token)

    def service_account_kubeconfig(self, namespace: str, name: str, *, create: bool = True) -> Path:
        token = self.service_account_token(namespace, name, create=create)
        path = self.workdir / f"kubeconfig-{namespace}-{name}"
        return write_kubeconfig(path, self.server, self.ca_file, token, f"{namespace}-{name}")

    # -- workloads

    def pod_driver(self) -> PodDriver:
        return PodDriver(self)

    def wait_deployment_available(self, namespace: str, name: str, timeout: float = 60) -> Any:
        """Wait for Available=True with all replicas updated and ready; returns it."""
        with self.api_client() as api:
            apps = client.AppsV1Api(api)

            def done() -> Any:
                dep = apps.read_namespaced_deployment(name, namespace)
                st = dep.status
                conds = {c.type: c.status for c in st.conditions or []}
                want = dep.spec.replicas or 0
                ok = (
                    conds.get("Available") == "True"
                    and st.observed_generation == dep.metadata.generation
                    and (st.updated_replicas or 0) == want
                    and (st.ready_replicas or 0) == want
                    and (st.replicas or 0) == want
                )
                return dep if ok else None

            return self.wait_for(done, timeout, f"deployment {namespace}/{name} available")

    # -- lifecycle

    def stop(self) -> None:
        if self.reaper is not None:
            self.reaper.stop()
        for comp in reversed(self.components):
            comp.stop()

    def check_alive(self) -> None:
        """pytest.fail with the logs if a control plane process has died."""
        dead = [c.name for c in self.components if not c.alive()]
        if dead:
            pytest.fail(f"test cluster component(s) died: {dead}\n{self.logs()}", pytrace=False)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.log_tail()}" for c in self.components)


def _https_ok(url: str, ca_file: Path, token: str) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_etcd(workdir: Path) -> tuple[Component, str]:
    client_port, peer_port = free_port(), free_port()
    client_url = f"http://127.0.0.1:{client_port}"
    peer_url = f"http://127.0.0.1:{peer_port}"
    comp = _spawn(
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


def _start_apiserver(workdir: Path, etcd_url: str) -> tuple[Component, str]:
    pki = workdir / "pki"
    (workdir / "tokens.csv").write_text(
        f'{ADMIN_TOKEN},slimspec-admin,uid-admin,"system:masters"\n'
        f'{KCM_TOKEN},system:kube-controller-manager,uid-kcm,"system:masters"\n'
    )
    port = free_port()
    comp = _spawn(
        "kube-apiserver",
        [
            tool_path("kube-apiserver"),
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
        ],
        workdir,
    )
    return comp, f"https://127.0.0.1:{port}"


def _start_controller_manager(workdir: Path, server: str) -> Component:
    pki = workdir / "pki"
    kcfg = write_kubeconfig(
        workdir / "kcm.kubeconfig", server, pki / "ca.crt", KCM_TOKEN, "kube-controller-manager"
    )
    return _spawn(
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


def start_cluster(workdir: Path) -> KubeCluster:
    """Start etcd, kube-apiserver and kube-controller-manager; stop all on failure."""
    binaries = [tool_path(n) for n in ("etcd", "kube-apiserver", "kube-controller-manager")]
    del binaries  # looked up first so a missing one fails before anything starts
    make_pki(workdir / "pki")
    components: list[Component] = []
    cluster: KubeCluster | None = None
    try:
        etcd, etcd_url = _start_etcd(workdir)
        components.append(etcd)
        _poll(lambda: _alive_or_fail(etcd) and _http_ok(f"{etcd_url}/health"), 30, "etcd /health")
        apiserver, server = _start_apiserver(workdir, etcd_url)
        components.append(apiserver)
        ca_file = workdir / "pki" / "ca.crt"
        _poll(
            lambda: (
                _alive_or_fail(apiserver) and _https_ok(f"{server}/readyz", ca_file, ADMIN_TOKEN)
            ),
            90,
            "kube-apiserver /readyz",
        )
        kubeconfig = write_kubeconfig(
            workdir / "admin.kubeconfig", server, ca_file, ADMIN_TOKEN, "slimspec-admin"
        )
        cluster = KubeCluster(workdir, server, ca_file, ADMIN_TOKEN, kubeconfig, components)
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
        if isinstance(exc, pytest.fail.Exception):
            pytest.fail(f"{exc}\ncomponent logs (workdir {workdir}):\n{logs}", pytrace=False)
        raise


def _alive_or_fail(comp: Component) -> bool:
    if not comp.alive():
        pytest.fail(f"{comp.name} exited with {comp.proc.returncode}:\n{comp.log_tail()}")
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
        _poll(
            lambda: (
                _alive_or_fail(kcm) and core.read_namespaced_service_account("default", "default")
            ),
            60,
            "kube-controller-manager (default ServiceAccount in namespace default)",
        )


# ---------------------------------------------------------------- pod driver


PodReady = bool | Callable[[client.V1Pod], bool]


class PodDriver:
    """Moves pods through their lifecycle as a kubelet would (see module docs)."""

    _ips = itertools.count(2)
    _ip_lock = threading.Lock()

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self._handles: list[DriverHandle] = []

    def _next_ip(self) -> str:
        with self._ip_lock:
            n = next(self._ips)
        return f"10.244.{(n // 250) % 250}.{n % 250 + 2}"

    def mark(self, namespace: str, selector: str = "", ready: PodReady = True) -> list[str]:
        changed: list[str] = []
        with self.cluster.api_client() as api:
            core = client.CoreV1Api(api)
            pods = core.list_namespaced_pod(namespace, label_selector=selector or None).items
            for pod in pods:
                if self._drive_one(core, pod, ready):
                    changed.append(pod.metadata.name)
        return changed

    def _drive_one(self, core: client.CoreV1Api, pod: client.V1Pod, ready: PodReady) -> bool:
        name, ns = pod.metadata.name, pod.metadata.namespace
        try:
            if pod.metadata.deletion_timestamp is not None:
                core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
                return True
            want_ready = ready(pod) if callable(ready) else bool(ready)
            if not pod.spec.node_name:
                self._bind(core, pod)
            if _pod_is(pod, want_ready):
                return False
            core.patch_namespaced_pod_status(name, ns, self._status(pod, want_ready))
            return True
        except ApiException as exc:
            if exc.status in (404, 409):  # pod went away or changed under us
                return False
            raise

    def _bind(self, core: client.CoreV1Api, pod: client.V1Pod) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod.metadata.name),
            target=client.V1ObjectReference(
                api_version="v1", kind="Node", name=self.cluster.node_name
            ),
        )
        # The client cannot deserialize the Binding reply; we do not need it.
        core.create_namespaced_binding(
            pod.metadata.namespace, body, _preload_content=False
        ).release_conn()

    def _status(self, pod: client.V1Pod, ready: bool) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        flag = "True" if ready else "False"
        ip = (pod.status.pod_ip if pod.status else None) or self._next_ip()
        started = pod.status.start_time if pod.status else None
        containers = [
            {
                "name": c.name,
                "image": c.image,
                "imageID": f"fake://{c.image}",
                "containerID": f"fake://{pod.metadata.uid}/{c.name}",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod.spec.containers
        ]
        conds = [
            ("PodScheduled", "True"),
            ("Initialized", "True"),
            ("ContainersReady", flag),
            ("Ready", flag),
        ]
        return {
            "status": {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": started.isoformat() if started else now,
                "conditions": [
                    {"type": t, "status": s, "lastTransitionTime": now} for t, s in conds
                ],
                "containerStatuses": containers,
            }
        }

    def start(
        self, namespace: str, selector: str = "", ready: PodReady = True, interval: float = 0.2
    ) -> DriverHandle:
        handle = DriverHandle(self, namespace, selector, ready, interval)
        self._handles.append(handle)
        handle.thread.start()
        return handle

    def stop_all(self) -> None:
        for handle in self._handles:
            handle.stop()


def _pod_is(pod: client.V1Pod, ready: bool) -> bool:
    st = pod.status
    if st is None or st.phase != "Running" or not st.pod_ip:
        return False
    conds = {c.type: c.status for c in st.conditions or []}
    return conds.get("Ready") == ("True" if ready else "False")


class DriverHandle:
    """A background PodDriver loop; stop() (or leaving the with-block) ends it."""

    def __init__(
        self, driver: PodDriver, namespace: str, selector: str, ready: PodReady, interval: float
    ) -> None:
        self.driver, self.namespace, self.selector = driver, namespace, selector
        self.ready, self.interval = ready, interval
        self.errors: list[Exception] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, name=f"pod-driver-{namespace}", daemon=True
        )

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.driver.mark(self.namespace, self.selector, self.ready)
            except Exception as exc:  # keep driving; surface errors via .errors
                self.errors.append(exc)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)

    def __enter__(self) -> DriverHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Reaper:
    """Removes terminating pods on the fake node, as their kubelet would.

    Without it, pods bound to the fake node stay Terminating forever, so scale-downs,
    rollouts and namespace deletions would never finish.
    """

    def __init__(self, cluster: KubeCluster, interval: float = 0.3) -> None:
        self.cluster, self.interval = cluster, interval
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="pod-reaper", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with self.cluster.api_client() as api:
            core = client.CoreV1Api(api)
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):  # API hiccups: try again next tick
                    self._reap(core)

    def _reap(self, core: client.CoreV1Api) -> None:
        pods = core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.cluster.node_name}"
        ).items
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None:
                with contextlib.suppress(ApiException):
                    core.delete_namespaced_pod(
                        pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
                    )

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


# ------------------------------------------------------------------ fixtures


WORKDIR_PREFIX = "slimspec-kube-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_workdirs() -> None:
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
    _remove_stale_workdirs()
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (workdir / "owner.pid").write_text(str(os.getpid()))
    return workdir


@contextlib.contextmanager
def running_cluster() -> Iterator[KubeCluster]:
    """Start a cluster, yield it, always stop it (and remove its temp dir).

    A failed start keeps its temp dir for the logs (removed by a later run).
    """
    for attempt in range(3):
        workdir = _workdir()
        try:
            cluster = start_cluster(workdir)
            break
        except pytest.fail.Exception as exc:
            # free_port() races with other processes: a taken port is worth a retry.
            if attempt == 2 or "address already in use" not in str(exc):
                raise
    try:
        yield cluster
    finally:
        cluster.stop()
        if os.environ.get("SLIMSPEC_TESTBED_KEEP") != "1":
            shutil.rmtree(workdir, ignore_errors=True)


def attach_cluster(workdir: Path) -> KubeCluster:
    """A handle on a cluster another process runs (``python -m tests.support.cluster``)."""
    kubeconfig = workdir / "admin.kubeconfig"
    try:
        cfg = yaml.safe_load(kubeconfig.read_text())
    except OSError as exc:
        pytest.fail(f"SLIMSPEC_TESTBED_DIR={workdir}: no running test cluster ({exc})")
    server = cfg["clusters"][0]["cluster"]["server"]
    ca_file = Path(cfg["clusters"][0]["cluster"]["certificate-authority"])
    token = cfg["users"][0]["user"]["token"]
    if not _https_ok(f"{server}/readyz", ca_file, token):
        pytest.fail(f"SLIMSPEC_TESTBED_DIR={workdir}: API server {server} is not ready")
    return KubeCluster(workdir, server, ca_file, token, kubeconfig)


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


if __name__ == "__main__":
    main()
