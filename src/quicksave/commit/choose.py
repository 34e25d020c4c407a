"""Which commit strategy serves a location: chosen here once, from its backend, so that
no caller asks which backend it has (docs/ARCHITECTURE.md, "Commit")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from quicksave.commit.kinds import CheckpointKind
from quicksave.commit.manifest_last import ManifestLastCommit
from quicksave.commit.rename import RenameCommit
from quicksave.commit.strategy import CommitStrategy
from quicksave.storage.backend import Backend
from quicksave.storage.location import Location, parse_location


def strategy_for(backend: Backend, *, owned: bool = False) -> CommitStrategy:
    """The strategy of the locations ``backend`` serves: rename where directories
    rename atomically, else manifest-last. ``owned``: the strategy closes ``backend``."""
    if backend.atomic_rename:
        return RenameCommit(backend, owned=owned)
    return ManifestLastCommit(backend, owned=owned)


def strategy_class(location: str | Location) -> type[CommitStrategy]:
    """The strategy class of ``location``, without opening it: to ask what it can do
    (:attr:`CommitStrategy.atomic_replace`) before any I/O."""
    return RenameCommit if parse_location(location).is_local else ManifestLastCommit


@contextlib.contextmanager
def open_strategy(
    location: str | Location, backend: Backend | None = None, *, rank: int = 0
) -> Iterator[CommitStrategy]:
    """The strategy of ``location`` for a ``with`` block: through ``backend`` if given
    (a caller's, kept open), else through one opened for the block and closed after."""
    if backend is not None:
        s = strategy_for(backend)
    else:
        s = strategy_for(parse_location(location).open(rank=rank), owned=True)
    try:
        yield s
    finally:
        s.close()


def classify(path: str | Location, backend: Backend | None = None) -> CheckpointKind:
    """What ``path`` is, from the names present; no file is parsed, except that the
    last bytes of a ``.metadata`` without ``manifest.json`` beside it are read to tell
    a DCP-layout quicksave checkpoint from a stock DCP one (:func:`metadata_has_footer`).
    On an object store a prefix with no object under it is MISSING, and only its
    manifest (or DCP-layout ``.metadata``) commits it.

    Args:
        path: a path, URL or Location.
        backend: an open backend serving it (default: one is opened for the call).
    """
    loc = parse_location(path)
    with open_strategy(loc, backend) as s:
        return s.classify(loc)
