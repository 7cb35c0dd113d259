"""Placeholder: being implemented."""


def train() -> None:
    """Not implemented yet."""
    raise SystemExit("not implemented yet")
