"""Prometheus credentials from Secrets, and the tuner's queries run with them.

`spec.prometheus.auth` names a Secret in the resource's namespace (keys `token` for
bearer, `username`/`password` for basic) and `spec.prometheus.tls` one with a CA
bundle. The tuner reads them here on each tick (so a rotated Secret is used at
once); the chart lets the operator `get` only the Secret names it lists
(`rbac.prometheusSecrets`), since the resource's author chooses both the Secret and
the URL it is sent to. KEDA gets the same credentials through a TriggerAuthentication
`<name>-prometheus` that the operator creates (KEDA reads the Secret itself: keda.py).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from typing import Any

from slimspec_operator.kube.client import ApiError, Kube
from slimspec_operator.resource.spec import PASSWORD_KEY, TOKEN_KEY, USERNAME_KEY, PrometheusSpec
from slimspec_operator.tuning.prometheus.client import PromAuth, PromClient
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.prometheus.queries import vector_values

Manifest = dict[str, Any]


def _secret_data(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    try:
        secret = kube.get("Secret", namespace, name)
    except ApiError as exc:
        if exc.status == 403:
            raise PromError(
                PromReason.NO_CREDENTIALS,
                f"the operator may not read Secret {name} (list it in the chart's "
                "rbac.prometheusSecrets)",
            ) from exc
        raise PromError(PromReason.NO_CREDENTIALS, f"Secret {name}: HTTP {exc.status}") from exc
    if secret is None:
        raise PromError(PromReason.NO_CREDENTIALS, f"Secret {name} does not exist")
    data = secret.get("data") or {}
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def _key(data: Mapping[str, str], secret: str, key: str) -> str:
    value = data.get(key, "").strip()
    if not value:
        raise PromError(PromReason.NO_CREDENTIALS, f"Secret {secret} has no key {key}")
    return value


def credentials(
    spec: PrometheusSpec,
    auth_data: Mapping[str, str] | None,
    ca_data: Mapping[str, str] | None,
) -> PromAuth:
    """PromAuth from the Secrets' decoded data (pure); PromError when a key is missing."""
    token = basic = ca = None
    if spec.auth is not None:
        data, secret = auth_data or {}, spec.auth.secret_name
        if spec.auth.type == "bearer":
            token = _key(data, secret, TOKEN_KEY)
        else:
            basic = (_key(data, secret, USERNAME_KEY), _key(data, secret, PASSWORD_KEY))
    if spec.tls is not None:
        ca = _key(ca_data or {}, spec.tls.ca_secret_name, spec.tls.ca_key)
    return PromAuth(bearer_token=token, basic=basic, ca_pem=ca)


def load_auth(kube: Kube, namespace: str, spec: PrometheusSpec) -> PromAuth:
    auth_data = _secret_data(kube, namespace, spec.auth.secret_name) if spec.auth else None
    ca_data = _secret_data(kube, namespace, spec.tls.ca_secret_name) if spec.tls else None
    return credentials(spec, auth_data, ca_data)


async def run_queries(
    kube: Kube | None,
    namespace: str,
    spec: PrometheusSpec,
    queries: Mapping[str, str],
    vectors: Mapping[str, tuple[str, str]] | None = None,
) -> tuple[dict[str, float | PromError], dict[str, dict[str, float] | PromError]]:
    """The tuner's queries with the resource's credentials: scalar `queries`, and
    `vectors` (name -> (PromQL, label)) answered as {label value: number}. A
    credential or URL problem is every query's error (so the tick holds still and
    says why)."""
    vectors = vectors or {}
    try:
        auth = None
        if kube is not None and (spec.auth or spec.tls):
            auth = await asyncio.to_thread(load_auth, kube, namespace, spec)
        client = PromClient(spec.url, spec.timeout_seconds, auth=auth)
    except PromError as err:
        return dict.fromkeys(queries, err), dict.fromkeys(vectors, err)
    async with client as prom:

        async def vector(promql: str, label: str) -> dict[str, float] | PromError:
            try:
                return vector_values(await prom.query_raw(promql), label, promql)
            except PromError as exc:
                return exc

        numbers, per_label = await asyncio.gather(
            prom.query_many(queries), asyncio.gather(*(vector(*v) for v in vectors.values()))
        )
    return numbers, dict(zip(vectors, per_label, strict=True))
