"""Run one job: write the rank's files from the staging pool, commit, report.

``execute_job`` is what a persister runs for each ``PersistJob`` (in the worker process's
loop, ``quicksave.worker.main``, or in a thread of the trainer,
``quicksave.worker.persisters.ThreadPersister``), on every rank for its own files. A
single-rank job writes its files and commits them (``quicksave.worker.files``); a
multi-rank one goes through ``quicksave.worker.multirank``. It never raises: the outcome,
success or error, is the ``JobResult`` sent back to the trainer.

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from quicksave.commit import rank_records as records
from quicksave.commit import strategy_for
from quicksave.commit.parts import RankPart, manifest_from_parts
from quicksave.format.manifest import TensorsTemplate
from quicksave.storage.backend import Backend
from quicksave.storage.retry import StoreHealth
from quicksave.worker.files import (
    backend_for,
    check_target,
    commit_files,
    discard,
    staged_files,
    write_files,
)
from quicksave.worker.job import JobResult, PersistJob, Phase, Usage, done, failure, untraced
from quicksave.worker.multirank import execute_multirank_job


class Templates:
    """The templates of the manifest skeletons' tensors (``format.manifest.
    TensorsTemplate``) that a writer keeps from job to job: a job's manifest then encodes
    its tensors by filling one in. A template is made from a skeleton seen a second time
    (the same ``PickledOnce.blob``: the same content), so a job whose skeleton differs at
    every save pays nothing for it; the latest ``keep`` are kept."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()  # (in-place jobs run on threads of their own)
        self._seen: list[bytes] = []
        self._made: list[tuple[bytes, TensorsTemplate | None]] = []

    def of(self, tensors: Mapping[str, Any]) -> TensorsTemplate | None:
        """The template of the skeleton's ``tensors``, if one is kept or made now."""
        blob = getattr(tensors, "blob", None)  # (None: not a PickledOnce that came pickled)
        if blob is None:
            return None
        with self._lock:
            for made, template in self._made:
                if made == blob:
                    return template
            if blob not in self._seen:
                self._seen = [blob, *self._seen][: self.keep]
                return None
        try:
            template: TensorsTemplate | None = TensorsTemplate(dict(tensors))
        except ValueError:  # not a skeleton (checksums filled), or a marker in a name
            template = None
        with self._lock:
            self._made = [(blob, template), *self._made][: self.keep]
        return template


def execute_job(
    job: PersistJob,
    pool: memoryview,
    store: Any = None,
    backends: dict[tuple, Backend] | None = None,
    health: StoreHealth | None = None,
    phase: Phase = untraced,
    templates: Templates | None = None,
) -> JobResult:
    """Write the job's files from ``pool`` (the staged images), then commit. Never raises:
    failures come back in the JobResult, and what was written is removed.

    A multi-rank job (``job.dist``) needs ``store``, a client of the ranks' store; its
    result is the outcome of the whole checkpoint, not only of this rank's files.
    ``backends`` keeps object-store backends (their clients) from job to job;
    ``health`` is where their retries say whether the store answers (the trainer reads
    it: it does not wait for a pool that a save stuck on a store that is down holds).
    ``phase`` wraps the writing (``"save.persist"``) and the commit (``"save.commit"``);
    their times come back in the result either way (``started_at``, ``write_s``,
    ``finished_at``). ``templates``: the manifest templates kept from job to job.
    """
    if health is not None:
        health.answered()  # a new job: the trainer hears of this one's trouble only
    try:
        backend = backend_for(job, backends if backends is not None else {}, health)
    except BaseException as e:  # noqa: BLE001 - e.g. the extra is not installed
        return failure(job, e)
    if job.dist is not None:
        return execute_multirank_job(job, pool, store, backend, phase)
    t0 = time.monotonic()
    usage = Usage(time.thread_time())
    try:  # here, not on the training thread: a store that is down stalls no trainer
        check_target(job, strategy_for(job.location, backend))
    except BaseException as e:  # noqa: BLE001 - nothing written: nothing to discard
        return failure(job, e)
    try:
        with phase("save.persist"):
            digests = write_files(job, pool, backend, usage)
        t1 = time.monotonic()
        with phase("save.commit"):
            template = None if templates is None else templates.of(job.manifest.tensors)
            commit_files(
                strategy_for(job.location, backend),
                job.draft,
                job.location,
                manifest_from_parts(
                    job.manifest,
                    job.chunk_keys,
                    [RankPart(job.rank, digests, {})],
                    job.draft,
                    objects_in_parts=False,
                    bases=job.bases,
                    # (filled from the same skeleton: the template's)
                    previous=None if template is None else template.last,
                ),
                job.dcp_metadata,
                replace=job.replace,
                # (a pool holds no bytes of the chunks referred to: never taken from it)
                staged=None if job.bases else staged_files(job, pool),
                template=template,
            )
        t2 = time.monotonic()
        return done(job, t0, t1, t2, usage, digests)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the trainer
        discard(job, backend)
        return failure(job, e)


def store_for(job: PersistJob, stores: records.StoreClients) -> Any:
    """The store client for a multi-rank job (one connection per address, kept by the
    persister that runs the jobs); None for a single-rank job or if it cannot connect
    (the job then fails: execute_job reports "needs the ranks' store")."""
    if job.dist is None:
        return None
    try:
        return stores.get(job.dist.store, job.dist.timeout_s)
    except Exception:  # noqa: BLE001 - never out of the worker's loop: the job fails
        return None
