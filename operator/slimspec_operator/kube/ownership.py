"""Never adopt an object this resource does not own (pure).

The operator writes to fixed names in the resource's namespace (`<name>` Service
and PodDisruptionBudget, `<name>-runtime` ConfigMap, `<name>-engine`
ServiceAccount/Role/RoleBinding, `<name>-<hash>` Deployments, `<name>-model-cache`
claim, `<name>-prep-<key>` Jobs). Server-side apply with force would take over an
object of that name that someone else made, and the garbage collector would then
delete it with the resource. So before any write the reconciler reads them all,
and an object that exists without this resource's controller reference (same
UID) stops the round: nothing is written, and the resource says which object is
in the way (Degraded, reason ResourceConflict, and an Event).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from slimspec_operator.contract import KIND

RESOURCE_CONFLICT = "ResourceConflict"


@dataclass(frozen=True)
class Conflict:
    kind: str
    name: str
    held_by: str  # who controls it, in words

    def text(self) -> str:
        return f"{self.kind} {self.name} exists and is not owned by this {KIND} ({self.held_by})"


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    ref = controller_of(obj)
    return ref is not None and bool(uid) and ref.get("uid") == uid


def _held_by(obj: Mapping[str, Any]) -> str:
    ref = controller_of(obj)
    if ref is None:
        return "it has no controller"
    return f"controlled by {ref.get('kind', '?')} {ref.get('name', '?')}"


def conflicts(
    observed: Iterable[tuple[str, str, Mapping[str, Any] | None]], uid: str
) -> list[Conflict]:
    """The objects (kind, name, object or None if absent) this resource may not write."""
    return [
        Conflict(kind, name, _held_by(obj))
        for kind, name, obj in observed
        if obj is not None and not owned_by(obj, uid)
    ]


def conflict_message(found: list[Conflict]) -> str:
    """One condition message for all of them (kept short: at most three named)."""
    shown = "; ".join(c.text() for c in found[:3])
    more = f"; and {len(found) - 3} more" if len(found) > 3 else ""
    return (
        f"{shown}{more}. The operator changes nothing until it is renamed or removed "
        "(or this resource is renamed)."
    )
