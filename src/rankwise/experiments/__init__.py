"""rankwise.experiments (being implemented)."""
