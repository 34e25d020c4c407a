"""Reading a committed checkpoint whole into host memory: every tensor at its global
shape (each stored chunk read straight into its box, its xxh3-64 checked), every object
decoded from typed JSON. What ``convert`` and the Hugging Face export start from."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch

from quicksave.checksum import tensor_view
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CorruptCheckpointError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_from_name, element_size
from quicksave.format.manifest import ChunkEntry, Manifest
from quicksave.loading.checkpoint import Checkpoint, require_committed
from quicksave.loading.chunks import (
    RUN_FOLDER,
    ChunkFiles,
    ChunkSource,
    Where,
    check_chunk_within,
    read_chunk_into,
)
from quicksave.loading.progress import byte_progress
from quicksave.storage import Location
from quicksave.storage.checkpoint_dir import CheckpointDir

Flat = dict[str, tuple[tuple[Any, ...], Any]]  # fqn -> (nested path, value)


def _open_data_files(files: ChunkFiles, m: Manifest) -> None:
    """Open every data file the tensors use (regular files only, in the checkpoint
    that holds each chunk) and check, before anything is allocated or read, that each
    holds its chunks and that the unsharded tensors fit in the bytes the files hold."""
    path = files.checkpoint.url
    sizes: dict[Where, int] = {}
    for fqn, t in sorted(m.tensors.items()):
        for c in t.chunks:
            rank = _rank_of(m, c)
            where = files.where(fqn, c)
            if where not in sizes:
                sizes[where] = files.open(where, fqn, rank).size
            with files.naming(where):
                check_chunk_within(c, sizes[where], files.url(where), fqn, rank)
    need = sum(
        volume(t.shape) * element_size(dtype_from_name(t.dtype, path=path, fqn=fqn))
        for fqn, t in m.tensors.items()
    )
    held = sum(sizes.values())
    if need > held:
        raise CorruptCheckpointError(
            f"the manifest's tensors need {need} bytes unsharded but the data files "
            f"hold {held}; refusing to allocate them",
            path=path,
        )


Select = Callable[[Manifest], Collection[str]]  # the manifest -> the fqns to read


def read_flat(
    loc: Location | Checkpoint,
    progress: bool,
    select: Select | None = None,
    *,
    chunks: ChunkSource = RUN_FOLDER,
) -> tuple[Flat, Manifest]:
    """The entries of the committed checkpoint at ``loc`` (classified here unless it is
    a :class:`~quicksave.loading.checkpoint.Checkpoint` already): all of them, or those that
    ``select`` picks once the manifest is read (the returned manifest then lists only
    those; nothing else is opened, allocated or read). Each chunk is read from the
    checkpoint that ``chunks`` says holds it (by default the checkpoint itself, or for a
    chunk reference the earlier checkpoint of its run folder: the result holds every
    byte, referring to nothing)."""
    with CheckpointDir(loc.location if isinstance(loc, Checkpoint) else loc) as d:
        checkpoint = require_committed(loc, backend=d.backend)
        m = read_manifest(d)
        with ChunkFiles(checkpoint, d.backend, chunks) as files:
            return _read_flat(files, m, progress, select)


def _read_flat(
    files: ChunkFiles, m: Manifest, progress: bool, select: Select | None
) -> tuple[Flat, Manifest]:
    path = files.checkpoint.url
    if select is not None:
        keep = set(select(m))
        m = dataclasses.replace(
            m,
            tensors={k: t for k, t in m.tensors.items() if k in keep},
            objects={k: o for k, o in m.objects.items() if k in keep},
        )
    flat: Flat = {}
    _open_data_files(files, m)
    with byte_progress(m.total_tensor_bytes(), "read", progress) as bar:
        for fqn, t in sorted(m.tensors.items()):
            dtype = dtype_from_name(t.dtype, path=path, fqn=fqn)
            covered = sum(volume(c.sizes) for c in t.chunks)
            # Zero only what no chunk will fill (FORMAT.md: chunks SHOULD cover).
            full = (
                torch.empty(t.shape, dtype=dtype)
                if covered == volume(t.shape)
                else torch.zeros(t.shape, dtype=dtype)
            )
            for c in t.chunks:
                rank = _rank_of(m, c)
                where = files.where(fqn, c)
                fpath = files.url(where)
                whole = tuple(c.sizes) == tuple(t.shape)
                buf = full if whole else torch.empty(c.sizes, dtype=dtype)
                view = tensor_view(buf)
                if len(view) != c.length:
                    raise CorruptCheckpointError(
                        f"chunk length {c.length} does not match its sizes {list(c.sizes)} "
                        f"of {t.dtype} ({len(view)} bytes)",
                        path=fpath,
                        fqn=fqn,
                        rank=rank,
                    )
                fd = files.open(where, fqn, rank)
                with files.naming(where):
                    read_chunk_into(fd, view, c, path=fpath, fqn=fqn, rank=rank)
                if not whole:
                    box = full
                    for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
                        box = box.narrow(dim, o, s)
                    box.copy_(buf)
                bar.update(c.length)
            flat[fqn] = (t.path or (fqn,), full)
    for fqn, o in sorted(m.objects.items()):
        flat[fqn] = (o.path or (fqn,), objcodec.decode(o.value, fqn=fqn, path=path))
    return flat, m


def _rank_of(m: Manifest, c: ChunkEntry) -> int | None:
    """The rank that wrote the file of chunk ``c``, for errors (a file of a base that
    ``m`` does not list: unknown)."""
    entry = m.files.get(c.file)
    return None if entry is None else entry.rank


def volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
