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
import copy
import dataclasses
import importlib.util
import json
import os
import pickle
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from quicksave import commit, parts
from quicksave.adapters.dcp_writer import (
    StorageWriter,
    _ChunkWritten,
    _ObjectWritten,
    _original_object,
    build_manifest,
    item_spec,
)
from quicksave.checksum import hexdigest
from quicksave.compat.nvrx.process_state import PROCESS
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import DCP_METADATA_NAME
from quicksave.format import objects as objcodec
from quicksave.format.keys import dcp_planner_data
from quicksave.format.manifest import RankPlan, to_json_bytes
from quicksave.saving.plan import ItemSpec, RankLayout, layout_rank
from quicksave.storage.backend import Backend, join
from quicksave.storage.location import Location
from quicksave.worker import persist


@dataclass(frozen=True)
class SeedRankPlan:
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
    staged = _tensors_of(pool)
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


def _identity_preload(staged: Any) -> Any:
    # Staging (device-to-host) already happened in prepare_write_data, in the trainer.
    return staged


_POOL_ALIGN = 64


def _tensors_of(staged: StagedPool | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return staged.tensors() if isinstance(staged, StagedPool) else staged


@dataclass
class StagedPool:
    """One rank's staged tensors: ONE shared-memory byte buffer and where each tensor
    lies in it. It travels to the worker as one shared-memory handle, whatever the
    number of tensors (a dict of shared tensors would send one file descriptor per
    tensor, each through its own connection to the trainer's resource sharer).

    Attributes:
        pool: a 1-D ``uint8`` CPU tensor in shared memory.
        entries: key -> (byte offset, dtype, shape).
    """

    pool: torch.Tensor
    entries: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """key -> a tensor over the pool's bytes whose storage is exactly that tensor
        (no copy; as ``torch.save`` must see it to write what DCP writes). Valid while
        this object lives."""
        import ctypes

        out: dict[str, torch.Tensor] = {}
        base = self.pool.data_ptr()
        for key, (offset, dtype, shape) in self.entries.items():
            numel = 1
            for n in shape:
                numel *= n
            if numel == 0:
                out[key] = torch.empty(shape, dtype=dtype)
                continue
            nbytes = numel * dtype.itemsize
            buf = (ctypes.c_ubyte * nbytes).from_address(base + offset)
            out[key] = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)
        return out


WriteBucket = tuple[str, str, tuple[list, list]]
"""NVRx's description of one file's writes: ``(file path, storage key (the file's name in
the checkpoint), ([(WriteItem, BytesIO)], [(WriteItem, CPU tensor)]))``."""


