"""One Prometheus query per metric per tick for all resources (the tuner's shared reads).

Every resource that keeps a built-in query reads it from the same grouped query
(resource/queries.py: `QueryDef.grouped`, one series per namespace and service),
so a tick costs one query set per Prometheus, whatever the number of resources.
Answers are shared between resources that query the same Prometheus in the same
way (URL, timeout, rate window) in the same evaluation slot (tuning/plan.py:
`grid_slot`), and only while younger than `max_age_s`; concurrent ticks wait for
one request instead of each sending their own.

Credentials are per namespace (auth.py reads the resource's Secrets): resources
with `prometheus.auth` or `prometheus.tls` share answers only with resources of
their namespace that name the same Secrets, and their grouped query is limited to
that namespace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slimspec_operator.kube.client import Kube
from slimspec_operator.resource.queries import QueryDef
from slimspec_operator.resource.spec import PrometheusSpec
from slimspec_operator.tuning.prometheus.auth import load_auth
from slimspec_operator.tuning.prometheus.client import PromClient
from slimspec_operator.tuning.prometheus.errors import PromError
from slimspec_operator.tuning.prometheus.queries import Grouped, grouped_query, split_grouped

PRUNE_AFTER = 10  # entries older than this many max_age go on the next fetch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A Prometheus asked the same way: same URL, timeout and credentials."""

    url: str
    timeout_s: float
    namespace: str | None  # set when credentials (read per namespace) are used
    secrets: tuple[str, ...]  # the Secrets they come from


def source_of(spec: PrometheusSpec, namespace: str) -> Source:
    secrets = (
        (spec.auth.type, spec.auth.secret_name) if spec.auth else (),
        (spec.tls.ca_secret_name, spec.tls.ca_key) if spec.tls else (),
    )
    named = tuple(part for pair in secrets for part in pair)
    return Source(spec.url, spec.timeout_seconds, namespace if named else None, named)


@dataclass
class _Entry:
    slot: int
    fetched: float  # monotonic seconds
    answer: asyncio.Future[Grouped | PromError]


class SharedReads:
    """The process's shared grouped answers (one per tuner process)."""

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s
        self.clock = clock
        self._entries: dict[tuple[Source, str, str], _Entry] = {}

    async def answers(
        self,
        kube: Kube | None,
        spec: PrometheusSpec,
        namespace: str,
        queries: Mapping[str, QueryDef],
        window: str,
        slot: int,
    ) -> dict[str, Grouped | PromError]:
        """The grouped answers of `queries` (name -> query) for this slot: shared
        when fresh, else fetched (all missing ones in one go)."""
        source = source_of(spec, namespace)
        now = self.clock()
        found: dict[str, asyncio.Future[Grouped | PromError]] = {}
        missing: dict[str, QueryDef] = {}
        for name, query in queries.items():
            entry = self._entries.get((source, window, name))
            if entry is not None and entry.slot == slot and now - entry.fetched <= self.max_age_s:
                found[name] = entry.answer
            else:
                missing[name] = query
        if missing:
            log.debug("%d grouped queries to %s for slot %d", len(missing), source.url, slot)
            self._prune(now)
            loop = asyncio.get_running_loop()
            futures = {name: loop.create_future() for name in missing}
            for name, future in futures.items():
                self._entries[(source, window, name)] = _Entry(slot, now, future)
                found[name] = future
            await self._fetch(kube, spec, source, missing, window, futures)
        return {name: await future for name, future in found.items()}

    async def _fetch(
        self,
        kube: Kube | None,
        spec: PrometheusSpec,
        source: Source,
        queries: Mapping[str, QueryDef],
        window: str,
        futures: Mapping[str, asyncio.Future[Grouped | PromError]],
    ) -> None:
        try:
            auth = None
            if kube is not None and source.secrets and source.namespace is not None:
                auth = await asyncio.to_thread(load_auth, kube, source.namespace, spec)
            client = PromClient(spec.url, spec.timeout_seconds, auth=auth)
        except PromError as err:
            for future in futures.values():
                future.set_result(err)
            return
        async with client as prom:

            async def one(name: str, query: QueryDef) -> None:
                promql = grouped_query(query, window, source.namespace)
                try:
                    result: Grouped | PromError = split_grouped(
                        await prom.query_raw(promql), query, promql
                    )
                except PromError as exc:
                    result = exc
                futures[name].set_result(result)

            try:
                await asyncio.gather(*(one(n, q) for n, q in queries.items()))
            finally:  # cancelled: forget those answers; whoever waits is cancelled too
                for name, future in futures.items():
                    if not future.done():
                        future.cancel()
                        self._entries.pop((source, window, name), None)

    def _prune(self, now: float) -> None:
        limit = PRUNE_AFTER * self.max_age_s
        for key in [k for k, e in self._entries.items() if now - e.fetched > limit]:
            del self._entries[key]
