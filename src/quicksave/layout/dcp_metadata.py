"""The DCP ``Metadata`` of a checkpoint, built from its manifest alone: what
``StorageReader.read_metadata`` hands to DCP's planners and what every save path
writes as ``.metadata`` (docs/FORMAT.md §2, §5). Nothing is unpickled here."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from quicksave.format import DCP_METADATA_NAME
from quicksave.format import objects as objcodec
from quicksave.format.dcp_guard import QuicksaveStorageData
from quicksave.format.dtypes import dtype_from_name
from quicksave.format.keys import dcp_planner_data
from quicksave.format.manifest import Manifest
from quicksave.format.torch_legacy import legacy_prefix_for, object_bytes


def manifest_to_metadata(manifest: Manifest, path: str | None = None) -> Metadata:
    """DCP ``Metadata`` equivalent to ``manifest`` (``path``: named in errors)."""
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    mappings: dict[str, tuple] = {}
    # In fqn order, tensors then values: the manifest records no other order (its JSON
    # is sorted), so every save path gives the same state the same bytes.
    for fqn, t in sorted(manifest.tensors.items()):
        chunks = [
            ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks
        ]
        sd_md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(t.dtype, path=path, fqn=fqn)),
            torch.Size(t.shape),
            chunks,
        )
        for c in t.chunks:
            storage[MetadataIndex(fqn, torch.Size(c.offsets))] = (fqn, c)
        mappings[fqn] = t.path or (fqn,)
    for fqn, o in sorted(manifest.objects.items()):
        sd_md[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = (fqn, o)
        mappings[fqn] = o.path or (fqn,)
    # DCP's own paths (plain str/int): DCP planners and .metadata pickles see only those.
    planner_data = dcp_planner_data(mappings)
    return Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data=storage)


def dcp_metadata_bytes(manifest: Manifest, *, dcp_compat: bool = False) -> bytes:
    """The ``.metadata`` of a checkpoint: DCP's ``Metadata`` for ``manifest``, pickled.

    Built from the manifest alone (no absolute path, no random id), so the same state
    gives the same bytes (docs/FORMAT.md §2, §5).

    Without ``dcp_compat`` stock DCP readers cannot load the checkpoint (raw tensor
    bytes, objects in the manifest only): ``storage_data`` is an empty
    :class:`.format.dcp_guard.QuicksaveStorageData`, whose lookups raise a
    ``CheckpointError`` naming the format and what to do, rather than a ``KeyError`` or
    a ``torch.load`` of raw bytes.

    ``dcp_compat`` (the data files were laid out with ``dcp_compat``): a chunk whose
    dtype has a torch legacy prefix points at prefix plus bytes, a ``torch.save`` item
    (one without a prefix at its raw bytes, ``_StorageInfo(file, offset, length)``);
    and the objects, ``torch.save`` bytes each (:func:`.format.torch_legacy.object_bytes`),
    follow the pickle in this same file, each ``BYTE_IO`` item pointing at its bytes
    (``pickle.load`` stops at the pickle's end, so DCP's readers never see them).
    """
    md = manifest_to_metadata(manifest)
    md.storage_meta = None
    if not dcp_compat:
        md.storage_data = QuicksaveStorageData()
        return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for fqn, t in manifest.tensors.items():
        for c in t.chunks:
            prefix = legacy_prefix_for(t.dtype, tuple(c.sizes))
            n = len(prefix) if prefix is not None else 0
            storage[MetadataIndex(fqn, torch.Size(c.offsets))] = _StorageInfo(
                c.file, c.offset - n, c.length + n
            )
    blobs: list[tuple[str, bytes]] = []
    for fqn in sorted(manifest.objects):
        blob = object_bytes(objcodec.decode(manifest.objects[fqn].value, fqn=fqn))
        if blob is not None:
            blobs.append((fqn, blob))
    if not blobs:
        md.storage_data = storage
        return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)

    def pickled(base: int) -> bytes:
        at = base
        objects = {}
        for fqn, blob in blobs:
            objects[MetadataIndex(fqn)] = _StorageInfo(DCP_METADATA_NAME, at, len(blob))
            at += len(blob)
        md.storage_data = {**storage, **objects}
        return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)

    # The objects' offsets are inside the pickle whose length places them: grow the
    # guess until the pickle fits before it (the lengths grow with the offsets), then
    # fill the rest with zeros.
    base = len(pickled(0))
    while True:
        head = pickled(base)
        if len(head) <= base:
            break
        base = len(head)
    return head + bytes(base - len(head)) + b"".join(blob for _, blob in blobs)
