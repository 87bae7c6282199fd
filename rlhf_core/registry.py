"""Name → implementation tables, one per family of interchangeable pieces: the algorithm families
(``algos.registry``: advantage estimators, policy losses, KL estimators, aggregation modes, KL
controllers), reward functions by data source (``rewards.registry``) and dataset adapters
(``data.adapters``). Each plugs a new entry in by decorator, refuses a name registered twice to
different objects (behaviour must not depend on import order), and names the valid entries when a
lookup misses, so a typo fails at start-up with the fix.

A table may name the modules whose decorators register its built-in entries (``providers``): it
imports them at its first lookup, so a module that only checks names against the table (the
config's schema) does not pay for what those modules import (torch, for the algorithm families).
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations for one family (``kind`` is used in error messages;
    ``providers``: the modules that register the built-in entries, imported at the first lookup)."""

    def __init__(self, kind: str, providers: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.providers = providers
        self._entries: dict[str, T] = {}
        self._provided = False

    def _table(self) -> dict[str, T]:
        """The entries, the built-in ones registered first (a provider's import registers them)."""
        if not self._provided:
            self._provided = True
            for module in self.providers:
                importlib.import_module(module)
        return self._entries

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; re-registering a different object errors."""

        def decorator(obj: T) -> T:
            # the entries as they stand: a provider registers while it imports, before the lookups
            existing = self._entries.get(name)
            # Silently replacing an entry would make behaviour depend on import order.
            if existing is not None and existing is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered as {existing!r}")
            self._entries[name] = obj
            return obj

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (for tests and plugins that register temporary variants)."""
        self._table().pop(name, None)

    def get(self, name: str) -> T:
        try:
            return self._table()[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {self.names()}") from None

    def names(self) -> list[str]:
        return sorted(self._table())

    def entries(self) -> dict[str, T]:
        """A copy of the table: name → implementation."""
        return dict(self._table())

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._table()
        except TypeError:  # unhashable, e.g. a list from a mis-parsed config
            return False
