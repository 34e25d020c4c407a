"""``quicksave.StorageWriter``: the quicksave format behind ``torch.distributed.checkpoint.save``.

Call order (DCP drives it; "all" = every rank, "coord" = the coordinator rank only):

1. (all)   ``reset(checkpoint_id)``, ``set_up_storage_writer(is_coordinator, rank=...)``
2. (all)   ``prepare_local_plan(plan)`` — attaches the rank's ``RankPlan`` (what it holds,
   before deduplication) as ``storage_data``, so the coordinator can record every plan
3. (coord) ``prepare_global_plan(plans)`` — records every rank's plan (the manifest's
   ``plans``), creates its temporary (``.quicksave.<encoded name>.tmp-<token>/``) and
   fixes every rank's file layout (names, headers, byte offsets) so the manifest is
   known at plan time
4. (all)   ``write_data(plan, planner)`` — writes this rank's files, fsyncs, returns checksums
5. (coord) ``finish(metadata, results)`` — the manifest: the skeleton of the global
   metadata and the layouts (``layout.skeleton``) filled from each rank's results taken
   as its ``RankPart`` (``commit.parts.manifest_from_parts``, as every save path); then
   ``.metadata`` and ``manifest.json``, fsynced, and the directory renamed into place

Example::

    import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, storage_writer=quicksave.StorageWriter("ckpt/step-100", step=100))
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from quicksave.commit import CommitStrategy, new_token, strategy_class, strategy_for
from quicksave.commit.parts import RankPart, manifest_from_parts
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import check_storable, dtype_name
from quicksave.format.keys import EMPTY_KEY, names_itself
from quicksave.format.manifest import (
    FileEntry,
    Manifest,
    PlannedChunk,
    RankPlan,
)
from quicksave.layout.dcp_metadata import dcp_metadata_bytes
from quicksave.layout.plan import ItemSpec, RankLayout, layout_rank
from quicksave.layout.skeleton import Placed, chunk_keys_of, manifest_skeleton, placed_of
from quicksave.storage import StorageOptions, parse_location
from quicksave.storage.backend import Backend
from quicksave.worker import persist
from quicksave.worker.files import commit_files


@dataclass(frozen=True)
class _RankWritePlan:
    """What the coordinator tells each rank (travels in ``SavePlan.storage_data``)."""

    draft: str
    layout: RankLayout


@dataclass(frozen=True)
class _ChunkWritten:
    """A chunk's write result: its key and the checksum of its bytes as written (where
    it went, the coordinator's layout says)."""

    key: str
    xxh3_64: str


@dataclass(frozen=True)
class _ObjectWritten:
    value: Any  # typed JSON


def part_of_results(rank: int, results: list[WriteResult], path: str | None = None) -> RankPart:
    """A rank's DCP write results as the ``RankPart`` the manifest is filled from.

    Raises:
        CheckpointError: a result this writer did not make (names the item and rank).
    """
    chunks: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for r in results:
        sd = r.storage_data
        if isinstance(sd, _ChunkWritten):
            chunks[sd.key] = sd.xxh3_64
        elif isinstance(sd, _ObjectWritten):
            objects[r.index.fqn] = sd.value
        else:
            raise CheckpointError(
                f"a write result quicksave's writer did not make ({type(sd).__name__})",
                path=path,
                fqn=r.index.fqn,
                rank=rank,
            )
    return RankPart(rank, chunks, objects)


def dcp_skeleton(
    metadata: Metadata,
    files: Mapping[str, FileEntry],
    placed: list[Placed],
    *,
    world_size: int,
    plans: tuple[RankPlan, ...] | None,
) -> Manifest:
    """The manifest skeleton of a save DCP's planner planned: tensors, values and key
    paths from the global ``metadata``, chunk places from the files (``placed``)."""
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    objects: dict[str, None] = {}
    paths: dict[str, tuple] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        p = mappings.get(fqn)
        if p is not None and not names_itself(p, fqn):
            paths[fqn] = tuple(p)
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = (dtype_name(md.properties.dtype), tuple(md.size))
        elif isinstance(md, BytesStorageMetadata):
            objects[fqn] = None
    return manifest_skeleton(
        tensors,
        files,
        placed,
        objects,
        world_size=world_size,
        paths=paths,
        plans=plans,
        empty_dicts=tuple(mappings.get(EMPTY_KEY, ())),
    )


