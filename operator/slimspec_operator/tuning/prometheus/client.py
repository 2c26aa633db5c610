"""Thin Prometheus HTTP API client: one instant query -> one float, or a typed error.

Every way a reading can fail maps to a `PromError` with a CamelCase `reason`,
which the tuner copies into the MetricsAvailable condition so an operator can
tell "Prometheus is down" from "the query matches nothing".

The URL is user input that the operator fetches from inside the cluster, so only
http(s) URLs without credentials are used, no redirect is followed, and what a
server answers never reaches status beyond a short reason: an HTTP status code,
or the error Prometheus' query API itself reports (cut short). A server that is
not Prometheus cannot have its replies read through the resource's status.
Credentials (bearer token or basic auth) and a private CA come in `PromAuth`
(auth.py reads them from Secrets).
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

from slimspec_operator.tuning.prometheus.errors import PromError, PromReason

DETAIL_LIMIT = 160  # characters of a server's or library's words kept in a message


def _cut(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= DETAIL_LIMIT else text[: DETAIL_LIMIT - 1] + "…"


@dataclass(frozen=True)
class PromAuth:
    """How to authenticate to Prometheus (at most one of bearer_token / basic)."""

    bearer_token: str | None = None
    basic: tuple[str, str] | None = None  # (username, password)
    ca_pem: str | None = None  # CA bundle that signs an https Prometheus' certificate

    def __repr__(self) -> str:  # never print a credential
        kind = "bearer" if self.bearer_token else "basic" if self.basic else "none"
        return f"PromAuth({kind}, ca={'yes' if self.ca_pem else 'no'})"


def check_url(url: str) -> None:
    """Refuse anything but an http(s) URL with a host and no user info."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise PromError(PromReason.INVALID_URL, f"not a URL: {_cut(str(exc))}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PromError(
            PromReason.INVALID_URL, "prometheus.url must be http:// or https:// with a host"
        )
    if parts.username is not None or parts.password is not None:
        raise PromError(
            PromReason.INVALID_URL, "prometheus.url must not carry credentials: use auth"
        )


class PromClient:
    """Instant queries against one Prometheus. Use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 5.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        auth: PromAuth | None = None,
    ) -> None:
        """Raises PromError(PromReason.INVALID_URL) for a URL it will not fetch."""
        check_url(base_url)
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        auth = auth or PromAuth()
        headers = {"Authorization": f"Bearer {auth.bearer_token}"} if auth.bearer_token else {}
        verify: ssl.SSLContext | bool = True
        if auth.ca_pem:
            try:
                verify = ssl.create_default_context(cadata=auth.ca_pem)
            except (ssl.SSLError, ValueError) as exc:
                msg = "the CA certificate in prometheus.tls does not load"
                raise PromError(PromReason.NO_CREDENTIALS, msg) from exc
        self._client = httpx.AsyncClient(
            timeout=timeout,
            transport=transport,
            headers=headers,
            auth=httpx.BasicAuth(*auth.basic) if auth.basic else None,
            verify=verify,
            follow_redirects=False,
        )

    async def __aenter__(self) -> PromClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def query_raw(self, promql: str, at: datetime | None = None) -> dict[str, Any]:
        """`data` of /api/v1/query, or PromError for transport/HTTP/API failures."""
        params = {"query": promql, "timeout": f"{self.timeout:g}s"}
        if at is not None:
            params["time"] = f"{at.timestamp():.3f}"
        url = f"{self.base_url}/api/v1/query"
        try:
            resp = await self._client.post(url, data=params)
        except httpx.TimeoutException as exc:
            raise PromError(PromReason.TIMEOUT, f"no answer in {self.timeout:g}s") from exc
        except httpx.HTTPError as exc:  # connect refused, DNS, reset, TLS...
            raise PromError(
                PromReason.UNREACHABLE, _cut(f"{exc.__class__.__name__}: {exc}")
            ) from exc
        if resp.status_code in (401, 403):
            raise PromError(
                PromReason.AUTH_FAILED, f"HTTP {resp.status_code}: check prometheus.auth"
            )
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, Mapping) and body.get("status") == "error" and "errorType" in body:
            # Prometheus answers 400/422 with errorType/error for bad PromQL.
            kind = _cut(body["errorType"])
            reason = PromReason.TIMEOUT if kind == "timeout" else PromReason.QUERY_ERROR
            raise PromError(reason, _cut(f"{kind}: {body.get('error', '')}"))
        if resp.status_code != 200:
            raise PromError(PromReason.HTTP_ERROR, f"HTTP {resp.status_code}")
        if not isinstance(body, Mapping) or not isinstance(body.get("data"), Mapping):
            raise PromError(PromReason.BAD_RESPONSE, "the answer is not Prometheus' query API")
        return dict(body["data"])

    async def query_value(self, promql: str, at: datetime | None = None) -> float:
        """A single number: a scalar, or a vector with exactly one series."""
        data = await self.query_raw(promql, at)
        kind, result = data.get("resultType"), data.get("result")
        if kind == "scalar":
            value = result
        elif kind == "vector":
            if not result:
                raise PromError(PromReason.NO_DATA, f"no series for {promql!r}")
            if len(result) > 1:
                raise PromError(
                    PromReason.AMBIGUOUS, f"{len(result)} series for {promql!r}; aggregate it"
                )
            value = result[0].get("value")
        else:
            raise PromError(PromReason.BAD_RESPONSE, _cut(f"result type {kind!r} for {promql!r}"))
        try:
            number = float(value[1])  # type: ignore[index]
        except (TypeError, ValueError, IndexError) as exc:
            raise PromError(PromReason.BAD_RESPONSE, _cut(f"unreadable value {value!r}")) from exc
        if not math.isfinite(number):
            raise PromError(PromReason.NOT_A_NUMBER, f"{promql!r} = {number}")
        return number

    async def query_many(
        self, queries: Mapping[str, str], at: datetime | None = None
    ) -> dict[str, float | PromError]:
        """Run several queries concurrently; each key maps to a value or its error."""
        names = list(queries)
        results = await asyncio.gather(
            *(self.query_value(queries[n], at) for n in names), return_exceptions=True
        )
        out: dict[str, float | PromError] = {}
        for name, res in zip(names, results, strict=True):
            if isinstance(res, PromError | float):
                out[name] = res
            elif isinstance(res, BaseException):
                raise res
        return out
