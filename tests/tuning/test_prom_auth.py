"""Prometheus behind authentication, for real: a real Prometheus scraping a real
exporter, behind an authenticating reverse proxy on loopback (bearer token or basic
auth, https with a test CA made by openssl), read by the tuner's client and, in the
cluster, with credentials from Secrets the chart's RBAC lets the operator read."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes import config as kconfig
from slimspec_operator.contract import GROUP, KEDA_GROUP, KEDA_PLURAL, KEDA_VERSION, PLURAL, VERSION
from slimspec_operator.kube.client import Kube
from slimspec_operator.resource.queries import DEFAULT_QUERIES
from slimspec_operator.tuning.prometheus.client import PromAuth, PromClient
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.prometheus.queries import rate_window, render_query
from slimspec_operator.tuning.tick import Memory, tick
from slimspec_testbed.cluster.pki import make_pki
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer
from slimspec_testbed.scenarios.resources import service_manifest

from tests.support.auth_proxy import AuthProxy
from tests.support.chart_rbac import bind_to_operator_account, chart_cluster_role

from .conftest import KEDA_CRD_FILE, LoadExporter, start_prometheus

pytestmark = pytest.mark.prometheus

TOKEN = "prom-token-5b2d"
UP = "sum(up)"
TA_CRD_FILE = KEDA_CRD_FILE.parent / "triggerauthentications.keda.sh.yaml"


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 (openssl, as the test bed's own)."""
    make_pki(tmp_path / "pki")
    return tmp_path / "pki"


@pytest.fixture
def prometheus(
    prometheus_server: PrometheusFactory, load_exporter: LoadExporter
) -> PrometheusServer:
    server = start_prometheus(prometheus_server, load_exporter.target, "ns1", "svc")
    server.wait_for_query(UP, bool, timeout=30)
    return server


async def _value(url: str, auth: PromAuth | None = None, promql: str = UP) -> float | PromError:
    try:
        async with PromClient(url, timeout=5, auth=auth) as c:
            return await c.query_value(promql)
    except PromError as err:
        return err


def test_bearer_token_over_https_with_a_private_ca(prometheus: PrometheusServer, pki: Path) -> None:
    tls = (pki / "server.crt", pki / "server.key")
    ca = (pki / "ca.crt").read_text()
    with AuthProxy(prometheus.url, bearer=TOKEN, tls=tls) as proxy:
        assert asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN, ca_pem=ca))) == 1.0
        assert proxy.requests[-1] == f"Bearer {TOKEN}"

        wrong = asyncio.run(_value(proxy.url, PromAuth(bearer_token="nope", ca_pem=ca)))
        assert isinstance(wrong, PromError) and wrong.reason == PromReason.AUTH_FAILED
        assert wrong.transport and wrong.message == "HTTP 401: check prometheus.auth"

        untrusted = asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN)))
        assert isinstance(untrusted, PromError) and untrusted.reason == PromReason.UNREACHABLE
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.message
        assert len(untrusted.message) <= 200 and TOKEN not in untrusted.message

        bad_ca = asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN, ca_pem="junk")))
        assert isinstance(bad_ca, PromError) and bad_ca.reason == PromReason.NO_CREDENTIALS


def test_basic_auth(prometheus: PrometheusServer) -> None:
    with AuthProxy(prometheus.url, basic=("tuner", "s3cret")) as proxy:
        assert asyncio.run(_value(proxy.url, PromAuth(basic=("tuner", "s3cret")))) == 1.0
        denied = asyncio.run(_value(proxy.url))
        assert isinstance(denied, PromError) and denied.reason == PromReason.AUTH_FAILED
        # credentials in the URL are refused before anything is sent
        sent = len(proxy.requests)
        userinfo = proxy.url.replace("http://", "http://tuner:s3cret@")
        refused = asyncio.run(_value(userinfo))
        assert isinstance(refused, PromError) and refused.reason == PromReason.INVALID_URL
        assert len(proxy.requests) == sent and "s3cret" not in refused.message


def test_what_a_server_answers_stays_out_of_the_message(prometheus: PrometheusServer) -> None:
    """The URL is user input: a server that is not Prometheus (an internal service the
    URL was pointed at) must not have its reply read back through the status."""
    leak = b"db_password=hunter2 " * 50
    with AuthProxy(prometheus.url, bearer=TOKEN, fail_with=(500, leak)) as proxy:
        err = asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN)))
        assert isinstance(err, PromError) and err.message == "HTTP 500"
    json_leak = b'{"status": "error", "error": "hunter2"}'  # no errorType: not the query API
    with AuthProxy(prometheus.url, bearer=TOKEN, fail_with=(200, json_leak)) as proxy:
        err = asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN)))
        assert isinstance(err, PromError) and err.reason == PromReason.BAD_RESPONSE
        assert "hunter2" not in err.message
    with AuthProxy(prometheus.url, bearer=TOKEN) as proxy:  # Prometheus' own error: kept short
        bad = asyncio.run(_value(proxy.url, PromAuth(bearer_token=TOKEN), "sum(rate(x[5m]"))
        assert isinstance(bad, PromError) and bad.reason == PromReason.QUERY_ERROR
        assert bad.message.startswith("bad_data:") and len(bad.message) <= 160


# ------------------------------------------------------------------ in the cluster

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def admin(kube_cluster: Any) -> Iterator[client.ApiClient]:
    with kube_cluster.api_client() as api:
        yield api


