"""tuning/tick.py's tick against the real API server and a real Prometheus.

The clock is injected (cooldowns are minutes long in production); everything
else is real: the CRD's schema and status subresource, server-side apply,
the scale subresource, Events, a Prometheus scraping a real exporter.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client
from slimspec_operator.contract import GROUP, KEDA_GROUP, KEDA_PLURAL, KEDA_VERSION, PLURAL, VERSION
from slimspec_operator.kube.client import Kube
from slimspec_operator.resource.queries import DEFAULT_QUERIES
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.prometheus.queries import rate_window, render_query
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.status import effect_from_status, effect_status
from slimspec_operator.tuning.tick import Memory, tick
from slimspec_operator.tuning.trials import Basis, EffectMemory, Trial, judge_paired
from slimspec_operator.tuning.verdict import Window
from slimspec_testbed.scenarios.resources import controlled_by, service_manifest
from slimspec_testbed.tools import free_port

from tests.support.chart_rbac import bind_to_operator_account

from .conftest import KEDA_CRD_FILE, LoadExporter, start_prometheus
from .plant import Plant

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.asyncio]

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SVC = "svc"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def api(kube_cluster: Any) -> Iterator[client.ApiClient]:
    with kube_cluster.api_client() as api:
        yield api


class Svc:
    """Create/read one SlimSpecService and its runtime ConfigMap."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.ns = namespace

    def create(self, owned: bool = True, **spec: Any) -> None:
        """The resource, and its runtime ConfigMap as the reconciler makes it (owned), or
        one of that name someone else made (owned=False)."""
        body = service_manifest(SVC, self.ns, **spec)
        made = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)
        refs = controlled_by(made) if owned else None
        cm = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=f"{SVC}-runtime", owner_references=refs),
            data={"compression_ratio": "0.3", "quality_threshold": "0.95"},
        )
        self.core.create_namespaced_config_map(self.ns, cm)

    def get(self) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, SVC)

    def configmap_ratio(self) -> str:
        return self.core.read_namespaced_config_map(f"{SVC}-runtime", self.ns).data[
            "compression_ratio"
        ]

    def events(self) -> list[str]:
        return [e.reason for e in self.core.list_namespaced_event(self.ns).items]

    def condition(self, kind: str = "MetricsAvailable") -> dict[str, Any]:
        conds = self.get().get("status", {}).get("conditions", [])
        return next(c for c in conds if c["type"] == kind)


def tuning(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "prometheus": {"url": url, "timeoutSeconds": 2},
        "tuning": {
            "enabled": True,
            "intervalSeconds": 5,
            "latencyTargetSeconds": 0.4,
            "cooldownSeconds": 30,
            **extra,
        },
    }


def p99_query(namespace: str) -> str:
    return render_query(DEFAULT_QUERIES["p99Latency"], namespace, SVC, rate_window(5))


def wait_for_load(
    server: Any, namespace: str, rate: float, p99: float | None = None, within: float = 0.25
) -> None:
    """Until Prometheus sees `rate` req/s (+-`within`) and p99 on the right side of `p99`."""
    rate_q = render_query(DEFAULT_QUERIES["requestRate"], namespace, SVC, rate_window(5))
    near = lambda r: bool(r) and abs(float(r[0]["value"][1]) - rate) < within * rate  # noqa: E731
    server.wait_for_query(rate_q, near, timeout=40)
    if p99 is not None:
        above = p99 > 0.4
        server.wait_for_query(
            p99_query(namespace),
            lambda r: bool(r) and (float(r[0]["value"][1]) > p99) == above,
            timeout=40,
        )


def p99_now(server: Any, namespace: str, check: Any, timeout: float = 40) -> None:
    """Until Prometheus's p99 (the tuner's query) satisfies `check`."""
    server.wait_for_query(
        p99_query(namespace), lambda r: bool(r) and check(float(r[0]["value"][1])), timeout
    )


def where_the_ratio_helps(
    api: client.ApiClient,
    namespace: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
    owned: bool = True,
) -> tuple[Svc, Any]:
    """A simulated engine whose p99 falls with the ratio, and says so in its predictions;
    Prometheus scraping it; the resource (tuning on) and its runtime ConfigMap."""
    load_exporter.set(rate=5, kept=0.99)
    load_exporter.simulate(Plant("helps", base=0.8), claims="helps")
    server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
    svc = Svc(api, namespace)
    svc.create(owned=owned, **tuning(server.url))
    return svc, server


