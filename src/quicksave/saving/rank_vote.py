"""The engine's multi-rank vote: before each multi-rank save every rank says whether it can
take the save now, and a save that any rank cannot make is skipped by all of them
together (``DistSaving.plan``, whose planning collective carries the vote).

Call order (training thread of every rank, once per ``save()``, inside the saver's
``save()``): :meth:`RankVote.plan` → ``DistSaving.plan(go=..., ready=...)``, which calls
:meth:`RankVote.ready` before each round of votes → the plan, or None (skipped), or
this rank's reason not to save raised.

The vote owns no state of the saver's: it sees this rank through one callback,
``poll(timeout) -> RankState`` (the saver waits up to ``timeout`` s for news from its
worker, takes its results, replaces a dead worker, and says what it has), and decides
from those snapshots and the other ranks' commit records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistSave, DistSaving
from quicksave.storage import Location

logger = logging.getLogger("quicksave")


@dataclass(frozen=True)
class RankState:
    """What this rank has before a save's vote (its saver's answer to ``poll``).

    Attributes:
        pool_free: a staging pool is free.
        worker_warm: the worker can start on a job at once (no warm-up awaited).
        store_failing: the writer's store does not answer its requests (the save that
            holds a pool may be stuck on it).
        lost: a save whose job this rank lost with its worker still awaits its outcome
            on every rank.
        oldest: the oldest save in flight, (its commit records' token, when it
            started), or None if none is.
    """

    pool_free: bool
    worker_warm: bool
    store_failing: bool
    lost: bool
    oldest: tuple[str, float] | None


Poll = Callable[[float], RankState]


class RankVote:
    """One multi-rank saver's side of the vote.

    Args:
        dist: the saver's multi-rank planning (the vote's collective, the records).
        config: the saver's (backpressure, planning threads).
        poll: ``poll(timeout)``: the saver's view of this rank, after waiting up to
            ``timeout`` s for news from its worker (see :class:`RankState`).
    """

    def __init__(self, dist: DistSaving, config: EngineConfig, poll: Poll) -> None:
        self.dist = dist
        self.config = config
        self.poll = poll

    def plan(
        self,
        state_dict: Mapping[str, Any],
        loc: Location,
        step: int | None,
        user_metadata: dict[str, Any] | None,
        problem: CheckpointError | None,
    ) -> DistSave | None:
        """Several ranks: plan (a collective every rank runs for every save, whatever
        happens on this rank), then raise this rank's reason not to save, if any. A save
        that any rank cannot make now is skipped by every rank together.

        Waiting (for a free pool, for a new worker) happens before each vote (see
        ``ready``): in step with the other ranks while the save that holds this rank up
        has no outcome yet, then in bounded rounds of votes. No rank sits in the
        collective for longer than its timeout while another is busy: a gloo collective
        that times out closes its pairs, and every later save's planning would fail.

        ``problem``: a failure already collected and not reported: this rank's reason
        not to save (raised here, the save skipped on every rank). One found while
        waiting here is reported by the next ``save()`` or ``finalize()``, and this save
        goes on, so that whether a save is made does not depend on when a failure is
        noticed.

        Raises:
            CheckpointError: ``problem``, or the planning's own errors.
        """
        # (the target is checked by each rank's writer before it writes, never here:
        # the training thread does not wait on the store)
        state = self.poll(0.0)
        # never wait for a pool that a save stuck on a store that is down holds (this
        # rank's writer says so; then its vote skips the save on every rank)
        wait = self.config.backpressure == "wait" and not state.store_failing
        free = wait or state.pool_free
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
            raise problem
        logger.warning(
            "quicksave: skipped the save of step %s: %s",
            step,
            "another rank cannot save now"
            if free
            else "the previous save is still in flight"
            if not state.store_failing
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
        already (a slow rank), or a new worker. A worker found dead is replaced by the
        saver's ``poll``, and the new one warmed up (torch imported, the store
        connected, the pools mapped) before this rank is ready: its first job must not
        spend the coordinator's ``commit_timeout_s`` starting up.

        None: this rank cannot take the save after all — the save that holds its pool
        is stuck on a store that does not answer (its writer says so): every rank then
        skips the save, and no training thread waits on the store."""
        state = self.poll(0.0)
        while True:
            if self._stuck_on_store(state, need_pool):
                return None
            if self._local_ready(state, need_pool) or not self._awaiting_outcome(state, need_pool):
                break
            state = self.poll(0.02)
        deadline = time.monotonic() + timeout
        while True:
            if self._local_ready(state, need_pool):
                return True
            if self._stuck_on_store(state, need_pool):
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            state = self.poll(min(0.05, left))

    @staticmethod
    def _stuck_on_store(state: RankState, need_pool: bool) -> bool:
        return need_pool and not state.pool_free and state.store_failing

    @staticmethod
    def _local_ready(state: RankState, need_pool: bool) -> bool:
        free = not need_pool or state.pool_free
        return free and state.worker_warm and not state.lost

    def _awaiting_outcome(self, state: RankState, need_pool: bool) -> bool:
        """Whether the outcome of a save this rank is held up by is still to be posted
        (and its time is not up): a lost one, or its oldest in flight if no pool is free."""
        if state.lost:
            return True
        if not need_pool or state.pool_free or state.oldest is None:
            return False
        token, started = state.oldest
        until = started + self.dist.outcome_wait_s
        return time.monotonic() < until and not self.dist.settled(token)
