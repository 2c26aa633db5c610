"""Alert rules and dashboard checked with the real Prometheus tools.

- the PrometheusRule's spec passes `promtool check rules`;
- `promtool test rules` runs promtool/alerts_test.yaml (seed §9.1: p99 latency
  above 0.5 s for 5 minutes, from the latency histogram; fallbacks; acceptance;
  5xx share) against the rules rendered with default values;
- every dashboard query is valid PromQL (promtool parses it as a recording rule)
  and names only metrics the engine or the operator really exports.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from slimspec_testbed.tools import run_checked

from .conftest import (
    Rendered,
    contract_metrics,
    dashboard,
    dashboard_exprs,
    prometheus_rule_groups,
    render,
)

HERE = Path(__file__).parent
METRIC = re.compile(r"(?<![:\w])(slimspec_[a-z0-9_]+)")
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


def base_metric(name: str, histograms: set[str]) -> str:
    for suffix in HIST_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in histograms:
            return name[: -len(suffix)]
    return name


def engine_histograms() -> set[str]:
    return {
        "slimspec_request_latency_seconds",
        "slimspec_time_to_first_token_seconds",
        "slimspec_batch_size",
    }


@pytest.fixture(scope="module")
def rules_default() -> dict:
    return prometheus_rule_groups(render("--set", "monitoring.prometheusRule.enabled=true"))


def write_rules(path: Path, groups: dict) -> Path:
    path.write_text(yaml.safe_dump(groups, sort_keys=False))
    return path


def test_rendered_rules_pass_promtool_check(promtool: Path, tmp_path: Path) -> None:
    for args in ([], ["-f", str(HERE / "values" / "full.yaml")]):
        r: Rendered = render("--set", "monitoring.prometheusRule.enabled=true", *args)
        rules = write_rules(tmp_path / "rules.yaml", prometheus_rule_groups(r))
        out = run_checked([promtool, "check", "rules", rules])
        assert "SUCCESS" in out.stdout


def test_seed_latency_alert_is_p99_over_half_a_second_for_5m(rules_default: dict) -> None:
    alerts = {
        rule["alert"]: rule
        for group in rules_default["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    latency = alerts["SlimSpecHighInferenceLatency"]
    expr = " ".join(latency["expr"].split())
    assert expr.startswith("histogram_quantile(0.99,")
    assert "slimspec_request_latency_seconds_bucket" in expr
    assert expr.endswith("> 0.5")
    assert latency["for"] == "5m"
    assert latency["labels"]["severity"] == "critical"
    assert set(alerts) == {
        "SlimSpecHighInferenceLatency",
        "SlimSpecFrequentFallbacks",
        "SlimSpecLowAcceptance",
        "SlimSpecServerErrors",
        "SlimSpecOperatorReconcileErrors",
    }


def test_promtool_unit_tests_of_the_alerts(
    promtool: Path, rules_default: dict, tmp_path: Path
) -> None:
    write_rules(tmp_path / "rules.yaml", rules_default)
    shutil.copy(HERE / "promtool" / "alerts_test.yaml", tmp_path)
    out = run_checked([promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path)
    assert "SUCCESS" in out.stdout


def test_unit_tests_catch_a_wrong_alert(promtool: Path, tmp_path: Path) -> None:
    """The unit tests are not vacuous: a 3-minute `for` makes them fail."""
    r = render(
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.prometheusRule.alerts.latency.for=3m",
    )
    write_rules(tmp_path / "rules.yaml", prometheus_rule_groups(r))
    shutil.copy(HERE / "promtool" / "alerts_test.yaml", tmp_path)
    out = run_checked([promtool, "test", "rules", "alerts_test.yaml"], cwd=tmp_path, check=False)
    assert out.returncode != 0
    assert "SlimSpecHighInferenceLatency" in out.stdout + out.stderr


def test_dashboard_json_is_a_grafana_dashboard() -> None:
    d = dashboard()
    assert d["uid"] == "slimspec-overview"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in d["panels"])
    for wanted in (
        "p95 / p99",
        "GPU utilisation",
        "Acceptance",
        "Compression ratio",
        "fallbacks",
        "QPS",
    ):
        assert wanted.lower() in titles.lower(), wanted
    for panel in d["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables == {"datasource", "namespace", "service"}


def concrete(expr: str) -> str:
    """A dashboard query with Grafana's variables filled in, as Grafana sends it."""
    return (
        expr.replace("$__rate_interval", "2m")
        .replace("${datasource}", "prom")
        .replace("$namespace", ".*")
        .replace("$service", ".*")
    )


def test_dashboard_queries_are_valid_promql(promtool: Path, tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = write_rules(tmp_path / "q.yaml", {"groups": [{"name": "dashboard", "rules": rules}]})
    out = run_checked([promtool, "check", "rules", path])
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
MATCHERS = re.compile(r"\{[^}]*\}")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label names in matchers and
    grouping clauses are not metrics)."""
    return set(METRIC.findall(MATCHERS.sub("", GROUPING.sub("", expr))))


def queried_metrics(exprs: list[str]) -> set[str]:
    return {base_metric(m, engine_histograms()) for e in exprs for m in metric_names(e)}


def test_metric_name_extraction() -> None:
    expr = (
        "sum by (le, service) (rate(slimspec_request_latency_seconds_bucket"
        '{service=~"$service"}[5m])) / on(namespace) slimspec_queue_depth'
    )
    assert metric_names(expr) == {"slimspec_request_latency_seconds_bucket", "slimspec_queue_depth"}


def test_engine_queries_name_contract_metrics(rules_default: dict) -> None:
    """Against docs/contracts.md; the live scrape test checks the real server too."""
    exprs = [e for _, e in dashboard_exprs()]
    exprs += [r["expr"] for g in rules_default["groups"] for r in g["rules"]]
    engine = {m for m in queried_metrics(exprs) if not m.startswith("slimspec_operator_")}
    assert engine, "no engine metric found in the queries"
    assert engine <= contract_metrics(), engine - contract_metrics()


def test_scrape_labels_match_the_tuners_queries(rendered_variants: dict) -> None:
    """The operator's tuner selects engine series by {namespace, service}; the
    chart's PodMonitor must produce both (namespace comes with every
    Kubernetes target; `service` is relabelled from the pod's instance label)."""
    from slimspec_operator.resource.queries import DEFAULT_QUERIES
    from slimspec_operator.tuning.prometheus.queries import render_query

    used = set()
    for template in DEFAULT_QUERIES.values():
        q = render_query(template, "ml", "chat", "2m")
        for matchers in re.findall(r"\{([^}]*)\}", q):
            used |= set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)", matchers))
    # `reason` is a label the engine exports itself (slimspec_compression_can_help_info),
    # not one the scrape must add
    assert used - {"reason"} == {"namespace", "service"}
    pm = rendered_variants["full"].one("PodMonitor")
    relabels = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"],
        "targetLabel": "service",
    } in relabels
