"""Kopf glue of the tuner and the autoscaler: a timer per SlimSpecService.

Thin: each firing runs one tuning tick (tick.py) with the process's one
API client, the process's shared Prometheus reads (one grouped query per metric
per tick for all resources: prometheus/shared.py) and the resource's memory,
which lives in Kopf's memo (lost on restart, by design). The timers are sharp,
and evaluations keep to one wall-clock grid (plan.due_on_grid), so all
resources of one interval evaluate together. Kopf's memo is per resource and
dropped when the resource is gone, so nothing needs a deletion handler (which
would also make Kopf keep a copy of the spec in an annotation: see
rollout/handlers.py). Nothing here decides
anything.

Environment: SLIMSPEC_TUNING_TICK_SECONDS (timer period, default 5; each
resource is evaluated every spec.tuning.intervalSeconds).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from typing import Any

import kopf

from slimspec_operator.contract import GROUP, PLURAL, VERSION
from slimspec_operator.kube.client import ApiError, shared
from slimspec_operator.tuning.prometheus.shared import SharedReads
from slimspec_operator.tuning.tick import Memory, tick

TICK_SECONDS = float(os.environ.get("SLIMSPEC_TUNING_TICK_SECONDS", "5"))
MEMO_KEY = "slimspec_tuning"
# The ticks of one slot fall within a timer period of its start, unless the process
# is busy (a burst of new resources): an answer serves its slot for up to 30 s, a
# fraction of the rate windows (two intervals) the readings are made over.
SHARED = SharedReads(max_age_s=max(TICK_SECONDS + 1, 30))


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_SECONDS, sharp=True)
async def tuning_timer(
    body: kopf.Body, uid: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    memories: dict[str, Memory] = memo.setdefault(MEMO_KEY, {})
    now = datetime.now(UTC)
    mem = memories.setdefault(uid, Memory(started=now))
    try:
        await tick(body, mem, shared(), now, shared=SHARED, timer_s=TICK_SECONDS)
    except ApiError as exc:
        logger.warning("tuning: API error %s; retrying next tick", exc)
