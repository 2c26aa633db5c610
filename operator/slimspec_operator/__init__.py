"""SlimSpec operator."""
