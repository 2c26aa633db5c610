"""Real model weights: the registry, fetching them without a hub, loading them."""