class ConsistentDataIdentifier:
    """NVRx's key of a cached data structure in its worker. quicksave's worker caches no
    data structure between saves, so this only carries ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConsistentDataIdentifier) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def get_write_results_queue(mp_mode: str = "spawn") -> Any:
    """A queue that write results can be put on from other processes (NVRx's helper): a
    new multiprocessing manager queue of context ``mp_mode`` on every call (NVRx keeps
    one per process; quicksave keeps no module state, so hold the one you get)."""
    import multiprocessing

    return multiprocessing.get_context(mp_mode).Manager().Queue()


def _write_bucket(open_file: Callable[..., Any], write_bucket: Any, use_fsync: bool) -> list:
    """Write one ``WriteBucket`` in DCP's item format (``format.dcp_layout``); its
    ``WriteResult``s point at each item's bytes."""
    from quicksave.format.dcp_layout import write_dcp_file

    file_name, storage_key, (bytes_data, tensor_data) = write_bucket
    items: list[tuple[str, Any]] = []
    index: dict[str, Any] = {}
    for n, (write_item, data) in enumerate(list(bytes_data) + list(tensor_data)):
        key = f"{n}:{write_item.index.fqn}"
        items.append((key, data))
        index[key] = write_item.index
    with open_file(file_name, "wb") as stream:
        written = write_dcp_file(stream, items, fsync=use_fsync)
    out = []
    for k, w in written.items.items():
        info = _StorageInfo(storage_key, w.item_offset, w.item_length)
        out.append(WriteResult(index[k], w.item_length, info))
    return out


class _NoCache:
    """Stands for NVRx's class-level caches (``_cached_identifiers``,
    ``_shm_tensor_cache``): quicksave keeps none, so there is nothing to clear."""

    def clear(self) -> None:
        pass

    def discard(self, key: object) -> None:
        pass

    def __contains__(self, key: object) -> bool:
        return False

    def __len__(self) -> int:
        return 0


# DCP FileSystemWriter's positional arguments after the path, in order (NVRx passes its
# *args on to it).
_WRITER_POSITIONAL = (
    "single_file_per_rank",
    "sync_files",
    "thread_count",
    "per_thread_copy_ahead",
    "cache_staged_state_dict",
    "overwrite",
    "_extensions",
    "serialization_format",
)
# Accepted and without effect here (documented in the class docstring).
_NO_OP_KWARGS = ("per_thread_copy_ahead", "cache_staged_state_dict")


class FileSystemWriterAsync(StorageWriter, FileSystemWriter):
    """NVRx 0.7's ``FileSystemWriterAsync`` (same arguments; a ``FileSystemWriter``, as
    NVRx's), writing a checkpoint that is at once DCP's own directory and a quicksave
    checkpoint.

    On a local path (or ``file://``, or any path with ``use_msc=True``) it writes the
    **DCP layout** (docs/FORMAT.md §8): exactly the files DCP's ``FileSystemWriter``
    writes — ``__{rank}_{i}.distcp``, byte for byte what DCP writes for the same items,
    and ``.metadata`` — so ``dcp.load`` with torch's ``FileSystemReader`` (or MSC's
    reader) loads it; ``.metadata`` carries quicksave's manifest after DCP's pickle, so
    ``quicksave.load``, ``verify`` and ``inspect`` read it without unpickling anything,
    with every byte under a checksum. The directory is written under a temporary name
    and renamed into place at finalize (an existing checkpoint there is replaced
    atomically when ``overwrite``, DCP's default). On an object store (``msc://`` with
    ``use_msc=True``, ``s3://``) it writes quicksave's layout with ``dcp_compat`` (see
    ``quicksave.StorageWriter``), which DCP's and MSC's readers load too.

    Args:
        path: the checkpoint: a directory (path or ``file://`` URL), or an object store
            prefix (``msc://profile/path`` with ``use_msc=True``, ``s3://bucket/key``).
        *args: DCP ``FileSystemWriter``'s positional arguments after the path
            (``single_file_per_rank``, ``sync_files``, ``thread_count``, ...).
        separation_hint: NVRx's hint to split files; accepted, no effect (files follow
            ``thread_count``, as DCP's).
        use_msc: open paths through the Multi-Storage Client, as in NVRx: required for
            ``msc://`` paths; plain paths stay local (see the module docstring).
        is_multiproc_io: NVRx's process-based file I/O. Files are written by threads here
            (writes release the GIL); as in NVRx, it fails the save ("Invalid Setup!")
            when the queue's worker is a daemon (``AsyncCallsQueue(is_daemon=True)``).
        use_cached_data_structure: accepted, no effect (NVRx's GPU tensor cache).
        use_cpu_shm_for_gpu_tensors: accepted, no effect (tensors are always staged in
            host shared memory here).
        thread_count: (default 1, as DCP's) data files, and writer threads, per rank.
        sync_files: fsync files and directories (default True).
        overwrite: (default True, as DCP's) replace a checkpoint already at ``path``,
            atomically; False: refuse it (``CheckpointExistsError``). Anything else there
            (a file, a non-empty directory that is no checkpoint) is always refused.
        single_file_per_rank: (default True) False: one file per item, as DCP's.
        open_file: how data files are opened (``open_file(path, "wb")``; NVRx's testing
            hook), default ``open``.
        _extensions: must be None or empty (compression and other DCP stream extensions
            are not supported: a clear error names them).
        serialization_format: DCP's ``SerializationFormat.TORCH_SAVE`` only.
        per_thread_copy_ahead, cache_staged_state_dict: accepted, no effect.
        step, user_metadata: for the manifest. storage: how to reach object stores.
        dcp_compat: object stores only: make the checkpoint loadable by DCP's readers too.

    Raises:
        CheckpointError: an ``msc://`` path without ``use_msc=True`` (or without the
            Multi-Storage Client), an unknown URL scheme, an unknown keyword argument, or
            an unsupported extension or serialization format (all before any I/O,
            naming the path).

    Example::

        writer = FileSystemWriterAsync("ckpt/iter-10", thread_count=2)
        ret = save_state_dict_async_plan(state_dict, writer, None, 0)
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    """

    _cached_identifiers = _NoCache()
    _shm_tensor_cache = _NoCache()

    def __init__(
        self,
        path: str | os.PathLike[str],
        *args: Any,
        separation_hint: str | None = None,
        use_msc: bool = False,
        is_multiproc_io: bool = False,
        use_cached_data_structure: bool = False,
        use_cpu_shm_for_gpu_tensors: bool = False,
        **kwargs: Any,
    ) -> None:
        where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path)
        if len(args) > len(_WRITER_POSITIONAL):
            raise CheckpointError(
                f"FileSystemWriterAsync: {len(args)} positional arguments after the path; "
                f"FileSystemWriter takes at most {len(_WRITER_POSITIONAL)}",
                path=where,
            )
        for name, value in zip(_WRITER_POSITIONAL, args, strict=False):
            if name in kwargs:
                raise CheckpointError(
                    f"FileSystemWriterAsync: {name} given twice (by position and by name)",
                    path=where,
                )
            kwargs[name] = value
        known = set(_WRITER_POSITIONAL) | {
            "open_file",
            "step",
            "user_metadata",
            "storage",
            "dcp_compat",
        }
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise CheckpointError(f"FileSystemWriterAsync: unknown arguments {unknown}", path=where)
        extensions = kwargs.get("_extensions")
        if extensions:
            raise CheckpointError(
                f"FileSystemWriterAsync: DCP stream extensions {list(extensions)!r} are not "
                "supported (quicksave reads raw tensor bytes at known offsets)",
                path=where,
            )
        fmt = kwargs.get("serialization_format")
        if fmt is not None and getattr(fmt, "value", fmt) != "torch_save":
            raise CheckpointError(
                f"FileSystemWriterAsync: serialization_format {fmt!r} is not supported; "
                "only SerializationFormat.TORCH_SAVE (DCP's default)",
                path=where,
            )
        super().__init__(
            path,
            step=kwargs.get("step"),
            thread_count=int(kwargs.get("thread_count", 1)),
            fsync=bool(kwargs.get("sync_files", True)),
            user_metadata=kwargs.get("user_metadata"),
            storage=kwargs.get("storage"),
            dcp_compat=bool(kwargs.get("dcp_compat", True)),
        )
        self.use_msc = use_msc
        self.separation_hint = separation_hint
        self.is_multiproc_io = is_multiproc_io
        self.use_cached_data_structure = use_cached_data_structure
        self.use_cpu_shm_for_gpu_tensors = use_cpu_shm_for_gpu_tensors
        self.overwrite = bool(kwargs.get("overwrite", True))
        self.single_file_per_rank = bool(kwargs.get("single_file_per_rank", True))
        self.open_file = kwargs.get("open_file", open)
        # FileSystemWriter's attributes (it is a subclass, as NVRx's writer; its __init__
        # does not run: quicksave's StorageWriter sets up the rest).
        self.fs = FileSystem()
        self.sync_files = self.fsync
        self.per_thread_copy_ahead = int(kwargs.get("per_thread_copy_ahead", 10_000_000))
        self.cache_staged_state_dict = bool(kwargs.get("cache_staged_state_dict", False))
        self.serialization_format = fmt
        if self.location.scheme == "msc":
            if not use_msc:
                raise CheckpointError(
                    "an msc:// path is a Multi-Storage Client location: pass use_msc=True "
                    "(FileSystemWriterAsync(path, use_msc=True), as NVRx requires)",
                    path=self.path,
                )
            if importlib.util.find_spec("multistorageclient") is None:
                raise CheckpointError(
                    "use_msc=True needs the Multi-Storage Client package "
                    "(pip install 'quicksave[msc]')",
                    path=self.path,
                )
        self.dcp_layout = self.location.is_local
        self.plan_id = uuid.uuid4().hex  # replaced by the caller on a restart-reuse save
        self.save_index = 0  # set by save_state_dict_async_plan (per-save counter)
        self.layouts: tuple[RankLayout | DcpRankLayout, ...] | None = None
        self._job: RankWriteJob | DcpWriteJob | None = None
        self._staged: dict[str, torch.Tensor] = {}
        self._pool: torch.Tensor | None = None  # this save's staging pool
        self._index_of: dict[str, MetadataIndex] = {}

    # ------------------------------------------------------- NVRx's class hooks
    @classmethod
    def cleanup_tensor_caches(cls) -> None:
        """NVRx's cache clean-up; quicksave keeps no class-level tensor cache."""

    @classmethod
    def register_shm_drain_callback(cls, fn: Callable[[], Any] | None) -> None:
        """NVRx's shared-memory drain hook; accepted, no effect (staging buffers here are
        per save)."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = rank or 0

    # ------------------------------------------------ NVRx's data-path statics
    @staticmethod
    def preload_tensors(resolved_plan_data: Any, non_blocking: bool = True) -> list:
        """NVRx's worker-side preload of its own cached data structures. quicksave stages
        in ``prepare_write_data`` and its ``preload_fn`` is the second element of
        ``get_save_function_and_args()``; NVRx's structures have no counterpart here.

        Raises:
            CheckpointError: always, naming what to use instead.
        """
        raise CheckpointError(
            "FileSystemWriterAsync.preload_tensors takes NVRx's internal data structures; "
            "use the preload_fn of writer.get_save_function_and_args()"
        )

    @staticmethod
    def write_preloaded_data(
        transform_list: Any,
        open_file: Callable[..., Any],
        local_thread_idx: int,
        write_bucket: Any,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """Write one ``WriteBucket`` (DCP's item format) and put ``(local_thread_idx,
        write results or the exception)`` on ``results_queue``; then mark one task of
        ``count_queue`` done (``get`` + ``task_done``), as NVRx's workers do.
        ``transform_list`` must hold no stream extension."""
        try:
            if any(getattr(t, "extensions", None) for t in transform_list or ()):
                raise CheckpointError("stream extensions are not supported")
            out: Any = (local_thread_idx, _write_bucket(open_file, write_bucket, use_fsync))
        except Exception as e:  # noqa: BLE001 - reported through the queue, as NVRx
            out = (local_thread_idx, e)
        results_queue.put(out)
        if count_queue is not None:
            count_queue.get()
            count_queue.task_done()

    @staticmethod
    def write_preloaded_data_proc(
        transform_list: Any,
        open_file: Callable[..., Any],
        local_proc_idx: int,
        write_bucket: Any,
        results_queue: Any,
        count_queue: Any,
        use_fsync: bool,
        **kwargs: Any,
    ) -> None:
        """:meth:`write_preloaded_data` (NVRx runs it in a child process)."""
        FileSystemWriterAsync.write_preloaded_data(
            transform_list,
            open_file,
            local_proc_idx,
            write_bucket,
            results_queue,
            count_queue,
            use_fsync,
            **kwargs,
        )

    @staticmethod
    def write_preloaded_data_multithread(
        transform_list: Any,
        use_msc: bool,
        open_file: Callable[..., Any],
        rank: int,
        write_buckets: list,
        global_results_queue: Any,
    ) -> None:
        """Write every bucket, one thread each, and put ``{bucket index: write results}``
        (or the first exception) on ``global_results_queue``."""
        import queue as queue_mod

        local: queue_mod.Queue = queue_mod.Queue()
        with ThreadPoolExecutor(max(1, len(write_buckets))) as pool:
            for i, bucket in enumerate(write_buckets):
                pool.submit(
                    FileSystemWriterAsync.write_preloaded_data,
                    transform_list,
                    open_file,
                    i,
                    bucket,
                    local,
                    None,
                    True,
                )
        results: dict[int, Any] = {}
        while not local.empty():
            i, r = local.get()
            if isinstance(r, Exception):
                global_results_queue.put(r)
                return
            results[i] = r
        global_results_queue.put(results)

    @staticmethod
    def write_preloaded_data_multiproc(
        transform_list: Any,
        use_msc: bool,
        open_file: Callable[..., Any],
        rank: int,
        write_buckets: list,
        global_results_queue: Any,
    ) -> None:
        """:meth:`write_preloaded_data_multithread`: file writes release the GIL, so
        threads do what NVRx's processes do. As NVRx, it refuses to run inside a daemonic
        process (an ``AsyncCallsQueue(is_daemon=True)`` worker): "Invalid Setup!"."""
        import multiprocessing

        if multiprocessing.current_process().daemon:
            global_results_queue.put(CheckpointError(INVALID_SETUP, rank=rank))
            return
        FileSystemWriterAsync.write_preloaded_data_multithread(
            transform_list, use_msc, open_file, rank, write_buckets, global_results_queue
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        """DCP's synchronous write step, which NVRx's writer does not implement either:
        use ``save_state_dict_async_plan`` and the save function.

        Raises:
            NotImplementedError: always (as NVRx).
        """
        raise NotImplementedError("write_data not implemented for FileSystemWriterAsync")

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """This rank's central plan without asking the coordinator (NVRx's decentralized
        planning): the DCP layout's file layout depends only on the rank's own items."""
        rank = self.rank
        if self.dcp_layout:
            layout: Any = dcp_rank_layout(
                rank, list(local_plan.items), self.thread_count, self.single_file_per_rank
            )
        else:
            items = [item_spec(i) for i in local_plan.items if i.type != WriteItemType.BYTE_IO]
            layout = layout_rank(rank, items, self.thread_count, dcp_compat=self.dcp_compat)
        return dataclasses.replace(local_plan, storage_data=SeedRankPlan(self.plan_id, layout))

    # ---------------------------------------------------------------- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach the rank's plan; on an object store the coordinator also checks the
        prefix (nothing committed, no other save's objects) before any rank can write:
        a failure here is raised on every rank by the planning collective.

        Raises:
            CheckpointExistsError: (coordinator) an object store prefix holds a
                checkpoint or objects; a local path holds something that is no
                checkpoint, or a checkpoint and ``overwrite`` is False.
            CheckpointError: (coordinator, object store) the store cannot be reached.
        """
        plan = super().prepare_local_plan(plan)
        if self.is_coordinator and not self.location.is_local:
            try:
                commit.check_target(self.location, self.rank, self.backend())
            except BaseException:
                self.close()  # this writer's save ends here: drop its client
                raise
        elif self.is_coordinator:
            kind = commit.classify(self.location)
            committed = kind in (commit.CheckpointKind.QUICKSAVE, commit.CheckpointKind.DCP)
            if not (committed and self.overwrite):
                commit.check_target(self.location, self.rank)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator (or every rank, when all of them replay a loaded plan): fix every
        rank's file layout. Creates nothing on disk: the directory comes at write time."""
        self.plans = tuple(_rank_plan(p) for p in plans)
        out, layouts = [], []
        for rank, plan in enumerate(plans):
            layout: RankLayout | DcpRankLayout
            if self.dcp_layout:
                layout = dcp_rank_layout(
                    rank, list(plan.items), self.thread_count, self.single_file_per_rank
                )
            else:
                items = [item_spec(i) for i in plan.items if i.type != WriteItemType.BYTE_IO]
                layout = layout_rank(rank, items, self.thread_count, dcp_compat=self.dcp_compat)
            layouts.append(layout)
            out.append(dataclasses.replace(plan, storage_data=SeedRankPlan(self.plan_id, layout)))
        self.layouts = tuple(layouts)
        return out

    def save_layout(self) -> SaveLayout:
        """What finalize needs (after ``prepare_global_plan``)."""
        if self.layouts is None or self.plans is None:
            raise CheckpointError("save_layout() before prepare_global_plan()", path=self.path)
        return SaveLayout(self.plan_id, self.layouts, self.plans)

    # ---------------------------------------------------------------- staging
    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Stage this rank's tensors on the CPU (copies; device-to-host for GPU tensors)
        and encode its objects, so that the trainer may change its state right after.

        Raises:
            CheckpointError: the central plan did not come from this writer's planning.
        """
        rank_plan = plan.storage_data
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
        sources: dict[str, torch.Tensor] = {}
        objects: dict[str, Any] = {}
        byte_items: dict[str, bytes] = {}
        self._index_of = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = _original_object(planner, item, self.rank)
                objects[item.index.fqn] = objcodec.encode(value, item.index.fqn)
                if self.dcp_layout:
                    data = planner.resolve_data(item)
                    byte_items[item.index.fqn] = bytes(data.getbuffer())
                continue
            key = item_spec(item).key
            # A copy even on the CPU: the trainer may mutate its tensor once we return.
            sources[key] = planner.resolve_data(item).detach()
            self._index_of[key] = item.index
        self._staged = self._stage_pool(sources)
        if isinstance(rank_plan.layout, DcpRankLayout):
            self._job = DcpWriteJob(
                self.rank,
                self.tmp_dir,
                rank_plan.layout,
                byte_items,
                objects,
                self.fsync,
                self.open_file,
                self.is_multiproc_io,
            )
            return
        store = None if self.location.is_local else self.location
        self._job = RankWriteJob(
            self.rank, self.tmp_dir, rank_plan.layout, objects, self.fsync, store
        )

    def _stage_pool(self, sources: dict[str, torch.Tensor]) -> StagedPool:
        """Copy every tensor into one shared-memory pool (64-byte aligned slots), reusing
        the pool of an earlier finalized save when it is large enough."""
        entries: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        total = 0
        for key, t in sources.items():
            entries[key] = (total, t.dtype, tuple(t.shape))
            nbytes = t.numel() * t.element_size()
            total += -(-nbytes // _POOL_ALIGN) * _POOL_ALIGN
        pool = PROCESS.take_staging_pool(total)
        if pool is None:
            storage = torch.UntypedStorage._new_shared(max(total, 1))
            pool = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        for key, t in sources.items():
            offset, dtype, shape = entries[key]
            nbytes = t.numel() * t.element_size()
            if nbytes:
                dst = pool[offset : offset + nbytes].view(dtype).view(shape)
                dst.copy_(t)
        self._pool = pool
        return StagedPool(pool, entries)

    def release_staging(self) -> None:
        """This save's staging pool may be reused (its write is over: finalize)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            PROCESS.release_staging_pool(pool)

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
        fn = write_dcp_rank_data if isinstance(self._job, DcpWriteJob) else write_rank_data
        return fn, partial(_identity_preload, staged), (self._job, staged)

    # ---------------------------------------------------------------- results
    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results, read back from its part file (nothing travels
        between ranks).

        Raises:
            CheckpointError: this rank's write failed or left no part.
        """
        if self._job is None:
            raise CheckpointError("no write was prepared", path=self.path, rank=self.rank)
        if isinstance(self._job, DcpWriteJob):
            body = _read_dcp_part(self._job.tmp_dir, self._job.layout)
            results = []
            for f in self._job.layout.files:
                for it in f.items:
                    off, length = body["files"][f.name]["items"][it.key][:2]
                    results.append(
                        WriteResult(it.index, int(length), _StorageInfo(f.name, off, length))
                    )
            return results
        backend = None if self.location.is_local else self.backend()
        return rank_write_results(self._job.tmp_dir, self._job.layout, self._index_of, backend)

    def commit_parts(self, metadata: Metadata, layout: SaveLayout) -> None:
        """Coordinator, at finalize: check every rank's part and commit.

        Raises:
            RankWritesFailed: ranks failed to write (every one named, with its cause).
            CheckpointError: the commit failed.
        """
        if self.tmp_dir is None:
            raise CheckpointError("finalize before prepare_write_data()", path=self.path)
        if all(isinstance(lay, DcpRankLayout) for lay in layout.layouts):
            commit_dcp(self, metadata, layout)
            self.tmp_dir = None
            return
        backend = None if self.location.is_local else self.backend()
        results, causes = [], {}
        for lay in layout.layouts:
            assert isinstance(lay, RankLayout)
            try:
                results.append(rank_write_results(self.tmp_dir, lay, None, backend))
            except CheckpointError as e:
                if isinstance(e, CorruptCheckpointError):
                    raise
                causes[lay.rank] = e.message
        if causes:
            raise RankWritesFailed(causes, self.path)
        if backend is None:
            _remove_unexpected(self.tmp_dir, expected_files(layout.layouts))
        else:
            _remove_parts(backend, self.tmp_dir, len(layout.layouts))
        self.plans = layout.plans
        super().finish(metadata, results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata`` and the manifest, then rename (the commit);
        on an object store the manifest, written last, is the commit."""
        if self.tmp_dir is None:
            raise CheckpointError("finish() before prepare_write_data()", path=self.path)
        super().finish(metadata, results)


