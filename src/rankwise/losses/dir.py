"""Placeholder: being implemented."""
DIRLoss = None  # placeholder
