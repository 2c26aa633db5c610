"""pytest fixtures: tools (see module owner)."""
