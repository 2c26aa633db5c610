"""pytest fixtures: tiny_models (see module owner)."""
