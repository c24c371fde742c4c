"""One registry mechanism for every family of variants (models, workload presets, planners,
load and cost models, schedules, studies): keyed by a StrEnum, failing loudly on a
duplicate or an unknown name and listing the known ones (vidur's `utils/base_registry.py`, without the dependency).

Each family keeps its own exception type, so callers that catch a family's error (the
CLI turns ConfigError/ValueError/KeyError into one-line messages) keep working.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Generic, TypeVar

K = TypeVar("K", bound=StrEnum)
V = TypeVar("V")


class Registry(Generic[K, V]):
    def __init__(self, family: str, keys: type[K], error: type[Exception] = ValueError,
                 known_label: str = "known", duplicate_error: type[Exception] | None = None):
        self.family = family
        self.keys = keys
        self.error = error
        self.duplicate_error = duplicate_error or error
        self.known_label = known_label
        self._items: dict[K, V] = {}

    def register(self, name: K, value: V) -> V:
        if not isinstance(name, self.keys):
            raise TypeError(f"{self.family} names are {self.keys.__name__} members, got {name!r}")
        if name in self._items:
            raise self.duplicate_error(f"{self.family} {name.value!r} registered twice")
        self._items[name] = value
        return value

    def known(self) -> list[str]:
        """Registered names, in the order the StrEnum declares them."""
        return [k.value for k in self.keys if k in self._items]

    def get(self, name: str) -> V:
        try:
            key = self.keys(name)
        except ValueError:
            key = None
        if key is None or key not in self._items:
            raise self.error(f"unknown {self.family} {name!r}; {self.known_label}: {', '.join(self.known())}")
        return self._items[key]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[K]:
        return (k for k in self.keys if k in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> list[tuple[K, V]]:
        """(name, value) pairs, in the order the StrEnum declares them."""
        return [(k, self._items[k]) for k in self]
