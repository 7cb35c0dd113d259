"""Implementations of the ``rankwise`` command-line sub-commands (kept out of :mod:`rankwise.cli`
so that each sub-command imports only what it needs)."""
