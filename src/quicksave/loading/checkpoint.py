"""Which checkpoint a load reads: the one place that classifies the location and turns
"not a loadable checkpoint" into an error.

A load classifies its location once (on an object store: one listing) and hands the
result, a :class:`Checkpoint`, down to everything that reads it (the reader, the DCP
reader of a stock checkpoint, the manifest read), which never classify again. Only an
error path looks again: a manifest or data file that is gone tells "deleted while
loaded" from "damaged" by a second look (:func:`not_loadable`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from quicksave.commit import CheckpointKind, classify
from quicksave.errors import CheckpointError, CheckpointNotFoundError, NotCommittedError
from quicksave.loading.run_folder import committed_steps, not_a_checkpoint
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.backend import Backend


class RemoteFiles(Protocol):
    """The data files of a checkpoint that another process holds and answers reads of
    (a peer rank's replica of this rank's memory snapshot: ``tiers/peer_recovery.py``),
    instead of files at the checkpoint's location."""

    sizes: Mapping[str, int]  # each data file's size, by name

    def read(
        self,
        reads: list[tuple[str, int, memoryview]],
        landed: Callable[[int], None] | None = None,
    ) -> None:
        """Fill each ``view`` with the bytes of file ``name`` from ``offset`` on, for
        every ``(name, offset, view)``, in one exchange with the holder; ``landed(i)``
        (if given) runs on the calling thread once ``reads[i]`` is in, in order, while
        later ones still travel (what it raises is raised after the exchange).

        Raises:
            CheckpointError: the holder refused the reads or the transfer failed."""
        ...

    def close(self) -> None:
        """No more reads: the holder may stop answering (once; later calls do nothing)."""
        ...


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint, classified once.

    Attributes:
        location: where it is.
        kind: ``CheckpointKind.QUICKSAVE`` (either layout) or ``CheckpointKind.DCP`` (a
            stock ``torch.distributed.checkpoint`` directory).
        read: what a load read of it already (the manifest): a second load of the same
            classified checkpoint (the optimizers' states, streamed in after) reads it
            once.
        remote: its data files are held by another process, which answers the reads
            (then ``read`` holds the manifest, received from it); None: they are at
            ``location``.
    """

    location: Location
    kind: CheckpointKind
    read: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    remote: RemoteFiles | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def url(self) -> str:
        return self.location.url


def require_committed(
    path: str | os.PathLike[str] | Location | Checkpoint,
    *,
    allow_dcp: bool = False,
    backend: Backend | None = None,
    storage: StorageOptions | None = None,
    step: int | None = None,
    folder: Location | None = None,
    rank: int | None = None,
) -> Checkpoint:
    """The committed checkpoint at ``path`` (one classification of it), or the error
    that says why it cannot be loaded. A :class:`Checkpoint` is returned as it is
    (already classified), unless it is a stock DCP one and not ``allow_dcp``.

    Args:
        path: a checkpoint directory: a path, URL, Location or Checkpoint.
        allow_dcp: accept a committed stock ``torch.distributed.checkpoint`` directory.
        backend: an open backend serving ``path`` (default: one is opened for the call).
        storage: how to reach an object store (a path or URL only).
        step: ``path`` is the checkpoint of ``step`` in the run folder ``folder``
            (default: its parent) of a ``CheckpointManager``: the errors name the step,
            the folder's committed steps and the manager's option for stock DCP ones.
        rank: named in the errors.

    Raises:
        CheckpointNotFoundError: nothing at ``path``, not a checkpoint, or a stock DCP
            directory when ``allow_dcp`` is False.
        NotCommittedError: a temporary or partial checkpoint (it is never loaded).

    Example::

        checkpoint = require_committed("ckpt/step-100", allow_dcp=True)
        checkpoint.kind  # CheckpointKind.QUICKSAVE
    """
    if isinstance(path, Checkpoint):
        loc, kind = path.location, path.kind
    else:
        loc = parse_location(path, options=storage)
        kind = classify(loc, backend)
    if kind is CheckpointKind.QUICKSAVE or (allow_dcp and kind is CheckpointKind.DCP):
        return path if isinstance(path, Checkpoint) else Checkpoint(loc, kind)
    raise not_loadable(
        loc, kind, allow_dcp=allow_dcp, backend=backend, step=step, folder=folder, rank=rank
    )


def not_loadable(
    loc: Location,
    kind: CheckpointKind,
    *,
    allow_dcp: bool = False,
    backend: Backend | None = None,
    step: int | None = None,
    folder: Location | None = None,
    rank: int | None = None,
) -> CheckpointError:
    """The error for loading ``loc``, which is of ``kind`` (anything but a quicksave
    checkpoint; arguments as :func:`require_committed`)."""
    path = loc.url
    what = "checkpoint" if step is None else f"the checkpoint of step {step}"
    if kind is CheckpointKind.MISSING:
        if step is None:
            return CheckpointNotFoundError("no such file or directory", path=path, rank=rank)
        parent = folder if folder is not None else loc.parent()
        steps = committed_steps(parent, allow_dcp=allow_dcp, backend=backend)
        return CheckpointNotFoundError(
            f"no checkpoint of step {step}; committed steps: {steps}", path=path, rank=rank
        )
    if kind is CheckpointKind.UNCOMMITTED:
        return NotCommittedError(
            f"{what} was never committed (a save was interrupted or is still running); "
            "it is never loaded",
            path=path,
            rank=rank,
        )
    if kind is CheckpointKind.DCP:
        how = (
            "quicksave.load() reads it through DCP's own reader"
            if step is None
            else "its metadata is a pickle: pass CheckpointConfig(allow_dcp=True) to load it"
        )
        subject = "this" if step is None else what
        return CheckpointNotFoundError(
            f"{subject} is a stock torch.distributed.checkpoint directory, not a quicksave "
            f"one; {how}",
            path=path,
            rank=rank,
        )
    return CheckpointNotFoundError(not_a_checkpoint(loc, backend), path=path, rank=rank)


def check_still_there(
    checkpoint: Checkpoint, backend: Backend | None, *, fqn: str | None, rank: int | None
) -> None:
    """Raise the error of a load whose checkpoint is no longer committed (deleted or
    replaced since it was classified: another job's retention); do nothing when it still
    is (then a missing member is damage, the caller's error). One more classification,
    on that error path only."""
    kind = classify(checkpoint.location, backend)
    if kind is checkpoint.kind:
        return
    if kind is CheckpointKind.MISSING:
        raise CheckpointNotFoundError(
            "the checkpoint was deleted while it was being loaded",
            path=checkpoint.url,
            fqn=fqn,
            rank=rank,
        )
    raise not_loadable(checkpoint.location, kind, backend=backend, rank=rank)
