"""``python -m rankwise ...``: the same program as the ``rankwise`` console script."""

from .cli import main

if __name__ == "__main__":
    main()
