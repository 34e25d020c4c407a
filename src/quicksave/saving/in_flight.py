"""The engine's saves in flight and the staging pools they hold: one pool per save that may
be in flight (``max_in_flight``), which job holds which pool, finishing each save's handle
from the worker's result (or failing it), and the failures not yet raised to the caller.

A pool the worker still reads is never written: a pool is busy from the save's submit
to its result. Pools are built on demand (``InFlightPools.pool_for``, in ``save()``) or
ahead of the first save (``install``, from ``prepare()``), kept while the plan is
unchanged, and kept for a new plan whose file images match (``adopt``).

Call order of :class:`InFlightSaves` (training thread, under the saver's lock):
``add()`` at a save's hand-off → ``confirm()`` once its background copy is done (overlap
mode) → ``complete()`` per result the saver collects from the worker, or ``fail()`` for
a save no writer will finish (its worker died, its background copy was torn or failed)
→ ``abandon()`` at ``close()`` for those still in flight. Each failure is raised once to
the caller (``save()``, ``finalize()`` or ``SaveHandle.wait()``): ``unreported`` until
then. Several ranks: a failed save is reported to the other ranks through the commit
records (``DistSaving.worker_failed``), and remembered in ``lost`` until every rank has
its outcome (the next vote waits for that).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from quicksave.commit import CheckpointKind, CommitStrategy
from quicksave.errors import CheckpointError
from quicksave.saving.background_copy import CopyDone
from quicksave.saving.dist_save import DistSaving
from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.handle import SaveHandle, SaveResult
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.stage.pool import StagingPool
from quicksave.storage import Location
from quicksave.trace import writer_spans
from quicksave.worker.calls import CallResult
from quicksave.worker.job import JobResult, PersistJob
from quicksave.worker.persisters import ProcessPersister

logger = logging.getLogger("quicksave")

# An in-place pool's file name in its folder (``.`` first: never a checkpoint's name).
POOL_PREFIX = ".quicksave-pool-"


@dataclass
class InFlightPool:
    """One staging pool and the job using it (a slot of :class:`InFlightPools`)."""

    pool: StagingPool | None = None
    plan_key: tuple | None = None
    pool_id: int = -1
    busy: int | None = None  # job id using the pool
    folder: str | None = None  # an in-place slot's: its pool is a file of this folder

    def held(self) -> bool:
        """Busy with a save, or (in place) its pool is a committed checkpoint's file."""
        return self.busy is not None or (self.pool is not None and self.pool.linked())