async def test_ratio_rises_holds_without_prometheus_and_resumes(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    svc, server = where_the_ratio_helps(api, namespace, prometheus_server, load_exporter)
    load_exporter.follow(svc.core, namespace, f"{SVC}-runtime")
    wait_for_load(server, namespace, 5, p99=0.5)

    kube, mem = Kube(api), Memory(started=T0)
    st = await tick(svc.get(), mem, kube, at(0), force=True)
    assert st is not None
    assert st["compression"]["lastDecision"]["reason"] == Reason.HOLD_CONFIRMING
    st = await tick(svc.get(), mem, kube, at(10), force=True)
    assert st["compression"]["ratio"] == pytest.approx(0.35)

    body = svc.get()
    comp = body["status"]["compression"]
    assert comp["ratio"] == pytest.approx(0.35) and comp["reason"] == Reason.ABOVE_TARGET
    entry = comp["history"][-1]
    assert (entry["from"], entry["to"], entry["reason"]) == (0.3, 0.35, Reason.ABOVE_TARGET)
    assert comp["lastRaise"]["requestRate"] > 1  # the load the raise answered
    assert comp["trial"]["basis"] == "predicted" and comp["trial"]["p99BeforeSeconds"] > 0.6
    # The engines' predictions, averaged over pods by ratio, as the tuner read them.
    preds = comp["predictions"]
    assert preds["canHelp"] is True and len(preds["ratios"]) == 20
    assert preds["ratios"][0]["ratio"] == 0.0 and preds["rankingCoverage"] == 0.93
    assert svc.condition("CompressionEffective")["status"] == "True"
    assert svc.configmap_ratio() == "0.35"  # in force within seconds, no pod restart
    assert svc.condition()["status"] == "True"
    assert "CompressionChanged" in svc.events()
    assert body["spec"]["replicas"] == 1  # ratio tuning never touches replicas

    # The engine follows the ConfigMap; its p99 falls a little (0.656 -> 0.632 s).
    p99_now(server, namespace, lambda v: v < 0.645)
    st = await tick(svc.get(), mem, kube, at(20), force=True)
    assert st["compression"]["lastDecision"]["reason"] == Reason.HOLD_MEASURING

    # Prometheus down: hold, and say why; the change stays under measurement.
    server.stop()
    st = await tick(svc.get(), mem, kube, at(60), force=True)
    cond = svc.condition()
    assert (cond["status"], cond["reason"]) == ("False", PromReason.UNREACHABLE)
    comp = svc.get()["status"]["compression"]
    assert comp["ratio"] == pytest.approx(0.35) and "trial" in comp
    assert svc.configmap_ratio() == "0.35"
    assert "MetricsUnavailable" in svc.events()
    assert svc.condition("CompressionEffective")["status"] == "True"  # unchanged

    # Back: available again at once; two fresh samples judge the change (kept:
    # not worse, and predicted faster), then the next step follows.
    server.start()
    wait_for_load(server, namespace, 5, p99=0.5)
    await tick(svc.get(), mem, kube, at(70), force=True)
    assert svc.condition()["status"] == "True"
    st = await tick(svc.get(), mem, kube, at(80), force=True)
    assert st["compression"]["lastDecision"]["reason"] == Reason.CONFIRMED
    assert st["compression"]["lastTrial"]["kept"] is True and "trial" not in st["compression"]
    assert Reason.CONFIRMED in svc.events()
    st = await tick(svc.get(), mem, kube, at(90), force=True)
    assert st["compression"]["ratio"] == pytest.approx(0.4)
    assert svc.configmap_ratio() == "0.4"

    # Latency well under target: the ratio comes down (faster), but not while the
    # load that needed the raise is unchanged (anti-flap), so drop the load too.
    load_exporter.set(rate=2)
    load_exporter.load = 0.3
    wait_for_load(server, namespace, 2, p99=0.2)
    await tick(svc.get(), mem, kube, at(200), force=True)
    st = await tick(svc.get(), mem, kube, at(210), force=True)
    assert st["compression"]["lastTrial"]["outcome"] == "Inconclusive"  # the load moved
    assert st["compression"]["lastTrial"]["kept"] is True  # a predicted move stays
    st = await tick(svc.get(), mem, kube, at(220), force=True)
    assert st["compression"]["ratio"] == pytest.approx(0.3)
    assert st["compression"]["reason"] == Reason.BELOW_TARGET


async def test_the_tuner_never_writes_a_runtime_configmap_it_does_not_own(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    """Someone else's ConfigMap under the runtime name: the tuner decides as usual, but
    writes nothing there and says why (as the reconciler refuses it: kube/ownership.py)."""
    svc, server = where_the_ratio_helps(
        api, namespace, prometheus_server, load_exporter, owned=False
    )
    wait_for_load(server, namespace, 5, p99=0.5)
    kube, mem = Kube(api), Memory(started=T0)
    await tick(svc.get(), mem, kube, at(0), force=True)
    st = await tick(svc.get(), mem, kube, at(10), force=True)
    assert st is not None and st["compression"]["ratio"] == pytest.approx(0.35)
    assert svc.configmap_ratio() == "0.3"
    conflicts = [
        e.message
        for e in svc.core.list_namespaced_event(namespace).items
        if e.reason == "ResourceConflict"
    ]
    assert conflicts and f"ConfigMap {SVC}-runtime is not owned" in conflicts[0]


async def test_a_change_that_made_latency_worse_is_reverted_and_backed_off(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    # The engines predict a larger ratio helps; on this engine it hurts.
    load_exporter.set(rate=5, kept=0.99)
    load_exporter.simulate(Plant("hurts", base=0.3, slope=3.0), claims="helps")
    server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
    svc = Svc(api, namespace)
    svc.create(**tuning(server.url, maxStep=0.1))
    load_exporter.follow(svc.core, namespace, f"{SVC}-runtime")
    # A steady rate first: the verdict discounts p99 moves that the load explains.
    wait_for_load(server, namespace, 5, p99=0.5, within=0.05)

    kube, mem = Kube(api), Memory(started=T0)
    await tick(svc.get(), mem, kube, at(0), force=True)
    st = await tick(svc.get(), mem, kube, at(10), force=True)
    assert st["compression"]["ratio"] == pytest.approx(0.4)
    p99_now(server, namespace, lambda v: v > 0.63)  # 0.57 -> 0.66 s at 0.4
    await tick(svc.get(), mem, kube, at(45), force=True)
    st = await tick(svc.get(), mem, kube, at(55), force=True)
    comp = st["compression"]
    assert comp["ratio"] == pytest.approx(0.3), comp["lastDecision"]
    assert comp["reason"] == Reason.REVERTED_WORSE
    assert svc.configmap_ratio() == "0.3"
    assert comp["lastTrial"]["outcome"] == "Worse" and comp["lastTrial"]["kept"] is False
    (backoff,) = comp["backoff"]
    assert (backoff["from"], backoff["direction"], backoff["count"]) == (0.3, "up", 1)
    assert backoff["until"] == "2026-01-01T12:05:55Z"  # 10 cooldowns after the revert
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    revert = next(e for e in events if e.reason == Reason.REVERTED_WORSE)
    assert revert.type == "Warning" and "0.4 -> 0.3" in revert.message
    # The revert brings p99 back; still over target, but the raise is backed off.
    p99_now(server, namespace, lambda v: v < 0.6)
    await tick(svc.get(), mem, kube, at(90), force=True)
    st = await tick(svc.get(), mem, kube, at(100), force=True)
    assert st["compression"]["lastDecision"]["reason"] == Reason.HOLD_BACKING_OFF
    assert svc.configmap_ratio() == "0.3"


async def test_where_compression_cannot_help_the_ratio_goes_low_and_says_why(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    # The default CPU engine: the head is a small share of a draft step, a larger
    # ratio is slower, and the engines say compression cannot help.
    load_exporter.set(rate=5, kept=0.99)
    load_exporter.simulate(Plant("hurts", base=0.3, slope=3.0), claims="hurts")
    server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
    svc = Svc(api, namespace)
    svc.create(**tuning(server.url))
    load_exporter.follow(svc.core, namespace, f"{SVC}-runtime")
    wait_for_load(server, namespace, 5, p99=0.5)
    server.wait_for_query(
        render_query(DEFAULT_QUERIES["compressionCanHelp"], namespace, SVC), bool, timeout=20
    )

    st = await tick(svc.get(), Memory(started=T0), Kube(api), at(0), force=True)
    comp = st["compression"]
    assert comp["ratio"] == pytest.approx(0.2) and comp["reason"] == Reason.CANNOT_HELP
    assert svc.configmap_ratio() == "0.2"
    cond = svc.condition("CompressionEffective")
    assert (cond["status"], cond["reason"]) == ("False", "HeadShareTooSmall")
    assert "8%" in cond["message"]  # the head's share of a draft step at ratio 0
    assert comp["predictions"]["canHelp"] is False
    assert comp["predictions"]["reason"] == "HeadShareTooSmall"
    assert "CompressionIneffective" in svc.events()


async def test_quality_guard_and_no_data(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    load_exporter.set(rate=5, latency=0.6, kept=0.9)
    server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
    svc = Svc(api, namespace)
    svc.create(**tuning(server.url))
    wait_for_load(server, namespace, 5)
    kube, mem = Kube(api), Memory(started=T0)
    # Dry run: the decision is reported, nothing changes.
    st = await tick(svc.get(), Memory(started=T0), kube, at(0), force=True, dry_run=True)
    assert st["compression"]["lastDecision"]["proposedRatio"] == pytest.approx(0.2)
    assert svc.get()["status"]["compression"]["ratio"] == pytest.approx(0.3)
    assert svc.configmap_ratio() == "0.3" and "DryRunCompression" in svc.events()
    # p99 is over target, but kept acceptance is below threshold: down, at once.
    st = await tick(svc.get(), mem, kube, at(0), force=True)
    assert st["compression"]["ratio"] == pytest.approx(0.2)
    assert st["compression"]["reason"] == Reason.QUALITY_GUARD
    assert svc.configmap_ratio() == "0.2"

    # A query that matches nothing: NoData, and the condition says so.
    body = svc.get()
    queries = {"requestRate": 'sum(rate(nothing_here_total{service="{service}"}[1m]))'}
    body["spec"]["tuning"]["queries"] = queries
    await tick(body, mem, kube, at(100), force=True)
    cond = svc.condition()
    assert (cond["status"], cond["reason"]) == ("False", PromReason.NO_DATA)


async def test_operator_autoscaling_scales_through_the_scale_subresource(
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    load_exporter.set(rate=5, latency=0.6, kept=0.99)
    server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
    svc = Svc(api, namespace)
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetRequestsPerReplica": 2}
    svc.create(replicas=1, autoscaling=auto, **tuning(server.url))
    wait_for_load(server, namespace, 5, p99=0.5)
    rate_q = render_query(DEFAULT_QUERIES["requestRate"], namespace, SVC, rate_window(5))
    # 3 replicas for anything in (4, 6] req/s at 2 req/s per replica.
    server.wait_for_query(rate_q, lambda r: bool(r) and 4.3 < float(r[0]["value"][1]) < 5.7)

    kube, mem = Kube(api), Memory(started=T0)
    st = await tick(svc.get(), mem, kube, at(0), force=True)
    assert st["autoscaling"]["reason"] == Reason.SCALED_UP
    scale = client.CustomObjectsApi(api).get_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, SVC
    )
    assert scale["spec"]["replicas"] == 3
    assert svc.get()["spec"]["replicas"] == 3
    assert "Scaled" in svc.events()
    # The replica change starts the ratio's settle window: p99 is over target,
    # but the ratio holds while the new capacity takes effect.
    st = await tick(svc.get(), mem, kube, at(10), force=True)
    assert st["compression"]["lastDecision"]["reason"] == Reason.SETTLING_AFTER_SCALE
    assert st["compression"]["ratio"] == pytest.approx(0.3)
    # Load gone: no scale-down inside the stabilisation window.
    load_exporter.set(rate=0.5)
    server.wait_for_query(rate_q, lambda r: bool(r) and float(r[0]["value"][1]) < 1, timeout=30)
    st = await tick(svc.get(), mem, kube, at(60), force=True)
    assert st["autoscaling"]["reason"] == Reason.HOLD_STABILISING
    assert svc.get()["spec"]["replicas"] == 3


async def test_keda_scaled_object_is_accepted_by_the_api_server(
    kube_cluster: Any,
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
) -> None:
    svc = Svc(api, namespace)
    auto = {"enabled": True, "mode": "keda", "minReplicas": 1, "maxReplicas": 5}
    svc.create(autoscaling=auto, **tuning("http://prometheus.monitoring:9090"))
    custom = client.CustomObjectsApi(api)

    kube_cluster.kubectl("delete", "--ignore-not-found", "-f", str(KEDA_CRD_FILE))
    await tick(svc.get(), Memory(started=T0), Kube(api), at(0), force=True)
    assert "KedaNotInstalled" in svc.events()

    kube_cluster.kubectl("apply", "-f", str(KEDA_CRD_FILE))
    try:
        kube_cluster.kubectl(
            "wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=30s"
        )
        mem = Memory(started=T0)
        await tick(svc.get(), mem, Kube(api), at(0), force=True)
        so = custom.get_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL, SVC
        )
        body = svc.get()
        assert so["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
        spec = so["spec"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "slimspec.io/v1alpha1",
            "kind": "SlimSpecService",
            "name": SVC,
        }
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 5)
        trig = spec["triggers"][0]
        assert trig["type"] == "prometheus" and trig["metricType"] == "AverageValue"
        assert trig["metadata"]["serverAddress"] == "http://prometheus.monitoring:9090"
        assert f'namespace="{namespace}"' in trig["metadata"]["query"]
        # Nothing was pruned: what the builder made is what the server stored.
        behaviour = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behaviour["scaleDown"]["stabilizationWindowSeconds"] == 300

        # The schema is enforced for real: KEDA's CEL rule rejects min > max.
        bad = dict(so)
        bad["spec"] = {**spec, "minReplicaCount": 9, "maxReplicaCount": 2}
        bad["metadata"] = {"name": "bad", "namespace": namespace}
        with pytest.raises(client.ApiException) as info:
            custom.create_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL, bad
            )
        assert info.value.status == 422

        # Switching to operator mode removes the ScaledObject.
        body["spec"]["autoscaling"]["mode"] = "operator"
        await tick(body, mem, Kube(api), at(10), force=True)
        left = custom.list_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL
        )
        assert left["items"] == []
    finally:
        kube_cluster.kubectl("delete", "--ignore-not-found", "-f", str(KEDA_CRD_FILE))


def chart_operator_role(kube_cluster: Any, name: str) -> dict[str, Any]:
    """The operator's ClusterRole exactly as the Helm chart renders it (KEDA rules on)."""
    from tests.support.chart_rbac import chart_cluster_role

    return chart_cluster_role(kube_cluster.env, name, "rbac.keda=true")


async def test_tuner_works_with_exactly_the_charts_rbac(
    kube_cluster: Any,
    api: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: Any,
    load_exporter: LoadExporter,
) -> None:
    from kubernetes import config as kconfig

    role_name = f"tuning-rbac-{namespace}"[:63]
    rbac = client.RbacAuthorizationV1Api(api)
    rbac.create_cluster_role(chart_operator_role(kube_cluster, role_name))
    kube_cluster.kubectl("apply", "-f", str(KEDA_CRD_FILE))
    try:
        bind_to_operator_account(rbac, namespace, role_name)
        kubeconfig = kube_cluster.service_account_kubeconfig(namespace, "operator")
        sa_api = kconfig.new_client_from_config(config_file=str(kubeconfig))
        kube_cluster.kubectl(
            "wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=30s"
        )

        load_exporter.set(rate=5, latency=0.6, kept=0.9)
        server = start_prometheus(prometheus_server, load_exporter.target, namespace, SVC)
        svc = Svc(api, namespace)
        auto = {"enabled": True, "maxReplicas": 4, "targetRequestsPerReplica": 2}
        svc.create(replicas=1, autoscaling=auto, **tuning(server.url))
        wait_for_load(server, namespace, 5)

        kube, mem = Kube(sa_api), Memory(started=T0)
        # Quality guard (ConfigMap patch, Event, status apply) and a scale-up
        # (scale subresource) in one tick, all as the chart's ServiceAccount.
        st = await tick(svc.get(), mem, kube, at(0), force=True)
        assert st["compression"]["reason"] == Reason.QUALITY_GUARD
        assert svc.configmap_ratio() == "0.2"
        assert svc.get()["spec"]["replicas"] >= 2
        assert {"CompressionChanged", "Scaled"} <= set(svc.events())
        # KEDA mode: discovery, apply, then delete when switched back.
        body = svc.get()
        body["spec"]["autoscaling"]["mode"] = "keda"
        await tick(body, mem, kube, at(10), force=True)
        custom = client.CustomObjectsApi(api)
        so = custom.get_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL, SVC
        )
        assert so["spec"]["scaleTargetRef"]["name"] == SVC
        body["spec"]["autoscaling"]["mode"] = "operator"
        await tick(body, mem, kube, at(20), force=True)
        left = custom.list_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL
        )
        assert left["items"] == []
        sa_api.close()
    finally:
        kube_cluster.kubectl("delete", "--ignore-not-found", "-f", str(KEDA_CRD_FILE))
        rbac.delete_cluster_role(role_name)


