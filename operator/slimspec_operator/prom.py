"""Thin Prometheus HTTP API client: one instant query -> one float, or a typed error.

Every way a reading can fail maps to a `PromError` with a CamelCase `reason`,
which the tuner copies into the MetricsAvailable condition so an operator can
tell "Prometheus is down" from "the query matches nothing".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import httpx

UNREACHABLE = "PrometheusUnreachable"
TIMEOUT = "PrometheusTimeout"
HTTP_ERROR = "PrometheusHTTPError"
BAD_RESPONSE = "PrometheusBadResponse"
QUERY_ERROR = "QueryError"
NO_DATA = "NoData"
NOT_A_NUMBER = "NotANumber"
AMBIGUOUS = "AmbiguousResult"

# Errors that say nothing about the series, only about reaching Prometheus:
# one of these makes a whole sample unusable.
TRANSPORT_REASONS = frozenset({UNREACHABLE, TIMEOUT, HTTP_ERROR, BAD_RESPONSE, QUERY_ERROR})


class PromError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    @property
    def transport(self) -> bool:
        return self.reason in TRANSPORT_REASONS


class PromClient:
    """Instant queries against one Prometheus. Use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 5.0,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport)

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
            raise PromError(TIMEOUT, f"no answer from {url} in {self.timeout:g}s") from exc
        except httpx.HTTPError as exc:  # connect refused, DNS, reset...
            raise PromError(UNREACHABLE, f"{url}: {exc.__class__.__name__}: {exc}") from exc
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, Mapping) and body.get("status") == "error":
            # Prometheus answers 400/422 with errorType/error for bad PromQL.
            kind = body.get("errorType", "error")
            reason = TIMEOUT if kind == "timeout" else QUERY_ERROR
            raise PromError(reason, f"{kind}: {body.get('error', '')}")
        if resp.status_code != 200:
            raise PromError(HTTP_ERROR, f"{url} answered HTTP {resp.status_code}")
        if not isinstance(body, Mapping) or not isinstance(body.get("data"), Mapping):
            raise PromError(BAD_RESPONSE, f"{url} answered something that is not the query API")
        return dict(body["data"])

    async def query_value(self, promql: str, at: datetime | None = None) -> float:
        """A single number: a scalar, or a vector with exactly one series."""
        data = await self.query_raw(promql, at)
        kind, result = data.get("resultType"), data.get("result")
        if kind == "scalar":
            value = result
        elif kind == "vector":
            if not result:
                raise PromError(NO_DATA, f"no series for {promql!r}")
            if len(result) > 1:
                raise PromError(AMBIGUOUS, f"{len(result)} series for {promql!r}; aggregate it")
            value = result[0].get("value")
        else:
            raise PromError(BAD_RESPONSE, f"result type {kind!r} for {promql!r}")
        try:
            number = float(value[1])  # type: ignore[index]
        except (TypeError, ValueError, IndexError) as exc:
            raise PromError(BAD_RESPONSE, f"unreadable value {value!r}") from exc
        if not math.isfinite(number):
            raise PromError(NOT_A_NUMBER, f"{promql!r} = {number}")
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