def _remove_parts(backend: Backend, prefix: str, world_size: int) -> None:
    """On an object store: delete every rank's part and error part (already read), so the
    checkpoint holds only its data objects, ``.metadata`` and the manifest. The prefix
    was empty when the save was planned, so nothing else of an earlier attempt is there;
    nothing else is deleted (never another save's manifest)."""
    names = [n for r in range(world_size) for n in (parts.part_name(r), error_part_name(r))]
    backend.delete(join(prefix, n) for n in names)


# ====================================================================== DCP layout
# FileSystemWriterAsync on a local path writes the DCP layout (docs/FORMAT.md §8): DCP's
# own files, byte for byte, with quicksave's manifest at the end of ``.metadata``.

DCP_SUFFIX = ".distcp"
INVALID_SETUP = (
    "Invalid Setup! User cannot establish a daemon Async worker and then use Multi-Proc "
    "File IO: build the AsyncCallsQueue with is_daemon=False, or pass is_multiproc_io=False"
)


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


@dataclass(frozen=True)
class DcpItem:
    """One DCP write item of a rank: a tensor chunk (``spec``) or a byte item (an object)."""

    key: str
    fqn: str
    spec: ItemSpec | None  # None: a byte item

    @property
    def index(self) -> MetadataIndex:
        if self.spec is None:
            return MetadataIndex(self.fqn)
        return MetadataIndex(self.fqn, torch.Size(self.spec.offsets))


