"""``FileSystemWriterAsync``: NVRx's asynchronous storage writer, writing quicksave's format.

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
(``worker/files.commit_files``): ``.metadata``, one listing that checks every object's size,
``manifest.json`` last — its presence is the commit. The prefix is checked before any
byte is written (the coordinator, while planning: a committed checkpoint or another
save's objects there fail the save on every rank, before any collective hands out a
plan). A failed finalize deletes this save's objects (never a manifest's checkpoint);
a rank whose write failed leaves its objects and error part, invisible without a
manifest, for a ``CheckpointManager``'s clean-up.

**use_msc** keeps NVRx's meaning, "open paths through the Multi-Storage Client":

* ``msc://`` paths need ``use_msc=True``; with ``use_msc=False`` the writer raises a
  ``CheckpointError`` naming ``use_msc=True`` before any I/O (NVRx would have opened
  ``msc://...`` as a local path; failing keeps code that runs here correct on NVRx).
* ``use_msc=True`` with a plain path or ``file://`` URL writes to the local filesystem,
  as MSC itself serves plain paths (its POSIX provider): same checkpoint as without it.
* ``s3://`` URLs work with either value, through quicksave's own S3 backend.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from quicksave.adapters.dcp_writer import StorageWriter, _original_object, item_spec, rank_plan_of
from quicksave.commit import strategy_class
from quicksave.compat.nvrx.dcp_save import (
    DcpRankLayout,
    DcpWriteJob,
    commit_dcp,
    dcp_rank_layout,
    read_dcp_part,
    write_dcp_rank_data,
)
from quicksave.compat.nvrx.nvrx_data_path import (
    ConsistentDataIdentifier,
    NvrxDataPath,
    WriteBucket,
    get_write_results_queue,
)
from quicksave.compat.nvrx.process_state import PROCESS
from quicksave.compat.nvrx.rank_write import (
    CentralRankPlan,
    RankWriteJob,
    RankWritesFailed,
    SaveLayout,
    clear_for_commit,
    draft_for,
    expected_files,
    failed_save_names,
    rank_part,
    rank_write_results,
    write_rank_data,
)
from quicksave.compat.nvrx.staging import identity_preload, stage_to_pool
from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format import objects as objcodec
from quicksave.layout.plan import RankLayout, layout_rank
from quicksave.stage.pool import StagingPool

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


class FileSystemWriterAsync(NvrxDataPath, StorageWriter, FileSystemWriter):
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
        self.location.check_msc_opt_in(use_msc)
        # DCP's own files where the location's commit strategy can write them (a rename)
        self.dcp_layout = strategy_class(self.location).can_write_dcp_layout
        self.plan_id = uuid.uuid4().hex  # replaced by the caller on a restart-reuse save
        self.save_index = 0  # set by save_state_dict_async_plan (per-save counter)
        self.layouts: tuple[RankLayout | DcpRankLayout, ...] | None = None
        self._job: RankWriteJob | DcpWriteJob | None = None
        self._staged: StagingPool | dict[str, torch.Tensor] = {}
        self._pool: StagingPool | None = None  # this save's staging pool
        self._index_of: dict[str, MetadataIndex] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.rank = rank or 0

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
        layout = self._rank_layout(self.rank, local_plan)
        return dataclasses.replace(local_plan, storage_data=CentralRankPlan(self.plan_id, layout))

    def _rank_layout(self, rank: int, plan: SavePlan) -> RankLayout | DcpRankLayout:
        """The files ``rank`` writes for ``plan``: DCP's layout on a local path, else
        quicksave's."""
        if self.dcp_layout:
            return dcp_rank_layout(
                rank, list(plan.items), self.thread_count, self.single_file_per_rank
            )
        items = [item_spec(i) for i in plan.items if i.type != WriteItemType.BYTE_IO]
        return layout_rank(rank, items, self.thread_count, dcp_compat=self.dcp_compat)

    # ---------------------------------------------------------------- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Attach the rank's plan; the coordinator also checks the target before any
        rank can write (:meth:`CommitStrategy.check_target`; ``overwrite`` lets a
        committed checkpoint be replaced where the location replaces atomically, else a
        committed checkpoint, or on an object store another save's objects, fail the
        save): a failure here is raised on every rank by the planning collective.

        Raises:
            CheckpointExistsError: (coordinator) an object store prefix holds a
                checkpoint or objects; a local path holds something that is no
                checkpoint, or a checkpoint and ``overwrite`` is False.
            CheckpointError: (coordinator, object store) the store cannot be reached.
        """
        plan = super().prepare_local_plan(plan)
        if self.is_coordinator:
            try:
                s = self.strategy()
                s.check_target(self.location, self.rank, replace=self._replaces())
            except BaseException:
                self.close()  # this writer's save ends here: drop its client
                raise
        return plan

    def _replaces(self) -> bool:
        """Whether this save replaces a committed checkpoint at its path: ``overwrite``
        (DCP's default) where the location's commit can replace one atomically; an
        object store's committed checkpoint is never replaced."""
        return self.overwrite and strategy_class(self.location).atomic_replace

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator (or every rank, when all of them replay a loaded plan): fix every
        rank's file layout. Creates nothing on disk: the directory comes at write time."""
        self.plans = tuple(rank_plan_of(p) for p in plans)
        out, layouts = [], []
        for rank, plan in enumerate(plans):
            layout = self._rank_layout(rank, plan)
            layouts.append(layout)
            out.append(
                dataclasses.replace(plan, storage_data=CentralRankPlan(self.plan_id, layout))
            )
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
        if not isinstance(rank_plan, CentralRankPlan):
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
        self.draft = draft_for(self.location, rank_plan.plan_id, self.save_index)
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
                self.draft,
                self.location,
                rank_plan.layout,
                byte_items,
                objects,
                self.fsync,
                self.open_file,
                self.is_multiproc_io,
            )
            return
        self._job = RankWriteJob(
            self.rank, self.draft, rank_plan.layout, objects, self.fsync, self.location
        )

    def _stage_pool(self, sources: dict[str, torch.Tensor]) -> StagingPool:
        """Copy every tensor into one shared-memory pool (64-byte aligned slots), reusing
        the pool of an earlier finalized save when it is large enough."""
        self._pool = stage_to_pool(sources, PROCESS.spare_pool.take)
        return self._pool

    def release_pool(self) -> None:
        """This save's staging pool may be reused (its write is over: finalize)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            PROCESS.spare_pool.give(pool)

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
        return fn, partial(identity_preload, staged), (self._job, staged)

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
            body = read_dcp_part(self.strategy(), self._job.draft, self._job.layout)
            results = []
            for f in self._job.layout.files:
                for it in f.items:
                    off, length = body["files"][f.name]["items"][it.key][:2]
                    results.append(
                        WriteResult(it.index, int(length), _StorageInfo(f.name, off, length))
                    )
            return results
        return rank_write_results(
            self.strategy(), self._job.draft, self._job.layout, self._index_of
        )

    def commit_parts(self, metadata: Metadata, layout: SaveLayout) -> None:
        """Coordinator, at finalize: check every rank's part and commit.

        Raises:
            RankWritesFailed: ranks failed to write (every one named, with its cause).
            CheckpointError: the commit failed.
        """
        if self.draft is None:
            raise CheckpointError("finalize before prepare_write_data()", path=self.path)
        strategy = self.strategy()
        if all(isinstance(lay, DcpRankLayout) for lay in layout.layouts):
            commit_dcp(
                strategy,
                metadata,
                layout,
                draft=self.draft,
                location=self.location,
                step=self.step,
                user_metadata=self.user_metadata,
                save_id=self.save_id,
                overwrite=self._replaces(),
            )
            self.draft = None
            self.close()
            return
        rank_parts, causes = [], {}
        for lay in layout.layouts:
            assert isinstance(lay, RankLayout)
            try:
                rank_parts.append(rank_part(strategy, self.draft, lay))
            except CheckpointError as e:
                if isinstance(e, CorruptCheckpointError):
                    raise
                causes[lay.rank] = e.message
        if causes:
            raise RankWritesFailed(causes, self.path)
        keep = expected_files(layout.layouts)
        clear_for_commit(strategy, self.draft, keep, len(layout.layouts))
        self.plans = layout.plans
        self.commit_parts_of(metadata, rank_parts, layout.layouts)  # type: ignore[arg-type]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write ``.metadata`` and the manifest, then commit them through the
        location's strategy (a rename; on an object store the manifest, written last)."""
        if self.draft is None:
            raise CheckpointError("finish() before prepare_write_data()", path=self.path)
        layout = metadata.storage_data
        if isinstance(layout, SaveLayout):
            # NVRx's planning records the layouts here, also when this writer did not
            # plan (a cached plan, decentralized planning); the parts on storage hold
            # what ``results`` say (``retrieve_write_results`` read them), and are checked
            self.commit_parts(metadata, layout)
            return
        super().finish(metadata, results)

    def draft_url(self) -> str:
        """The path or URL of this save's draft (for messages): its temporary
        directory, or on an object store the checkpoint's URL."""
        if self.draft is None:
            return self.path
        return self.strategy().backend.url(self.draft)

    def discard(self, layout: SaveLayout | None = None) -> None:
        """Remove what this failed save wrote (the coordinator calls it; best effort):
        its temporary directory, or on an object store the objects of ``layout``
        (default: this writer's own planning) that it wrote
        (:func:`~quicksave.compat.nvrx.rank_write.failed_save_names`), nothing else."""
        if self.draft is None:
            return
        layouts = tuple(layout.layouts if layout is not None else (self.layouts or ()))
        s = self.strategy()
        s.discard(self.draft, failed_save_names(layouts))
        self.close()


__all__ = [
    "ConsistentDataIdentifier",
    "FileSystemWriterAsync",
    "WriteBucket",
    "get_write_results_queue",
]
