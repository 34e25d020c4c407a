"""Persist: write a rank's data files exactly as the plan laid them out.

One thread per data file; each file is written front to back with large ``pwrite``
calls straight from the tensors' memory (no serialization, no intermediate copy), the
xxh3-64 of every chunk computed on the same pass, then ``fsync``. The gaps between
aligned chunks are left as holes, which read back as zeros; a ``dcp_compat`` layout's
torch legacy prefixes (``FileLayout.fixed``) are written with the header.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from quicksave.checksum import hexdigest, tensor_view
from quicksave.errors import CheckpointError
from quicksave.storage.backend import join
from quicksave.storage.posix_io import WRITE_PIECE, os_error

if TYPE_CHECKING:  # the worker process imports this module: keep torch out of it
    import torch

    from quicksave.saving.plan import EntryLayout, FileLayout, RankLayout
    from quicksave.storage.backend import Backend


def as_writable_source(t: torch.Tensor) -> torch.Tensor:
    """Detached, contiguous, on the CPU; copies only when it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    header_xxh3_64: str
    chunk_xxh3_64: dict[str, str]  # safetensors key -> digest


def _entry_bytes(
    source: Callable[[str], torch.Tensor], entry: EntryLayout, path: str, rank: int
) -> tuple[torch.Tensor, memoryview]:
    """The tensor of a planned chunk and a view of its bytes (valid while the tensor
    lives: keep both), checked against the plan's length."""
    t = as_writable_source(source(entry.item.key))
    view = tensor_view(t)
    if len(view) != entry.length:
        raise CheckpointError(
            f"tensor has {len(view)} bytes but the plan expects {entry.length}; "
            "was the state dict modified during save?",
            path=path,
            fqn=entry.item.fqn,
            rank=rank,
        )
    return t, view


def _each_file(
    layout: RankLayout, one: Callable[[FileLayout], WrittenFile], name: str
) -> list[WrittenFile]:
    """``one(file)`` for every data file of ``layout``, one thread per file."""
    if not layout.files:
        return []
    if len(layout.files) == 1:
        return [one(layout.files[0])]
    with ThreadPoolExecutor(len(layout.files), thread_name_prefix=name) as pool:
        return [f.result() for f in [pool.submit(one, f) for f in layout.files]]


def write_file(
    directory: str,
    layout: FileLayout,
    source: Callable[[str], torch.Tensor],
    fsync: bool = True,
) -> WrittenFile:
    """Write one data file. ``source(key)`` returns the tensor for a chunk key."""
    path = os.path.join(directory, layout.name)
    digests: dict[str, str] = {}
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644
        )
    except OSError as e:
        raise os_error(e, path, layout.rank) from e
    try:
        os.pwrite(fd, layout.header, 0)
        for off, fixed in layout.fixed:  # torch legacy prefixes (dcp_compat layouts)
            os.pwrite(fd, fixed, off)
        for entry in layout.entries:
            key = entry.item.key
            t, view = _entry_bytes(source, entry, path, layout.rank)
            h = xxhash.xxh3_64()
            pos = 0
            while pos < entry.length:
                piece = view[pos : pos + WRITE_PIECE]
                h.update(piece)
                written = 0
                while written < len(piece):
                    written += os.pwrite(fd, piece[written:], entry.offset + pos + written)
                pos += len(piece)
            digests[key] = hexdigest(h.intdigest())
        os.ftruncate(fd, layout.size)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        raise os_error(e, path, layout.rank) from e
    finally:
        os.close(fd)
    return WrittenFile(layout.name, layout.size, layout.header_xxh3_64, digests)


def write_rank_files(
    directory: str,
    layout: RankLayout,
    tensors: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
    fsync: bool = True,
) -> list[WrittenFile]:
    """Write all data files of one rank in parallel (one thread per file)."""
    source = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    return _each_file(layout, lambda f: write_file(directory, f, source, fsync), "quicksave-write")


def write_rank_objects(
    backend: Backend,
    prefix: str,
    layout: RankLayout,
    tensors: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
) -> list[WrittenFile]:
    """Store all data files of one rank as objects under ``prefix`` on an object store,
    one thread per file: each file's image (header, tensor bytes at their offsets, zeros
    between) is assembled in memory, then uploaded by ``backend.put``, which hashes every
    chunk on the way. (The asynchronous engine uploads straight from its staging pool
    instead; this is the synchronous ``quicksave.save`` path.)"""
    source = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors

    def one(layout_: FileLayout) -> WrittenFile:
        key = join(prefix, layout_.name)
        image = bytearray(layout_.size)
        view = memoryview(image)
        view[: len(layout_.header)] = layout_.header
        for off, fixed in layout_.fixed:  # torch legacy prefixes (dcp_compat layouts)
            view[off : off + len(fixed)] = fixed
        for entry in layout_.entries:
            # t keeps src's memory alive while it is copied
            t, src = _entry_bytes(source, entry, backend.url(key), layout_.rank)
            view[entry.offset : entry.offset + entry.length] = src
        ranges = [(e.item.key, e.offset, e.length) for e in layout_.entries]
        digests = backend.put(key, view, ranges=ranges)
        return WrittenFile(layout_.name, layout_.size, layout_.header_xxh3_64, digests)

    return _each_file(layout, one, "quicksave-put")
