"""Staging of one rank's tensors for ``FileSystemWriterAsync``: copies in ONE shared-memory
pool that travels to the checkpoint worker as one handle.

Order of calls: (trainer, ``prepare_write_data``) :func:`stage_to_pool` copies every
tensor into a pool (an earlier finalized save's pool when it is large enough) and returns
the :class:`StagedPool`; it is the ``preload_fn``'s result (:func:`identity_preload`:
staging already happened) and ``save_fn``'s second argument; (worker) :func:`tensors_of`
gives the tensors over the pool's bytes; (trainer, at finalize) the writer hands the pool
back for reuse. No collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def identity_preload(staged: Any) -> Any:
    # Staging (device-to-host) already happened in prepare_write_data, in the trainer.
    return staged


_POOL_ALIGN = 64


def tensors_of(staged: StagedPool | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def stage_to_pool(
    sources: dict[str, torch.Tensor], take_pool: Callable[[int], torch.Tensor | None]
) -> StagedPool:
    """Copy every tensor of ``sources`` into one shared-memory pool (64-byte aligned
    slots): the pool ``take_pool(total bytes)`` gives (a free pool large enough, or
    None), else a new one."""
    entries: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    total = 0
    for key, t in sources.items():
        entries[key] = (total, t.dtype, tuple(t.shape))
        nbytes = t.numel() * t.element_size()
        total += -(-nbytes // _POOL_ALIGN) * _POOL_ALIGN
    pool = take_pool(total)
    if pool is None:
        storage = torch.UntypedStorage._new_shared(max(total, 1))
        pool = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    for key, t in sources.items():
        offset, dtype, shape = entries[key]
        nbytes = t.numel() * t.element_size()
        if nbytes:
            dst = pool[offset : offset + nbytes].view(dtype).view(shape)
            dst.copy_(t)
    return StagedPool(pool, entries)
