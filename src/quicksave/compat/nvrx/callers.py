"""NVRx's caller classes (``AsyncCaller``, ``PersistentAsyncCaller``,
``TemporalAsyncCaller``): adapters over an ``AsyncCallsQueue`` of their own.

NVRx's queue holds callers; quicksave's callers hold a queue, so they share its worker,
failure reporting and agreement. Order of calls (every rank, training thread):
``schedule_async_call`` → ``is_current_async_call_done`` (with ``no_dist=False`` a
collective of the queue's group: every rank calls it, as often) → ``close``;
``sync_all_async_calls`` is one SUM all-reduce of the default group.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from quicksave.compat.nvrx.call_agreement import dist_rank
from quicksave.compat.nvrx.calls_queue import AsyncCallsQueue
from quicksave.compat.nvrx.process_state import PROCESS
from quicksave.compat.nvrx.request import AsyncRequest
from quicksave.errors import CheckpointError
from quicksave.ranks import collectives as talk


class AsyncCaller(ABC):
    """NVRx's interface of one background caller: schedule a call, check whether the
    current one is done (on every rank), close. quicksave's callers are adapters over an
    ``AsyncCallsQueue`` of their own (NVRx's queue holds callers; quicksave's callers
    hold a queue), so they share its worker, failure reporting and agreement."""

    def __init__(self) -> None:
        self.rank: int | None = dist_rank()
        self.start_time: float | None = None

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req`` in the background (every rank)."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool, no_dist: bool) -> bool:
        """Whether the oldest call is done (on every rank unless ``no_dist``); a done call
        is removed. Its finalize functions are the caller's business (the queue's)."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """Collective: True iff no rank passes a non-zero ``is_alive`` (one SUM
        all-reduce), i.e. every rank's call is done."""
        return talk.all_reduce_ints([int(is_alive)], "sum")[0] == 0

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the caller (``abort``: drop the calls in flight)."""


class _QueueCaller(AsyncCaller):
    def __init__(self, queue: AsyncCallsQueue) -> None:
        super().__init__()
        self._queue = queue

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self.start_time = time.monotonic()
        self._queue.schedule_async_request(async_req._replace(finalize_fns=[]))

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        if not self._queue._calls:
            return True
        return bool(self._queue.maybe_finalize_async_calls(blocking, no_dist))

    def _debug_is_async_process_running(self) -> bool:
        handle = self._queue._get_async_caller()
        return handle is not None and handle._debug_is_async_process_running()

    def close(self, abort: bool = False) -> None:
        self._queue.close(abort=abort)

    def __del__(self) -> None:
        queue = getattr(self, "_queue", None)
        if queue is not None:
            queue.__del__()


class PersistentAsyncCaller(_QueueCaller):
    """NVRx's persistent caller: calls run one at a time in one worker process, started
    now (arguments as ``AsyncCallsQueue``'s)."""

    def __init__(
        self,
        is_daemon: bool = True,
        cpu_priority: int = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
    ) -> None:
        super().__init__(
            AsyncCallsQueue(
                True, is_daemon, cpu_priority, io_priority, sigterm_timeout, cpu_shm_mode
            )
        )

    @classmethod
    def register_worker_restart_callback(cls, fn: Any) -> None:
        """Call ``fn()`` in the trainer whenever a queue starts a worker to replace one
        that was closed, aborted or died (NVRx's hook for re-sending cached state)."""
        PROCESS.add_restart_callback(fn)

    @classmethod
    def cleanup_worker_data_cache(cls) -> None:
        """NVRx's worker-side tensor cache clean-up; quicksave's worker keeps none."""

    @staticmethod
    def async_process_target(*args: Any, **kwargs: Any) -> None:
        """NVRx's worker entry point. quicksave's worker is ``quicksave.worker.main.main``,
        started by ``AsyncCallsQueue``; NVRx's loop has no counterpart to run.

        Raises:
            CheckpointError: always (naming what to use instead).
        """
        raise CheckpointError(_NO_NVRX_LOOP)

    @staticmethod
    def async_loop(*args: Any, **kwargs: Any) -> None:
        """See :meth:`async_process_target`."""
        raise CheckpointError(_NO_NVRX_LOOP)

    @staticmethod
    def async_loop_for_daemon_worker(*args: Any, **kwargs: Any) -> None:
        """See :meth:`async_process_target`."""
        raise CheckpointError(_NO_NVRX_LOOP)


class TemporalAsyncCaller(_QueueCaller):
    """NVRx's per-call caller (it forks a process per call): here a thread per call, as
    ``AsyncCallsQueue(persistent=False)``."""

    def __init__(self) -> None:
        super().__init__(AsyncCallsQueue(persistent=False))


_NO_NVRX_LOOP = (
    "NVRx's worker loop has no counterpart in quicksave: the worker process is "
    "quicksave.worker.main.main, started and fed by AsyncCallsQueue (use the queue, or "
    "PersistentAsyncCaller().schedule_async_call)"
)
