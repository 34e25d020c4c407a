r"""The NVRx-compatible API's errors: :class:`quicksave.CheckpointError`\ s that are also
torch's ``CheckpointException`` (which NVRx documents), so this module imports torch and
:mod:`quicksave.errors` stays torch-free."""

from __future__ import annotations

import os

from torch.distributed.checkpoint import CheckpointException

from quicksave.errors import CheckpointError, WorkerFailedError


class AsyncCheckpointError(CheckpointError, CheckpointException):
    """An asynchronous save failed (``quicksave.compat.nvrx``): a :class:`CheckpointError`
    that is also torch's ``CheckpointException``, which NVRx's API documents, so code
    catching either catches it.

    Attributes:
        failures: rank -> ``(exception, traceback frames or None)`` for every rank known
            to have failed (torch's ``CheckpointException.failures``).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        fqn: str | None = None,
        rank: int | None = None,
        failures: dict[int, tuple[BaseException, object]] | None = None,
    ) -> None:
        super().__init__(message, path=path, fqn=fqn, rank=rank)
        # CheckpointException.__init__ does not run (Exception's comes first in the MRO).
        self._failures = dict(failures or {})

    @property
    def failures(self) -> dict[int, tuple[BaseException, object]]:
        return self._failures

    def __str__(self) -> str:
        return CheckpointError.__str__(self)


class AsyncWorkerFailedError(AsyncCheckpointError, WorkerFailedError):
    """The worker process running an asynchronous call died, hung or could not start."""


def as_async_error(
    e: BaseException, *, path: str | None = None, rank: int | None = None
) -> AsyncCheckpointError:
    """``e`` as an :class:`AsyncCheckpointError` (itself if it is one), keeping its
    message, path, fqn and rank; ``failures`` names this rank with ``e``."""
    if isinstance(e, AsyncCheckpointError):
        return e
    failures = {rank if rank is not None else -1: (e, None)}
    if isinstance(e, CheckpointError):
        cls = AsyncWorkerFailedError if isinstance(e, WorkerFailedError) else AsyncCheckpointError
        return cls(
            e.message,
            path=e.path if e.path is not None else path,
            fqn=e.fqn,
            rank=e.rank if e.rank is not None else rank,
            failures=failures,
        )
    return AsyncCheckpointError(f"{type(e).__name__}: {e}", path=path, rank=rank, failures=failures)