async def test_a_tick_planned_from_a_stale_read_does_not_undo_a_status_edit(
    api: client.ApiClient, namespace: str, slimspec_crd: str
) -> None:
    """The status write carries the resourceVersion the tick read: a user's
    `kubectl patch --subresource=status` (here: a ratio set by hand) made after that
    read gets a 409 for the tick, which reads again and plans from the user's value."""
    svc = Svc(api, namespace)
    svc.create(**tuning(f"http://127.0.0.1:{free_port()}"))  # nothing listens: hold
    stale = svc.get()
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, SVC, {"status": {"compression": {"ratio": 0.45}}}
    )
    st = await tick(stale, Memory(started=T0), Kube(api), at(0), force=True)
    assert st is not None and st["compression"]["ratio"] == 0.45
    status = svc.get()["status"]
    assert status["compression"]["ratio"] == 0.45  # not put back to the stale 0.3
    assert status["compression"]["lastDecision"]["reason"] == PromReason.UNREACHABLE
    assert svc.condition()["reason"] == PromReason.UNREACHABLE
    assert svc.configmap_ratio() == "0.3"  # held: nothing else was written


async def test_a_paired_trial_and_its_verdict_survive_the_crds_schema(
    api: client.ApiClient, namespace: str, slimspec_crd: str
) -> None:
    """A paired trial's windows and a paired verdict's effect and margin are in the
    CRD's status schema: the API server keeps every field (a structural schema
    prunes unknown ones silently), and the tuner reads the trial back whole."""
    svc = Svc(api, namespace)
    svc.create(**tuning(f"http://127.0.0.1:{free_port()}"))

    def window(ratio: float, start: float, parts: tuple[float, float]) -> Window:
        return Window(ratio, at(start), at(start + 60), sum(parts) / 2, parts, 3.5, 1.0)

    before = window(0.3, -60, (0.079, 0.081))
    after = window(0.35, 60, (0.071, 0.073))
    again = window(0.3, 180, (0.08, 0.082))
    trial = Trial(at(0), 0.3, 0.35, Basis.PREDICTED, 3.5, 1.0, before=before)
    trial = replace(trial, after=after, recheck_time=at(120))
    last = judge_paired(trial, again, at(240), 0.1, 0.2)
    docs = effect_status(EffectMemory(trial=trial, last=last))
    client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, SVC, {"status": {"compression": {"ratio": 0.3, **docs}}}
    )
    stored = svc.get()["status"]["compression"]
    assert stored["trial"] == docs["trial"] and stored["lastTrial"] == docs["lastTrial"]
    assert {w["role"] for w in stored["lastTrial"]["windows"]} == {"before", "after", "again"}
    assert stored["lastTrial"]["kept"] is True and stored["lastTrial"]["meanEffect"] < 0
    read = effect_from_status(stored)
    assert read.trial is not None and read.trial.before == before and read.trial.after == after
    assert read.last is not None and read.last.again == again
