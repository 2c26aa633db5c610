"""SlimSpec engine."""
