"""The one place quicksave's exceptions come from.

Every error names what it can of: the checkpoint path, the tensor's fully-qualified
name (fqn) and the rank, and says what to do. All are ordinary ``Exception`` subclasses
so a training loop can catch :class:`CheckpointError` and carry on.
"""

from __future__ import annotations

import errno
import os


class CheckpointError(Exception):
    """Base class: something about a checkpoint went wrong.

    Attributes:
        path: the checkpoint (or file inside it) concerned, if known.
        fqn: the fully-qualified name of the tensor or value concerned, if any.
        rank: the rank that saw the problem, if known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        fqn: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.fqn = fqn
        self.rank = rank
        super().__init__(message)

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(f"path={self.path}")
        if self.fqn is not None:
            where.append(f"fqn={self.fqn}")
        if self.rank is not None:
            where.append(f"rank={self.rank}")
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    def __reduce__(self):  # keep fields across pickling (DCP gathers exceptions)
        return (
            _rebuild,
            (type(self), self.message, self.path, self.fqn, self.rank),
        )


def _rebuild(cls, message, path, fqn, rank):
    return cls(message, path=path, fqn=fqn, rank=rank)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist, or is not a checkpoint (nor a folder of them).

    Also a ``FileNotFoundError`` (``errno`` ``ENOENT``, ``filename`` the path), as a
    missing file is to ``torch.load`` and to frameworks that catch it (Lightning's
    ``fit(ckpt_path=...)``)."""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        fqn: str | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(message, path=path, fqn=fqn, rank=rank)
        self.errno = errno.ENOENT
        self.strerror = message
        self.filename = self.path


class NotCommittedError(CheckpointError):
    """The folder is a checkpoint that was never committed (still being written, or
    left behind by a crash). It is never loaded; the manager deletes it at start-up."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match what the manifest promises (checksum mismatch,
    truncated or missing file, unreadable manifest)."""


class IncompatibleStateError(CheckpointError):
    """The state being saved or loaded does not fit: missing or unexpected keys,
    shape or dtype mismatch, a value that cannot be stored without pickle."""


class CheckpointExistsError(CheckpointError):
    """A committed checkpoint is already at the target path; quicksave never
    overwrites one in place."""


class AlreadyCommittedError(CheckpointExistsError):
    """The target holds a committed checkpoint already (not something else in the way):
    a manager that meets one when it saves a step again skips that save."""


class WorkerFailedError(CheckpointError):
    """A background worker (thread or process) failed, died or timed out."""


def combined_failure(
    failures: list[tuple[int, BaseException]], path: str | None
) -> CheckpointError:
    """One error for failures on several ranks (``(rank, exception)``, lowest rank
    first): the first one, its class kept when it is a ``CheckpointError`` (naming the
    rank at fault: its own ``rank``, else the rank it happened on), the others named
    after it. What every rank raises when a step of a save (planning, writing, the
    commit) failed on some ranks.

    Example::

        raise combined_failure([(1, IncompatibleStateError("bad", fqn="w"))], "ckpt/a")
    """
    if not failures:
        return CheckpointError("planning failed on an unknown rank", path=path)
    rank, first = failures[0]
    if isinstance(first, CheckpointError):
        at = first.rank if first.rank is not None else rank
        err = type(first)(first.message, path=first.path or path, fqn=first.fqn, rank=at)
    else:
        err = CheckpointError(f"{type(first).__name__}: {first}", path=path, rank=rank)
    if len(failures) > 1:
        others = ", ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in failures[1:])
        err.message += f" (also failed: {others})"
    return err


def rank_of_this_process() -> int | None:
    """The global rank if torch.distributed is initialized, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class FrozenRequestError(CheckpointError, RuntimeError):
    """A finalize function was added to a frozen (scheduled) ``AsyncRequest``; a
    ``RuntimeError`` too, as NVRx raises."""