@dataclass(frozen=True)
class DcpFile:
    """A data file and its items in DCP's order: byte items first, then tensors."""

    name: str
    items: tuple[DcpItem, ...]


@dataclass(frozen=True)
class DcpRankLayout:
    rank: int
    files: tuple[DcpFile, ...]


def _dcp_item(item: Any) -> DcpItem:
    if item.type == WriteItemType.BYTE_IO:
        return DcpItem(item.index.fqn, item.index.fqn, None)
    spec = item_spec(item)
    return DcpItem(spec.key, spec.fqn, spec)


def dcp_rank_layout(
    rank: int, items: list[Any], thread_count: int, single_file_per_rank: bool = True
) -> DcpRankLayout:
    """The files rank ``rank`` writes, as DCP's ``FileSystemWriter`` lays them out:
    ``__{rank}_{i}.distcp``; one file per item without ``single_file_per_rank``; else
    ``thread_count`` files, byte items dealt round-robin and tensors, largest first, each
    to the least-filled file (with one file: every item, in plan order)."""
    if not single_file_per_rank:
        buckets = [[i] for i in items]
    elif thread_count <= 1:
        buckets = [list(items)]
    else:
        byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
        tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
        buckets = [[] for _ in range(thread_count)]
        sizes = [0] * thread_count
        tensors.sort(key=lambda i: item_spec(i).nbytes, reverse=True)  # stable, as DCP's
        for n, i in enumerate(byte_items):
            buckets[n % thread_count].append(i)
        for i in tensors:
            at = min(range(thread_count), key=lambda b: sizes[b])
            buckets[at].append(i)
            sizes[at] += item_spec(i).nbytes
    files = []
    for n, bucket in enumerate(buckets):
        ordered = [i for i in bucket if i.type == WriteItemType.BYTE_IO] + [
            i for i in bucket if i.type != WriteItemType.BYTE_IO
        ]
        files.append(DcpFile(f"__{rank}_{n}{DCP_SUFFIX}", tuple(_dcp_item(i) for i in ordered)))
    return DcpRankLayout(rank, tuple(files))


