"""One rank's background write in quicksave's layout, and the coordinator's reading of it.

``FileSystemWriterAsync`` where it cannot write the DCP layout (an object store), and the
plan records of every layout, use this module. Order of calls:

1. (every rank, trainer, while planning) the central plan carries a :class:`CentralRankPlan`
   (plan id and this rank's file layout); the coordinator keeps the :class:`SaveLayout`
   of every rank in the global metadata; :func:`draft_for` names the save's draft
   (its location's commit strategy's: a temporary directory, or the checkpoint's own
   prefix on a store) on every rank without a collective;
2. (every rank, checkpoint worker) :func:`write_rank_data` = ``save_fn``: the rank's
   data files and then its part, its "done" record; on failure an error part naming
   the cause (both members of the draft, :meth:`CommitStrategy.write_member`);
3. (coordinator, trainer, at finalize) :func:`rank_write_results` reads each rank's part
   back (:func:`read_error_part` for its cause when it failed; :class:`RankWritesFailed`
   names every failed rank), then :func:`clear_for_commit` leaves only the checkpoint's
   files before the commit.

No collective: the parts on storage are how the ranks' results reach the coordinator.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from quicksave.adapters.dcp_writer import _ChunkWritten, _ObjectWritten
from quicksave.checksum import hexdigest
from quicksave.commit import CommitStrategy, parts, strategy_class, strategy_for
from quicksave.compat.nvrx.staging import tensors_of
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from quicksave.format.manifest import RankPlan
from quicksave.layout.plan import RankLayout
from quicksave.stage.pool import StagingPool
from quicksave.storage.location import Location
from quicksave.worker import persist

# An error part holds one rank's cause in a line of JSON; a larger one is not read.
MAX_ERROR_PART_BYTES = 1 << 20


@dataclass(frozen=True)
class CentralRankPlan:
    """What the coordinator tells each rank (``SavePlan.storage_data`` of a central plan).

    ``plan_id`` identifies the planning that produced it; with the save counter it names
    the temporary directory, so a reused (cached) plan never reuses a directory."""

    plan_id: str
    layout: Any  # RankLayout, or DcpRankLayout in the DCP layout


@dataclass(frozen=True)
class SaveLayout:
    """Everything the coordinator needs at finalize, kept in the global metadata's
    ``storage_data`` (cached with it): every rank's file layout and plan."""

    plan_id: str
    layouts: tuple[Any, ...]  # RankLayout or DcpRankLayout per rank
    plans: tuple[RankPlan, ...]


@dataclass(frozen=True)
class RankWriteJob:
    """The small, picklable description of one rank's background write.

    ``draft`` is the save's draft key under the commit strategy of ``location`` (the
    checkpoint's): a temporary directory on a filesystem, the checkpoint's own prefix on
    an object store, where the objects go directly."""

    rank: int
    draft: str
    layout: RankLayout
    objects: dict[str, Any]  # fqn -> typed JSON, encoded in the trainer
    fsync: bool
    location: Location


def error_part_name(rank: int) -> str:
    return f"error-rank-{rank:05d}.json"


def rank_members(rank: int) -> list[str]:
    """``rank``'s part and error part: draft members that a checkpoint never holds."""
    return [parts.part_name(rank), error_part_name(rank)]


def rank_member_names(world_size: int) -> list[str]:
    """Every rank's part and error part."""
    return [n for r in range(world_size) for n in rank_members(r)]


def draft_for(location: Location, plan_id: str, save_index: int) -> str:
    """The draft key of save number ``save_index`` of plan ``plan_id`` at ``location``
    (:meth:`CommitStrategy.draft`, without opening anything): a pure function of what
    every rank knows, so no rank needs to be told."""
    key = f"{plan_id}|{location.url}|{save_index}".encode()
    token = hexdigest(xxhash.xxh3_64_intdigest(key))[:12]
    return strategy_class(location).draft(location, token)


def worker_strategy(location: Location, fsync: bool, rank: int) -> CommitStrategy:
    """The commit strategy of ``location`` for one rank's background write, over a
    backend opened for it (closed with the strategy).

    Raises:
        CheckpointError: the backend cannot be opened (naming the location).
    """
    return strategy_for(location, location.open(fsync=fsync, rank=rank), owned=True)


def write_rank_data(job: RankWriteJob, staged: StagingPool | dict[str, torch.Tensor]) -> None:
    """``save_fn``: write one rank's data files and then its part (the "done" record),
    through the commit strategy of the checkpoint's location (a backend opened here, in
    the worker).

    Runs in the ``AsyncCallsQueue`` worker process (or a thread). Files this rank left in
    the same draft by an earlier, failed attempt are removed first, so nothing stale
    is ever committed.

    Args:
        job: what to write and where.
        staged: chunk key -> CPU tensor, or the ``StagingPool`` holding them
            (``preload_fn``'s result).

    Raises:
        CheckpointError: naming the rank, the draft (its path or URL) and the cause; an
            error part is left for the coordinator when the draft takes it.
    """
    pool = staged  # keeps the pool's memory alive while its tensors are written
    staged = tensors_of(pool)
    strategy: CommitStrategy | None = None
    try:
        strategy = worker_strategy(job.location, job.fsync, job.rank)
        strategy.prepare_draft(job.draft)
        stale = [f.name for f in job.layout.files]
        strategy.delete_members(job.draft, stale + rank_members(job.rank))
        written = persist.write_rank(strategy.backend, job.draft, job.layout, staged)
        chunks = {k: d for w in written for k, d in w.chunk_xxh3_64.items()}
        part = parts.RankPart(job.rank, chunks, job.objects)
        parts.write_part(strategy, job.draft, part, job.fsync)
    except Exception as e:  # noqa: BLE001 - recorded, then raised with the rank named
        cause = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        where = job.location.url
        if strategy is not None:
            where = strategy.backend.url(job.draft)
            with contextlib.suppress(Exception):  # the draft itself may be the problem
                write_error_part(strategy, job.draft, job.rank, cause)
        raise CheckpointError(
            f"rank {job.rank} failed to write its checkpoint data: {cause}",
            path=where,
            rank=job.rank,
        ) from e
    finally:
        if strategy is not None:
            strategy.close()


