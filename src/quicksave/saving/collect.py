"""Collect: turn what the user passes (dicts, ``Stateful`` objects) into a state dict,
and check every leaf before any I/O happens.

The checks of one leaf live here (:func:`check_tensor`, :func:`whole_local`); the one
collector that walks a state dict with them, flattens it and encodes every plain value
at the call (its value then, not later) is ``rank_plans.collect_local``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from quicksave.errors import IncompatibleStateError
from quicksave.format.dtypes import check_storable


def to_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """Call ``state_dict()`` on top-level ``Stateful`` values (as DCP does)."""
    if not isinstance(state, Mapping):
        raise IncompatibleStateError(
            f"state_dict must be a mapping of names to values, got {type(state).__name__}"
        )
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def _is_tensor_like(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def iter_leaves(value: Any, prefix: str = ""):
    """Yield (fqn, leaf) like DCP's flattening: dicts and lists that hold tensors are
    traversed, anything else is a leaf."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from iter_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list) and any(
        _is_tensor_like(v) or isinstance(v, (Mapping, list)) for v in value
    ):
        for i, v in enumerate(value):
            yield from iter_leaves(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, value


def check_tensor(fqn: str, leaf: torch.Tensor, rank: int | None = None) -> None:
    """Raise IncompatibleStateError if quicksave cannot store this tensor's bytes."""
    local = leaf
    if type(leaf).__name__ == "ShardedTensor":
        # A Tensor subclass whose own attributes raise FutureWarnings; this rank
        # writes its local shards, which share one dtype and layout.
        shards = leaf.local_shards()
        if not shards:
            return
        local = shards[0].tensor
    elif hasattr(leaf, "to_local"):  # DTensor
        local = leaf.to_local()
    check_storable(local.dtype, fqn, rank)
    if local.layout != torch.strided:
        raise IncompatibleStateError(
            f"{local.layout} tensors are not supported; save .to_dense() instead",
            fqn=fqn,
            rank=rank,
        )
    if local.device.type == "meta":
        raise IncompatibleStateError(
            "tensor is on the meta device (it has no data); materialize it first",
            fqn=fqn,
            rank=rank,
        )


def whole_local(fqn: str, v: torch.Tensor) -> torch.Tensor:
    """The plain tensor a single-rank save stages for ``v``: ``v`` itself, or the local
    tensor of a DTensor on a one-rank mesh (FSDP2 or TP code run on one rank), which holds
    every element.

    Raises:
        IncompatibleStateError: a tensor split over several ranks (a multi-rank saver
            saves it), or another tensor subclass.
    """
    if type(v) is torch.Tensor or isinstance(v, torch.nn.Parameter):
        return v.detach()
    if type(v).__name__ == "DTensor":
        local = v.to_local()
        if v.device_mesh.size() == 1 and tuple(local.shape) == tuple(v.shape):
            return local.detach()
        raise IncompatibleStateError(
            f"this DTensor is split over {v.device_mesh.size()} ranks, and this saver saves "
            "one rank; build the saver with a dist_context (CheckpointManager does when the "
            "process group has several ranks) or save with quicksave.save",
            fqn=fqn,
        )
    raise IncompatibleStateError(
        f"{type(v).__name__} values are not saved by the single-rank engine; save them "
        "with quicksave.save, or pass plain tensors",
        fqn=fqn,
    )
