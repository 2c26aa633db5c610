"""Handle on a running test control plane (see ``control_plane`` for starting one).

:class:`KubeCluster`:

- ``.server`` API URL (``https://127.0.0.1:<port>``); ``.kubeconfig`` admin
  kubeconfig (bearer token, ``system:masters``); ``.token``; ``.ca_file``.
- ``.env``: a full environment for subprocesses (``os.environ`` plus ``KUBECONFIG``
  and the test bed's bin dir first on ``PATH``: kubectl, helm). Run kopf / the
  operator with it.
- ``.api_client(token=None)``: a new ``kubernetes.client.ApiClient`` (admin, or the
  given bearer token); close it or use it as a context manager.
- ``.kubectl(*args, check=True, input=None)``: ``CompletedProcess`` (text).
- ``.apply(yaml_text | dict | list_of_dicts, namespace="")``: ``kubectl apply``.
- ``.create_namespace(name=None)`` -> name (waits for its ``default``
  ServiceAccount, so pods can be created right away); ``.delete_namespace(name)``.
- ``.service_account_token(ns, sa, create=True)`` -> token (TokenRequest API);
  ``.service_account_kubeconfig(ns, sa, create=True)`` -> ``Path`` of a kubeconfig
  for that ServiceAccount (least-privilege RBAC tests).
- ``.pod_driver()`` -> :class:`~slimspec_testbed.cluster.pods.PodDriver` (plays kubelet).
- ``.wait_for(fn, timeout=30, what="...")`` polls ``fn()`` until truthy and returns
  its value; ``.wait_deployment_available(ns, name, timeout=60)``.
- ``.node_name``: the fake Node pods get bound to (``slimspec-fake-node``).
- ``.check_alive()``: a TestbedError with the logs if a component died.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from slimspec_testbed.cluster.pki import write_kubeconfig
from slimspec_testbed.cluster.pods import PodDriver, Reaper
from slimspec_testbed.cluster.processes import Component, poll
from slimspec_testbed.errors import fail
from slimspec_testbed.tools import cache_dir, run_checked, tool_path

T = TypeVar("T")

FAKE_NODE = "slimspec-fake-node"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


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
        return poll(fn, timeout, what, interval=0.2)

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
            token = resp.status.token if resp.status else None
            if not token:
                fail(f"TokenRequest for {namespace}/{name} returned no token")
            return token

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
                st, spec, meta = dep.status, dep.spec, dep.metadata
                if st is None or spec is None or meta is None:
                    return None
                conds = {c.type: c.status for c in st.conditions or []}
                want = spec.replicas or 0
                ok = (
                    conds.get("Available") == "True"
                    and st.observed_generation == meta.generation
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
        """TestbedError with the logs if a control plane process has died."""
        dead = [c.name for c in self.components if not c.alive()]
        if dead:
            fail(f"test cluster component(s) died: {dead}\n{self.logs()}", traceback=False)

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} ---\n{c.log_tail()}" for c in self.components)


def https_ok(url: str, ca_file: Path, token: str) -> bool:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def attach_cluster(workdir: Path) -> KubeCluster:
    """A handle on a cluster another process runs (``python -m slimspec_testbed``)."""
    kubeconfig = workdir / "admin.kubeconfig"
    try:
        cfg = yaml.safe_load(kubeconfig.read_text())
    except OSError as exc:
        fail(f"SLIMSPEC_TESTBED_DIR={workdir}: no running test cluster ({exc})")
    server = cfg["clusters"][0]["cluster"]["server"]
    ca_file = Path(cfg["clusters"][0]["cluster"]["certificate-authority"])
    token = cfg["users"][0]["user"]["token"]
    if not https_ok(f"{server}/readyz", ca_file, token):
        fail(f"SLIMSPEC_TESTBED_DIR={workdir}: API server {server} is not ready")
    return KubeCluster(workdir, server, ca_file, token, kubeconfig)