def _secret(core: client.CoreV1Api, ns: str, name: str, data: dict[str, str]) -> None:
    body = client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data)
    core.create_namespaced_secret(ns, body)


@pytest.mark.cluster
def test_tuner_reads_credentials_the_chart_lets_it_read_and_keda_gets_them(
    kube_cluster: Any,
    admin: client.ApiClient,
    namespace: str,
    slimspec_crd: str,
    prometheus_server: PrometheusFactory,
    load_exporter: LoadExporter,
    pki: Path,
) -> None:
    load_exporter.set(rate=4, latency=0.2, kept=0.99)
    prometheus = start_prometheus(prometheus_server, load_exporter.target, namespace, "svc")
    rate_q = render_query(DEFAULT_QUERIES["requestRate"], namespace, "svc", rate_window(5))
    prometheus.wait_for_query(rate_q, lambda r: bool(r) and float(r[0]["value"][1]) > 1, timeout=40)
    core, custom = client.CoreV1Api(admin), client.CustomObjectsApi(admin)
    _secret(core, namespace, "prom-auth", {"token": TOKEN})
    _secret(core, namespace, "prom-ca", {"ca.crt": (pki / "ca.crt").read_text()})
    _secret(core, namespace, "other", {"token": TOKEN})  # not listed in the chart's values
    rbac = client.RbacAuthorizationV1Api(admin)
    role_name = f"prom-auth-{namespace}"[:63]
    role = chart_cluster_role(
        kube_cluster.env, role_name, "rbac.keda=true", "rbac.prometheusSecrets={prom-auth,prom-ca}"
    )
    rbac.create_cluster_role(role)
    for crd in (KEDA_CRD_FILE, TA_CRD_FILE):
        kube_cluster.kubectl("apply", "-f", str(crd))
    tls = (pki / "server.crt", pki / "server.key")
    try:
        bind_to_operator_account(rbac, namespace, role_name)
        sa_api = kconfig.new_client_from_config(
            config_file=str(kube_cluster.service_account_kubeconfig(namespace, "operator"))
        )
        kube = Kube(sa_api)
        for crd in ("scaledobjects.keda.sh", "triggerauthentications.keda.sh"):
            kube_cluster.kubectl(
                "wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s"
            )
        with AuthProxy(prometheus.url, bearer=TOKEN, tls=tls) as proxy:
            auth = {"type": "bearer", "secretName": "prom-auth"}
            spec = {
                "prometheus": {"url": proxy.url, "auth": auth, "tls": {"caSecretName": "prom-ca"}},
                "tuning": {"enabled": True, "intervalSeconds": 5},
            }
            body = service_manifest("svc", namespace, **spec)
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

            def condition() -> dict[str, Any]:
                obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc")
                conds = (obj.get("status") or {}).get("conditions") or []
                return next((c for c in conds if c["type"] == "MetricsAvailable"), {})

            def fresh() -> dict[str, Any]:
                return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc")

            mem = Memory(started=T0)
            asyncio.run(tick(fresh(), mem, kube, T0, force=True))
            # The queries reached Prometheus through the proxy, with the Secret's token.
            assert proxy.requests and set(proxy.requests) == {f"Bearer {TOKEN}"}
            assert condition()["status"] == "True", condition()

            # A Secret the chart does not list: the operator may not read it, and says so.
            obj = fresh()
            obj["spec"]["prometheus"]["auth"]["secretName"] = "other"
            custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc", obj)
            asyncio.run(tick(fresh(), mem, kube, T0, force=True))
            cond = condition()
            assert cond["status"] == "False" and cond["reason"] == PromReason.NO_CREDENTIALS
            assert "rbac.prometheusSecrets" in cond["message"]

            # KEDA: a TriggerAuthentication with the Secret, referenced by the trigger.
            obj = fresh()
            obj["spec"]["prometheus"]["auth"]["secretName"] = "prom-auth"
            obj["spec"]["autoscaling"] = {"enabled": True, "mode": "keda", "maxReplicas": 3}
            custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc", obj)
            asyncio.run(tick(fresh(), mem, kube, T0, force=True))
            ta = custom.get_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, namespace, "triggerauthentications", "svc-prometheus"
            )
            assert ta["spec"]["secretTargetRef"] == [
                {"parameter": "bearerToken", "name": "prom-auth", "key": "token"}
            ]
            so = custom.get_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, namespace, KEDA_PLURAL, "svc"
            )
            (trigger,) = so["spec"]["triggers"]
            assert trigger["authenticationRef"]["name"] == "svc-prometheus"
            assert trigger["metadata"]["authModes"] == "bearer"
            assert TOKEN not in str(so) + str(ta)  # references only
            obj = fresh()
            obj["spec"]["autoscaling"]["mode"] = "operator"
            custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "svc", obj)
            asyncio.run(tick(fresh(), mem, kube, T0, force=True))
            left = custom.list_namespaced_custom_object(
                KEDA_GROUP, KEDA_VERSION, namespace, "triggerauthentications"
            )["items"]
            assert left == []
        sa_api.close()
    finally:
        for crd in (KEDA_CRD_FILE, TA_CRD_FILE):
            kube_cluster.kubectl("delete", "--ignore-not-found", "-f", str(crd))
        rbac.delete_cluster_role(role_name)
