"""A save in flight and what it cost: :class:`SaveHandle` (returned by ``AsyncSaver.save()``)
and :class:`SaveResult` (what ``wait()`` returns once the save is durable).

Call order (any thread that holds the handle): ``done()`` to poll, ``wait(timeout)`` to
block until durable; both drive the saver that made the handle (confirm a finished
background copy, collect the worker's results), which finishes the handle through
``_finish``. A failed save raises its error from ``wait()`` — and is then not raised again
by the saver's ``save()`` or ``finalize()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from quicksave.errors import CheckpointError
from quicksave.trace import Span


@dataclass(frozen=True)
class SaveResult:
    """What one save cost. Times in seconds from the ``save()`` call."""

    step: int | None
    path: str
    bytes: int
    blocking_s: float  # save() held the caller
    staging_s: float  # every tensor copied into the pool
    durable_s: float  # committed: files, manifest and rename fsynced
    write_s: float  # the persister's writing (files + fsync)
    commit_s: float  # .metadata + manifest + rename
    # CPU seconds spent on this save by the trainer (save() on the calling thread plus
    # the background staging thread) and by the persister (its job and writer threads)
    trainer_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    bytes_copied: int = 0  # tensor bytes copied into the staging pool
    bytes_hashed: int = 0  # bytes checksummed, by the trainer's staging and the writer
    # bytes of the chunks an incremental save refers to instead of writing them
    bytes_referred: int = 0
    # the writer's phases (persist, commit) as it timed them: quicksave.trace
    spans: tuple[Span, ...] = ()


class HandleOwner(Protocol):
    """What a handle asks of the saver that made it (``AsyncSaver``)."""

    def maybe_wait_for_staging(self) -> None: ...

    def _confirm_if_staged(self) -> None: ...

    def _collect(self, timeout: float) -> None: ...

    def _reported(self, err: BaseException) -> None: ...

    def _awaits_confirmation(self, handle: SaveHandle) -> bool: ...


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)`` → SaveResult (or raises)."""

    def __init__(self, step: int | None, path: str, started: float) -> None:
        self.step = step
        self.path = path
        self.started = started
        self.blocking_s = 0.0
        self.staging_s: float | None = None
        self.trainer_cpu_s = 0.0  # save() on its thread + the background staging thread
        self.bytes_copied = 0
        self.bytes_hashed = 0  # by the staging thread (hashed while copying)
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._saver: HandleOwner | None = None

    def done(self) -> bool:
        if not self._done.is_set() and self._saver is not None:
            if self._confirmable():
                with contextlib.suppress(CheckpointError):  # this handle holds it
                    self._saver._confirm_if_staged()
            self._saver._collect(0.0)
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until durable. Raises CheckpointError if the save failed, TimeoutError if
        not done within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._confirmable():
            assert self._saver is not None
            with contextlib.suppress(CheckpointError):  # this handle holds it
                self._saver.maybe_wait_for_staging()
        while not self._done.is_set():
            if self._saver is None:
                self._done.wait(0.05)
            else:
                self._saver._collect(0.05)
            if deadline is not None and time.monotonic() > deadline and not self._done.is_set():
                raise TimeoutError(
                    f"save of step {self.step} to {self.path} not done after {timeout} s"
                )
        if self._error is not None:
            if self._saver is not None:
                self._saver._reported(self._error)  # raised here: not again by save/finalize
            raise self._error
        assert self._result is not None
        return self._result

    def _confirmable(self) -> bool:
        """Whether this save's background copy awaits the training thread's check."""
        return self._saver is not None and self._saver._awaits_confirmation(self)

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()
