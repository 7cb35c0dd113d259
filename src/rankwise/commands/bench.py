"""Placeholder: being implemented."""


def bench() -> None:
    """Not implemented yet."""
    raise SystemExit("not implemented yet")
