"""The SlimSpecService resource as typed, defaulted pydantic models (pure)."""
