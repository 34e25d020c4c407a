"""``FileSystemWriterAsync``: the seeds' asynchronous storage writer, writing quicksave's format.

Call order (rank r; "coord" = the coordinator only), driven by ``state_dict_saver``:

1. (all, trainer) ``set_up_storage_writer`` → ``prepare_local_plan`` → (coord)
   ``prepare_global_plan`` (fixes every rank's file layout; skipped when a cached plan is
   reused) → ``prepare_write_data(central_plan, planner)``: this rank's tensors are copied
   to CPU now (device-to-host), so the trainer may mutate its own tensors right after.
2. (all, background) ``get_save_function_and_args()`` → ``(save_fn, preload_fn, save_args)``
   for ``AsyncRequest``: ``save_fn`` writes this rank's data files into the temporary
   directory, then its *part file* (chunk checksums and object values, written whole or
   not at all): the part is the rank's "done" record. On failure it leaves an error part
   naming the cause (when the directory is writable) and raises.
3. (coord, trainer) ``save_state_dict_async_finalize`` reads every rank's part from the
   temporary directory (no gather), then ``finish`` writes the manifest and commits.

The temporary directory is derived on every rank from what all ranks know — the final
path, the id of the last real planning and a per-save counter — so a cached plan (no
collective at all) still gives every rank the same fresh directory.

**Object stores** (``msc://profile/path``, ``s3://bucket/prefix``): nothing is created on
the local filesystem. Every rank's worker uploads its data objects and then its part
object straight under the checkpoint's prefix (objects appear whole or not at all); a
failed rank leaves an error part object there. The coordinator reads the parts through
the store at finalize, deletes them, and commits like the engine's store saves
(``worker.commit_files``): ``.metadata``, one listing that checks every object's size,
``manifest.json`` last — its presence is the commit. The prefix is checked before any
byte is written (the coordinator, while planning: a committed checkpoint or another
save's objects there fail the save on every rank, before any collective hands out a
plan). A failed finalize deletes this save's objects (never a manifest's checkpoint);
a rank whose write failed leaves its objects and error part, invisible without a
manifest, for a ``CheckpointManager``'s clean-up.

**use_msc** keeps the seed's meaning, "open paths through the Multi-Storage Client":

* ``msc://`` paths need ``use_msc=True``; with ``use_msc=False`` the writer raises a
  ``CheckpointError`` naming ``use_msc=True`` before any I/O (the seed would have opened
  ``msc://...`` as a local path; failing keeps code that runs here correct on the seed).
* ``use_msc=True`` with a plain path or ``file://`` URL writes to the local filesystem,
  as MSC itself serves plain paths (its POSIX provider): same checkpoint as without it.
* ``s3://`` URLs work with either value, through quicksave's own S3 backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .. import commit, parts, persist
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import objects as objcodec
from ..format.manifest import RankPlan, hexdigest
from ..plan import RankLayout, layout_rank
from ..storage import StorageOptions
from ..storage.backend import Backend, join
from ..storage.location import Location
from ..writer import StorageWriter, _ChunkWritten, _ObjectWritten, _original_object, item_spec

_IGNORED_KWARGS = ("single_file_per_rank", "per_thread_copy_ahead", "separation_hint", "overwrite")


@dataclass(frozen=True)
class SeedRankPlan:
    """What the coordinator tells each rank (``SavePlan.storage_data`` of a central plan).

    ``plan_id`` identifies the planning that produced it; with the save counter it names
    the temporary directory, so a reused (cached) plan never reuses a directory."""

    plan_id: str
    layout: RankLayout


@dataclass(frozen=True)
class SaveLayout:
    """Everything the coordinator needs at finalize, kept in the global metadata's
    ``storage_data`` (cached with it): every rank's file layout and plan."""

    plan_id: str
    layouts: tuple[RankLayout, ...]
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


def write_rank_data(job: RankWriteJob, staged: dict[str, torch.Tensor]) -> None:
    """``save_fn``: write one rank's data files and then its part (the "done" record).

    Runs in the ``AsyncCallsQueue`` worker process (or a thread). Files this rank left in
    the same directory by an earlier, failed attempt are removed first, so nothing stale
    is ever committed.

    Args:
        job: what to write and where.
        staged: chunk key -> CPU tensor (``preload_fn``'s result).

    Raises:
        CheckpointError: naming the rank and the cause; an error part is left for the
            coordinator when the directory is writable.
    """
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
            _write_error_part(job.tmp_dir, job.rank, cause)
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


