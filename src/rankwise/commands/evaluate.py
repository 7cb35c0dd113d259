"""Placeholder: being implemented."""


def evaluate() -> None:
    """Not implemented yet."""
    raise SystemExit("not implemented yet")
