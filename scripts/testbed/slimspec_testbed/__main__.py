"""``python -m slimspec_testbed``: run a test control plane by hand (see control_plane)."""

from slimspec_testbed.cluster.control_plane import main

if __name__ == "__main__":
    main()
