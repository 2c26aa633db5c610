"""helm v3 templates, installs and uninstalls a chart on the real API server."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import Helm

pytestmark = pytest.mark.cluster


def _tiny_chart(root: Path) -> Path:
    chart = root / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: tiny\nversion: 0.1.0\nappVersion: '1.0'\n"
    )
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    return chart


def test_helm_is_v3_and_renders_without_cluster(helm_local: Helm, tmp_path: Path) -> None:
    assert helm_local("version", "--short").stdout.startswith("v3.")
    chart = _tiny_chart(tmp_path)
    out = helm_local("template", "r0", str(chart)).stdout
    assert yaml.safe_load(out)["data"] == {"greeting": "hello"}
    (chart / "templates" / "broken.yaml").write_text("x: {{ .Values.greeting \n")
    bad = helm_local("lint", str(chart), check=False)
    assert bad.returncode != 0
    assert "broken.yaml" in bad.stdout + bad.stderr


def test_helm_template_install_uninstall(
    helm: Helm, kube_cluster: KubeCluster, namespace: str, tmp_path: Path
) -> None:
    chart = _tiny_chart(tmp_path)
    helm("lint", str(chart))
    rendered = yaml.safe_load(helm("template", "r1", str(chart), "--set", "greeting=hi").stdout)
    assert rendered["metadata"]["name"] == "r1-cm"
    assert rendered["data"]["greeting"] == "hi"

    helm("install", "r1", str(chart), "-n", namespace, "--wait", "--timeout", "60s")
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        assert core.read_namespaced_config_map("r1-cm", namespace).data == {"greeting": "hello"}
        assert "r1" in helm("list", "-n", namespace, "-q").stdout.split()

        helm("uninstall", "r1", "-n", namespace, "--wait")
        with pytest.raises(ApiException) as err:
            core.read_namespaced_config_map("r1-cm", namespace)
        assert err.value.status == 404
