"""``quicksave.StorageReader``: quicksave checkpoints for ``torch.distributed.checkpoint.load``.

A thin DCP-facing class over the load engine's reader
(:class:`quicksave.loading.reader.CheckpointReader`, which ``quicksave.load`` drives
itself): DCP's checkpoint-id protocol (``reset``, ``checkpoint_id``,
``validate_checkpoint_id``), and metadata that also carries every rank's save-time plan
(``all_local_plans``, for the NVRx API's plan reuse). Nothing from the checkpoint is
unpickled.

Call order (DCP drives it): ``reset`` → ``read_metadata`` (all ranks) →
``set_up_storage_reader`` → ``prepare_local_plan`` / ``prepare_global_plan`` (identity) →
``read_data`` (all ranks, each its own read items).

Example::

    import torch.distributed.checkpoint as dcp
    dcp.load(state_dict, storage_reader=quicksave.StorageReader("ckpt/step-100"))
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DCPStorageReader

from quicksave.format.dtypes import dtype_from_name
from quicksave.format.keys import EMPTY_KEY
from quicksave.format.manifest import Manifest, PlannedChunk, RankPlan
from quicksave.loading.reader import CheckpointReader
from quicksave.storage import parse_location


def manifest_rank_plans(manifest: Manifest) -> tuple[RankPlan, ...] | None:
    """Every rank's plan at save time: the manifest's ``plans``, or for a one-rank
    checkpoint its whole content (FORMAT.md §2 lets writers omit it then); ``None`` when
    the manifest of a multi-rank checkpoint does not record them."""
    if manifest.plans is not None:
        return manifest.plans
    if manifest.world_size != 1:
        return None
    chunks = tuple(
        PlannedChunk(fqn, c.offsets, c.sizes, t.shape, t.dtype)
        for fqn, t in sorted(manifest.tensors.items())
        for c in t.chunks
    )
    return (RankPlan(chunks, tuple(sorted(manifest.objects)), manifest.empty_dicts),)


def save_plan_of(rank_plan: RankPlan, manifest: Manifest) -> SavePlan:
    """A DCP ``SavePlan`` equivalent to ``rank_plan`` (tensor properties other than the
    dtype take their defaults), carrying ``rank_plan`` as ``storage_data`` and the
    manifest's state-dict paths as ``planner_data``, as quicksave's writer and DCP's
    default planner produce them."""
    items = []
    paths: dict[str, tuple] = {}
    for c in rank_plan.tensors:
        whole = c.sizes == c.shape and not any(c.offsets)
        items.append(
            WriteItem(
                index=MetadataIndex(c.fqn, torch.Size(c.offsets)),
                type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=dtype_from_name(c.dtype, fqn=c.fqn)),
                    size=torch.Size(c.shape),
                ),
            )
        )
        entry = manifest.tensors.get(c.fqn)
        paths[c.fqn] = (entry.path if entry is not None else None) or (c.fqn,)
    for fqn in rank_plan.objects:
        items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        entry = manifest.objects.get(fqn)
        paths[fqn] = (entry.path if entry is not None else None) or (fqn,)
    if rank_plan.empty_dicts:
        paths[EMPTY_KEY] = rank_plan.empty_dicts  # type: ignore[index]
    return SavePlan(items, storage_data=rank_plan, planner_data=paths)


class StorageReader(CheckpointReader, _DCPStorageReader):
    """Reads a committed quicksave checkpoint for ``torch.distributed.checkpoint.load``.

    Args:
        path: the checkpoint directory: a path, a ``file://``, ``s3://`` or ``msc://``
            URL, or a Location.
        thread_count: parallel reader threads (on object stores each also splits a
            large chunk into parallel ranged reads).
        verify: check every chunk's xxh3-64 while reading (on by default).
        storage: how to reach an object store (default: the environment's chain).
        backend: an open backend serving ``path`` to read through (kept open); by
            default one is opened per step.
        chunks: where each chunk's bytes are (a
            :class:`~quicksave.loading.chunks.ChunkSource`; default: the checkpoint's
            own files, and for a chunk reference those of the checkpoint it names).
    """

    def __init__(self, path: Any, **kwargs: Any) -> None:
        CheckpointReader.__init__(self, path, **kwargs)
        self._planned: Metadata | None = None  # the metadata given its plans

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            new = parse_location(checkpoint_id, options=self._storage)
            if new.backend_id() != self.location.backend_id():
                self._backend = None  # the caller's backend serves the old location only
            self.location = new
            self.path = self.location.url
            self.checkpoint = self.manifest = self._metadata = None
        self.storage_data = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP ``Metadata`` rebuilt from the manifest, once. It also carries
        ``all_local_plans`` (every rank's ``SavePlan`` at save time, from the manifest's
        ``plans``; ``None`` if not recorded), which ``init_checkpoint_metadata_cache``
        uses to let the first save after a restart skip global planning."""
        md = super().read_metadata(*args, **kwargs)
        if self._planned is not md:
            manifest = self.read_manifest()
            plans = manifest_rank_plans(manifest)
            md.all_local_plans = (
                None if plans is None else [save_plan_of(p, manifest) for p in plans]
            )
            self._planned = md
        return md
