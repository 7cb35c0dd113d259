"""rankwise.training (being implemented)."""
