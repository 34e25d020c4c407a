"""Named implementations of one extension point: URL schemes (:mod:`.schemes`), commit
strategies (:mod:`quicksave.commit.choose`) and writer leases
(:mod:`quicksave.manager.lease`).

A :class:`Registry` is a frozen value, never a global that code mutates: each layer keeps
its built-in entries in one constant, and a user's own entries travel in the
:class:`~quicksave.storage.backend.StorageOptions` a location carries
(``StorageOptions(schemes=..., commits=..., leases=...)``), so that every process that
opens the location (an async saver's worker included: the options are pickled with it)
resolves a name the same way. A user's entry replaces a built-in one of the same name.
Entries cross to the worker process by pickle: define them at module level in a module
that process can import (a class, a function, a frozen dataclass instance).

Example::

    schemes = Registry({"mys3": S3Scheme(endpoint_url="http://127.0.0.1:8333")})
    opts = StorageOptions(schemes=schemes)
    parse_location("mys3://bucket/run", options=opts)  # served by the S3 backend

Torch-free: the worker process imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from quicksave.errors import CheckpointError

T = TypeVar("T")


@dataclass(frozen=True, init=False)
class Registry(Generic[T]):
    """Names and what they stand for, in the order given; immutable, hashable when
    its entries are (so that options holding one can key a cache of backends) and
    picklable when they are (classes and frozen dataclasses defined at module level).

    Args:
        entries: name -> entry (a mapping, or ``(name, entry)`` pairs).
    """

    entries: tuple[tuple[str, T], ...]

    def __init__(self, entries: Mapping[str, T] | Iterable[tuple[str, T]] = ()) -> None:
        pairs = dict(entries.items() if isinstance(entries, Mapping) else entries)
        object.__setattr__(self, "entries", tuple(pairs.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.entries)

    def get(self, name: str) -> T | None:
        """The entry registered as ``name``; None if there is none."""
        for n, entry in self.entries:
            if n == name:
                return entry
        return None

    def require(self, name: str, what: str, *, path: str | None = None) -> T:
        """The entry registered as ``name``.

        Raises:
            CheckpointError: none is; the message names ``what`` was asked for, the
                names known, and ``path`` (the location concerned).
        """
        entry = self.get(name)
        if entry is None:
            known = ", ".join(repr(n) for n in self.names) or "none"
            raise CheckpointError(
                f"no {what} is registered as {name!r} (registered: {known})", path=path
            )
        return entry

    def with_entry(self, name: str, entry: T) -> Registry[T]:
        """A new registry: this one with ``name`` standing for ``entry`` (replacing an
        entry of that name, in its place)."""
        return Registry({**dict(self.entries), name: entry})

    def over(self, base: Registry[T]) -> Registry[T]:
        """``base`` with this registry's entries added, replacing those of the same
        name: how a user's registry is combined with a layer's built-in one."""
        return Registry({**dict(base.entries), **dict(self.entries)})
