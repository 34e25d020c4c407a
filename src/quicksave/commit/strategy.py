"""The commit strategy: how checkpoints at one kind of location become visible, and how
they leave it.

A checkpoint is visible all at once or not at all. How that is done depends on the
location, and only here: on a filesystem the checkpoint is written under a temporary
directory that one rename makes visible (:class:`~quicksave.commit.rename.RenameCommit`);
on an object store, which has no rename, its objects go straight under their prefix and
the manifest, written last, is the commit (:class:`~quicksave.commit.manifest_last.
ManifestLastCommit`). The strategy is chosen once, where a location is opened
(:func:`quicksave.commit.strategy_for`); callers never ask which backend they have.

What a caller does with one, in order, for a save::

    s.check_target(loc, rank, replace=...)   # before any byte is written
    draft = s.begin(loc, token)              # where the data files go (every rank)
    s.write_member(draft, name, data)        # small whole-or-nothing files (parts)
    s.read_member(draft, name, max_bytes)
    s.commit(draft, loc, members, expected, staged=...)     # the coordinator, once
    s.discard(draft, names)                  # a failed save: what it wrote

(a writer whose every rank names the draft itself, the NVRx-compatible API, checks
the target on its coordinator, calls :meth:`prepare_draft` on each rank instead of
:meth:`begin`, and :meth:`prune_draft` before the commit);
and for a folder of checkpoints: :meth:`committed` (what retention, ``latest`` and
``load`` see), :meth:`remove` (retention), :meth:`quarantine` (a checkpoint that failed
its checks), :meth:`clean_leftovers` (crashed saves, by the lease holder only).

A tier (local disk, object store; later memory and peers) is a location with its
strategy and its retention; the strategies keep no state beyond their backend, so
several tiers compose by holding one each.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from quicksave.commit.kinds import COMMITTED, CheckpointKind
from quicksave.errors import AlreadyCommittedError, CheckpointError, CheckpointExistsError
from quicksave.format import DCP_METADATA_NAME
from quicksave.format.dcp_layout import PROBE_SIZE, has_footer
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir, read_range
from quicksave.storage.location import Location

# What a save onto a committed checkpoint is told: the way to replace one, where there is
# one (the entry points that take ``overwrite``), else the alternatives.
EXISTS_REPLACEABLE = (
    "a committed checkpoint already exists here; quicksave never overwrites one unless "
    "asked: pass overwrite=True (quicksave.save, StorageWriter, AsyncSaver.save on one "
    "rank) to replace it atomically, or choose another path or delete it first"
)
EXISTS_NOT_REPLACEABLE = (
    "a committed checkpoint already exists under this prefix; quicksave never overwrites "
    "one, and an object store has no atomic replace for overwrite=True: choose another "
    "prefix or delete it first"
)


def metadata_has_footer(path: str | Location, backend: Backend | None = None) -> bool:
    """Whether the ``.metadata`` of the directory ``path`` claims the DCP layout
    (:func:`~quicksave.format.dcp_layout.has_footer` on its last bytes; one small ranged
    read). False when it is missing, not a regular file or unreadable: then it is
    whatever the names say (a stock DCP checkpoint), and its readers report the rest.
    """
    try:
        with CheckpointDir(path, backend) as d:
            f = d.open(DCP_METADATA_NAME, what="DCP metadata")
            try:
                n = min(PROBE_SIZE, f.size)
                tail = read_range(f, f.size - n, n, path=d.member_url(DCP_METADATA_NAME))
            finally:
                f.close()
    except (OSError, CheckpointError):
        return False
    return has_footer(tail)


@dataclass(frozen=True)
class StagedFiles:
    """The data files of a save where they lie when it commits: in the draft pool the
    writer wrote them from (views of the pool, no copy). A strategy that keeps
    checkpoints in memory, or hands them to a peer, takes the bytes from here instead of
    reading back what was written. Only the committing rank's own files: a multi-rank
    save's other ranks' are in their pools.

    Attributes:
        pool: the pool's memory.
        files: file name -> (offset in ``pool``, size in bytes).
    """

    pool: memoryview
    files: Mapping[str, tuple[int, int]]

    def view(self, name: str) -> memoryview:
        """The bytes of the file ``name`` (a view of the pool: valid while the save's
        pool is held, i.e. during :meth:`CommitStrategy.commit`)."""
        base, size = self.files[name]
        return self.pool[base : base + size]


class CommitStrategy(abc.ABC):
    """How checkpoints commit at the locations one backend serves.

    Args:
        backend: the location's backend, used for every I/O of the strategy.
        owned: close ``backend`` with the strategy (it was opened for it).
    """

    # The strategy's name in logs and docs ("rename", "manifest-last").
    name: ClassVar[str]
    # Whether a committed checkpoint can be replaced atomically (``overwrite=True``).
    atomic_replace: ClassVar[bool]
    # Whether data files are written straight under the checkpoint's own name (no
    # draft name to rename): then a checkpoint's name can hold a crashed save's
    # objects, and a save checks its target for them.
    writes_in_place: ClassVar[bool]
    # Whether a save may be written in the DCP layout (docs/FORMAT.md §8: DCP's own
    # ``__{rank}_{i}.distcp`` files, quicksave's manifest inside ``.metadata``), as the
    # NVRx-compatible writer does where it can. Only where the commit is a rename: the
    # layout's data files are written as local files at :meth:`member_key` (through
    # NVRx's ``open_file`` hook), and its ``.metadata`` is its commit, which must not be
    # visible before every rank's part has been read and every file checked.
    can_write_dcp_layout: ClassVar[bool]

    def __init__(self, backend: Backend, *, owned: bool = False) -> None:
        self.backend = backend
        self._owned = owned

    def close(self) -> None:
        """Close the backend if the strategy opened it."""
        if self._owned:
            self._owned = False
            self.backend.close()

    def __enter__(self) -> CommitStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is there -------------------------------------------------------------

    @abc.abstractmethod
    def classify(self, loc: Location) -> CheckpointKind:
        """What ``loc`` is (:class:`CheckpointKind`), from the names under it."""

    @abc.abstractmethod
    def committed(
        self, folder: Location, match: Callable[[str], bool] | None = None
    ) -> dict[str, CheckpointKind]:
        """The committed checkpoints directly under ``folder`` whose names ``match``
        (default: all): name -> kind (quicksave or stock DCP). What vanishes while listed
        is simply not listed."""

    # -- one save ------------------------------------------------------------------

    def check_target(
        self, loc: Location, rank: int | None = None, *, replace: bool = False
    ) -> None:
        """Raise unless a checkpoint can be committed at ``loc``: nothing there, or an
        empty directory, or with ``replace`` also a committed checkpoint (where
        :attr:`atomic_replace`). Checked before any byte is written, so that a save onto
        a file or a full directory fails at once instead of after writing everything.

        Raises:
            CheckpointError: ``replace`` where there is no atomic replace.
            CheckpointExistsError: a committed checkpoint (unless ``replace``), a file,
                a non-empty directory or a prefix holding objects is at ``loc``.
        """
        if replace:
            self.check_replace(loc, rank)
        kind = self.classify(loc)
        if kind is CheckpointKind.MISSING or (replace and kind in COMMITTED):
            return
        if kind in COMMITTED:
            raise AlreadyCommittedError(
                EXISTS_REPLACEABLE if self.atomic_replace else EXISTS_NOT_REPLACEABLE,
                path=loc.url,
                rank=rank,
            )
        self._check_in_the_way(loc, rank)

    @classmethod
    def check_replace(cls, loc: Location, rank: int | None = None) -> None:
        """Raise unless a committed checkpoint can be replaced atomically here (no I/O:
        ``strategy_class(loc).check_replace(loc)`` refuses ``overwrite=True`` before
        anything is opened).

        Raises:
            CheckpointError: there is no atomic replace (an object store).
        """
        if not cls.atomic_replace:
            raise CheckpointError(
                "overwrite=True is not supported on an object store: it has no atomic "
                "replace (the new objects would land beside the old checkpoint's, under "
                "its manifest); save to a new prefix instead",
                path=loc.url,
                rank=rank,
            )

    @abc.abstractmethod
    def _check_in_the_way(self, loc: Location, rank: int | None) -> None:
        """Raise unless what is at ``loc``, neither missing nor committed, may be
        written over (an empty directory may)."""

    @classmethod
    @abc.abstractmethod
    def draft(cls, loc: Location, token: str) -> str:
        """The key the data files of the save ``token`` at ``loc`` are written under
        (nothing is created, nothing opened: ``strategy_class(loc).draft(...)`` works
        without a backend)."""

    def begin(self, loc: Location, token: str, *, replace: bool = False) -> str:
        """Check the target and prepare :meth:`draft` for writing; return its key."""
        self.check_target(loc, replace=replace)
        return self.draft(loc, token)

    def prepare_draft(self, draft: str) -> None:
        """Make ``draft`` ready for writing without :meth:`begin`, for writers that
        name it themselves: every rank of the NVRx-compatible API derives the save's
        draft key from what all ranks know, and no rank creates it for the others. A
        filesystem creates the directory; a store needs nothing. Nothing is checked (the
        coordinator checked the target while planning).

        Raises:
            CheckpointError: it cannot be created.
        """
        return  # a store: objects need no directory

    def prune_draft(self, draft: str, keep: Collection[str]) -> None:
        """Before the commit of a save whose draft key may have been used before (the
        NVRx-compatible API derives it from the plan and a save counter, so a save after
        a restart can meet what a crashed attempt at the same key left): delete
        everything under ``draft`` but the names in ``keep``, where the draft
        belongs to this save alone (a temporary directory). Where it is the checkpoint's
        own key (:attr:`writes_in_place`) nothing is deleted: the target was checked
        empty before the save, so anything else there now is another writer's.

        Raises:
            CheckpointError: something could not be deleted.
        """
        return  # the default: draft is the checkpoint's own key

    @abc.abstractmethod
    def write_member(self, draft: str, name: str, data: bytes, *, fsync: bool = True) -> str:
        """Write a small file (a rank's part, a marker) whole or not at all, durably;
        return its path or URL."""

    def read_member(self, draft: str, name: str, max_bytes: int) -> bytes:
        """Read a file :meth:`write_member` wrote (hardened: a regular file or object,
        at most ``max_bytes``).

        Raises:
            CheckpointNotFoundError: it is not there.
            CorruptCheckpointError: it is larger than ``max_bytes``.
        """
        return self.backend.get(self.member_key(draft, name), max_bytes)

    @abc.abstractmethod
    def member_key(self, draft: str, name: str) -> str:
        """The key of ``name`` under ``draft``."""

    def member_url(self, draft: str, name: str) -> str:
        return self.backend.url(self.member_key(draft, name))

    def delete_members(self, draft: str, names: Iterable[str]) -> None:
        """Delete files written under ``draft`` that the checkpoint must not hold
        (merged parts); a missing one is no error."""
        self.backend.delete([self.member_key(draft, n) for n in names])

    @abc.abstractmethod
    def commit(
        self,
        draft: str,
        loc: Location,
        members: Mapping[str, bytes],
        expected: Mapping[str, int],
        *,
        replace: bool = False,
        staged: StagedFiles | None = None,
    ) -> None:
        """Make the save visible at ``loc``: write ``members`` in their order (the last
        one commits: the manifest), after checking that every data file of
        ``expected`` (name -> size) is under ``draft`` whole. ``staged``: this rank's
        data files in the draft pool, where the save was written from one (an async
        save's writer); None otherwise.

        Raises:
            CheckpointError: a file is missing or of another size; nothing is committed.
            CheckpointExistsError: a checkpoint was committed at ``loc`` meanwhile.
        """

    @abc.abstractmethod
    def discard(self, draft: str, names: Iterable[str]) -> None:
        """Remove what a failed save wrote under ``draft`` (its data files ``names``,
        parts included). Best effort, never raises."""

    # -- outputs that are no checkpoint -------------------------------------------

    def check_free(self, loc: Location) -> None:
        """Raise ``CheckpointExistsError`` if anything is at ``loc`` (an output is never
        written over anything)."""
        if self._exists(loc):
            raise CheckpointExistsError(
                "output already exists; quicksave never overwrites it (choose another path "
                "or delete it first)",
                path=loc.url,
            )

    @abc.abstractmethod
    def _exists(self, loc: Location) -> bool: ...

    @abc.abstractmethod
    def write_output(
        self, loc: Location, build: Callable[[str], list[str] | None], what: str
    ) -> None:
        """Write an output that is no checkpoint (a converted file, a model export) at
        ``loc``, never over anything there: ``build(path)`` writes one file, or a
        directory of files, at the local ``path`` and returns the directory's file names
        in the order they may appear (the last one completes it), or None for a file.

        Raises:
            CheckpointExistsError: something is at ``loc``.
            CheckpointError: writing failed (``what`` names the output); nothing is
                left at ``loc``.
        """

    def abandon(self, draft: str, names: Iterable[str]) -> None:
        """Remove what a save whose writer died left, from the trainer side, without
        knowing whether another rank's writer still commits it: where the draft is
        this save's own (a temporary directory) as :meth:`discard`; where it is the
        checkpoint's key, nothing (clean-up takes it later)."""
        self.discard(draft, names)

    # -- a folder of checkpoints ---------------------------------------------------

    @abc.abstractmethod
    def create_folder(self, folder: Location, rank: int | None) -> None:
        """Make ``folder`` ready to hold checkpoints; fail here, not at the first save,
        if it cannot (a file in the way, a missing bucket, bad credentials).

        Raises:
            CheckpointError: naming the folder.
        """

    @abc.abstractmethod
    def remove(self, loc: Location) -> bool:
        """Delete the checkpoint at ``loc`` so that it never looks committed while half
        deleted. False if nothing was deleted (gone, or it could not be moved)."""

    @classmethod
    def reserve(cls, loc: Location) -> bool:
        """Make the name ``loc`` look taken while a save to it is in flight, for
        callers that choose a name by whether it exists (Lightning's ``ModelCheckpoint``
        adds ``-v1``, ``-v2`` to a name it sees taken): True if a placeholder was made,
        which the save's commit replaces (:meth:`check_target` lets a save write over
        it) and :meth:`release` removes if the save fails. Nothing is made where
        something is already at ``loc``, nor where the strategy has no placeholder
        (an object store: the default). Needs no backend:
        ``strategy_class(loc).reserve(loc)``."""
        return False

    @classmethod
    def release(cls, loc: Location) -> bool:
        """Remove :meth:`reserve`'s placeholder at ``loc`` if one is still there (its
        save failed, or the process that made it died); True if one was removed.
        Anything else at ``loc`` is left alone."""
        return False

    def unlink(self, loc: Location) -> bool:
        """If ``loc`` is a link to a checkpoint (a filesystem's symbolic link), remove
        the link alone, its target kept, and return True; else False (stores have no
        links)."""
        return False

    @abc.abstractmethod
    def quarantine(self, loc: Location, why: str) -> str | None:
        """Move the committed checkpoint at ``loc``, which failed its checks, out of
        sight under ``<name>.corrupt-<token>`` (kept for a person, never deleted);
        return where, or None if it could not be moved (the caller logs)."""

    @abc.abstractmethod
    def clean_leftovers(
        self, folder: Location, stale_after_s: float, keep: Collection[str] = ()
    ) -> list[str]:
        """Remove what crashed saves left under ``folder`` (never the names in
        ``keep``: saves in flight); return what was removed. Only the holder of the
        folder's writer lease calls this."""
