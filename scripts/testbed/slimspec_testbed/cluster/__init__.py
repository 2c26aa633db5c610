"""A Kubernetes control plane on loopback without a node: start it (control_plane),
its handle (handle.KubeCluster), the pod driver that plays kubelet (pods), and the
processes and certificates both this and the real node use."""