class InFlightPools(Sequence[InFlightPool]):
    """The saver's pools (a sequence of :class:`InFlightPool`); training thread (and the
    prepare thread's installation), under the saver's lock.

    Args:
        count: slots, i.e. saves that may be in flight at once.
        ids: the saver's id counter (pools and jobs draw from it: each id is new).
        pin: page-lock pools for CUDA copies (None: when CUDA is available).
    """

    def __init__(self, count: int, ids: itertools.count, pin: bool | None) -> None:
        self._slots = [InFlightPool() for _ in range(count)]
        self._in_place: list[InFlightPool] = []  # see in_place_slot()
        self._ids = ids
        self.pin = pin

    def __getitem__(self, i):  # type: ignore[override]
        return self._slots[i]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[InFlightPool]:
        return iter(self._slots)

    def free(self) -> InFlightPool | None:
        """A slot whose pool no job uses, if any."""
        return next((s for s in self._slots if s.busy is None), None)

    def pools(self) -> list[tuple[int, StagingPool]]:
        """(pool id, pool) of every slot that has a pool (in-place ones included)."""
        return [(s.pool_id, s.pool) for s in self._all() if s.pool is not None]

    def _all(self) -> list[InFlightPool]:
        return self._slots + self._in_place

    def in_place_busy(self, folder: str) -> int:
        """In-place saves into ``folder`` in flight."""
        return sum(s.busy is not None for s in self._in_place if s.folder == folder)

    def in_place_slot(
        self, folder: str, count: int, plan: EnginePlan, worker: WorkerSupervisor
    ) -> InFlightPool | None:
        """A slot for an in-place snapshot into ``folder``: its pool is a file there that
        the snapshot's commit hard-links as its data file (no copy after staging), so a
        pool is free again only once no checkpoint links it (retention removed that
        snapshot). Up to ``count`` such pools, each built by one of the first ``count``
        snapshots (so that the tier's memory is all there early, not built in the middle
        of training when a commit lags); then one of ``plan``, then one that takes
        ``plan``'s images, then any free one (rebuilt by :meth:`pool_for`). None: every
        one is busy or a kept snapshot's."""
        gone = [s for s in self._in_place if s.folder != folder and s.busy is None]
        for s in gone:  # another folder's (a rebuilt tier): freed, their files unnamed
            self._in_place.remove(s)
            if s.pool is not None:
                if worker.persister is not None:
                    worker.persister.unmap_pool(s.pool_id)
                s.pool.close()
        if len(self._in_place) < count:
            self._in_place.append(InFlightPool(folder=folder))
            return self._in_place[-1]
        free = [s for s in self._in_place if s.folder == folder and not s.held()]
        for s in free:
            if s.plan_key == plan.key:
                return s
        for s in free:
            if s.pool is not None and s.pool.adopt(plan.layout):
                s.plan_key = plan.key
                return s
        return free[0] if free else None

    def any_free(self) -> bool:
        return self.free() is not None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the pools now."""
        return sum(s.pool.nbytes for s in self._all() if s.pool is not None)

    def pool_for(
        self, slot: InFlightPool, plan: EnginePlan, worker: WorkerSupervisor
    ) -> StagingPool:
        """``slot``'s pool, (re)built for ``plan`` if needed, and mapped into the worker
        (whose persister the caller made sure of)."""
        persister = worker.persister
        assert persister is not None
        self.adopt(plan)
        if slot.pool is None or slot.plan_key != plan.key:
            if slot.pool is not None:
                persister.unmap_pool(slot.pool_id)
                slot.pool.close()
            slot.pool_id = next(self._ids)
            file = None if slot.folder is None else f"{slot.folder}/{POOL_PREFIX}{slot.pool_id}"
            slot.pool = self.new_pool(plan, file=file)
            slot.plan_key = plan.key
        worker.map(slot.pool_id, slot.pool)
        return slot.pool

    def new_pool(
        self, plan: EnginePlan, populate: bool = True, file: str | None = None
    ) -> StagingPool:
        """A new pool shaped for ``plan`` (not in a slot yet; see ``StagingPool``)."""
        return StagingPool(plan.layout, pin=self.pin, populate=populate, file=file)

    def adopt(self, plan: EnginePlan) -> None:
        """Free pools of another plan whose file images match ``plan``'s are kept for it
        (``StagingPool.adopt``): a plan changes with the order of the state dict (e.g.
        an optimizer state loaded from a checkpoint lists its keys in another order) or
        with its non-tensor names, while the layout, sorted by name, stays the same."""
        for slot in self._slots:
            if (
                slot.busy is None
                and slot.pool is not None
                and slot.plan_key != plan.key
                and slot.pool.adopt(plan.layout)
            ):
                slot.plan_key = plan.key

    def missing(self, plan: EnginePlan) -> int:
        """How many slots have no pool for ``plan``."""
        return sum(s.plan_key != plan.key for s in self._slots)

    def install(
        self,
        plan: EnginePlan,
        pools: list[StagingPool],
        worker: WorkerSupervisor,
        sync_s: float | None,
    ) -> CheckpointError | None:
        """Put pools built ahead for ``plan`` (``AsyncSaver.prepare``) into free slots
        without one (the pool a slot had is unmapped and freed), and map them into the
        worker while it is idle: its populate of the mapping (which clears the pages) then
        runs neither beside the first save's copies nor before its write. A pool without
        such a slot is freed; with no worker, ``pool_for`` maps it into the next one.

        Args:
            sync_s: at start-up (the pools built on the training thread): wait up to
                this long for a worker process to have started and mapped them, so that
                its populate does not run beside the first training step.

        Returns:
            the worker's failure (the caller fails its saves; the pools not installed
            yet are freed), or None.
        """
        for i, pool in enumerate(pools):
            slot = next((s for s in self._slots if s.busy is None and s.plan_key != plan.key), None)
            if slot is None:
                pool.close()
                continue
            persister = worker.persister
            if slot.pool is not None:
                if persister is not None:
                    persister.unmap_pool(slot.pool_id)
                slot.pool.close()
            slot.pool, slot.plan_key, slot.pool_id = pool, plan.key, next(self._ids)
            if persister is None:
                continue
            try:
                worker.map(slot.pool_id, pool)
                if sync_s is not None and isinstance(persister, ProcessPersister):
                    persister.sync(sync_s)
            except CheckpointError as e:
                for rest in pools[i + 1 :]:
                    rest.close()
                return e
        return None

    def close(self) -> None:
        """Free every pool (an in-place pool's bytes stay with the snapshot linking them)."""
        for slot in self._all():
            if slot.pool is not None:
                slot.pool.close()
                slot.pool = None


@dataclass
class InFlight:
    """A save handed to (or about to be handed to) the worker."""

    handle: SaveHandle
    slot: InFlightPool
    bytes: int
    location: Location  # where it commits
    strategy: CommitStrategy  # of its location: removes what a dead writer left
    draft: str  # where its files are written (the strategy's draft key)
    names: tuple[str, ...]  # the files this rank writes
    token: str = ""  # multi-rank: the save's commit records (see commit/rank_records.py)
    replace: bool = False  # overwrite: a committed checkpoint was there before the save
    local: bool = False  # one rank's own snapshot: its failure is its handle's alone
    referred: int = 0  # bytes of the chunks it refers to (incremental), once submitted


class InFlightSaves:
    """One saver's saves in flight, by job id (oldest first), and its unreported failures.

    Attributes:
        jobs: job id -> the save.
        unreported: failures not raised to the caller yet, oldest first.
        lost: several ranks: token -> when every rank has the outcome at the latest, of
            the saves whose job this rank lost with its worker.
    """

    def __init__(self, rank: int, dist: DistSaving | None) -> None:
        self.rank = rank
        self.dist = dist
        self.jobs: dict[int, InFlight] = {}
        self.unreported: list[BaseException] = []
        self.lost: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job_id: int, fl: InFlight) -> None:
        """Register a save whose slot is now busy with ``job_id``."""
        fl.slot.busy = job_id
        self.jobs[job_id] = fl

    def drop(self, job_id: int) -> None:
        """Forget a save that raised before its hand-off (the caller gets the error)."""
        self.jobs.pop(job_id).slot.busy = None

    def oldest_shared(self) -> InFlight | None:
        """The oldest save in flight that the ranks commit together (None: none)."""
        shared = [job_id for job_id, fl in self.jobs.items() if fl.token]
        return self.jobs[min(shared)] if shared else None

    def held_only(self, job_id: int | None) -> bool:
        """Whether no job but ``job_id`` (if any) is in the worker's hands."""
        return set(self.jobs) <= (set() if job_id is None else {job_id})

    def only_local_besides(self, job_id: int) -> bool:
        """Whether every save in flight but ``job_id`` is a ``local`` one (a memory
        tier's snapshot, in a folder of its own)."""
        return all(fl.local for j, fl in self.jobs.items() if j != job_id)

    def lost_pending(self) -> bool:
        """Several ranks: whether a save whose job this rank lost with its worker still
        awaits its outcome on every rank (those posted, or past their time, are
        forgotten here)."""
        now = time.monotonic()
        for token, until in list(self.lost.items()):
            if now >= until or self.dist is None or self.dist.settled(token):
                del self.lost[token]
        return bool(self.lost)

    def reported(self, err: BaseException) -> None:
        """``err`` was raised to the caller: not again."""
        self.unreported = [e for e in self.unreported if e is not err]

    def fail(self, job_id: int, err: BaseException) -> None:
        """Fail one save in flight that no writer will finish: free its pool, tell the
        other ranks (they stop waiting for this rank, and nothing commits), remove its
        partial files."""
        fl = self.jobs.pop(job_id)
        fl.slot.busy = None
        fl.handle._finish(None, err)
        if self.dist is not None and fl.token:
            why = err.message if isinstance(err, CheckpointError) else str(err)
            self.dist.worker_failed(fl.token, why)  # the others stop waiting for us
            self.lost[fl.token] = fl.handle.started + self.dist.outcome_wait_s
        else:  # the dead writer's partial files: nobody else will remove them
            fl.strategy.abandon(fl.draft, fl.names)

    def fail_all(self, err: BaseException) -> None:
        """The worker is gone: fail every save in flight; ``err`` is reported once."""
        for job_id in list(self.jobs):
            self.fail(job_id, err)
        self.unreported.append(err)

    def release_unsubmitted(self) -> None:
        """Fail the saves not handed to the worker yet (their copy into the staging pool failed)."""
        for job_id, fl in list(self.jobs.items()):
            if fl.handle.staging_s is None:
                err = CheckpointError(
                    "the copy into the staging pool failed", path=fl.handle.path, rank=self.rank
                )
                self.fail(job_id, err)

    def confirm(self, done: CopyDone) -> PersistJob | None:
        """A background copy is done (``BackgroundCopy.wait``): its save's job, to hand
        to the writer; or that save fails (a torn copy), or every save not handed over
        yet fails (the copy failed), and the error is raised. None: its save failed
        meanwhile (its worker died; reported then): nothing to hand over.

        Raises:
            CheckpointError: the copy's error.
        """
        if done.error is not None and not done.torn:
            self.release_unsubmitted()
            raise done.error
        job = done.job
        fl = None if job is None else self.jobs.get(job.job_id)
        if job is None or fl is None or fl.handle is not done.handle:
            return None
        if done.error is None:
            return job
        logger.error("quicksave: %s", done.error)
        self.fail(job.job_id, done.error)
        raise done.error

    def submitted(self, job: PersistJob) -> None:
        """``job`` goes to the writer as it is (an incremental one's references final:
        the background copy's finds are in)."""
        fl = self.jobs.get(job.job_id)
        if fl is not None:
            fl.referred = job.referenced_bytes()

    def complete(self, r: JobResult | CallResult) -> None:
        """Finish the handle of the save ``r`` reports on."""
        fl = self.jobs.pop(r.job_id, None)
        if fl is None or not isinstance(r, JobResult):
            return
        fl.slot.busy = None
        h = fl.handle
        if r.ok:
            h._finish(
                SaveResult(
                    step=h.step,
                    path=h.path,
                    bytes=r.bytes_written,
                    bytes_referred=r.bytes_referred,
                    blocking_s=h.blocking_s,
                    staging_s=h.staging_s or 0.0,
                    durable_s=r.finished_at - h.started,
                    write_s=r.write_s,
                    commit_s=r.commit_s,
                    trainer_cpu_s=h.trainer_cpu_s,
                    worker_cpu_s=r.cpu_s,
                    bytes_copied=h.bytes_copied,
                    bytes_hashed=h.bytes_hashed + r.bytes_hashed,
                    spans=writer_spans(
                        r.started_at, r.started_at + r.write_s, r.finished_at, r.pid
                    ),
                ),
                None,
            )
        else:
            err = r.error()
            if r.detail:
                logger.error("quicksave: save of step %s failed:\n%s", h.step, r.detail)
            h._finish(None, err)
            if not fl.local:
                self.unreported.append(err)

    def abandon(self, close_timeout_s: float) -> None:
        """``close()``: the writer is stopped; finish every save still in flight — as
        done if it committed just before, else failed (its partial files removed)."""
        for job_id, fl in list(self.jobs.items()):
            del self.jobs[job_id]
            fl.slot.busy = None
            # With overwrite a checkpoint was there before: its presence proves nothing.
            if not fl.replace and fl.strategy.classify(fl.location) is CheckpointKind.QUICKSAVE:
                h = fl.handle  # committed just before the writer stopped
                durable = time.monotonic() - h.started
                h._finish(
                    SaveResult(
                        h.step,
                        h.path,
                        fl.bytes - fl.referred,
                        h.blocking_s,
                        h.staging_s or 0.0,
                        durable,
                        0,
                        0,
                        bytes_referred=fl.referred,
                    ),
                    None,
                )
                continue
            fl.strategy.abandon(fl.draft, fl.names)
            fl.handle._finish(
                None,
                CheckpointError(
                    "the saver was closed before this save was durable (close_timeout_s="
                    f"{close_timeout_s:g} s or abort); "
                    + (
                        "the checkpoint at this path is the old one or this one (each "
                        "whole): the writer stopped around its atomic replace"
                        if fl.replace
                        else "it was not committed"
                    ),
                    path=fl.handle.path,
                    rank=self.rank,
                ),
            )
