"""Placeholder: being implemented."""
LOSSES = None  # placeholder
build_loss = None  # placeholder
