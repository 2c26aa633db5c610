"""The real node: a kubelet registered under the Node authorizer, pods run by
containerd + runc on the CNI bridge, `kubectl logs/exec/port-forward` through the API
server, and a ClusterIP Service routed by kube-proxy to two replicas, from the node
and from a pod."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.node_cluster import NodeCluster
from slimspec_testbed.scenarios.userpath import cluster_ip, wait_pods_ready, wait_until
from slimspec_testbed.tools import free_port, tool_path

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("in_node")]

# A tiny web server in the operator image (it has Python): answers with its pod name.
SERVER = (
    "import http.server,os\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    " def do_GET(self):\n"
    "  b=os.environ['POD_NAME'].encode(); self.send_response(200)\n"
    "  self.send_header('Content-Length',str(len(b))); self.end_headers(); self.wfile.write(b)\n"
    " def log_message(self,*a): print('served',flush=True)\n"
    "print('listening',flush=True)\n"
    "http.server.ThreadingHTTPServer(('',8000),H).serve_forever()\n"
)


def test_node_is_a_real_kubelet(node: NodeCluster, kube: KubeCluster) -> None:
    with kube.api_client() as api:
        obj = client.CoreV1Api(api).read_node(node.node_name)
    info = obj.status.node_info
    assert info.kubelet_version == "v1.36.3"
    assert info.container_runtime_version.startswith("containerd://")
    addresses = {a.type: a.address for a in obj.status.addresses}
    assert addresses["InternalIP"] == node.node_ip
    conds = {c.type: c.status for c in obj.status.conditions}
    assert conds["Ready"] == "True"
    assert not [t for t in obj.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
    # The images the test bed built are in the node's runtime.
    names = {n for image in obj.status.images or [] for n in image.names or []}
    for tag in (node.images.engine, node.images.operator, node.images.pause):
        assert f"docker.io/{tag}" in names, tag


def test_the_node_authorizer_confines_the_kubelet(node: NodeCluster, kube: KubeCluster) -> None:
    """The kubelet's credentials work for its own Node and nothing it has no pod for."""
    with kube.api_client(token="slimspec-kubelet-token") as api:
        core = client.CoreV1Api(api)
        assert core.read_node(node.node_name).metadata.name == node.node_name
        with pytest.raises(ApiException) as denied:
            core.read_namespaced_secret("anything", "kube-system")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as other:
            core.patch_node("another-node", {"metadata": {"labels": {"x": "y"}}})
        assert other.value.status in (403, 404)


@pytest.fixture
def web(in_node: None, kube: KubeCluster, node: NodeCluster) -> Iterator[str]:
    ns = kube.create_namespace()
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "web",
                            "image": node.images.operator,
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", SERVER],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                }
                            ],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {"httpGet": {"path": "/", "port": "http"},
                                               "periodSeconds": 1},
                        }
                    ],
                },
            },
        },
    }  # fmt: skip
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
    }
    kube.apply([deployment, service])
    wait_pods_ready(kube, ns, "app=web", 120, count=2)
    yield ns
    kube.delete_namespace(ns)


def test_service_routes_to_both_replicas_from_node_and_pod(kube: KubeCluster, web: str) -> None:
    ip = cluster_ip(kube, web, "web")
    seen: set[str] = set()

    def both() -> bool:
        seen.add(httpx.get(f"http://{ip}/", timeout=5).text)
        return len(seen) == 2

    wait_until(both, 60, f"answers from both replicas behind {ip}", interval=0.1)
    pod = kube.kubectl("get", "pods", "-n", web, "-l", "app=web", "-o",
                       "jsonpath={.items[0].metadata.name}").stdout  # fmt: skip
    # From inside a pod: pod -> ClusterIP -> a pod on the same bridge, and back.
    fetch = (
        f"import urllib.request as u; print(u.urlopen('http://{ip}/', timeout=5).read().decode())"
    )
    out = kube.kubectl("exec", "-n", web, pod, "--", "python", "-c", fetch)
    assert out.stdout.strip().startswith("web-")


def test_kubectl_logs_exec_and_port_forward(kube: KubeCluster, web: str) -> None:
    pod = kube.kubectl("get", "pods", "-n", web, "-l", "app=web", "-o",
                       "jsonpath={.items[0].metadata.name}").stdout  # fmt: skip
    assert "listening" in kube.kubectl("logs", "-n", web, pod).stdout
    assert kube.kubectl("exec", "-n", web, pod, "--", "id", "-u").stdout.strip() == "10001"
    port = free_port()
    forward = subprocess.Popen(
        [str(tool_path("kubectl")), f"--kubeconfig={kube.kubeconfig}", "port-forward", "-n", web,
         f"pod/{pod}", f"{port}:8000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=kube.env,
    )  # fmt: skip
    try:

        def answers() -> str:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
            return httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text

        assert wait_until(answers, 30, "kubectl port-forward") == pod
    finally:
        forward.terminate()
        forward.wait(10)
