"""SlimSpec's development test bed, shared by tests/ and bench/ (never shipped).

Real programs on loopback, no mocks: a Kubernetes control plane (etcd +
kube-apiserver + kube-controller-manager, with a pod driver in place of a kubelet),
helm and a Prometheus server, from the binaries ``scripts/testbed/install.sh``
caches; real model weights; and the SlimSpecService bodies and tuning scenario parts
the tests and benchmarks share. Nothing here imports pytest: the fixtures that wrap it
live in ``tests/support/``, and a failure is a :class:`errors.TestbedError`.

Modules:

- ``tools``: binary lookup (``tool_path``), ``free_port``, ``run_checked``, ``Helm``.
- ``control_plane``: ``running_cluster()`` starts a cluster (``python -m
  slimspec_testbed`` runs one by hand); ``cluster``: the ``KubeCluster`` handle;
  ``pods``: ``PodDriver`` (plays kubelet) and the terminating-pod reaper;
  ``processes`` and ``pki``: the components' processes and certificates.
- ``prometheus``: ``PrometheusServer``, ``scrape_config``, ``scrape_job``.
- ``models``: the real model pair and the small real model (``slimspec.weights.fetch``).
- ``resources``: SlimSpecService bodies; ``tuning_scenario``: the engine, tuner, load
  and recorder of the end-to-end tuning run.
"""
