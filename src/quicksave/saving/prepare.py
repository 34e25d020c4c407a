"""Staging pools built ahead of the first save (``AsyncSaver.prepare``): allocate the pools
of a plan, put them into free slots and map them into the worker while it is idle, so
that the first save of the same shapes pays no allocation and no first-touch page faults.

Call order: ``AsyncSaver.prepare()`` plans on the training thread, then runs
:meth:`PoolPreparer.build` in a low-priority ``quicksave-prepare`` thread (beside
training, ``start()``; ``wait()`` joins it) or on the training thread itself (at
start-up). The pools are allocated outside the saver's lock, installed under it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.slots import StagingSlots
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.worker.persisters import ProcessPersister

logger = logging.getLogger("quicksave")


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: threads have their own),
    so that background preparation mostly takes CPU time that training leaves idle."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError):
        pass


class PoolPreparer:
    """Builds one saver's pools ahead of its first save.

    Args:
        config: the saver's.
        lock: the saver's lock (held while installing the pools).
        slots, worker: the saver's slots and worker.
        closed: whether the saver is closed (its pools are then freed, not installed).
        worker_failed: the saver's handling of a worker that failed meanwhile.

    Attributes:
        thread: the background build running, else None.
    """

    def __init__(
        self,
        config: EngineConfig,
        lock: threading.RLock,
        slots: StagingSlots,
        worker: WorkerSupervisor,
        closed: Callable[[], bool],
        worker_failed: Callable[[BaseException], None],
    ) -> None:
        self.config = config
        self.lock = lock
        self.slots = slots
        self.worker = worker
        self.closed = closed
        self.worker_failed = worker_failed
        self.thread: threading.Thread | None = None

    def start(self, plan: EnginePlan, n: int) -> threading.Thread:
        """Build ``n`` pools for ``plan`` in a new low-priority thread."""
        thread = threading.Thread(
            target=self.build,
            args=(plan, n, True),
            name="quicksave-prepare",
            daemon=True,
        )
        self.thread = thread
        thread.start()
        return thread

    def wait(self) -> None:
        """Block until a background build is finished."""
        t = self.thread
        if t is not None:
            t.join()
            self.thread = None

    def build(self, plan: EnginePlan, n: int, background: bool) -> None:
        """Build ``n`` pools for ``plan``, put them into free slots and map them into the
        worker (never raises: a pool that cannot be allocated is logged, and built by
        ``save()``; a worker that fails meanwhile goes to ``worker_failed``).

        In the background (beside training) this thread runs at the worker's lower CPU
        priority, and the page clearing (the bulk of the cost: ~0.4 s/GiB) goes to the
        worker process, whose map_pool faults the pages in (see stage/pool.py); only an
        in-process persister has them touched here. In the foreground: populate here.
        """
        if background:
            lower_thread_priority(self.config.worker.nice)
        in_worker = background and isinstance(self.worker.persister, ProcessPersister)
        try:
            pools = [self.slots.new_pool(plan, populate=not background) for _ in range(n)]
            if background and not in_worker:
                for pool in pools:
                    pool.touch()
        except CheckpointError as e:
            logger.warning("quicksave: staging pool not prepared ahead: %s", e)
            return
        with self.lock:
            for pool in pools:
                slot = None if self.closed() else self.slots.install(pool, plan, self.worker)
                if slot is None:
                    pool.close()
                    continue
                persister = self.worker.persister
                if persister is None:
                    continue  # save() maps it into the next worker
                # Mapped now, while the worker is idle: its populate of the mapping (which
                # clears the pages) then runs neither beside the first save's copies nor
                # before its write.
                try:
                    self.worker.map(slot.pool_id, pool)
                    if not background and isinstance(persister, ProcessPersister):
                        # At start-up: the worker's own start and its populate of this
                        # mapping (~0.1 CPU s per 1.6 GB) finish here, not beside the
                        # first training step.
                        persister.sync(self.config.worker.start_timeout_s)
                except CheckpointError as e:
                    self.worker_failed(e)
