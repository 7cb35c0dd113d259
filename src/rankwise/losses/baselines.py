"""Placeholder: being implemented."""
BASELINES = None  # placeholder
baseline = None  # placeholder
