"""rankwise.models (being implemented)."""
