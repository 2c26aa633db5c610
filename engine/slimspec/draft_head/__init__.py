"""The compressed draft head: frequency-ranked subsets, low-rank factors, calibration."""
