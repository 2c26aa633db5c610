"""The real single-node cluster of the end-to-end tests: the node itself
(node_cluster), the images it runs (images) and its network namespace (netns)."""