def _write_error_part(tmp_dir: str, rank: int, cause: str) -> None:
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


def _identity_preload(staged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Staging (device-to-host) already happened in prepare_write_data, in the trainer.
    return staged


class FileSystemWriterAsync(StorageWriter):
    """The seeds' ``FileSystemWriterAsync``, writing a quicksave checkpoint.

    Args:
        path: the final checkpoint: a directory (path or ``file://`` URL), or an object
            store prefix (``msc://profile/path`` with ``use_msc=True``, ``s3://bucket/key``);
            it must not hold a committed checkpoint.
        thread_count: data files (and writer threads) per rank.
        use_msc: open paths through the Multi-Storage Client, as in the seed: required
            for ``msc://`` paths; plain paths stay local (see the module docstring).
        sync_files: fsync files and directories (off only for throwaway tests).
        step: training step for the manifest. user_metadata: JSON dict for the manifest.
        storage: how to reach object stores (default: ``MSC_CONFIG`` and MSC's search
            for ``msc://``, the environment's AWS chain for ``s3://``).
        dcp_compat: (default True) also loadable by DCP's stock ``FileSystemReader`` and
            MSC's ``MultiStorageFileSystemReader``, as the seed's checkpoints are (see
            ``quicksave.StorageWriter``); False: quicksave's plain layout.
        **kwargs: the seeds' ``single_file_per_rank``, ``per_thread_copy_ahead``,
            ``separation_hint`` and ``overwrite`` are accepted and ignored (quicksave's
            layout decides files; it never overwrites a committed checkpoint).

    Raises:
        CheckpointError: an ``msc://`` path without ``use_msc=True``, an ``msc://`` path
            without the Multi-Storage Client installed, an unknown URL scheme, or an
            unknown keyword argument (all before any I/O, naming the path).

    Example::

        writer = FileSystemWriterAsync("msc://model-checkpoints/iter-10", use_msc=True)
        ret = save_state_dict_async_plan(state_dict, writer, None, 0)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        thread_count: int = 2,
        use_msc: bool = False,
        sync_files: bool = True,
        step: int | None = None,
        user_metadata: dict[str, Any] | None = None,
        storage: StorageOptions | None = None,
        dcp_compat: bool = True,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_IGNORED_KWARGS))
        if args or unknown:
            raise CheckpointError(
                f"FileSystemWriterAsync: unsupported arguments {list(args) + unknown}",
                path=os.fspath(path),
            )
        super().__init__(
            path,
            step=step,
            thread_count=thread_count,
            fsync=sync_files,
            user_metadata=user_metadata,
            storage=storage,
            dcp_compat=dcp_compat,
        )
        self.use_msc = use_msc
        if self.location.scheme == "msc":
            if not use_msc:
                raise CheckpointError(
                    "an msc:// path is a Multi-Storage Client location: pass use_msc=True "
                    "(FileSystemWriterAsync(path, use_msc=True), as the seed requires)",
                    path=self.path,
                )
            if importlib.util.find_spec("multistorageclient") is None:
                raise CheckpointError(
                    "use_msc=True needs the Multi-Storage Client package "
                    "(pip install 'quicksave[msc]')",
                    path=self.path,
                )
        self.plan_id = uuid.uuid4().hex  # replaced by the caller on a restart-reuse save
        self.save_index = 0  # set by save_state_dict_async_plan (per-save counter)
        self.layouts: tuple[RankLayout, ...] | None = None
        self._job: RankWriteJob | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._index_of: dict[str, MetadataIndex] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = rank or 0

    # ---------------------------------------------------------------- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach the rank's plan; on an object store the coordinator also checks the
        prefix (nothing committed, no other save's objects) before any rank can write:
        a failure here is raised on every rank by the planning collective.

        Raises:
            CheckpointExistsError: (coordinator, object store) the prefix holds a
                checkpoint or objects.
            CheckpointError: (coordinator, object store) the store cannot be reached.
        """
        plan = super().prepare_local_plan(plan)
        if self.is_coordinator and not self.location.is_local:
            try:
                commit.check_target(self.location, self.rank, self.backend())
            except BaseException:
                self.close()  # this writer's save ends here: drop its client
                raise
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator (or every rank, when all of them replay a loaded plan): fix every
        rank's file layout. Creates nothing on disk: the directory comes at write time."""
        self.plans = tuple(_rank_plan(p) for p in plans)
        out, layouts = [], []
        for rank, plan in enumerate(plans):
            items = [item_spec(i) for i in plan.items if i.type != WriteItemType.BYTE_IO]
            layout = layout_rank(rank, items, self.thread_count, dcp_compat=self.dcp_compat)
            layouts.append(layout)
            storage = SeedRankPlan(self.plan_id, layout)
            out.append(dataclasses.replace(plan, storage_data=storage))
        self.layouts = tuple(layouts)
        return out

    def save_layout(self) -> SaveLayout:
        """What finalize needs (after ``prepare_global_plan``)."""
        if self.layouts is None or self.plans is None:
            raise CheckpointError("save_layout() before prepare_global_plan()", path=self.path)
        return SaveLayout(self.plan_id, self.layouts, self.plans)

    # ---------------------------------------------------------------- staging
    def prepare_write_data(self, central_plan: SavePlan, planner: SavePlanner) -> None:
        """Stage this rank's tensors on the CPU (copies; device-to-host for GPU tensors)
        and encode its objects, so that the trainer may change its state right after.

        Raises:
            CheckpointError: the central plan did not come from this writer's planning.
        """
        rank_plan = central_plan.storage_data
        if not isinstance(rank_plan, SeedRankPlan):
            raise CheckpointError(
                "the central plan was not prepared by FileSystemWriterAsync",
                path=self.path,
                rank=self.rank,
            )
        if rank_plan.layout.rank != self.rank and rank_plan.layout.files:
            raise CheckpointError(
                f"the central plan is rank {rank_plan.layout.rank}'s",
                path=self.path,
                rank=self.rank,
            )
        if self.location.is_local:
            self.tmp_dir = temp_dir_for(self.path, rank_plan.plan_id, self.save_index)
        else:  # the objects go straight under the checkpoint's prefix
            self.tmp_dir = self.location.key
        staged: dict[str, torch.Tensor] = {}
        objects: dict[str, Any] = {}
        self._index_of = {}
        for item in central_plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = _original_object(planner, item, self.rank)
                objects[item.index.fqn] = objcodec.encode(value, item.index.fqn)
                continue
            key = item_spec(item).key
            t = planner.resolve_data(item).detach()
            # A copy even on the CPU: the trainer may mutate its tensor once we return.
            staged[key] = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
            self._index_of[key] = item.index
        self._staged = staged
        store = None if self.location.is_local else self.location
        self._job = RankWriteJob(
            self.rank, self.tmp_dir, rank_plan.layout, objects, self.fsync, store
        )

    def get_save_function_and_args(self) -> tuple[Any, Any, tuple]:
        """``(save_fn, preload_fn, save_args)`` for ``AsyncRequest(save_fn, save_args,
        [finalize_fn], preload_fn=preload_fn)``; ``preload_fn()`` returns ``save_args[1]``.

        Raises:
            CheckpointError: ``prepare_write_data`` was not called.
        """
        if self._job is None:
            raise CheckpointError(
                "get_save_function_and_args() before prepare_write_data()",
                path=self.path,
                rank=self.rank,
            )
        staged, self._staged = self._staged, {}
        return write_rank_data, partial(_identity_preload, staged), (self._job, staged)

    # ---------------------------------------------------------------- results
    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results, read back from its part file (nothing travels
        between ranks).

        Raises:
            CheckpointError: this rank's write failed or left no part.
        """
        if self._job is None:
            raise CheckpointError("no write was prepared", path=self.path, rank=self.rank)
        backend = None if self.location.is_local else self.backend()
        return rank_write_results(self._job.tmp_dir, self._job.layout, self._index_of, backend)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata`` and the manifest, then rename (the commit);
        on an object store the manifest, written last, is the commit."""
        if self.tmp_dir is None:
            raise CheckpointError("finish() before prepare_write_data()", path=self.path)
        super().finish(metadata, results)


def _rank_plan(plan: SavePlan) -> RankPlan:
    from ..writer import rank_plan_of

    return rank_plan_of(plan)


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


def expected_files(layouts: tuple[RankLayout, ...]) -> set[str]:
    """The data files a committed save of these layouts holds (besides the files the
    commit itself writes)."""
    return {f.name for lay in layouts for f in lay.files}


__all__ = [
    "FileSystemWriterAsync",
    "RankWriteJob",
    "SaveLayout",
    "SeedRankPlan",
    "rank_write_results",
    "temp_dir_for",
    "write_rank_data",
]