@dataclass(frozen=True)
class DcpWriteJob:
    """The picklable description of one rank's background write in the DCP layout."""

    rank: int
    tmp_dir: str
    layout: DcpRankLayout
    byte_items: dict[str, bytes]  # key -> DCP's bytes of the object (torch.save)
    objects: dict[str, Any]  # fqn -> typed JSON, for the manifest
    fsync: bool
    open_file: Callable[..., Any] = open
    multiproc_io: bool = False


def write_dcp_rank_data(job: DcpWriteJob, staged: Any) -> None:
    """``save_fn`` in the DCP layout: this rank's data files (one thread each), then its
    part (item offsets and digests), the rank's "done" record.

    A failure is recorded in an error part, which the coordinator reports at finalize on
    every rank (NVRx reports writer failures at finalize too); this function then returns
    normally. It raises only when even the error part cannot be written.

    Raises:
        CheckpointError: the write failed and the failure could not be recorded.
    """
    from quicksave.format.dcp_layout import write_dcp_file

    pool = staged  # keeps the pool's memory alive while its tensors are written
    staged = _tensors_of(pool)
    try:
        if job.multiproc_io:
            import multiprocessing

            if multiprocessing.current_process().daemon:
                raise CheckpointError(INVALID_SETUP, path=job.tmp_dir, rank=job.rank)
        os.makedirs(job.tmp_dir, exist_ok=True)
        for name in [f.name for f in job.layout.files] + [
            parts.part_name(job.rank),
            error_part_name(job.rank),
        ]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(job.tmp_dir, name))

        def write_one(f: DcpFile) -> dict[str, Any]:
            items: list[tuple[str, Any]] = []
            for it in f.items:
                items.append(
                    (it.key, job.byte_items[it.key] if it.spec is None else staged[it.key])
                )
            with job.open_file(os.path.join(job.tmp_dir, f.name), "wb") as stream:
                w = write_dcp_file(stream, items, fsync=job.fsync)
            return _file_record(w)

        files = job.layout.files
        if len(files) <= 1:
            records = [write_one(f) for f in files]
        else:
            with ThreadPoolExecutor(len(files), thread_name_prefix="quicksave-dcp") as pool:
                records = list(pool.map(write_one, files))
        body = {
            "format": DCP_PART_FORMAT,
            "rank": job.rank,
            "files": {f.name: r for f, r in zip(files, records, strict=True)},
            "objects": job.objects,
        }
        parts.write_sealed(job.tmp_dir, parts.part_name(job.rank), parts.seal(body), job.fsync)
    except Exception as e:  # noqa: BLE001 - recorded for the coordinator
        cause = e.message if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
        try:
            os.makedirs(job.tmp_dir, exist_ok=True)
            _write_error_part(job.tmp_dir, job.rank, cause)
        except OSError:
            raise CheckpointError(
                f"rank {job.rank} failed to write its checkpoint data: {cause}",
                path=job.tmp_dir,
                rank=job.rank,
            ) from e


