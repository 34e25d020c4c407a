"""Checksums of checkpoint bytes: xxh3-64, written as 16 hex digits.

The lowest layer beside :mod:`quicksave.errors`: format, storage, persist and load all
hash bytes the same way through these few functions. Torch-free at import (the worker
process imports it).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def hexdigest(value: int) -> str:
    """An xxh3-64 integer digest as the manifest writes it: 16 lowercase hex digits."""
    return f"{value:016x}"


def tensor_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (kept valid by ``t``)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
