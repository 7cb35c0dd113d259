"""The one name -> object table of rankwise: losses, backbones, datasets, experiments, hash methods.

Names map (in order) to objects or to :class:`Lazy` entries imported on first use; aliases and a
normalisation resolve what users type, and an unknown name fails with one error format.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Lazy", "Registry", "keyword_parameters"]

T = TypeVar("T")


@dataclass(frozen=True)
class Lazy:
    """An entry imported on first use: attribute ``attribute`` of module ``module``."""

    module: str
    attribute: str

    def load(self) -> Any:
        """The object (importing its module)."""
        return getattr(importlib.import_module(self.module), self.attribute)


class Registry(Generic[T]):
    """Names -> objects, with aliases and one error for an unknown name.

    Args:
        kind: what the names name, for the error (``"loss"``, ``"dataset"``...).
        entries: name -> object (or :class:`Lazy`), in the order names are listed.
        aliases: other spellings -> name.
        normalize: applied to a name before the look-up (e.g. ``str.lower``).
        hint: appended to the list of names in the error (e.g. the aliases).
    """

    def __init__(
        self,
        kind: str,
        entries: Mapping[str, T | Lazy],
        *,
        aliases: Mapping[str, str] | None = None,
        normalize: Callable[[Any], str] | None = None,
        hint: str = "",
    ) -> None:
        self.kind = kind
        self._entries = dict(entries)
        self.aliases = dict(aliases or {})
        self._normalize = normalize
        self._hint = hint

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, in order (aliases excluded)."""
        return tuple(self._entries)

    def lookup(self, name: Any) -> str | None:
        """The name ``name`` stands for (after normalisation and aliases), or None."""
        key = self._normalize(name) if self._normalize is not None else name
        if not isinstance(key, str):
            return None
        key = self.aliases.get(key, key)
        return key if key in self._entries else None

    def canonical(self, name: Any) -> str:
        """The name ``name`` stands for; ``ValueError`` listing the names when it is unknown."""
        key = self.lookup(name)
        if key is None:
            raise ValueError(
                f"unknown {self.kind} {name!r}; available: {', '.join(self._entries)}{self._hint}."
            )
        return key

    def __getitem__(self, name: Any) -> T:
        entry = self._entries[self.canonical(name)]
        return entry.load() if isinstance(entry, Lazy) else entry

    def __contains__(self, name: Any) -> bool:
        return self.lookup(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def keyword_parameters(func: Callable, skip: int = 0) -> tuple[dict[str, inspect.Parameter], bool]:
    """Named parameters of ``func`` after the first ``skip`` ones, and whether it takes **kwargs.

    A class gives its constructor's, less ``self``.
    """
    params = list(inspect.signature(func).parameters.values())
    named = {
        p.name: p
        for p in params[skip:]
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    return named, any(p.kind == p.VAR_KEYWORD for p in params)
