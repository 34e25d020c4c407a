"""Staging pools built ahead of the first save (``AsyncSaver.prepare``): allocate the pools
of a plan, put them into free slots and map them into the worker while it is idle, so
that the first save of the same shapes pays no allocation and no first-touch page faults.

Call order: ``AsyncSaver.prepare()`` plans on the training thread, then runs
:meth:`PoolPreparer.build` in a low-priority ``quicksave-prepare`` thread (beside
training, ``start()``; ``wait()`` joins it) or on the training thread itself (at
start-up), which allocates the pools and hands them to ``AsyncSaver._install_prepared``:
the saver installs them under its own lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.in_flight import InFlightPools
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.stage.pool import StagingPool
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
    """Allocates one saver's pools ahead of its first save; the saver installs them.

    Its own state is the build thread only: it allocates pools and hands them to
    ``install`` (the saver puts them into free slots and maps them into its worker,
    under its own lock), so it needs neither the saver's lock nor its state.

    Args:
        config: the saver's.
        slots: the saver's slots (a new pool is made by them; none is installed here).
        worker: the saver's worker (whose kind says who clears the pages).
        install: ``install(plan, pools, background)``: the saver's installation of the
            pools built (it frees those it has no free slot for, or all once closed).

    Attributes:
        thread: the background build running, else None.
    """

    def __init__(
        self,
        config: EngineConfig,
        slots: InFlightPools,
        worker: WorkerSupervisor,
        install: Callable[[EnginePlan, list[StagingPool], bool], None],
    ) -> None:
        self.config = config
        self.slots = slots
        self.worker = worker
        self.install = install
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
        """Build ``n`` pools for ``plan`` and hand them to ``install`` (never raises: a
        pool that cannot be allocated is logged, and built by ``save()``).

        In the background (beside training) this thread runs at the worker's lower CPU
        priority, and the page clearing (the bulk of the cost) goes to the
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
        self.install(plan, pools, background)
