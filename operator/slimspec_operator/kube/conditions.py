"""Status conditions after the Kubernetes API conventions (pure).

A condition is a dict with type, status ("True"/"False"/"Unknown"), reason,
message, observedGeneration and lastTransitionTime. `lastTransitionTime` moves
only when `status` flips, so watchers can tell how long a state has held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

Condition = dict[str, Any]

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def format_time(now: datetime | str) -> str:
    """RFC 3339 in UTC with second precision, as the API server writes times."""
    if isinstance(now, str):
        return now
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _status_str(status: bool | str) -> str:
    if isinstance(status, bool):
        return TRUE if status else FALSE
    if status not in (TRUE, FALSE, UNKNOWN):
        raise ValueError(f"condition status must be True, False or Unknown, not {status!r}")
    return status


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type: str,
    status: bool | str,
    reason: str,
    message: str,
    observed_generation: int | None,
    now: datetime | str,
) -> list[Condition]:
    """Return a new list with condition `type` set; the input is not modified.

    Other conditions keep their order and values; a new type is appended.
    """
    status = _status_str(status)
    out: list[Condition] = []
    found = False
    for cond in conditions or ():
        cond = dict(cond)
        if cond.get("type") == type:
            found = True
            changed = cond.get("status") != status or not cond.get("lastTransitionTime")
            cond.update(status=status, reason=reason, message=message)
            if observed_generation is not None:
                cond["observedGeneration"] = observed_generation
            if changed:
                cond["lastTransitionTime"] = format_time(now)
        out.append(cond)
    if not found:
        new: Condition = {"type": type, "status": status, "reason": reason, "message": message}
        if observed_generation is not None:
            new["observedGeneration"] = observed_generation
        new["lastTransitionTime"] = format_time(now)
        out.append(new)
    return out


def get_condition(
    conditions: Iterable[Mapping[str, Any]] | None, type: str
) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type:
            return cond
    return None


def is_true(conditions: Iterable[Mapping[str, Any]] | None, type: str) -> bool:
    cond = get_condition(conditions, type)
    return cond is not None and cond.get("status") == TRUE
