"""The engine's persister supervision: start the worker (process or thread), keep track
of the staging pools it maps, notice a worker that died, and start the next one.

Call order (training thread, under the saver's lock): ``start()`` at the saver's
construction (the first save pays no start-up) → ``for_submit()`` before each hand-off
(a worker that died while idle is replaced first) → ``kill()`` when the worker failed
with jobs in hand (the saver fails those) → several ranks: ``replace_dead()`` before a
save's vote, which also warms the new worker up (``warm()`` / ``poll_warm()``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from quicksave import trace
from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistSaving
from quicksave.stage.pool import StagingPool
from quicksave.worker.persisters import PERSISTERS, Persister, PersisterStart, ProcessPersister

logger = logging.getLogger("quicksave")


class WorkerSupervisor:
    """One saver's persister, and the pools mapped into it.

    Attributes:
        persister: the worker (None: gone; the next hand-off starts another).
        mapped: ids of the pools the current worker maps.
        replaced: several ranks: this save's vote started a new worker (once per save).
    """

    def __init__(self, config: EngineConfig, rank: int, dist: DistSaving | None) -> None:
        self.config = config
        self.rank = rank
        self.dist = dist
        self.persister: Persister | None = None
        self.mapped: set[int] = set()
        self.replaced = False

    def start(self) -> Persister:
        """Start a new worker (the caller made sure the last one is gone)."""
        self.mapped = set()
        make = self.config.persister or PERSISTERS.require(self.config.mode, "persister")
        start = PersisterStart(self.config.worker, self.rank, phase=trace.phase)
        if self.dist is not None:
            # Several ranks: a worker process connects to the ranks' store (imports
            # torch) at start-up, in the background, not at the first save.
            start = dataclasses.replace(
                start, store=self.dist.address, store_timeout_s=self.dist.ctx.commit_timeout_s
            )
        p = make(start)
        self.persister = p
        return p

    def for_submit(self, idle: bool) -> Persister:
        """The persister to hand work to. ``idle``: no job is in its hands, so a worker
        found dead is replaced (no save was lost)."""
        if idle:  # died while idle (SIGTERM, OOM killer...): no save was lost
            self.drop_idle_dead()
        if self.persister is None:
            logger.warning("quicksave: starting a new checkpoint worker (rank %d)", self.rank)
            return self.start()
        return self.persister

    def kill(self) -> None:
        """Stop the worker now (it failed): kills it, and frees its socket and heartbeat
        page."""
        if self.persister is not None:
            self.persister.close(0.0)
        self.persister = None

    def stop(self, now: bool, unmap: Callable[[], None]) -> None:
        """``close()``: stop the worker. ``now``: saves are still in flight (timed out,
        or abort): stop the writer at once, so that no save is reported failed and then
        committed behind the saver's back. ``unmap`` frees the saver's pools."""
        persister, self.persister = self.persister, None
        if persister is None:
            return
        if now:
            persister.close(0.0)
        elif isinstance(persister, ProcessPersister):
            # Idle: our own mappings go first (cheap while the worker still maps the
            # pages), then the worker is told to stop; its exit, and the freeing of the
            # pages it maps last, need not delay close() nor run beside our unmapping.
            unmap()
            persister.close(5.0, wait=False)
        else:
            persister.close(5.0)

    def map(self, pool_id: int, pool: StagingPool) -> None:
        """Map ``pool`` into the worker as ``pool_id``, unless it is already."""
        assert self.persister is not None
        if pool_id not in self.mapped:
            self.persister.map_pool(pool_id, pool.fd, pool.nbytes, memoryview(pool._mm))
            self.mapped.add(pool_id)

    @property
    def pid(self) -> int | None:
        p = self.persister
        return p.pid if isinstance(p, ProcessPersister) else None

    def drop_idle_dead(self) -> None:
        """Forget a worker process that exited while it held no job (the caller checked
        that none is in flight): no save was lost; the next use starts another."""
        p = self.persister
        if isinstance(p, ProcessPersister) and p.process.poll() is not None:
            logger.warning(
                "quicksave: the checkpoint worker (pid %d) exited while idle (code %s)",
                p.pid,
                p.process.returncode,
            )
            p.close(0.0)
            self.persister = None

    def replace_dead(
        self, pools: Iterable[tuple[int, StagingPool]], busy: bool, closed: bool
    ) -> None:
        """Process mode, several ranks: start a new worker now (once per save) if the
        last one died — after its jobs were failed or while idle — and send it the pools
        and a warm-up (see ``ProcessPersister.warm_up``).

        Args:
            pools: the saver's pools by id (mapped into the new worker).
            busy: jobs are in flight (a death with jobs in hand is the saver's to find
                while collecting results: it fails them).
            closed: the saver is closed (nothing is started).
        """
        if self.config.mode != "process" or self.replaced or closed:
            return
        if self.persister is not None:
            if busy:
                return
            self.drop_idle_dead()
            if self.persister is not None:  # alive (or a thread persister)
                return
        self.replaced = True
        logger.warning("quicksave: starting a new checkpoint worker (rank %d)", self.rank)
        assert self.dist is not None
        try:
            p = self.start()
        except CheckpointError as e:  # save() tries again, and raises
            logger.warning("quicksave: %s", e)
            return
        try:
            for pool_id, pool in pools:
                self.map(pool_id, pool)
            if isinstance(p, ProcessPersister):
                p.warm_up(self.dist.address, self.dist.ctx.commit_timeout_s)
        except CheckpointError as e:
            self.drop_new(e)

    def warm(self) -> bool:
        """No warm-up of a new worker is awaited (answered, gone, or past its start-up
        timeout: then its first job shows what is wrong)."""
        p = self.persister
        if not isinstance(p, ProcessPersister) or not p.warming:
            return True
        return p.age > self.config.worker.start_timeout_s

    def store_failing_for(self) -> float | None:
        """Seconds since the writer's store stopped answering its requests (its retry
        loop says so: ``storage.retry.StoreHealth``), or None while it answers. No I/O."""
        p = self.persister
        health = getattr(p, "health", None)
        since = 0.0 if health is None else health.failing_since()
        return None if since == 0.0 else max(0.0, time.monotonic() - since)

    def poll_warm(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a new worker's warm-up answer (no job in flight)."""
        p = self.persister
        if not isinstance(p, ProcessPersister) or not p.warming:
            time.sleep(timeout)
            return
        try:
            p.poll(timeout)  # no job in flight: no result to lose
        except CheckpointError as e:
            self.drop_new(e)

    def drop_new(self, err: CheckpointError) -> None:
        """A worker started by ``replace_dead`` failed before any job: no save is lost;
        the next submit starts another (and reports what goes wrong then)."""
        logger.warning("quicksave: the new checkpoint worker failed at start-up: %s", err)
        self.kill()
