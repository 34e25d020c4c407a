"""The engine's saves in flight and their outcomes: which job holds which slot, finishing
each save's handle from the worker's result (or failing it), and the failures not yet
raised to the caller.

Call order (training thread, under the saver's lock): ``add()`` at a save's hand-off →
``complete()`` per result the saver collects from the worker, or ``fail()`` for a save
no writer will finish (its worker died, its background copy was torn or failed) →
``abandon()`` at ``close()`` for those still in flight. Each failure is raised once to
the caller (``save()``, ``finalize()`` or ``SaveHandle.wait()``): ``unreported`` until
then. Several ranks: a failed save is reported to the other ranks through the commit
records (``DistSaving.worker_failed``), and remembered in ``lost`` until every rank has
its outcome (the next vote waits for that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from quicksave.commit import CheckpointKind, CommitStrategy
from quicksave.errors import CheckpointError
from quicksave.saving.dist_save import DistSaving
from quicksave.saving.handle import SaveHandle, SaveResult
from quicksave.saving.slots import Slot
from quicksave.storage import Location
from quicksave.trace import writer_spans
from quicksave.worker.calls import CallResult
from quicksave.worker.job import JobResult

logger = logging.getLogger("quicksave")


@dataclass
class InFlight:
    """A save handed to (or about to be handed to) the worker."""

    handle: SaveHandle
    slot: Slot
    bytes: int
    location: Location  # where it commits
    strategy: CommitStrategy  # of its location: removes what a dead writer left
    staging: str  # where its files are written (the strategy's staging key)
    names: tuple[str, ...]  # the files this rank writes
    token: str = ""  # multi-rank: the save's commit records (see commit/rank_records.py)
    replace: bool = False  # overwrite: a committed checkpoint was there before the save


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

    def oldest(self) -> InFlight:
        return self.jobs[min(self.jobs)]

    def held_only(self, job_id: int | None) -> bool:
        """Whether no job but ``job_id`` (if any) is in the worker's hands."""
        return set(self.jobs) <= (set() if job_id is None else {job_id})

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
            fl.strategy.abandon(fl.staging, fl.names)

    def fail_all(self, err: BaseException) -> None:
        """The worker is gone: fail every save in flight; ``err`` is reported once."""
        for job_id in list(self.jobs):
            self.fail(job_id, err)
        self.unreported.append(err)

    def release_unsubmitted(self) -> None:
        """Fail the saves not handed to the worker yet (their staging failed)."""
        for job_id, fl in list(self.jobs.items()):
            if fl.handle.staging_s is None:
                err = CheckpointError("staging failed", path=fl.handle.path, rank=self.rank)
                self.fail(job_id, err)

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
                        h.step, h.path, fl.bytes, h.blocking_s, h.staging_s or 0.0, durable, 0, 0
                    ),
                    None,
                )
                continue
            fl.strategy.abandon(fl.staging, fl.names)
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
