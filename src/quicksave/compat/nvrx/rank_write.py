"""One rank's background write in quicksave's layout, and the coordinator's reading of it.

``FileSystemWriterAsync`` on an object store (and the plan records of every layout) use
this module. Order of calls:

1. (every rank, trainer, while planning) the central plan carries a :class:`CentralRankPlan`
   (plan id and this rank's file layout); the coordinator keeps the :class:`SaveLayout`
   of every rank in the global metadata; :func:`temp_dir_for` names the save's temporary
   directory on every rank without a collective;
2. (every rank, checkpoint worker) :func:`write_rank_data` = ``save_fn``: the rank's data
   files (or objects) and then its part file, its "done" record; on failure an error part
   naming the cause;
3. (coordinator, trainer, at finalize) :func:`rank_write_results` reads each rank's part
   back (:func:`read_error_part` for its cause when it failed; :class:`RankWritesFailed`
   names every failed rank), then :func:`remove_unexpected` / :func:`remove_parts` leave
   only the checkpoint's files before the commit.

No collective: the parts on storage are how the ranks' results reach the coordinator.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from quicksave import commit, parts
from quicksave.adapters.dcp_writer import _ChunkWritten, _ObjectWritten
from quicksave.checksum import hexdigest
from quicksave.compat.nvrx.staging import StagedPool, tensors_of
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format.manifest import RankPlan
from quicksave.saving.plan import RankLayout
from quicksave.storage.backend import Backend, join
from quicksave.storage.location import Location
from quicksave.worker import persist


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

    ``location`` is the object store's checkpoint location (None: the local filesystem);
    ``tmp_dir`` is then the checkpoint's key prefix, where the objects go directly."""

    rank: int
    tmp_dir: str
    layout: RankLayout
    objects: dict[str, Any]  # fqn -> typed JSON, encoded in the trainer
    fsync: bool
    location: Location | None = None


def error_part_name(rank: int) -> str:
    return f"error-rank-{rank:05d}.json"


def temp_dir_for(path: str, plan_id: str, save_index: int) -> str:
    """The temporary directory of save number ``save_index`` of plan ``plan_id``: a pure
    function of what every rank knows, so no rank needs to be told."""
    token = hexdigest(xxhash.xxh3_64_intdigest(f"{plan_id}|{path}|{save_index}".encode()))
    return commit.temp_path_for(path, token[:12])


def write_rank_data(job: RankWriteJob, staged: StagedPool | dict[str, torch.Tensor]) -> None:
    """``save_fn``: write one rank's data files and then its part (the "done" record).

    Runs in the ``AsyncCallsQueue`` worker process (or a thread). Files this rank left in
    the same directory by an earlier, failed attempt are removed first, so nothing stale
    is ever committed.

    Args:
        job: what to write and where.
        staged: chunk key -> CPU tensor, or the ``StagedPool`` holding them
            (``preload_fn``'s result).

    Raises:
        CheckpointError: naming the rank and the cause; an error part is left for the
            coordinator when the directory is writable.
    """
    pool = staged  # keeps the pool's memory alive while its tensors are written
    staged = tensors_of(pool)
    if job.location is not None:
        _write_rank_objects(job, staged)
        return
    try:
        os.makedirs(job.tmp_dir, exist_ok=True)
        for name in [f.name for f in job.layout.files] + [
            parts.part_name(job.rank),
            error_part_name(job.rank),
        ]:
            try:
                os.unlink(os.path.join(job.tmp_dir, name))
            except FileNotFoundError:
                pass
        written = persist.write_rank_files(job.tmp_dir, job.layout, staged, job.fsync)
        chunks = {k: d for w in written for k, d in w.chunk_xxh3_64.items()}
        parts.write_part(job.tmp_dir, parts.RankPart(job.rank, chunks, job.objects), job.fsync)
    except Exception as e:  # noqa: BLE001 - recorded, then raised with the rank named
        cause = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        try:
            write_error_part(job.tmp_dir, job.rank, cause)
        except OSError:
            pass  # the directory itself is the problem: the missing part says enough
        raise CheckpointError(
            f"rank {job.rank} failed to write its checkpoint data: {cause}",
            path=job.tmp_dir,
            rank=job.rank,
        ) from e


def _write_rank_objects(job: RankWriteJob, staged: dict[str, torch.Tensor]) -> None:
    """``write_rank_data`` on an object store: this rank's data objects, then its part
    object, straight under the checkpoint's prefix (``job.tmp_dir``) through a backend
    opened here (in the worker). Nothing touches the local filesystem.

    Raises:
        CheckpointError: naming the checkpoint's URL, the rank and the cause; an error
            part object is left for the coordinator when the store takes it.
    """
    assert job.location is not None
    url = job.location.url
    backend: Backend | None = None
    try:
        backend = job.location.open(rank=job.rank)
        written = persist.write_rank_objects(backend, job.tmp_dir, job.layout, staged)
        chunks = {k: d for w in written for k, d in w.chunk_xxh3_64.items()}
        parts.write_part_object(backend, job.tmp_dir, parts.RankPart(job.rank, chunks, job.objects))
    except Exception as e:  # noqa: BLE001 - recorded, then raised with the rank named
        cause = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        if backend is not None:
            body = json.dumps({"rank": job.rank, "error": cause}).encode()
            with contextlib.suppress(Exception):  # the store itself may be the problem
                backend.put(join(job.tmp_dir, error_part_name(job.rank)), memoryview(body))
        raise CheckpointError(
            f"rank {job.rank} failed to write its checkpoint data: {cause}",
            path=url,
            rank=job.rank,
        ) from e
    finally:
        if backend is not None:
            backend.close()


