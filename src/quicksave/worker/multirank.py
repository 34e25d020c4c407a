"""One rank's share of a multi-rank save, run by that rank's writer.

Protocol (``quicksave.commit.rank_records``, commit through parts): every rank writes its files
and its part (its chunk digests and the objects it owns), then posts its rank record.
The coordinator's writer waits for every rank's record, merges the parts into the
manifest (``quicksave.commit.parts.manifest_from_parts``; its job's ``manifest`` is the
skeleton and its ``chunk_keys`` cover every rank), removes the parts and commits
(``quicksave.worker.files.commit_files``), then posts the commit record; the other ranks'
writers wait for that record. A failure anywhere is posted instead, so every rank's
result is the outcome of the whole checkpoint and nothing is committed.

Called by ``quicksave.worker.execute.execute_job`` for a job with ``dist`` set, on every
rank. No torch.distributed here: the writers talk through the ranks' store only.
"""

from __future__ import annotations

import time
from typing import Any

from quicksave.commit import CommitStrategy, strategy_for
from quicksave.commit import rank_records as records
from quicksave.commit.parts import (
    RankPart,
    manifest_from_parts,
    part_name,
    read_part,
    write_part,
)
from quicksave.commit.strategy import StagedFiles
from quicksave.errors import CheckpointError
from quicksave.storage.backend import Backend
from quicksave.worker.files import (
    check_target,
    commit_files,
    discard,
    staged_files,
    write_files,
)
from quicksave.worker.job import (
    JobResult,
    PersistJob,
    Phase,
    Usage,
    done,
    failure,
    not_committed,
    untraced,
)


def execute_multirank_job(
    job: PersistJob, pool: memoryview, store: Any, backend: Backend, phase: Phase = untraced
) -> JobResult:
    """One rank's share of a multi-rank save: files, part, rank record (``phase``
    ``"save.persist"``); then commit (the coordinator) or wait for the commit record
    (``"save.commit"``)."""
    d = job.dist
    assert d is not None
    t0 = time.monotonic()
    usage = Usage(time.thread_time())
    coordinator = job.rank == d.coordinator
    strategy = strategy_for(job.location, backend)
    try:
        if store is None:
            raise CheckpointError("a multi-rank save needs the ranks' store", rank=job.rank)
        try:
            # every rank, before it writes (on a store its objects go straight under
            # the checkpoint's prefix): here, not on the training thread
            check_target(job, strategy)
            with phase("save.persist"):
                digests = write_files(job, pool, backend, usage)
                part = RankPart(job.rank, digests, d.objects, job.bases)
                write_part(strategy, job.draft, part, job.fsync)
        except BaseException as e:  # noqa: BLE001 - told to the others, then reported here
            result = failure(job, e)
            records.post_rank(store, d.token, job.rank, result.error_message)
            if coordinator:
                problem = f"rank {job.rank}: {result.error_message}"
                records.post_commit(store, d.token, problem)
                discard(job, backend, parts=True)
            return result
        records.post_rank(store, d.token, job.rank)
        t1 = time.monotonic()
        with phase("save.commit"):
            # (a pool holds no bytes of the chunks referred to: never taken from it)
            staged = None if job.bases else staged_files(job, pool)
            failed = (
                _commit(job, store, backend, strategy, staged) if coordinator else _wait(job, store)
            )
        if failed is not None:
            return failed
        t2 = time.monotonic()
        return done(job, t0, t1, t2, usage, digests)
    except BaseException as e:  # noqa: BLE001 - e.g. the store went away
        return failure(job, e)


def _commit(
    job: PersistJob,
    store: Any,
    backend: Backend,
    strategy: CommitStrategy,
    staged: StagedFiles | None,
) -> JobResult | None:
    """The coordinator: wait for every rank's record, merge the parts, commit (``staged``:
    its own files in its pool), post the commit record; the result of a save not
    committed, else None."""
    d = job.dist
    assert d is not None
    problems = records.wait_ranks(store, d.token, d.world_size, d.timeout_s)
    if not problems:
        try:
            ranks = range(d.world_size)
            parts = [read_part(strategy, job.draft, r) for r in ranks]
            assert job.manifest is not None
            bases = {k: step for part in parts for k, step in part.bases.items()}
            manifest = manifest_from_parts(
                job.manifest, job.chunk_keys, parts, job.draft, bases=bases
            )
            # merged: the checkpoint holds no parts
            strategy.delete_members(job.draft, [part_name(r) for r in ranks])
            commit_files(
                strategy, job.draft, job.location, manifest, job.dcp_metadata, staged=staged
            )
        except BaseException as e:  # noqa: BLE001 - an abort like any other
            problems = {job.rank: f"{type(e).__name__}: {e}"}
    if problems:
        r, why = min(problems.items())
        reason = f"rank {r}: {why}"
        records.post_commit(store, d.token, reason)
        discard(job, backend, parts=True)
        return not_committed(job, reason, r)
    records.post_commit(store, d.token)
    return None


def _wait(job: PersistJob, store: Any) -> JobResult | None:
    """Any other rank: wait for the coordinator's commit record; the result of a save
    not committed, else None."""
    d = job.dist
    assert d is not None
    reason = records.wait_commit(
        store, d.token, records.commit_wait_s(d.timeout_s), coordinator=d.coordinator
    )
    return None if reason is None else not_committed(job, reason, None)