DCP_PART_FORMAT = "quicksave-dcp-part"


def _file_record(w: Any) -> dict[str, Any]:
    items = {}
    for key, it in w.items.items():
        items[key] = [
            it.item_offset,
            it.item_length,
            getattr(it, "raw_offset", None),
            getattr(it, "raw_length", None),
            getattr(it, "xxh3_64", None),
        ]
    return {"size": w.size, "xxh3_64": w.xxh3_64, "items": items}


def _read_dcp_part(tmp_dir: str, layout: DcpRankLayout) -> dict[str, Any]:
    """One rank's DCP part, checked against its layout.

    Raises:
        CheckpointError: the rank recorded an error or left no part (its cause).
        CorruptCheckpointError: the part is damaged or does not match the layout.
    """
    rank = layout.rank
    cause = read_error_part(tmp_dir, rank)
    if cause is not None:
        raise CheckpointError(cause, path=tmp_dir, rank=rank)
    body, path = parts.read_sealed(tmp_dir, rank, DCP_PART_FORMAT)
    files = body.get("files")
    for f in layout.files:
        rec = files.get(f.name) if isinstance(files, dict) else None
        items = rec.get("items") if isinstance(rec, dict) else None
        if (
            not isinstance(items, dict)
            or set(items) != {it.key for it in f.items}
            or not isinstance(rec.get("size"), int)
            or not isinstance(rec.get("xxh3_64"), str)
            or not all(_item_record_ok(items[it.key], it.spec is None) for it in f.items)
        ):
            raise CorruptCheckpointError(
                f"the part does not match the plan for {f.name}", path=path, rank=rank
            )
    if not isinstance(body.get("objects", {}), dict):
        raise CorruptCheckpointError("the part's objects are malformed", path=path, rank=rank)
    return body


