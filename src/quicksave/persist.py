"""Persist: write a rank's data files exactly as the plan laid them out.

One thread per data file; each file is written front to back with large ``pwrite``
calls straight from the tensors' memory (no serialization, no intermediate copy), the
xxh3-64 of every chunk computed on the same pass, then ``fsync``. The gaps between
aligned chunks are left as holes, which read back as zeros; a ``dcp_compat`` layout's
torch legacy prefixes (``FileLayout.fixed``) are written with the header.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from .errors import CheckpointError
from .format.manifest import hexdigest
from .storage.backend import join

if TYPE_CHECKING:  # the worker process imports this module: keep torch out of it
    import torch

    from .plan import EntryLayout, FileLayout, RankLayout
    from .storage.backend import Backend

WRITE_PIECE = 64 << 20  # bytes per pwrite: large enough to stream, small enough to hash in cache


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (kept valid by ``t``)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


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


def _os_error(e: OSError, path: str, rank: int) -> CheckpointError:
    name = errno.errorcode.get(e.errno or 0, "EIO")
    return CheckpointError(
        f"writing checkpoint data failed: {name} ({e.strerror})", path=path, rank=rank
    )


def _entry_bytes(
    source: Callable[[str], torch.Tensor], entry: EntryLayout, path: str, rank: int
) -> tuple[torch.Tensor, memoryview]:
    """The tensor of a planned chunk and a view of its bytes (valid while the tensor
    lives: keep both), checked against the plan's length."""
    t = as_writable_source(source(entry.item.key))
    view = byte_view(t)
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
        raise _os_error(e, path, layout.rank) from e
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
        raise _os_error(e, path, layout.rank) from e
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


def write_image(
    path: str,
    image: memoryview,
    size: int,
    entries: list[tuple[str, int, int]],
    *,
    rank: int,
    fsync: bool = True,
    o_direct: bool = False,
    rate: float | None = None,
) -> dict[str, str]:
    """Write a file whose exact bytes are ``image[:size]`` (a staged file image) and return
    the xxh3-64 of every ``(key, offset, length)`` entry, hashed piece by piece as written.

    ``rate`` (bytes/s) paces the writes: after each piece the writer sleeps until the
    bytes written so far are not ahead of ``rate`` (None: as fast as the disk goes).

    With ``o_direct`` the file is written with ``O_DIRECT`` (the page cache is bypassed: no
    kernel copy, less CPU taken from training) in page-aligned pieces of ``image``, which
    must then extend to a multiple of 4096 bytes past ``size``; the file is truncated to
    ``size`` afterwards. Falls back to buffered writes where the filesystem refuses it.
    """
    aligned = (size + 4095) // 4096 * 4096
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = o_direct and hasattr(os, "O_DIRECT") and len(image) >= aligned
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise _os_error(e, path, rank) from e
        direct = False
        fd = os.open(path, flags, 0o644)
    digests: dict[str, str] = {}
    todo = sorted(entries, key=lambda e: e[1])
    hashers = {key: xxhash.xxh3_64() for key, _, _ in todo}
    end = aligned if direct else size
    began = time.monotonic()
    try:
        pos = 0
        while pos < end:
            if rate and pos:
                ahead = pos / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
            stop = min(pos + WRITE_PIECE, end)
            for key, off, length in todo:
                lo, hi = max(off, pos), min(off + length, stop)
                if lo < hi:
                    hashers[key].update(image[lo:hi])
            while pos < stop:
                try:
                    pos += os.pwrite(fd, image[pos:stop], pos)
                except OSError as e:
                    if not direct or e.errno != errno.EINVAL:
                        raise
                    # the filesystem takes O_DIRECT at open but not for writes: go buffered
                    os.close(fd)
                    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                    direct, end = False, size
                    stop = min(stop, end)
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        raise _os_error(e, path, rank) from e
    finally:
        os.close(fd)
    for key, _, _ in todo:
        digests[key] = hexdigest(hashers[key].intdigest())
    return digests


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
