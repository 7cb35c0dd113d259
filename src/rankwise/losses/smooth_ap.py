"""Placeholder: being implemented."""
SmoothAPLoss = None  # placeholder
