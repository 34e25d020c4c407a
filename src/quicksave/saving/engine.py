"""The async engine: ``AsyncSaver`` — plan, stage, hand off, finalize — one per rank.

One ``save()``, in the training thread::

    finalize finished saves (FIFO; a failed one raises here)
    → backpressure: a free staging pool (wait, or skip by policy)
    → collect: flatten, snapshot plain values as JSON (now, not later)
    → plan: layout of the rank's files (cached while the state's shapes are unchanged)
    → stage: copy tensors into the pool (blocking mode: all now; overlap mode: the small
      and forward-mutable ones now, the deferred ones — parameters, optimizer states — in a
      background thread while the next forward/backward runs)
    → submit: a small PersistJob to the persister (worker process or thread)
    → return a SaveHandle

The persister writes the files from the pool, checksums them, fsyncs and commits (single
rank). ``finalize()`` collects outcomes; a worker that died or hung becomes a
``WorkerFailedError`` there (or in ``save()``), and the next save starts a new worker.
A pool the worker still reads is never written: it is busy from its submit to its result.

This module wires the stages together; each lives in its own module of ``saving/``:
``config``, ``handle``, ``rank_plans`` (the one collector), ``collect_cache``,
``engine_plan`` (the single-rank plan), ``staging`` (copies into a pool),
``incremental`` (what an incremental save neither copies nor writes), ``in_flight``
(pools and saves in flight), ``worker_supervision`` (the persister).

The saver owns that state, under one lock (``_lock``). Its collaborators own theirs and
never take the saver's lock: ``background_copy`` (overlap mode: the copy beside training
and its guard; ``wait()`` returns what the saver then does under its lock), ``rank_vote``
(several ranks: the vote before each save; it sees this rank through ``_poll_rank``),
``prepare`` (pools built ahead; handed to ``_install_prepared``). ``_closed`` is set by
``close()`` under the lock, so that no save or installation runs across it.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from quicksave.commit import new_token, strategy_class
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.format.manifest import check_user_metadata
from quicksave.saving.background_copy import BackgroundCopy, Overlap
from quicksave.saving.collect_cache import CollectCache
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistContext, DistSaving
from quicksave.saving.engine_plan import (
    EnginePlan,
    PlannedSave,
    fqns_of,
    single_rank_manifest,
    single_rank_plan,
)
from quicksave.saving.guard import Snapshot
from quicksave.saving.handle import SaveHandle, SaveResult
from quicksave.saving.in_flight import InFlight, InFlightPool, InFlightPools, InFlightSaves
from quicksave.saving.incremental import Increments, check_destination
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.prepare import PoolPreparer
from quicksave.saving.rank_plans import LocalState
from quicksave.saving.rank_vote import RankState, RankVote
from quicksave.saving.staging import Deferred, PoolCopier, cuda_ready, split
from quicksave.saving.trainer_strategies import TrainerStrategies
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.stage.pool import StagingPool
from quicksave.storage import Location, parse_location
from quicksave.trace import phase
from quicksave.worker.job import PersistJob

logger = logging.getLogger("quicksave")


class AsyncSaver:
    """Saves checkpoints of one rank in the background.

    Call order (training thread): ``save()`` per checkpoint (returns after staging, or at
    once in overlap mode) → optionally ``maybe_wait_for_staging()`` before mutating
    deferred tensors → ``finalize()`` now and then (surfaces errors) → ``close()``.

    Args:
        config: :class:`EngineConfig`.
        rank: this process's rank (named in errors).
        dist_context: several ranks: where their saves coordinate (each ``save()`` is
            then collective).

    Example::

        saver = AsyncSaver(EngineConfig(mode="process"))
        handle = saver.save(model.state_dict(), "ckpt/step-10", step=10)
        ...  # training goes on
        handle.wait()
        saver.close()
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        rank: int = 0,
        dist_context: DistContext | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.rank = dist_context.rank if dist_context is not None else rank
        self._lock = threading.RLock()
        self._ids = itertools.count()  # pool and job ids
        self._slots = InFlightPools(self.config.max_in_flight, self._ids, self.config.pin_memory)
        self._plans: PlanCache[EnginePlan] = PlanCache()  # single rank (several: DistSaving's)
        self._collected = CollectCache()  # single rank
        self._copier = PoolCopier()
        self._background = BackgroundCopy(self._copier, self.rank)
        self._incr = Increments(self.config.incremental, self._copier, self._background.unguarded)
        # Multi-rank: plans through the plan cache, commits through parts and records.
        blocked = self._incr.blocked if self.config.incremental.enabled else None
        self._dist = DistSaving(dist_context, blocked) if dist_context is not None else None
        self._flights = InFlightSaves(self.rank, self._dist)
        self._worker = WorkerSupervisor(self.config, self.rank, self._dist)
        self._vote = (
            None if self._dist is None else RankVote(self._dist, self.config, self._poll_rank)
        )
        self._strategies = TrainerStrategies(self.rank, self.config.worker.save_timeout_s)
        self._closed = False
        self._preparer = PoolPreparer(
            self.config, self._slots, self._worker, self._install_prepared
        )
        self._worker.start()  # started now: the first save pays no start-up
        atexit.register(self._atexit)

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory held by this saver's staging pools now."""
        return self._slots.nbytes

    @property
    def distributed(self) -> bool:
        """True if this saver's saves are multi-rank (each ``save()`` is collective)."""
        return self._dist is not None

    @property
    def worker_pid(self) -> int | None:
        """PID of the worker process (process mode), for monitoring and tests."""
        return self._worker.pid

    in_flight = property(lambda self: len(self._flights))

    # --------------------------------------------------------------------- save
    def save(
        self,
        state_dict: Mapping[str, Any],
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        deferred: Deferred | None = None,
        user_metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        local: bool = False,
        in_place: int = 0,
    ) -> SaveHandle | None:
        """Start saving ``state_dict`` to the checkpoint directory ``path``.

        Args:
            state_dict: names to tensors, ``Stateful`` objects, nested dicts/lists, values.
            path: the checkpoint directory to create (must not hold a committed one,
                unless ``overwrite``).
            step: recorded in the manifest.
            deferred: in overlap mode, ``deferred(fqn, tensor)`` says which tensors may be
                copied after ``save()`` returns (their values are still those at the call,
                as long as nothing mutates them before ``maybe_wait_for_staging()``).
            user_metadata: JSON-serializable dict stored in the manifest.
            overwrite: a committed checkpoint at ``path`` is replaced atomically at the
                commit (the rename commit exchanges the two directories): until
                then, and if the save fails, the old one stays whole. Single-rank saves
                to local paths only.
            local: save from this rank alone, as a single-rank checkpoint of its own
                (several ranks: no vote, no collective; each rank's snapshot of a
                memory tier). Its failure is its handle's alone: no later ``save()`` or
                ``finalize()`` raises it.
            in_place: a ``local`` snapshot whose one data file IS its staging memory, a
                file of ``path``'s folder (a tmpfs) linked at the commit: no copy after
                staging. Up to ``in_place`` such pools, each reused once no snapshot
                links it; while all are held, the save is skipped (None, logged).

        Returns:
            a SaveHandle, or None if skipped by ``backpressure="skip"``.

        Raises:
            CheckpointError: a previous save failed (reported once), bad input (checked
                before any I/O), the target exists, ``overwrite`` on an object store or
                in a multi-rank saver, or the worker failed.
        """
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        self._settle_last_copy()  # outside the lock: the staging and prepare threads take it
        self.wait_prepared()
        with self._lock:
            if self._closed:
                raise CheckpointError("the saver is closed", path=os.fspath(path), rank=self.rank)
            loc = parse_location(path, options=self.config.storage)
            if self.config.mode == "process":
                loc.check_shared("save with EngineConfig(mode='thread') instead")
            check_user_metadata(dict(user_metadata or {}), loc.url, self.rank)
            if overwrite and self._dist is not None and not local:
                raise CheckpointError(
                    "overwrite=True is supported for single-rank saves only",
                    path=loc.url,
                    rank=self.rank,
                )
            local = local or bool(in_place)
            check_destination(self.config.incremental, loc, self.rank, local)
            planned = self._collect_and_plan(
                state_dict, loc, step, user_metadata, overwrite, local, in_place
            )
            slot = None if planned is None else self._free_slot(planned, loc, in_place, step)
            if slot is None:
                return None
            handle = SaveHandle(step, loc.url, t0)
            handle._saver = self
            job, pool = self._new_job(slot, planned, handle, loc, step, overwrite, local)
            self._stage(job, handle, pool, planned, deferred)
            handle.blocking_s = time.monotonic() - t0
            handle.trainer_cpu_s += time.thread_time() - cpu0
            return handle

    def _settle_last_copy(self) -> None:
        """Confirm the last save's background copy before this save."""
        try:
            self.maybe_wait_for_staging()
        except CheckpointError as e:
            if self._dist is None:
                raise
            # Several ranks: the last save's copy failed (or its tensors moved) on this
            # rank. Raised after this save's vote (see RankVote.plan), which it turns into
            # a skip on every rank: raising now would leave the others waiting in the vote.
            self._flights.unreported.append(e)

    def _collect_and_plan(
        self,
        state_dict: Mapping[str, Any],
        loc: Location,
        step: int | None,
        user_metadata: dict[str, Any] | None,
        overwrite: bool,
        local: bool,
        in_place: int = 0,
    ) -> PlannedSave | None:
        """Collect and plan (several ranks: through their vote, unless ``local``;
        ``in_place``: one data file; None: skipped)."""
        if self._vote is not None and not local:
            unreported = self._flights.unreported
            self._worker.replaced = False  # a dead worker is replaced once per save
            try:
                with phase("save.plan"):  # the vote and the plan exchange; collect inside
                    ds = self._vote.plan(
                        state_dict, loc, step, user_metadata, unreported[0] if unreported else None
                    )
            except CheckpointError as e:
                self._flights.reported(e)  # this rank's reason not to save: raised once
                raise
            return None if ds is None else PlannedSave.of_dist(ds)
        if not local:
            self.finalize(blocking=False)  # raises an earlier failure, once
        else:  # (one rank's own snapshot: an earlier failure is the next shared save's)
            self._confirm_if_staged()
            self._collect(0.0)
        if overwrite:  # no I/O (the worker checks the target: never the training thread)
            strategy_class(loc).check_replace(loc, self.rank)
        with phase("save.collect"):
            state = self._collect_whole(state_dict, loc.url, 0 if local else self.rank, local)
        with phase("save.plan"):
            plan = single_rank_plan(self._plans, state, 1 if in_place else self.config.thread_count)
            manifest = single_rank_manifest(plan, state, step, user_metadata)
        return PlannedSave.of_state(plan, state, manifest, new_token())

    def _collect_whole(
        self, state_dict: Mapping[str, Any], final: str, rank: int, local: bool = False
    ) -> LocalState:
        """One rank: collect ``state_dict`` (every tensor whole here; incremental saves
        but ``local`` ones: tracked in blocks) as ``rank``'s files (0 for a local
        snapshot) for a save to ``final``; errors name it and this rank."""
        try:
            state = self._collected.collect(state_dict, rank)
            return state if local else self._incr.blocked(state)
        except IncompatibleStateError as e:
            if e.path is None and final:
                e.path = final
            e.rank = self.rank
            raise

    def _free_slot(
        self, planned: PlannedSave, loc: Location, in_place: int, step: int | None
    ) -> InFlightPool | None:
        """A free slot (``in_place``: ``InFlightPools.in_place_slot``, beside up to
        ``max_in_flight`` in-place snapshots committing): waits for one, or None, logged
        (``"skip"``, every in-place pool held, a save stuck on a store)."""
        folder = os.path.dirname(loc.key.rstrip("/"))
        while True:
            if not in_place and (slot := self._slots.free()) is not None:
                return slot
            if in_place and self._slots.in_place_busy(folder) <= self.config.max_in_flight:
                slot = self._slots.in_place_slot(folder, in_place, planned.plan, self._worker)
                if slot is None:
                    logger.warning("quicksave: skipped step %s: every in-place pool is held", step)
                return slot
            failing = self._worker.store_failing_for()
            if self.config.backpressure == "skip" or failing is not None:
                why = (
                    f"the store has not answered the save in flight for {failing or 0:.1f} s "
                    "(it retries up to retry_deadline_s)"
                )
                why = "the previous save is still in flight" if failing is None else why
                logger.warning("quicksave: skipped the save of step %s: %s", step, why)
                return None
            self._collect(0.02)  # wait: a buffer the worker still reads is never overwritten

    def _new_job(
        self,
        slot: InFlightPool,
        planned: PlannedSave,
        handle: SaveHandle,
        loc: Location,
        step: int | None,
        overwrite: bool,
        local: bool = False,
    ) -> tuple[PersistJob, StagingPool]:
        """The slot's pool for the plan, and the save's job for the worker (registered
        in flight: the slot is busy from now on)."""
        self._worker.for_submit(idle=self._flights.held_only(None))
        plan = planned.plan
        pool = self._slots.pool_for(slot, plan, self._worker)
        strategy = self._strategies.of(loc)
        draft = strategy.draft(loc, planned.token)
        job = planned.job(
            next(self._ids),
            slot.pool_id,
            pool,
            loc,
            draft,
            step,
            self.rank,
            self.config,
            overwrite,
        )
        if pool.file is not None:  # in place: the commit links the pool's file
            job = dataclasses.replace(job, linked=pool.file)
        fl = InFlight(
            handle,
            slot,
            sum(f.size for f in plan.layout.files),
            loc,
            strategy,
            draft,
            tuple(f.name for f in job.files),
            planned.token if planned.dist is not None else "",
            overwrite,
            local,
        )
        self._flights.add(job.job_id, fl)
        return job, pool

    def _stage(
        self,
        job: PersistJob,
        handle: SaveHandle,
        pool: StagingPool,
        planned: PlannedSave,
        deferred: Deferred | None,
    ) -> None:
        """Copy what ``save()`` copies, then hand the save to the worker — or, with
        deferred tensors, start their background copy (the save is handed over once it
        is confirmed)."""
        plan, tensors = planned.plan, planned.tensors
        now, later = split(self.config.staging, tensors, deferred, self._background.unguarded)
        ready = cuda_ready(tensors)
        try:
            with phase("save.stage"):
                if planned.tracked:  # incremental: the unchanged is neither copied nor written
                    idle = self._flights.only_local_besides(job.job_id)
                    job, now, later = self._incr.stage(job, planned, now, later, pool, ready, idle)
                    handle.bytes_copied, handle.bytes_hashed = self._incr.cost
                handle.bytes_copied += self._copier.stage(pool, plan, tensors, now, ready=ready)
        except BaseException:
            self._flights.drop(job.job_id)
            raise
        if later:
            fqn_of = {} if self._dist is None else fqns_of(plan.layout)
            snapshot = Snapshot.take(planned.sources, later)
            overlap = Overlap(job, handle, snapshot, tensors, fqn_of, self._incr.sift)
            self._background.start(overlap, pool, plan, later, ready)
        else:
            handle.staging_s = time.monotonic() - handle.started
            self._submit(job, handle)

    def _submit(self, job: PersistJob, handle: SaveHandle) -> None:
        """Hand a staged save to the worker (a failed worker fails it)."""
        self._flights.submitted(job)
        try:
            with phase("save.submit"):
                self._worker.for_submit(idle=self._flights.held_only(job.job_id)).submit(job)
        except CheckpointError as e:
            self._worker_failed(e)

    # ------------------------------------------------------------ overlap staging
    def maybe_wait_for_staging(self) -> None:
        """Block until background staging is done, then hand that save to the writer —
        or fail it, if a deferred tensor was written since ``save()`` (``guard.py``).

        Call from the training thread before writing deferred tensors, between training
        operations (the manager's optimizer pre-hooks do, and so do ``save()``,
        ``finalize()``, ``close()`` and ``SaveHandle.wait()``).

        Raises:
            CheckpointError: the background copy failed, or a deferred tensor was
                written during it (the save is not committed; on every rank).
        """
        done = self._background.wait()
        if done is None:
            return
        with self._lock:
            job = self._flights.confirm(done)  # raises the copy's error
            if job is not None and done.handle is not None:
                self._submit(job, done.handle)

    def _confirm_if_staged(self) -> None:
        """``maybe_wait_for_staging`` if the background copy is already done (no wait)."""
        if self._background.finished():
            self.maybe_wait_for_staging()

    def _awaits_confirmation(self, handle: SaveHandle) -> bool:
        """Whether ``handle``'s background copy awaits the training thread's check."""
        return self._background.awaits(handle)

    # ----------------------------------------------------------------- finalize
    def _collect(self, timeout: float) -> None:
        """Take results from the persister and complete their handles (never raises)."""
        with self._lock:
            persister = self._worker.persister
            if persister is None or not self._flights.jobs:
                if timeout:
                    time.sleep(min(timeout, 0.01))
                return
            try:
                results = persister.poll(timeout)
            except CheckpointError as e:
                self._worker_failed(e)
                return
            for r in results:
                self._flights.complete(r)
                self._incr.settled(r)

    def _poll_rank(self, timeout: float) -> RankState:
        """This rank, for its vote (``RankVote``, inside ``save()``): news from the worker
        for up to ``timeout`` s, its results taken, a dead worker replaced."""
        if timeout and self._flights.jobs:
            self._collect(timeout)
        elif timeout:
            self._worker.poll_warm(timeout)
        self._collect(0.0)
        flights = self._flights
        self._worker.replace_dead(self._slots.pools(), bool(flights.jobs), self._closed)
        oldest = flights.oldest_shared()
        return RankState(
            pool_free=self._slots.any_free(),
            worker_warm=self._worker.warm(),
            store_failing=self._worker.store_failing_for() is not None,
            lost=flights.lost_pending(),
            oldest=None if oldest is None else (oldest.token, oldest.handle.started),
        )

    def _worker_failed(self, err: BaseException) -> None:
        """The persister is gone: fail every save in flight, free the pools (the next
        save is full: one of them may have committed unseen)."""
        self._incr.forget()
        self._worker.kill()
        self._flights.fail_all(err)

    def _reported(self, err: BaseException) -> None:
        self._flights.reported(err)

    def finalize(self, blocking: bool = False) -> list[SaveResult]:
        """Collect finished saves (all in flight if ``blocking``), oldest first.

        Raises:
            CheckpointError: the first failed save not reported before (each failure is
                raised once, here or by ``save()``).
        """
        done: list[SaveHandle] = [fl.handle for fl in self._flights.jobs.values()]
        if blocking:
            self.maybe_wait_for_staging()
            while self._flights.jobs:
                self._collect(0.1)
        else:
            self._confirm_if_staged()
            self._collect(0.0)
        if self._flights.unreported:
            raise self._flights.unreported.pop(0)
        return [h._result for h in done if h._done.is_set() and h._result is not None]

    # ------------------------------------------------------------------- close
    def close(self, abort: bool = False) -> None:
        """Wait for saves in flight (unless ``abort``), stop the worker, free the pools."""
        if self._closed:
            return
        try:
            if not abort:
                deadline = time.monotonic() + self.config.close_timeout_s
                try:
                    self.maybe_wait_for_staging()
                except CheckpointError:
                    pass
                while self._flights.jobs and time.monotonic() < deadline:
                    self._collect(0.1)
        finally:
            with self._lock:  # a save() or an installation under way finishes first
                self._closed = True
            self.wait_prepared()  # it sees _closed and frees what it built
            self._background.join()  # abort: a copy still writing into a pool
            # saves still in flight here timed out (or abort): the writer stops now
            self._worker.stop(now=abort or bool(self._flights.jobs), unmap=self._slots.close)
            self._flights.abandon(self.config.close_timeout_s)
            self._slots.close()
            self._copier.forget()
            self._incr.close()  # (kernel write tracking: registrations, held storages)
            atexit.unregister(self._atexit)
            self._strategies.close()

    def _atexit(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter exit: best effort
            logger.exception("quicksave: closing the saver at exit failed")

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prepare
    def prepare(
        self, state_dict: Mapping[str, Any], *, background: bool = True
    ) -> threading.Thread | None:
        """Plan ``state_dict`` and build, populate and hand to the worker its staging
        pools now, so that the first ``save()`` of the same shapes pays no allocation
        and no first-touch page faults.

        Call from the training thread once the state is complete (optimizer states
        exist only after the first optimizer step, or after a checkpoint was loaded into
        them); values are not read, only names, dtypes and shapes. ``save()`` waits for a
        build still running. Never raises: a state that cannot be saved is reported by
        ``save()``, a pool that cannot be allocated is logged and built by ``save()``.

        Args:
            state_dict: the state that later saves will pass (same shapes).
            background: build in a low-priority thread while training goes on (the page
                clearing then happens in the worker process). False: build here, before
                returning — for start-up, when nothing else competes for the CPU.

        Returns:
            the thread building the pools; None: nothing to build, or built already.
        """
        self.wait_prepared()
        if self._dist is not None:
            return None  # planning is collective: the first save builds the pool
        with self._lock:
            if self._closed:
                return None
            try:
                state = self._incr.observed(self._collect_whole(state_dict, "", self.rank))
                plan = single_rank_plan(self._plans, state, self.config.thread_count)
            except CheckpointError as e:
                logger.debug("quicksave: nothing prepared: %s", e)
                return None
            self._slots.adopt(plan)
            if (n := self._slots.missing(plan)) == 0:
                return None
            if background:
                return self._preparer.start(plan, n)
        self._preparer.build(plan, n, False)
        return None

    def _install_prepared(self, plan: EnginePlan, pools: list[StagingPool], bg: bool) -> None:
        """Install pools built ahead (``PoolPreparer``); once closed, they are freed."""
        with self._lock:
            if self._closed:
                for pool in pools:
                    pool.close()
                return
            sync_s = None if bg else self.config.worker.start_timeout_s
            failed = self._slots.install(plan, pools, self._worker, sync_s)
            if failed is not None:
                self._worker_failed(failed)

    def wait_prepared(self) -> None:
        """Block until a :meth:`prepare` build is finished (call outside the lock)."""
        self._preparer.wait()
