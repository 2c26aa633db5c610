"""A spec the API server accepts can always be handled, whatever its size.

All annotations of an object together may hold at most 256 KiB. Kopf keeps a copy
of the whole spec in an annotation (its diff base) for every resource that has
create/update/resume/delete handlers; a spec larger than what is left of that
budget would be accepted by the API server and then never handled, since each of
the operator's patches would be refused. So the operator registers no such
handlers (it is level-based: rollout/handlers.py reconciles on a new metadata.generation),
and keeps nothing of the spec in annotations. The pod settings the spec takes
(env, args, affinity, ...) are then bounded only by what the API server stores.

`kubectl apply` (client-side) keeps its own copy in an annotation too; a spec too
large for it is refused at apply time, where the user sees it.
"""

from __future__ import annotations

import kopf
import pytest
import slimspec_operator.rollout.handlers
import slimspec_operator.tuning.handlers  # noqa: F401
from slimspec_operator.contract import GROUP

from .conftest import HASH, Api, OperatorProcess, sample


def test_the_operator_keeps_no_diff_base() -> None:
    registry = kopf.get_default_registry()
    assert [h.id for h in registry._changing.get_all_handlers()] == []
    assert {h.id for h in registry._spawning.get_all_handlers()} == {"on_timer", "tuning_timer"}


@pytest.mark.cluster
def test_a_spec_larger_than_the_annotation_limit_is_handled(
    operator: OperatorProcess, api: Api, namespace: str
) -> None:
    env = [{"name": f"EXTRA_{i}", "value": "v" * 3000} for i in range(100)]  # ~300 KB
    body = sample(replicas=1, engine={"env": env})
    api.create(body)
    (dep,) = api.wait(lambda: api.deployments() or None, timeout=60, what="engine Deployment")
    got = {e.name for e in dep.spec.template.spec.containers[0].env}
    assert {e["name"] for e in env} <= got
    api.wait(lambda: api.condition("Progressing").get("reason"), what="status written")
    annotations = api.get()["metadata"].get("annotations") or {}
    size = sum(len(k) + len(v) for k, v in annotations.items())
    assert size < 1024, f"{size} bytes of annotations: {sorted(annotations)}"
    assert not any(k.startswith(f"{GROUP}/") for k in annotations), sorted(annotations)
    # a spec change is handled too (it is the new generation that triggers a round)
    api.patch_spec({"replicas": 2})
    api.wait(lambda: api.deployments()[0].spec.replicas == 2, what="Deployment at 2 replicas")
    assert [d.metadata.name for d in api.deployments()] == [dep.metadata.name]
    assert dep.metadata.labels[HASH]
    # Kopf storing its copy would have been refused: "metadata.annotations: Too long"
    assert "Too long" not in operator.log()
