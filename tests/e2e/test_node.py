"""The real nodes: two kubelets registered under the Node authorizer, pods run by
containerd + runc on each node's CNI bridge, `kubectl logs/exec/port-forward` through
the API server to the second node, and a ClusterIP Service routed by kube-proxy to two
replicas spread over the two nodes, from a node and from a pod on the other node."""

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


def test_both_nodes_are_real_kubelets(node: NodeCluster, kube: KubeCluster) -> None:
    assert [n.name for n in node.nodes] == ["slimspec-node", "slimspec-node-2"]
    for each in node.nodes:
        with kube.api_client() as api:
            obj = client.CoreV1Api(api).read_node(each.name)
        info = obj.status.node_info
        assert info.kubelet_version == "v1.36.3"
        assert info.container_runtime_version.startswith("containerd://")
        addresses = {a.type: a.address for a in obj.status.addresses}
        assert addresses["InternalIP"] == each.ip
        conds = {c.type: c.status for c in obj.status.conditions}
        assert conds["Ready"] == "True"
        assert not [t for t in obj.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        # The images the test bed built are in each node's own runtime.
        names = {n for image in obj.status.images or [] for n in image.names or []}
        for tag in (node.images.engine, node.images.operator, node.images.pause):
            assert f"docker.io/{tag}" in names, (each.name, tag)


def test_the_node_authorizer_confines_each_kubelet(node: NodeCluster, kube: KubeCluster) -> None:
    """A kubelet's credentials work for its own Node, not the other node, and nothing
    it has no pod for."""
    first, second = node.nodes
    with kube.api_client(token=f"{second.name}-kubelet-token") as api:
        core = client.CoreV1Api(api)
        assert core.read_node(second.name).metadata.name == second.name
        with pytest.raises(ApiException) as denied:
            core.read_namespaced_secret("anything", "kube-system")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as other:
            core.patch_node(first.name, {"metadata": {"labels": {"x": "y"}}})
        assert other.value.status == 403


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
                    # one replica on each node
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "web"}},
                    }],
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


def web_pods(kube: KubeCluster, ns: str) -> dict[str, str]:
    """node name -> the web pod on it."""
    out = kube.kubectl(
        "get",
        "pods",
        "-n",
        ns,
        "-l",
        "app=web",
        "-o",
        "jsonpath={range .items[*]}{.spec.nodeName} {.metadata.name}{'\\n'}{end}",
    )
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())  # fmt: skip


def test_service_routes_to_both_replicas_from_node_and_pod(
    node: NodeCluster, kube: KubeCluster, web: str
) -> None:
    on = web_pods(kube, web)
    assert set(on) == {n.name for n in node.nodes}, on  # one replica per node
    ip = cluster_ip(kube, web, "web")
    seen: set[str] = set()

    def both() -> bool:
        seen.add(httpx.get(f"http://{ip}/", timeout=5).text)
        return len(seen) == 2

    # From the first node: ClusterIP -> the local pod, and over the link to the other.
    wait_until(both, 60, f"answers from both replicas behind {ip}", interval=0.1)
    assert seen == set(on.values())
    # From a pod on the second node: pod -> ClusterIP -> either pod (one across the
    # link) and back; the pod IPs answer directly too.
    pod = on[node.nodes[1].name]
    fetch = (
        "import sys, urllib.request as u\n"
        "get = lambda: u.urlopen(f'http://{sys.argv[1]}/', timeout=5).read().decode()\n"
        "seen = {get() for _ in range(40)}\n"
        "print(' '.join(sorted(seen)))"
    )
    from_pod: set[str] = set()

    def both_from_pod() -> bool:
        out = kube.kubectl("exec", "-n", web, pod, "--", "python", "-c", fetch, ip)
        from_pod.update(out.stdout.split())
        return from_pod == set(on.values())

    # as from the first node, wait: this node's kube-proxy may program the other
    # endpoint a moment later (one CI run saw only the local pod in 40 requests)
    wait_until(both_from_pod, 60, f"answers from both replicas from pod {pod}", interval=1)
    assert from_pod == set(on.values()), from_pod


def test_kubectl_logs_exec_and_port_forward(node: NodeCluster, kube: KubeCluster, web: str) -> None:
    # The pod on the second node: the API server reaches its kubelet over the link.
    pod = web_pods(kube, web)[node.nodes[1].name]
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
