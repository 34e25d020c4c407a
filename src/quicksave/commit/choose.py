"""Which commit strategy serves a location: chosen here once, by name from a registry,
so that no caller asks which backend it has (docs/ARCHITECTURE.md, "Commit").

A location's scheme entry names its strategy (``Scheme.commit``: ``"rename"`` for the
local filesystem, ``"manifest-last"`` for the stores); the name is looked up in the
location's ``StorageOptions.commits``, then in :data:`STRATEGIES`. A new strategy is a
:class:`~quicksave.commit.strategy.CommitStrategy` subclass registered under a name and
named by a scheme's entry::

    opts = StorageOptions(
        commits=Registry({"mine": MyCommit}),
        schemes=Registry({"file": LocalScheme(commit="mine")}),
    )
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from quicksave.commit.kinds import CheckpointKind
from quicksave.commit.manifest_last import ManifestLastCommit
from quicksave.commit.rename import RenameCommit
from quicksave.commit.strategy import CommitStrategy
from quicksave.storage.backend import Backend
from quicksave.storage.location import Location, parse_location
from quicksave.storage.registry import Registry

# The built-in strategies; ``StorageOptions.commits`` adds to them.
STRATEGIES: Registry[type[CommitStrategy]] = Registry(
    {RenameCommit.name: RenameCommit, ManifestLastCommit.name: ManifestLastCommit}
)


def strategy_class(location: str | Location) -> type[CommitStrategy]:
    """The strategy class of ``location``, without opening it: to ask what it can do
    (:attr:`CommitStrategy.atomic_replace`) before any I/O.

    Raises:
        CheckpointError: its scheme names a strategy no registry holds (named).
    """
    loc = parse_location(location)
    registry: Registry[type[CommitStrategy]] = loc.options.commits.over(STRATEGIES)
    return registry.require(loc.entry.commit, "commit strategy", path=loc.url)


def strategy_for(loc: Location, backend: Backend, *, owned: bool = False) -> CommitStrategy:
    """The strategy of ``loc``, doing its I/O through ``backend`` (one that serves
    ``loc``: ``loc.open()``, or one shared by locations of the same container).
    ``owned``: the strategy closes ``backend``."""
    return strategy_class(loc)(backend, owned=owned)


@contextlib.contextmanager
def open_strategy(
    location: str | Location, backend: Backend | None = None, *, rank: int = 0
) -> Iterator[CommitStrategy]:
    """The strategy of ``location`` for a ``with`` block: through ``backend`` if given
    (a caller's, kept open), else through one opened for the block and closed after."""
    loc = parse_location(location)
    if backend is not None:
        s = strategy_for(loc, backend)
    else:
        s = strategy_for(loc, loc.open(rank=rank), owned=True)
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