def _item_record_ok(record: Any, byte_item: bool) -> bool:
    # [item_offset, item_length, raw_offset, raw_length, xxh3_64]; the last three are
    # null for a byte item
    if not isinstance(record, list) or len(record) != 5:
        return False
    ints = record[:2] if byte_item else record[:4]
    if not all(isinstance(v, int) and v >= 0 for v in ints):
        return False
    return byte_item or isinstance(record[4], str)


def commit_dcp(writer: FileSystemWriterAsync, metadata: Metadata, layout: SaveLayout) -> None:
    """The coordinator's commit of a DCP-layout save: read every rank's part, build DCP's
    ``Metadata`` (``storage_data`` → each item's bytes) and quicksave's manifest, write
    ``.metadata`` = pickle | manifest | footer (FORMAT.md §8), check that every file is
    whole, and rename the temporary directory into place (replacing an older checkpoint
    there atomically when ``overwrite``).

    Raises:
        RankWritesFailed: ranks recorded errors or left no part (every one named).
        CheckpointError: the commit itself failed.
    """
    from quicksave.format.dcp_layout import encode_metadata

    tmp_dir = writer.tmp_dir
    assert tmp_dir is not None
    bodies: dict[int, dict[str, Any]] = {}
    causes: dict[int, str] = {}
    for lay in layout.layouts:
        assert isinstance(lay, DcpRankLayout)
        try:
            bodies[lay.rank] = _read_dcp_part(tmp_dir, lay)
        except CheckpointError as e:
            causes[lay.rank] = e.message
    if causes:
        raise RankWritesFailed(causes, writer.path)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    results: list[list[WriteResult]] = []
    expected: dict[str, int] = {}
    for lay in layout.layouts:
        body = bodies[lay.rank]
        rank_results: list[WriteResult] = []
        for f in lay.files:
            rec = body["files"][f.name]
            expected[f.name] = int(rec["size"])
            for it in f.items:
                item_off, item_len, raw_off, raw_len, digest = rec["items"][it.key]
                storage[it.index] = _StorageInfo(f.name, int(item_off), int(item_len))
                if it.spec is not None:
                    written = _ChunkWritten(
                        f.name,
                        int(raw_off),
                        int(raw_len),
                        str(digest),
                        int(rec["size"]),
                        str(rec["xxh3_64"]),
                        None,  # type: ignore[arg-type] - no data_start in this layout
                        lay.rank,
                    )
                    rank_results.append(WriteResult(it.index, int(raw_len), written))
        for fqn, value in body.get("objects", {}).items():
            rank_results.append(WriteResult(MetadataIndex(fqn), 0, _ObjectWritten(value)))
        results.append(rank_results)
    plans = layout.plans if len(layout.plans) > 1 else None
    manifest = build_manifest(metadata, results, writer.step, writer.user_metadata, plans=plans)
    manifest = dataclasses.replace(manifest, layout="dcp")
    dcp_md = copy.copy(metadata)
    dcp_md.storage_data = storage
    dcp_md.planner_data = dcp_planner_data(metadata.planner_data)  # the pickle: DCP's only
    dcp_md.storage_meta = StorageMeta(checkpoint_id=writer.path, save_id=writer.save_id)
    data = encode_metadata(pickle.dumps(dcp_md), to_json_bytes(manifest))
    commit.write_durable(os.path.join(tmp_dir, DCP_METADATA_NAME), data)
    expected[DCP_METADATA_NAME] = len(data)
    _remove_unexpected(tmp_dir, set(expected))
    commit.publish(tmp_dir, writer.path, expected, replace=writer.overwrite)


def _remove_unexpected(tmp_dir: str, keep: set[str]) -> None:
    """Only the checkpoint's files are committed: the parts (already read) and anything
    an earlier attempt left are removed first."""
    for name in os.listdir(tmp_dir):
        if name not in keep:
            path = os.path.join(tmp_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _rank_plan(plan: SavePlan) -> RankPlan:
    from quicksave.adapters.dcp_writer import rank_plan_of

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


def expected_files(layouts: tuple[Any, ...]) -> set[str]:
    """The data files a committed save of these layouts holds (besides the files the
    commit itself writes)."""
    return {f.name for lay in layouts for f in lay.files}


__all__ = [
    "ConsistentDataIdentifier",
    "DcpWriteJob",
    "FileSystemWriterAsync",
    "RankWriteJob",
    "RankWritesFailed",
    "SaveLayout",
    "SeedRankPlan",
    "rank_write_results",
    "WriteBucket",
    "get_write_results_queue",
    "temp_dir_for",
    "write_dcp_rank_data",
    "write_rank_data",
]
