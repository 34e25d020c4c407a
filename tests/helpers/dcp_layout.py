"""Write a DCP-layout checkpoint (docs/FORMAT.md §8) from a state dict, one rank, for
tests: DCP's file set (``.metadata`` and ``__0_0.distcp``) whose ``.metadata`` also
carries the quicksave manifest. Built from the format pieces the writer uses
(:mod:`quicksave.format.dcp_layout`), not from quicksave's writer.

Example::

    write_dcp_layout_checkpoint(tmp_path / "ckpt", {"w": torch.ones(4, 2), "step": 3},
                                split={"w": 2})
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from quicksave.compat.nvrx.dcp_write import write_dcp_file
from quicksave.format import DCP_METADATA_NAME
from quicksave.format import objects as objcodec
from quicksave.format.dcp_layout import DcpFileWritten, encode_metadata
from quicksave.format.dtypes import dtype_name
from quicksave.format.manifest import (
    LAYOUT_DCP,
    Manifest,
    ObjectEntry,
    TensorEntry,
    to_json_bytes,
)
from quicksave.layout.dcp_metadata import manifest_to_metadata

DATA_FILE = "__0_0.distcp"


def _pieces(t: torch.Tensor, n: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``t`` cut along dim 0 into ``n`` chunks (one if it has no dim 0): (offsets, chunk
    with a storage of exactly its bytes)."""
    if t.dim() == 0 or n <= 1:
        return [((0,) * t.dim(), t.detach().clone())]
    out = []
    start = 0
    for piece in torch.tensor_split(t.detach(), n, dim=0):
        out.append(((start,) + (0,) * (t.dim() - 1), piece.clone()))
        start += piece.shape[0]
    return out


def write_dcp_layout_checkpoint(
    path: str | os.PathLike[str],
    state_dict: Mapping[str, Any],
    step: int | None = None,
    *,
    split: Mapping[str, int] | None = None,
    user_metadata: dict[str, Any] | None = None,
) -> tuple[Manifest, DcpFileWritten]:
    """Write ``state_dict`` at ``path`` (created; must not exist) as a committed
    DCP-layout checkpoint of one rank: objects as ``torch.save`` byte items first, then
    tensor chunks, in ``__0_0.distcp``; then ``.metadata`` = pickle | manifest | footer.

    Args:
        path: the checkpoint directory.
        state_dict: nested dicts/lists of CPU tensors and typed-JSON-encodable values.
        step: the manifest's step.
        split: fqn -> number of chunks to cut that tensor into along dim 0.
        user_metadata: the manifest's user_metadata.

    Returns:
        The manifest written and what ``write_dcp_file`` reported.
    """
    root = Path(path)
    root.mkdir(parents=True)
    flat, mappings = flatten_state_dict(dict(state_dict))
    split = split or {}
    byte_items: list[tuple[str, Any]] = []
    tensor_items: list[tuple[str, Any]] = []
    chunk_of: dict[str, tuple[str, tuple[int, ...], torch.Tensor]] = {}
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            for offsets, piece in _pieces(value, split.get(fqn, 1)):
                key = f"{fqn}@{list(offsets)}"
                chunk_of[key] = (fqn, offsets, piece)
                tensor_items.append((key, piece))
        else:
            buf = io.BytesIO()
            torch.save(value, buf)
            byte_items.append((fqn, buf))
    with open(root / DATA_FILE, "wb") as f:
        written = write_dcp_file(f, byte_items + tensor_items, fsync=False)

    def entry_path(fqn: str) -> tuple | None:
        p = tuple(mappings.get(fqn, (fqn,)))
        return None if p == (fqn,) else p

    tensors: dict[str, TensorEntry] = {}
    for fqn, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        chunks = []
        for key, (owner, offsets, piece) in chunk_of.items():
            if owner != fqn:
                continue
            chunks.append(written.items[key].chunk_entry(DATA_FILE, offsets, piece.shape))
        tensors[fqn] = TensorEntry(
            dtype_name(value.dtype), tuple(value.shape), tuple(chunks), entry_path(fqn)
        )
    objects = {
        fqn: ObjectEntry(objcodec.encode(value, fqn), entry_path(fqn))
        for fqn, value in flat.items()
        if not isinstance(value, torch.Tensor)
    }
    manifest = Manifest(
        step=step,
        world_size=1,
        tensors=tensors,
        objects=objects,
        files={DATA_FILE: written.file_entry(rank=0)},
        user_metadata=dict(user_metadata or {}),
        layout=LAYOUT_DCP,
    )
    md = manifest_to_metadata(manifest)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, (fqn, offsets, _) in chunk_of.items():
        w = written.items[key]
        storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(
            DATA_FILE, w.item_offset, w.item_length
        )
    for fqn, _ in byte_items:
        w = written.items[fqn]
        storage[MetadataIndex(fqn)] = _StorageInfo(DATA_FILE, w.item_offset, w.item_length)
    md.storage_data = storage
    md.planner_data = {fqn: tuple(p) for fqn, p in mappings.items()}
    blob = encode_metadata(
        pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL), to_json_bytes(manifest)
    )
    (root / DCP_METADATA_NAME).write_bytes(blob)
    return manifest, written
