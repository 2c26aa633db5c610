"""pytest fixtures: cluster (see module owner)."""
