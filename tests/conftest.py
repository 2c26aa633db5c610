"""Root conftest: fixtures live in tests/support/, one module per area; the test bed
they wrap is the slimspec_testbed package (scripts/testbed/), shared with bench/."""

pytest_plugins = [
    "tests.support.testbed_fixtures",  # real control plane, helm, Prometheus
    "tests.support.crd_fixtures",  # the CRD on the pinned and the floor API server
    "tests.support.model_fixtures",  # real model pair from the pinned PyPI chunks
    "tests.support.tiny_models",  # tiny random causal LMs built in-process
]
