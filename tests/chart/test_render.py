"""helm lint / helm template of the chart with default and non-default values."""

from __future__ import annotations

import subprocess

import jsonschema
import pytest
import yaml
from slimspec_testbed.tools import run_checked

from .conftest import (
    CHART,
    DASHBOARD,
    REPO,
    VARIANTS,
    Rendered,
    helm_bin,
    helm_template,
    pod_specs,
    render,
)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_strict(variant: str) -> None:
    out = run_checked([helm_bin(), "lint", "--strict", str(CHART), *VARIANTS[variant]])
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_default_render_is_the_operator_and_its_rbac(rendered_variants: dict) -> None:
    r: Rendered = rendered_variants["default"]
    assert r.kinds() == sorted(
        [
            "ClusterRole",  # Kopf's reads of CRDs and namespaces only
            "ClusterRoleBinding",
            "Role",  # namespace scope: writes only in the release namespace
            "RoleBinding",
            "Deployment",
            "NetworkPolicy",  # operator ingress
            "NetworkPolicy",  # helm test pod
            "Pod",  # the helm test hook
            "Service",
            "ServiceAccount",
        ]
    )
    assert "monitoring.coreos.com" not in r.text  # monitoring is opt-in
    pod = r.one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"


def test_full_render_has_every_optional_part(rendered_variants: dict) -> None:
    r: Rendered = rendered_variants["full"]
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap", "SlimSpecService"):
        assert r.of_kind(kind), kind
    cm = r.one("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # The ConfigMap carries the dashboard file unchanged.
    assert cm["data"]["slimspec-overview.json"] == DASHBOARD.read_text().rstrip("\n")
    assert r.one("ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pods_are_hardened(variant: str, rendered_variants: dict) -> None:
    r: Rendered = rendered_variants[variant]
    specs = list(pod_specs(r))
    assert specs
    for name, spec in specs:
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True, name
        assert psc["runAsUser"] == 10001, name
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in sc["capabilities"], name
            assert set(c["resources"]["requests"]) >= {"cpu", "memory"}, name
            assert set(c["resources"]["limits"]) >= {"cpu", "memory"}, name
            image = c["image"]
            assert "@sha256:" in image or (":" in image and not image.endswith(":latest")), image


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_operator_deployment(variant: str, rendered_variants: dict) -> None:
    r: Rendered = rendered_variants[variant]
    dep = r.one("Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert spec["serviceAccountName"] == r.one("ServiceAccount")["metadata"]["name"]
    # The selector is a subset of the pod labels, and stable (no version in it).
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert "app.kubernetes.io/version" not in sel
    args = c["args"]
    watched = [a for a in args if a.startswith("--namespace")]
    if variant == "namespaced":
        assert watched == ["--namespace=team-a", "--namespace=team-b"]
        assert c["image"].endswith("@sha256:" + "0" * 63 + "1")
    elif variant == "default":
        assert watched == ["--namespace=slimspec-system"]  # the release namespace
        assert c["image"] == "ghcr.io/slimspec/operator:0.1.0"
    else:
        assert watched == []  # cluster scope: the whole cluster


def test_image_tags_follow_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["image"]["tag"] == chart["appVersion"]
    # The engine image comes from each SlimSpecService (CRD default): same version.
    crd = yaml.safe_load((REPO / "crds" / "slimspecservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert (
        spec["properties"]["image"]["default"] == f"ghcr.io/slimspec/engine:{chart['appVersion']}"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "operator.image.tag=latest"], "/operator/image/tag"),
        (["--set", "rbac.scope=everywhere"], "/rbac/scope"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "monitoring.serviceMonitor.interval=30 seconds"], "interval"),
        (["--set", "operator.image.digest=sha256:abc"], "digest"),
        (["--set", "rbac.watchNamespaces={Bad_NS}"], "watchNamespaces"),
    ],
)
def test_schema_rejects_bad_values(args: list[str], message: str) -> None:
    proc = helm_template(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_serviceaccount_must_be_named_when_not_created() -> None:
    proc = helm_template("--set", "serviceAccount.create=false", check=False)
    assert proc.returncode != 0
    assert "serviceAccount.name is required" in proc.stderr
    r = render("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops")
    assert not r.of_kind("ServiceAccount")
    assert r.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert r.one("ClusterRoleBinding")["subjects"][0]["name"] == "ops"


def test_chart_crds_are_the_source_crds() -> None:
    src = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert "slimspecservice.yaml" in src
    assert sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == src
    for name in src:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"{name}: run bash scripts/sync-chart-crd.sh"
        )
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "sync-chart-crd.sh"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    # helm ships them unchanged (crds/ is never templated).
    crds = {
        d["metadata"]["name"]: d
        for d in render("--include-crds").of_kind("CustomResourceDefinition")
    }
    source = yaml.safe_load((REPO / "crds" / "slimspecservice.yaml").read_text())
    assert crds["slimspecservices.slimspec.io"] == source
    assert source["spec"]["group"] == "slimspec.io"
    assert source["spec"]["names"]["kind"] == "SlimSpecService"
    assert source["spec"]["names"]["shortNames"] == ["ssvc"]


def test_peering_objects_follow_the_scope() -> None:
    r = render("--set", "operator.peering.enabled=true", "--set", "rbac.scope=cluster")
    (peering,) = r.of_kind("ClusterKopfPeering")
    args = r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--peering={peering['metadata']['name']}" in args
    assert "--standalone" not in args
    r = render(
        "--set",
        "operator.peering.enabled=true",
        "--set",
        "rbac.scope=namespace",
        "--set",
        "rbac.watchNamespaces={a,b}",
        "--set",
        "operator.peering.name=ops",
    )
    assert {
        (d["metadata"]["namespace"], d["metadata"]["name"]) for d in r.of_kind("KopfPeering")
    } == {("a", "ops"), ("b", "ops")}
    assert not r.of_kind("ClusterKopfPeering")
    assert (
        "--standalone"
        in render().one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )


def test_more_than_one_replica_needs_peering() -> None:
    proc = helm_template("--set", "operator.replicas=2", check=False)
    assert proc.returncode != 0 and "needs operator.peering.enabled=true" in proc.stderr
    r = render("--set", "operator.replicas=2", "--set", "operator.peering.enabled=true")
    assert r.one("Deployment")["spec"]["replicas"] == 2


def test_example_resource_matches_the_crd_schema(rendered_variants: dict) -> None:
    """Offline check with the CRD's own OpenAPI schema (the cluster test asks the
    real API server too)."""
    crd = yaml.safe_load((REPO / "crds" / "slimspecservice.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    example = rendered_variants["full"].one("SlimSpecService")
    assert example["apiVersion"] == f"slimspec.io/{version['name']}"
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(version["schema"]["openAPIV3Schema"]).validate(
        {k: example[k] for k in ("apiVersion", "kind", "spec")}
    )
