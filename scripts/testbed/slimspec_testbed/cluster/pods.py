"""Pods without a kubelet: the test bed moves them through their lifecycle.

:class:`PodDriver` plays kubelet for pods matching a namespace + label selector:

- ``.mark(ns, selector="", ready=True)`` one pass: binds unscheduled pods to the fake
  node and patches ``pods/status`` (phase Running, podIP, Ready/ContainersReady
  conditions = ``ready``, container statuses); pods being deleted are removed (grace
  0) as a kubelet would. Returns changed pod names. ``ready`` may be a callable
  ``(V1Pod) -> bool`` (e.g. new version never ready).
- ``.start(ns, selector="", ready=True, interval=0.2)`` -> :class:`DriverHandle` with
  ``.stop()``: does ``mark`` in a background thread until stopped, so Deployment
  rollouts driven by an operator complete. Also usable as a context manager:
  ``with pod_driver.start(ns): ...``.

:class:`Reaper` removes terminating pods on the fake node cluster-wide; the process
that starts the cluster runs one.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.rest import ApiException


class Cluster(Protocol):
    """What the driver needs of a cluster handle (handle.KubeCluster is one); a
    protocol, so this module does not import the handle that imports it."""

    node_name: str

    def api_client(self, token: str | None = None) -> client.ApiClient: ...


PodReady = bool | Callable[[client.V1Pod], bool]
# A V1Pod as the API server returns it: metadata (name, namespace, uid) and spec are
# always set, which the client's everything-Optional model types cannot express.
ServerPod = Any


class PodDriver:
    """Moves pods through their lifecycle as a kubelet would (see the module docstring)."""

    _ips = itertools.count(2)
    _ip_lock = threading.Lock()

    def __init__(self, cluster: Cluster) -> None:
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
            pods: list[ServerPod] = core.list_namespaced_pod(
                namespace, label_selector=selector or None
            ).items
            for pod in pods:
                if self._drive_one(core, pod, ready):
                    changed.append(pod.metadata.name)
        return changed

    def _drive_one(self, core: client.CoreV1Api, pod: ServerPod, ready: PodReady) -> bool:
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

    def _bind(self, core: client.CoreV1Api, pod: ServerPod) -> None:
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod.metadata.name),
            target=client.V1ObjectReference(
                api_version="v1", kind="Node", name=self.cluster.node_name
            ),
        )
        # The client cannot deserialize the Binding reply; we do not need it.
        raw: Any = core.create_namespaced_binding(
            pod.metadata.namespace, body, _preload_content=False
        )  # the HTTP response, not a V1Binding
        raw.release_conn()

    def _status(self, pod: ServerPod, ready: bool) -> dict[str, Any]:
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


def _pod_is(pod: ServerPod, ready: bool) -> bool:
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

    def __init__(self, cluster: Cluster, interval: float = 0.3) -> None:
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
        pods: list[ServerPod] = core.list_pod_for_all_namespaces(
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