def item_spec(item) -> ItemSpec:
    """ItemSpec of a DCP tensor WriteItem."""
    td = item.tensor_data
    dtype = td.properties.dtype
    check_storable(dtype, item.index.fqn)
    sizes = tuple(td.chunk.sizes)
    numel = 1
    for s in sizes:
        numel *= s
    return ItemSpec(
        fqn=item.index.fqn,
        offsets=tuple(td.chunk.offsets),
        sizes=sizes,
        global_shape=tuple(td.size),
        dtype=dtype_name(dtype),
        nbytes=numel * dtype.itemsize,
    )


def rank_plan_of(plan: SavePlan) -> RankPlan:
    """What ``plan`` holds, as the manifest records it: the ``RankPlan`` that
    ``StorageWriter.prepare_local_plan`` attached (which survives deduplication), else one
    built from the plan's items."""
    if isinstance(plan.storage_data, RankPlan):
        return plan.storage_data
    data = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    tensors = []
    objects = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            objects.append(item.index.fqn)
            continue
        td = item.tensor_data
        tensors.append(
            PlannedChunk(
                item.index.fqn,
                tuple(td.chunk.offsets),
                tuple(td.chunk.sizes),
                tuple(td.size),
                dtype_name(td.properties.dtype),
            )
        )
    return RankPlan(tuple(tensors), tuple(objects), tuple(data.get(EMPTY_KEY, ())))


