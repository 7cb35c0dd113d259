"""rankwise.data (being implemented)."""
