"""rankwise.metrics (being implemented)."""