class StorageWriter(_DCPStorageWriter):
    """Writes a quicksave-format checkpoint from ``torch.distributed.checkpoint.save``.

    Args:
        path: the final checkpoint directory; it must not hold a committed checkpoint.
        step: training step recorded in the manifest (optional).
        thread_count: data files (and writer threads) per rank.
        fsync: fsync files and directories (turn off only for throwaway tests).
        user_metadata: JSON-serializable dict stored in the manifest.
        dcp_compat: make the checkpoint loadable by DCP's stock ``FileSystemReader`` (and
            readers built on it, such as MSC's ``MultiStorageFileSystemReader``) too: each
            chunk is preceded by its torch legacy-serialization prefix and ``.metadata``
            carries the objects as ``torch.save`` bytes (docs/FORMAT.md §3, §5). Costs a
            few hundred bytes, and up to one 4 KiB page, per chunk.
        overwrite: a committed checkpoint at ``path`` is replaced atomically at the
            commit (a filesystem's rename commit exchanges the two directories); until
            then, and if the save fails, the old one stays whole. Where the location has
            no atomic replace (an object store) it raises ``CheckpointError``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        thread_count: int = 2,
        fsync: bool = True,
        user_metadata: dict[str, Any] | None = None,
        storage: StorageOptions | None = None,
        dcp_compat: bool = False,
        overwrite: bool = False,
    ) -> None:
        # Not super(): a subclass may also derive from DCP's FileSystemWriter, whose
        # __init__ (next in its MRO) takes a path and sets up DCP's own writing.
        _DCPStorageWriter.__init__(self)
        self.dcp_compat = dcp_compat
        self._storage = storage
        self.location = parse_location(path, options=storage)
        self.path = self.location.url
        # Private: FileSystemWriterAsync (a subclass) has its own public ``overwrite``.
        self._overwrite = overwrite
        self._strategy: CommitStrategy | None = None
        self.fsync = fsync
        self.rank = 0
        if overwrite:  # refused before any I/O where there is no atomic replace
            strategy_class(self.location).check_replace(self.location)
        self.step = step
        self.thread_count = max(1, thread_count)
        self.user_metadata = dict(user_metadata or {})
        self.is_coordinator = True
        self.draft: str | None = None
        self.save_id = uuid.uuid4().hex
        self.plans: tuple[RankPlan, ...] | None = None  # every rank's, set on the coordinator
        self.layouts: tuple[Any, ...] | None = None  # every rank's files, the coordinator's
        self._written: list[str] = []  # every rank's data files (the coordinator's discard)

    # 1 ------------------------------------------------------------------ set-up
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.close()  # its strategy served the old location
            self.location = parse_location(checkpoint_id, options=self._storage)
            self.path = self.location.url
        self.draft = None
        self.save_id = uuid.uuid4().hex
        self.plans = None
        self.layouts = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0) or 0

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # 2, 3 ------------------------------------------------------------- planning
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Travels to the coordinator with the plan; DCP's deduplication replaces items but
        # keeps storage_data, so the coordinator still sees what each rank held.
        return dataclasses.replace(plan, storage_data=rank_plan_of(plan))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.plans = tuple(rank_plan_of(p) for p in plans)
        self._written = []
        self.draft = self.strategy().begin(self.location, new_token(), replace=self._overwrite)
        out, layouts = [], []
        for rank, plan in enumerate(plans):
            items = [item_spec(i) for i in plan.items if i.type != WriteItemType.BYTE_IO]
            layout = layout_rank(rank, items, self.thread_count, dcp_compat=self.dcp_compat)
            layouts.append(layout)
            self._written.extend(f.name for f in layout.files)
            out.append(dataclasses.replace(plan, storage_data=_RankWritePlan(self.draft, layout)))
        self.layouts = tuple(layouts)
        return out

    # 4 ------------------------------------------------------------------ writing
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank_plan: _RankWritePlan = plan.storage_data
        self.draft = rank_plan.draft
        by_key = {}
        results: list[WriteResult] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value = _original_object(planner, item, self.rank)
                encoded = objcodec.encode(value, item.index.fqn)
                results.append(WriteResult(item.index, 0, _ObjectWritten(encoded)))
            else:
                by_key[item_spec(item).key] = item

        def source(key: str) -> torch.Tensor:
            return planner.resolve_data(by_key[key])

        written = persist.write_rank(
            self.strategy().backend, rank_plan.draft, rank_plan.layout, source
        )
        for f_layout, f_written in zip(rank_plan.layout.files, written, strict=True):
            for entry in f_layout.entries:
                key = entry.item.key
                digest = f_written.chunk_xxh3_64[key]
                results.append(
                    WriteResult(by_key[key].index, entry.length, _ChunkWritten(key, digest))
                )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    # 5 ------------------------------------------------------------------- commit
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        parts = [part_of_results(rank, got, self.path) for rank, got in enumerate(results)]
        self.commit_parts_of(metadata, parts)

    def commit_parts_of(
        self,
        metadata: Metadata,
        parts: list[RankPart],
        layouts: tuple[RankLayout, ...] | None = None,
    ) -> None:
        """Coordinator: the manifest (the skeleton of ``metadata`` and ``layouts`` —
        default: the ones ``prepare_global_plan`` fixed — filled from every rank's part),
        ``.metadata``, then the commit."""
        layouts = layouts if layouts is not None else self.layouts
        if self.draft is None or layouts is None:
            raise CheckpointError("finish() called before prepare_global_plan()", path=self.path)
        # One rank's plan is the manifest itself (FORMAT.md §2, plans): omit it.
        plans = self.plans if self.plans is not None and len(self.plans) > 1 else None
        files, placed = placed_of(layouts)
        skeleton = dcp_skeleton(metadata, files, placed, world_size=len(layouts), plans=plans)
        manifest = manifest_from_parts(skeleton, chunk_keys_of(skeleton), parts, self.draft)
        manifest = dataclasses.replace(
            manifest, step=self.step, user_metadata=dict(self.user_metadata)
        )
        metadata_bytes = dcp_metadata_bytes(manifest, dcp_compat=self.dcp_compat)
        commit_files(
            self.strategy(),
            self.draft,
            self.location,
            manifest,
            metadata_bytes,
            replace=self._overwrite,
        )
        self.draft = None
        self.close()

    def strategy(self) -> CommitStrategy:
        """The commit strategy of this writer's location, over a backend opened once
        (closed by :meth:`close`)."""
        if self._strategy is None:
            backend = self.location.open(fsync=self.fsync, rank=self.rank)
            self._strategy = strategy_for(self.location, backend, owned=True)
        return self._strategy

    def backend(self) -> Backend:
        """This writer's backend (the strategy's; closed by :meth:`close`)."""
        return self.strategy().backend

    def close(self) -> None:
        if self._strategy is not None:
            self._strategy.close()
            self._strategy = None

    def discard(self) -> None:
        """Remove what a failed save wrote (the coordinator calls it; best effort): every
        rank's data files as the plans laid them out, and nothing else (never another
        save's commit)."""
        if self.draft is None:
            return
        tmp, self.draft = self.draft, None
        self.strategy().discard(tmp, self._written)
        self.close()


def _original_object(planner: SavePlanner, item, rank: int) -> Any:
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise IncompatibleStateError(
            "the save planner does not expose lookup_object(); quicksave stores non-tensor "
            "values as JSON and needs the original value (use DefaultSavePlanner)",
            fqn=item.index.fqn,
            rank=rank,
        )
    return lookup(item.index)
