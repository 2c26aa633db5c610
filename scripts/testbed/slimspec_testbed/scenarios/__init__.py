"""Scenario parts tests and benchmarks share: SlimSpecService bodies (resources),
the end-to-end tuning run (tuning) and the user's path on the node (userpath)."""
