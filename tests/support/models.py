"""pytest fixtures: models (see module owner)."""
