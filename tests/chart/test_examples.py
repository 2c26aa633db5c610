"""examples/: the manifests are valid for the real API server and the CRD, the
example rules file is the chart's rules, and the example Prometheus config's
rules pass promtool."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import run_checked

from .conftest import CHART, REPO, prometheus_rule_groups, render

EXAMPLES = REPO / "examples"
MANIFESTS = [
    "namespace.yaml",
    "models-pvc.yaml",
    "slimspecservice-minimal.yaml",
    "slimspecservice-full.yaml",
]


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def crd_schema() -> dict:
    crd = yaml.safe_load((REPO / "crds" / "slimspecservice.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("name", ["slimspecservice-minimal.yaml", "slimspecservice-full.yaml"])
def test_example_services_match_the_crd_schema(name: str) -> None:
    (svc,) = docs(name)
    assert svc["apiVersion"] == "slimspec.io/v1alpha1" and svc["kind"] == "SlimSpecService"
    jsonschema.Draft4Validator(crd_schema()).validate(
        {k: svc[k] for k in ("apiVersion", "kind", "spec")}
    )
    # The models they name are where examples/models-pvc.yaml's Job puts them.
    (pvc, job) = docs("models-pvc.yaml")
    for role in ("target", "draft"):
        src = svc["spec"]["model"][role]
        assert src["pvc"]["claimName"] == pvc["metadata"]["name"]
        assert src["pvc"]["path"].startswith("models/")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][:4] == [
        "--pair",
        "default",
        "--cache-dir",
        "/models",
    ]


def test_full_example_sets_every_spec_field() -> None:
    (svc,) = docs("slimspecservice-full.yaml")
    schema = crd_schema()["properties"]["spec"]["properties"]
    missing = set(schema) - set(svc["spec"])
    assert not missing, f"slimspecservice-full.yaml lacks {sorted(missing)}"


def test_example_rules_are_the_charts_rules() -> None:
    chart_rules = prometheus_rule_groups(render("--set", "monitoring.prometheusRule.enabled=true"))
    assert yaml.safe_load((EXAMPLES / "prometheus" / "slimspec-rules.yaml").read_text()) == (
        chart_rules
    ), "regenerate examples/prometheus/slimspec-rules.yaml from the chart (see its header)"


def test_example_prometheus_rules_pass_promtool(promtool: Path) -> None:
    config = yaml.safe_load((EXAMPLES / "prometheus" / "prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        out = run_checked([promtool, "check", "rules", EXAMPLES / "prometheus" / rule_file])
        assert "SUCCESS" in out.stdout


def test_example_job_pod_is_hardened() -> None:
    (_, job) = docs("models-pvc.yaml")
    spec = job["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["image"].endswith(
        ":" + yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    )


@pytest.mark.cluster
def test_examples_pass_server_side_dry_run(kube_cluster: KubeCluster) -> None:
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/slimspecservices.slimspec.io",
    )
    # The namespace first (for real: the others are namespaced in it), then
    # everything else as a server-side dry run, CRD schema and CEL rules included.
    kube_cluster.kubectl("apply", "-f", str(EXAMPLES / "namespace.yaml"))
    try:
        for name in MANIFESTS[1:]:
            proc = kube_cluster.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLES / name))
            assert proc.stdout.count("(server dry run)") == len(docs(name)), proc.stdout
            # Pod Security admission warns about workloads whose pods the
            # namespace's "restricted" level would reject: none here.
            assert "PodSecurity" not in proc.stderr, proc.stderr
    finally:
        kube_cluster.kubectl("delete", "-f", str(EXAMPLES / "namespace.yaml"), "--wait=false")
