"""Persist: write a rank's data files exactly as the plan laid them out, from the
tensors (the synchronous path: ``quicksave.save``, the DCP writer, the NVRx API).

One thread per data file; each file goes to the backend as pieces (header, a
``dcp_compat`` layout's torch legacy prefixes, every chunk at its offset): a filesystem
writes them with large ``pwrite`` calls straight from the tensors' memory (no
serialization, no intermediate copy; the gaps between aligned chunks are holes, read
back as zeros), a store uploads the assembled image; the xxh3-64 of every chunk is
computed on the same pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quicksave.checksum import tensor_view
from quicksave.errors import CheckpointError
from quicksave.storage.backend import join

if TYPE_CHECKING:  # the worker process imports this module: keep torch out of it
    import torch

    from quicksave.layout.plan import EntryLayout, FileLayout, RankLayout
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
    backend: Backend,
    draft: str,
    layout: FileLayout,
    source: Callable[[str], torch.Tensor],
) -> WrittenFile:
    """Write one data file under ``draft`` (``backend.put_pieces``: on a filesystem
    straight from the tensors' memory; a store uploads its assembled image). ``source(key)``
    returns the tensor for a chunk key."""
    key = join(draft, layout.name)

    def pieces() -> Iterator[tuple[str | None, int, memoryview]]:
        yield None, 0, memoryview(layout.header)
        for off, fixed in layout.fixed:  # torch legacy prefixes (dcp_compat layouts)
            yield None, off, memoryview(fixed)
        for entry in layout.entries:
            # t keeps the bytes alive until the next piece is asked for
            t, view = _entry_bytes(source, entry, backend.url(key), layout.rank)
            yield entry.item.key, entry.offset, view
            del t

    digests = backend.put_pieces(key, layout.size, pieces())
    return WrittenFile(layout.name, layout.size, layout.header_xxh3_64, digests)


def write_rank(
    backend: Backend,
    draft: str,
    layout: RankLayout,
    tensors: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
) -> list[WrittenFile]:
    """Write all data files of one rank under ``draft`` (its commit strategy's
    draft key), one thread per file. (The asynchronous engine writes from its staging
    pool instead: ``quicksave.worker.files``; this is the synchronous path.)"""
    source = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
    return _each_file(layout, lambda f: write_file(backend, draft, f, source), "quicksave-write")
