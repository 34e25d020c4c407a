"""The engine's multi-rank vote: before each multi-rank save every rank says whether it can
take the save now, and a save that any rank cannot make is skipped by all of them
together (``DistSaving.plan``, whose planning collective carries the vote).

Call order (training thread of every rank, once per ``save()``, under the saver's
lock): :meth:`RankVote.plan` → this rank's reason not to save (an unreported failure, a
taken target) → ``DistSaving.plan(go=..., ready=...)``, which calls :meth:`RankVote.ready`
before each round of votes → the plan, or None (skipped), or this rank's reason raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistSave, DistSaving
from quicksave.saving.in_flight import InFlightSaves
from quicksave.saving.slots import StagingSlots
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.storage import Location

logger = logging.getLogger("quicksave")


class RankVote:
    """One multi-rank saver's side of the vote.

    Args:
        dist: the saver's multi-rank planning.
        config, rank: the saver's.
        lock: the saver's lock.
        slots, worker, flights: the saver's pools, worker and saves in flight.
        collect: takes the worker's results (``AsyncSaver._collect``).
        closed: whether the saver is closed.
    """

    def __init__(
        self,
        dist: DistSaving,
        config: EngineConfig,
        rank: int,
        lock: threading.RLock,
        slots: StagingSlots,
        worker: WorkerSupervisor,
        flights: InFlightSaves,
        collect: Callable[[float], None],
        closed: Callable[[], bool],
    ) -> None:
        self.dist = dist
        self.config = config
        self.rank = rank
        self.lock = lock
        self.slots = slots
        self.worker = worker
        self.flights = flights
        self.collect = collect
        self.closed = closed

    def plan(
        self,
        state_dict: Mapping[str, Any],
        loc: Location,
        step: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> DistSave | None:
        """Several ranks: plan (a collective every rank runs for every save, whatever
        happens on this rank), then raise this rank's reason not to save, if any. A save
        that any rank cannot make now is skipped by every rank together.

        Waiting (for a free pool, for a new worker) happens before each vote (see
        ``ready``): in step with the other ranks while the save that holds this rank up
        has no outcome yet, then in bounded rounds of votes. No rank sits in the
        collective for longer than its timeout while another is busy: a gloo collective
        that times out closes its pairs, and every later save's planning would fail.

        A failure already collected and not reported is this rank's reason not to save
        (raised here, the save skipped on every rank); one found while waiting here is
        reported by the next ``save()`` or ``finalize()``, and this save goes on, so
        that whether a save is made does not depend on when a failure is noticed."""
        unreported = self.flights.unreported
        # (the target is checked by each rank's writer before it writes, never here:
        # the training thread does not wait on the store)
        problem: CheckpointError | None = unreported[0] if unreported else None
        # never wait for a pool that a save stuck on a store that is down holds (this
        # rank's writer says so; then its vote skips the save on every rank)
        wait = self.config.backpressure == "wait" and self.worker.store_failing_for() is None
        self.collect(0.0)
        free = wait or self.slots.any_free()
        self.worker.replaced = False
        round_s = self.dist.ctx.commit_timeout_s / 4

        def ready() -> bool | None:
            return self.ready(round_s, need_pool=wait)

        ds = self.dist.plan(
            state_dict,
            loc.url,
            step=step,
            user_metadata=user_metadata,
            thread_count=self.config.thread_count,
            go=problem is None and free,
            ready=ready,
        )
        if ds is not None:
            return ds
        if problem is not None:
            self.flights.reported(problem)
            raise problem
        logger.warning(
            "quicksave: skipped the save of step %s: %s",
            step,
            "another rank cannot save now"
            if free
            else "the previous save is still in flight"
            if self.worker.store_failing_for() is None
            else "the store does not answer the previous save, which still retries",
        )
        return None

    def ready(self, timeout: float, need_pool: bool) -> bool | None:
        """Several ranks, before a save's vote: whether this rank can take the save now —
        a free staging pool (``need_pool``) and a worker that can start on the job at
        once. Never raises; False if not ready yet (every rank then votes again).

        It waits in two stages. First, in step with the other ranks, for the outcome of
        the save it is held up by (its oldest in flight when no pool is free, and any
        whose job it lost with its worker): every rank waits for the same commit record,
        so all of them leave this wait together, however long the save took. Then for at
        most ``timeout`` seconds (well under the collective's timeout) for what only
        this rank still needs: its own writer finishing a save whose outcome is known
        already (a slow rank), or a new worker. A worker found dead is replaced here, and
        the new one warmed up (torch imported, the store connected, the pools mapped)
        before this rank is ready: its first job must not spend the coordinator's
        ``commit_timeout_s`` starting up.

        None: this rank cannot take the save after all — the save that holds its pool
        is stuck on a store that does not answer (its writer says so): every rank then
        skips the save, and no training thread waits on the store."""
        while True:
            with self.lock:
                self.collect(0.0)
                self._replace_dead_worker()
                if self._stuck_on_store(need_pool):
                    return None
                if self._local_ready(need_pool) or not self._awaiting_outcome(need_pool):
                    break
                self._pause(0.02)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if self._local_ready(need_pool):
                    return True
                if self._stuck_on_store(need_pool):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pause(min(0.05, left))
                self.collect(0.0)
                self._replace_dead_worker()

    def _stuck_on_store(self, need_pool: bool) -> bool:
        return (
            need_pool and not self.slots.any_free() and self.worker.store_failing_for() is not None
        )

    def _replace_dead_worker(self) -> None:
        self.worker.replace_dead(self.slots.pools(), bool(self.flights.jobs), self.closed())

    def _local_ready(self, need_pool: bool) -> bool:
        free = not need_pool or self.slots.any_free()
        return free and self.worker.warm() and not self.flights.lost

    def _awaiting_outcome(self, need_pool: bool) -> bool:
        """Whether the outcome of a save this rank is held up by is still to be posted
        (and its time is not up): a lost one, or its oldest in flight if no pool is free."""
        now = time.monotonic()
        lost = self.flights.lost
        for token, until in list(lost.items()):
            if now >= until or self.dist.settled(token):
                del lost[token]
        if lost:
            return True
        if not need_pool or self.slots.any_free() or not self.flights.jobs:
            return False
        oldest = self.flights.oldest()
        until = oldest.handle.started + self.dist.outcome_wait_s
        return now < until and not self.dist.settled(oldest.token)

    def _pause(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for news from the worker (a result, a warm-up answer)."""
        if self.flights.jobs:
            self.collect(timeout)
        else:
            self.worker.poll_warm(timeout)
