"""rankwise.sampling (being implemented)."""