def write_error_part(tmp_dir: str, rank: int, cause: str) -> None:
    path = os.path.join(tmp_dir, error_part_name(rank))
    staging = f"{path}.{uuid.uuid4().hex[:8]}.writing"
    commit.write_durable(staging, json.dumps({"rank": rank, "error": cause}).encode())
    os.replace(staging, path)


def read_error_part(tmp_dir: str, rank: int, backend: Backend | None = None) -> str | None:
    """The cause recorded by ``rank``'s failed write, or None if it recorded none
    (``backend``: an object store's, ``tmp_dir`` then being the checkpoint's prefix)."""
    if backend is not None:
        key = join(tmp_dir, error_part_name(rank))
        if backend.stat(key) is None:
            return None
        try:
            return str(json.loads(backend.get(key, 1 << 20)).get("error", "unknown error"))
        except CheckpointError as e:
            return f"unreadable error part: {e.message}"
        except (ValueError, AttributeError) as e:
            return f"unreadable error part: {e}"
    try:
        with open(os.path.join(tmp_dir, error_part_name(rank)), "rb") as f:
            return str(json.loads(f.read()).get("error", "unknown error"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
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


def remove_parts(backend: Backend, prefix: str, world_size: int) -> None:
    """On an object store: delete every rank's part and error part (already read), so the
    checkpoint holds only its data objects, ``.metadata`` and the manifest. The prefix
    was empty when the save was planned, so nothing else of an earlier attempt is there;
    nothing else is deleted (never another save's manifest)."""
    names = [n for r in range(world_size) for n in (parts.part_name(r), error_part_name(r))]
    backend.delete(join(prefix, n) for n in names)


def remove_unexpected(tmp_dir: str, keep: set[str]) -> None:
    """Only the checkpoint's files are committed: the parts (already read) and anything
    an earlier attempt left are removed first."""
    for name in os.listdir(tmp_dir):
        if name not in keep:
            path = os.path.join(tmp_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def rank_write_results(
    tmp_dir: str,
    layout: RankLayout,
    index_of: dict[str, MetadataIndex] | None = None,
    backend: Backend | None = None,
) -> list[WriteResult]:
    """Rebuild one rank's DCP write results from its part file and its layout.

    Args:
        tmp_dir: the save's temporary directory (an object store: the checkpoint's prefix).
        layout: the rank's file layout (fixed at plan time).
        index_of: chunk key -> ``MetadataIndex``; derived from the layout when None.
        backend: the object store's backend (None: the local filesystem).

    Raises:
        CheckpointError: the rank recorded an error, or left no part (names the rank and
            the directory, or the checkpoint's URL).
        CorruptCheckpointError: the part does not match the layout.
    """
    rank = layout.rank
    where = backend.url(tmp_dir) if backend is not None else tmp_dir
    cause = read_error_part(tmp_dir, rank, backend)
    if cause is not None:
        raise CheckpointError(f"rank {rank} failed to write: {cause}", path=where, rank=rank)
    part = parts.read_part(tmp_dir, rank, backend)
    results: list[WriteResult] = []
    expected = set()
    for f in layout.files:
        for e in f.entries:
            key = e.item.key
            expected.add(key)
            digest = part.chunks.get(key)
            if digest is None:
                raise CorruptCheckpointError(
                    f"rank {rank}'s part lacks chunk {key!r}",
                    path=where,
                    fqn=e.item.fqn,
                    rank=rank,
                )
            index = (index_of or {}).get(key) or MetadataIndex(
                e.item.fqn, torch.Size(e.item.offsets)
            )
            written = _ChunkWritten(
                f.name, e.offset, e.length, digest, f.size, f.header_xxh3_64, f.data_start, rank
            )
            results.append(WriteResult(index, e.length, written))
    extra = sorted(set(part.chunks) - expected)
    if extra:
        raise CorruptCheckpointError(
            f"rank {rank}'s part reports chunks its plan does not have: {extra[:5]}",
            path=where,
            rank=rank,
        )
    for fqn, value in part.objects.items():
        results.append(WriteResult(MetadataIndex(fqn), 0, _ObjectWritten(value)))
    return results


def expected_files(layouts: tuple[Any, ...]) -> set[str]:
    """The data files a committed save of these layouts holds (besides the files the
    commit itself writes)."""
    return {f.name for lay in layouts for f in lay.files}
