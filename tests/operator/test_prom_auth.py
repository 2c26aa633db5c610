"""Prometheus credentials and URL checks (pure parts of tuning/prometheus and tuning/keda.py)."""

from __future__ import annotations

import pytest
from slimspec_operator.resource.spec import PrometheusSpec
from slimspec_operator.tuning.keda import trigger_authentication, with_trigger_auth
from slimspec_operator.tuning.prometheus.auth import credentials
from slimspec_operator.tuning.prometheus.client import PromAuth, PromClient, check_url
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason

BEARER = PrometheusSpec.model_validate(
    {"url": "https://p:9090", "auth": {"type": "bearer", "secretName": "prom-auth"}}
)
BASIC_TLS = PrometheusSpec.model_validate(
    {
        "url": "https://p:9090",
        "auth": {"type": "basic", "secretName": "prom-auth"},
        "tls": {"caSecretName": "prom-ca"},
    }
)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://prometheus:21",
        "file:///etc/passwd",
        "gopher://x",
        "http://",
        "https://user:secret@prometheus:9090",
        "http://prometheus:notaport",
    ],
)
def test_only_plain_http_urls_are_fetched(url: str) -> None:
    with pytest.raises(PromError) as info:
        check_url(url)
    assert info.value.reason == PromReason.INVALID_URL and info.value.transport
    assert "secret" not in info.value.message
    with pytest.raises(PromError):
        PromClient(url)


def test_good_urls_pass() -> None:
    for url in ("http://prometheus.monitoring:9090", "https://thanos.example.com/api/prom"):
        check_url(url)


def test_credentials_from_secret_data() -> None:
    assert credentials(BEARER, {"token": "t0k\n"}, None) == PromAuth(bearer_token="t0k")
    auth = credentials(BASIC_TLS, {"username": "u", "password": "p"}, {"ca.crt": "PEM"})
    assert auth == PromAuth(basic=("u", "p"), ca_pem="PEM")
    with pytest.raises(PromError) as info:
        credentials(BEARER, {"username": "u"}, None)
    assert info.value.reason == PromReason.NO_CREDENTIALS
    assert info.value.message == "Secret prom-auth has no key token"
    with pytest.raises(PromError, match=r"prom-ca has no key ca\.crt"):
        credentials(BASIC_TLS, {"username": "u", "password": "p"}, {})
    assert "t0k" not in repr(credentials(BEARER, {"token": "t0k"}, None))  # never printed


def test_trigger_authentication_names_the_secret_not_its_contents() -> None:
    ta = trigger_authentication(BEARER, "ml", "chat", "uid-1")
    assert ta is not None
    assert ta["metadata"]["name"] == "chat-prometheus"
    assert ta["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert ta["spec"] == {
        "secretTargetRef": [{"parameter": "bearerToken", "name": "prom-auth", "key": "token"}]
    }
    basic = trigger_authentication(BASIC_TLS, "ml", "chat", "uid-1")
    assert basic is not None
    assert [r["parameter"] for r in basic["spec"]["secretTargetRef"]] == ["username", "password"]
    assert trigger_authentication(PrometheusSpec(), "ml", "chat", "u") is None

    so = {"spec": {"triggers": [{"type": "prometheus", "metadata": {"query": "q"}}]}}
    out = with_trigger_auth(so, BEARER, "chat")
    (trigger,) = out["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": "chat-prometheus"}
    assert trigger["metadata"]["authModes"] == "bearer"
