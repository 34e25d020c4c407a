"""Staging of one rank's tensors for ``FileSystemWriterAsync``: copies in ONE shared-memory
``StagingPool`` (tensor slots, ``quicksave.stage``) that travels to the checkpoint worker
as one handle.

Order of calls: (trainer, ``prepare_write_data``) :func:`stage_to_pool` lays the tensors
out in slots, takes a pool (an earlier finalized save's pool when it is large enough, or
a new one) and copies every tensor into it; the pool is the ``preload_fn``'s result
(:func:`identity_preload`: staging already happened) and ``save_fn``'s second argument;
(worker) :func:`tensors_of` gives the tensors over the pool's bytes; (trainer, at
finalize) the writer hands the pool back for reuse. No collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quicksave.stage.pool import StagingPool
from quicksave.stage.tensor_slots import SlotLayout, slot_layout


def identity_preload(staged: Any) -> Any:
    # Staging (device-to-host) already happened in prepare_write_data, in the trainer.
    return staged


def tensors_of(staged: StagingPool | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The staged tensors: those over a pool's slots, or a plain dict as it is."""
    return staged.tensors() if isinstance(staged, StagingPool) else staged


def stage_to_pool(
    sources: dict[str, torch.Tensor], take_pool: Callable[[SlotLayout], StagingPool | None]
) -> StagingPool:
    """Copy every tensor of ``sources`` into one shared-memory pool (64-byte aligned
    slots): the pool ``take_pool(layout)`` gives (a free pool that adopted the layout, or
    None), else a new one.

    Raises:
        CheckpointError: a new pool cannot be allocated (names the size).
    """
    layout = slot_layout(sources)
    pool = take_pool(layout)
    if pool is None:
        pool = StagingPool(layout)
    try:
        pool.stage_slots(sources)
    except BaseException:
        pool.close()
        raise
    return pool
