"""Placeholder: being implemented."""
BlackBoxAPLoss = None  # placeholder
