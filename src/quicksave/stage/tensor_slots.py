"""Stage: the slot layout of a staging pool that holds plain tensors instead of file images.

A slot layout places every tensor of a rank back to back, each at a 64-byte aligned
offset, with its dtype and shape (:func:`slot_layout`, pure). A ``StagingPool`` built for
it writes no headers; its tensors are copied into the slots (``StagingPool.stage_slots``)
and read back as tensors over the pool's bytes (:func:`slot_tensors`, no copy).

This is the staging pool's generic layout for plain tensors, beside the file images of
the engine; it lives in ``stage/``, below ``compat/``, because ``StagingPool`` and the
worker process use it. The NVRx-compatible ``FileSystemWriterAsync``
(``quicksave.compat.nvrx``) and ``TorchAsyncCheckpoint`` stage in this layout, in the
trainer; the worker process that writes the files maps the same pool (it travels
pickled as one file descriptor) and calls :func:`slot_tensors` there. No collective.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SLOT_ALIGN = 64  # every slot starts at a multiple of this (a cache line)


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the pool."""

    key: str
    offset: int  # pool offset of the tensor's byte 0
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class SlotLayout:
    """Every tensor of a rank in its slot; ``nbytes`` is the pool size it needs (whole
    pages, at least one)."""

    slots: tuple[Slot, ...]
    nbytes: int


def slot_layout(sources: Mapping[str, torch.Tensor]) -> SlotLayout:
    """Place every tensor of ``sources`` (any device, any strides) in a 64-byte aligned
    slot, in the mapping's order. Pure."""
    slots = []
    cur = 0
    for key, t in sources.items():
        slot = Slot(key, cur, t.dtype, tuple(t.shape))
        slots.append(slot)
        cur += -(-slot.nbytes // SLOT_ALIGN) * SLOT_ALIGN
    pages = max(1, -(-cur // mmap.PAGESIZE))
    return SlotLayout(tuple(slots), pages * mmap.PAGESIZE)


def slot_tensors(memory: mmap.mmap, layout: SlotLayout) -> dict[str, torch.Tensor]:
    """key -> a tensor over the bytes of its slot in ``memory`` (no copy) whose storage is
    exactly that tensor's bytes, not the whole pool: ``torch.save`` writes a tensor's
    whole storage, so this is how it writes what DCP writes for the tensor.

    Each tensor is made over a ``memoryview`` of its slot, which it holds: the mapping
    cannot be closed under it (``mmap.close`` raises ``BufferError`` while one lives; a
    tensor made straight over the ``mmap`` would not hold it) and is unmapped when the
    last of them and the ``mmap`` object are garbage."""
    whole = memoryview(memory)
    out: dict[str, torch.Tensor] = {}
    for s in layout.slots:
        if s.numel == 0:
            out[s.key] = torch.empty(s.shape, dtype=s.dtype)
            continue
        flat = torch.frombuffer(whole[s.offset : s.offset + s.nbytes], dtype=s.dtype)
        out[s.key] = flat.view(s.shape)
    return out