def write_error_part(strategy: CommitStrategy, draft: str, rank: int, cause: str) -> None:
    """Record ``rank``'s failure under ``draft`` for the coordinator (whole or not at
    all, durably: :meth:`CommitStrategy.write_member`)."""
    body = json.dumps({"rank": rank, "error": cause}).encode()
    strategy.write_member(draft, error_part_name(rank), body)


def read_error_part(strategy: CommitStrategy, draft: str, rank: int) -> str | None:
    """The cause recorded by ``rank``'s failed write under ``draft``, or None if it
    recorded none."""
    try:
        data = strategy.read_member(draft, error_part_name(rank), MAX_ERROR_PART_BYTES)
    except CheckpointNotFoundError:
        return None
    except CheckpointError as e:
        return f"unreadable error part: {e.message}"
    except OSError as e:
        return f"unreadable error part: {e}"
    try:
        return str(json.loads(data).get("error", "unknown error"))
    except (ValueError, AttributeError) as e:
        return f"unreadable error part: {e}"


class RankWritesFailed(CheckpointError):
    """Ranks failed to write their part of a save (the coordinator's view at finalize).

    Attributes:
        causes: rank -> what went wrong there.
    """

    def __init__(self, causes: dict[int, str], path: str) -> None:
        named = "; ".join(f"rank {r}: Worker failure: {c}" for r, c in sorted(causes.items()))
        super().__init__(
            f"{len(causes)} rank(s) failed to write the checkpoint, nothing was committed: {named}",
            path=path,
        )
        self.causes = dict(sorted(causes.items()))


def clear_for_commit(strategy: CommitStrategy, draft: str, keep: set[str], world_size: int) -> None:
    """Only the checkpoint's files are committed: every rank's part and error part
    (already read) are deleted, and where the draft is the save's own (a temporary
    directory) anything else but ``keep`` that an earlier attempt left
    (:meth:`CommitStrategy.prune_draft`). Never another save's files: on a store only
    the named members go."""
    strategy.delete_members(draft, rank_member_names(world_size))
    strategy.prune_draft(draft, keep)


def rank_part(strategy: CommitStrategy, draft: str, layout: RankLayout) -> parts.RankPart:
    """One rank's part (its chunks' checksums, its values), checked against its layout.

    Args:
        strategy: the commit strategy of the checkpoint's location.
        draft: the save's draft (an object store: the checkpoint's prefix).
        layout: the rank's file layout (fixed at plan time).

    Raises:
        CheckpointError: the rank recorded an error, or left no part (names the rank and
            the directory, or the checkpoint's URL).
        CorruptCheckpointError: the part does not match the layout.
    """
    rank = layout.rank
    where = strategy.backend.url(draft)
    cause = read_error_part(strategy, draft, rank)
    if cause is not None:
        raise CheckpointError(f"rank {rank} failed to write: {cause}", path=where, rank=rank)
    part = parts.read_part(strategy, draft, rank)
    expected = set()
    for f in layout.files:
        for e in f.entries:
            expected.add(e.item.key)
            if e.item.key not in part.chunks:
                raise CorruptCheckpointError(
                    f"rank {rank}'s part lacks chunk {e.item.key!r}",
                    path=where,
                    fqn=e.item.fqn,
                    rank=rank,
                )
    extra = sorted(set(part.chunks) - expected)
    if extra:
        raise CorruptCheckpointError(
            f"rank {rank}'s part reports chunks its plan does not have: {extra[:5]}",
            path=where,
            rank=rank,
        )
    return part


def rank_write_results(
    strategy: CommitStrategy,
    draft: str,
    layout: RankLayout,
    index_of: dict[str, MetadataIndex] | None = None,
) -> list[WriteResult]:
    """One rank's DCP write results, from its part (:func:`rank_part`; raises as it
    does). ``index_of``: chunk key -> ``MetadataIndex``; derived from the layout when
    None."""
    part = rank_part(strategy, draft, layout)
    results: list[WriteResult] = []
    for f in layout.files:
        for e in f.entries:
            key = e.item.key
            index = (index_of or {}).get(key) or MetadataIndex(
                e.item.fqn, torch.Size(e.item.offsets)
            )
            results.append(WriteResult(index, e.length, _ChunkWritten(key, part.chunks[key])))
    for fqn, value in part.objects.items():
        results.append(WriteResult(MetadataIndex(fqn), 0, _ObjectWritten(value)))
    return results


def expected_files(layouts: tuple[Any, ...]) -> set[str]:
    """The data files a committed save of these layouts holds (besides the files the
    commit itself writes)."""
    return {f.name for lay in layouts for f in lay.files}


def failed_save_names(layouts: tuple[Any, ...]) -> list[str]:
    """What a failed save of ``layouts`` may have left under its draft, for
    :meth:`CommitStrategy.discard` (which also takes an interrupted commit's
    ``.metadata``): every rank's data files, part and error part."""
    return sorted(expected_files(layouts)) + rank_member_names(len(layouts))
