"""Thin Kubernetes I/O: the operator's one API client, on plain dicts.

All decisions live in the pure modules; this file only talks to the API server.
Writes use server-side apply with the writer's field manager (the reconciler's
by default, the tuner's for its own fields), so re-applying the same manifest is
a no-op and fields other managers own (HPA, the other writer) are left alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes import client, config

from slimspec_operator.contract import (
    API_VERSION,
    INSTANCE_LABEL,
    KEDA_API_VERSION,
    KEDA_AUTH_KIND,
    KEDA_AUTH_PLURAL,
    KEDA_KIND,
    KEDA_PLURAL,
    KIND,
    MANAGED_BY_LABEL,
    MANAGER,
    OPERATOR_FIELD_MANAGER,
    PLURAL,
)

FIELD_MANAGER = OPERATOR_FIELD_MANAGER
# Immediate re-reads when a conditional status write loses a race (the tuner,
# the reconciler or a user wrote the object since it was read).
CONFLICT_RETRIES = 3

# kind -> (API prefix, plural); everything the operator writes is namespaced.
_PATHS: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Job": ("/apis/batch/v1", "jobs"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Event": ("/api/v1", "events"),
    KIND: (f"/apis/{API_VERSION}", PLURAL),
    KEDA_KIND: (f"/apis/{KEDA_API_VERSION}", KEDA_PLURAL),
    KEDA_AUTH_KIND: (f"/apis/{KEDA_API_VERSION}", KEDA_AUTH_PLURAL),
}


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            self.message = json.loads(body).get("message", body)
        except ValueError:
            self.message = body
        super().__init__(f"{status}: {self.message}")


def load_config() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = _PATHS[kind]
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    def __init__(self, api: client.ApiClient | None = None, timeout: float = 30) -> None:
        self.api = api or load_config()
        self.timeout = timeout
        self._served: set[str] = set()  # group/version/plural found by discovery

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        params = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(*params, _request_timeout=self.timeout)
        resp.read()
        text = (resp.data or b"").decode()
        if not 200 <= resp.status <= 299:
            raise ApiError(resp.status, text)
        return json.loads(text) if text else {}

    # ------------------------------------------------------------ generic verbs

    def apply(
        self,
        manifest: Mapping[str, Any],
        subresource: str | None = None,
        *,
        manager: str = FIELD_MANAGER,
    ) -> dict[str, Any]:
        """Server-side apply. A `metadata.resourceVersion` in the manifest makes it
        conditional: 409 when the object changed since that version was read."""
        meta = manifest["metadata"]
        path = _path(manifest["kind"], meta["namespace"], meta["name"], subresource)
        query = [("fieldManager", manager), ("force", "true")]
        return self.request("PATCH", path, dict(manifest), query, "application/apply-patch+yaml")

    def merge_patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: Any,
        subresource: str | None = None,
        *,
        manager: str = FIELD_MANAGER,
    ) -> dict[str, Any]:
        path = _path(kind, namespace, name, subresource)
        query = [("fieldManager", manager)]
        return self.request("PATCH", path, patch, query, "application/merge-patch+json")

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when it already exists (create-once objects such as the admin Secret)."""
        meta = manifest["metadata"]
        try:
            return self.request("POST", _path(manifest["kind"], meta["namespace"]), manifest)
        except ApiError as e:
            if e.status == 409:
                return None
            raise

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", _path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self.request("GET", _path(kind, namespace), query=[("labelSelector", selector)])
        return list(out.get("items") or [])

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (the GC removes ReplicaSets and pods); False if absent."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", _path(kind, namespace, name), body)
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def apply_status(
        self,
        read: Mapping[str, Any],
        status: Mapping[str, Any],
        *,
        manager: str,
        resource_version: str | None = None,
    ) -> str | None:
        """Apply one writer's status fields of the SlimSpecService `read` (its
        metadata: name, namespace, resourceVersion); returns the new resourceVersion.

        The write is conditional on the resourceVersion the status was computed
        from (`resource_version`, else the one in `read`): 409 when the object
        changed since, so a field someone removed meanwhile (`kubectl patch
        --subresource=status` dropping failedTemplateHash to retry a rollout) is
        never put back from a stale read. `conflict_retries` re-runs the caller.
        """
        meta: dict[str, Any] = {"name": read["name"], "namespace": read["namespace"]}
        version = resource_version or read.get("resourceVersion")
        if version:
            meta["resourceVersion"] = version
        manifest = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "status": status}
        written = self.apply(manifest, "status", manager=manager)
        return (written.get("metadata") or {}).get("resourceVersion")

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves `plural` in `api_version` (discovery: needs no
        read rights on CRDs). Remembered once True; asked again while False."""
        key = f"{api_version}/{plural}"
        if key in self._served:
            return True
        try:
            found = self.request("GET", f"/apis/{api_version}")
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        if any(r.get("name") == plural for r in found.get("resources") or []):
            self._served.add(key)
            return True
        return False

    # ------------------------------------------------------------ domain reads

    def owned(self, kind: str, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        """Objects of `kind` made for resource `name` whose controller is that resource."""
        selector = f"{INSTANCE_LABEL}={name},{MANAGED_BY_LABEL}={MANAGER}"
        return [
            d
            for d in self.list_objects(kind, namespace, selector)
            if any(
                ref.get("uid") == uid and ref.get("controller")
                for ref in d["metadata"].get("ownerReferences") or []
            )
        ]

    def owned_deployments(self, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
        return self.owned("Deployment", namespace, name, uid)


class Attempt:
    """One try of `conflict_retries`: a context that swallows a 409 unless it is
    the last try (then the caller sees it)."""

    def __init__(self, number: int, last: bool) -> None:
        self.number = number  # 0 for the first try
        self.last = last
        self.conflicted = False

    @property
    def retry(self) -> bool:
        """A later try: what the caller read before is stale."""
        return self.number > 0

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, ApiError) and exc.status == 409 and not self.last:
            self.conflicted = True
            return True
        return False


def conflict_retries(retries: int = CONFLICT_RETRIES) -> Iterator[Attempt]:
    """Tries of a read-plan-write round until its conditional write lands (at most
    1 + `retries`; the last conflict is raised):

        for attempt in conflict_retries():
            with attempt:
                ...read (again when attempt.retry), plan, write...
    """
    for number in range(retries + 1):
        attempt = Attempt(number, last=number == retries)
        yield attempt
        if not attempt.conflicted:
            return


_shared: Kube | None = None


def shared() -> Kube:
    """The process's one client (reconciler and tuner): credentials are loaded once."""
    global _shared
    if _shared is None:
        _shared = Kube()
    return _shared
