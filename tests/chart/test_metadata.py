"""Chart.yaml: the Kubernetes floor it claims is the one the CRD is tested on."""

from __future__ import annotations

import re

import yaml
from slimspec_testbed.tools import pinned_versions

from .conftest import CHART, helm_template

CHART_YAML = yaml.safe_load((CHART / "Chart.yaml").read_text())


def floor_minor() -> tuple[int, int]:
    match = re.fullmatch(r"v(\d+)\.(\d+)\.\d+", pinned_versions()["K8S_FLOOR_VERSION"])
    assert match, pinned_versions()["K8S_FLOOR_VERSION"]
    return int(match[1]), int(match[2])


def test_kube_version_floor_is_the_tested_floor() -> None:
    """kubeVersion admits the floor API server the CRD tests run on
    (tests/operator/test_cluster_validation.py) and nothing older."""
    major, minor = floor_minor()
    assert CHART_YAML["kubeVersion"] == f">={major}.{minor}.0-0"
    assert helm_template("--kube-version", f"{major}.{minor}.0").returncode == 0
    old = helm_template("--kube-version", f"{major}.{minor - 1}.99", check=False)
    assert old.returncode != 0
    assert "kubeVersion" in old.stderr or "incompatible" in old.stderr


def test_artifact_hub_annotations_match_the_chart() -> None:
    """The images and CRDs Chart.yaml announces are the ones the chart uses."""
    notes = CHART_YAML["annotations"]
    assert all(isinstance(v, str) for v in notes.values())  # ct: map(str, str)
    images = {i["name"]: i["image"] for i in yaml.safe_load(notes["artifacthub.io/images"])}
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    op = values["operator"]["image"]
    assert images["operator"] == f"{op['repository']}:{op['tag']}"
    crd = yaml.safe_load((CHART / "crds" / "slimspecservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert images["engine"] == spec["properties"]["image"]["default"]
    (announced,) = yaml.safe_load(notes["artifacthub.io/crds"])
    assert announced["name"] == crd["metadata"]["name"]
    assert announced["kind"] == crd["spec"]["names"]["kind"]
    assert announced["version"] == crd["spec"]["versions"][0]["name"]
    assert CHART_YAML["home"] and CHART_YAML["sources"] and CHART_YAML["maintainers"]
