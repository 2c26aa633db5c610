"""A real Prometheus scrapes a real exporter and answers PromQL; promtool checks rules."""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server
from slimspec_testbed.prometheus import PrometheusFactory
from slimspec_testbed.tools import free_port, run_checked

pytestmark = pytest.mark.prometheus


@pytest.fixture
def exporter() -> Iterator[tuple[str, Counter]]:
    registry = CollectorRegistry()
    counter = Counter("testbed_requests", "Requests seen by the test exporter.", registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{port}", counter
    server.shutdown()
    thread.join(5)


def test_prometheus_scrapes_and_answers_promql(
    prometheus_server: PrometheusFactory, exporter: tuple[str, Counter]
) -> None:
    target, counter = exporter
    counter.inc(7)
    prom = prometheus_server([target], scrape_interval="1s")
    result = prom.wait_for_query(
        'testbed_requests_total{job="slimspec"}', lambda r: len(r) == 1, timeout=20
    )
    assert float(result[0]["value"][1]) == 7.0
    assert result[0]["metric"]["instance"] == target
    assert [t["health"] for t in prom.targets()] == ["up"]

    counter.inc(5)
    prom.wait_for_query(
        "sum(testbed_requests_total)", lambda r: bool(r) and float(r[0]["value"][1]) == 12.0
    )


def test_prometheus_can_be_stopped_and_restarted(
    prometheus_server: PrometheusFactory, exporter: tuple[str, Counter]
) -> None:
    target, _ = exporter
    prom = prometheus_server([target])
    prom.wait_for_query("up", lambda r: bool(r) and r[0]["value"][1] == "1")
    prom.stop()
    assert not prom.running
    with pytest.raises(urllib.error.URLError):
        prom.query("up")
    prom.start()
    prom.wait_for_query("up", lambda r: bool(r) and r[0]["value"][1] == "1")


def test_promtool_checks_rules(promtool: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.yml"
    good.write_text(
        "groups:\n- name: g\n  rules:\n  - alert: HighLatency\n"
        "    expr: histogram_quantile(0.99, rate(x_bucket[5m])) > 0.5\n    for: 1m\n"
    )
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n- name: g\n  rules:\n  - alert: Broken\n    expr: rate(x[5m]\n")
    assert "SUCCESS" in run_checked([promtool, "check", "rules", good]).stdout
    proc = run_checked([promtool, "check", "rules", bad], check=False)
    assert proc.returncode != 0
    assert "Broken" in proc.stdout + proc.stderr or "parse error" in proc.stdout + proc.stderr
