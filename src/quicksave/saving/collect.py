"""Collect: turn what the user passes (dicts, ``Stateful`` objects) into a state dict,
and check every leaf before any I/O happens.

The async engine's single-rank saves collect with :func:`collect_state` (training
thread, first step of ``save()`` and of ``prepare()``): flatten, check each tensor, and
encode every plain value now — its value at the call, not later."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from quicksave.errors import IncompatibleStateError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import check_storable
from quicksave.format.keys import names_itself
from quicksave.saving import keypaths


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


@dataclass(frozen=True)
class CollectedState:
    """A state dict flattened for a single-rank save."""

    tensors: dict[str, torch.Tensor]  # fqn -> the plain tensor to stage
    sources: dict[str, torch.Tensor]  # fqn -> the tensor whose version counter tracks it
    objects: dict[str, Any]  # fqn -> encoded plain value
    paths: dict[str, tuple]  # fqn -> key path, where the fqn does not name it alone
    empty: tuple[tuple, ...]  # paths of the empty dicts


def collect_state(state_dict: Mapping[str, Any], final: str, rank: int) -> CollectedState:
    """Flatten ``state_dict`` for a single-rank save to ``final`` (named in errors).

    Raises:
        IncompatibleStateError: a value that cannot be saved (before any I/O).
    """
    try:
        nested = to_state_dict(state_dict)
        flat, all_paths, empty = keypaths.flatten_with_paths(nested, rank)
        tensors: dict[str, torch.Tensor] = {}
        sources: dict[str, torch.Tensor] = {}
        objects: dict[str, Any] = {}
        for fqn, v in flat.items():
            if isinstance(v, torch.Tensor):
                check_tensor(fqn, v, rank)
                tensors[fqn] = whole_local(fqn, v)
                sources[fqn] = v
            else:
                # Encoding is also the check; done once, with the value of this moment.
                objects[fqn] = objcodec.encode(v, fqn)
    except IncompatibleStateError as e:
        raise IncompatibleStateError(e.message, path=final, fqn=e.fqn, rank=rank) from None
    paths = {fqn: p for fqn, p in all_paths.items() if not names_itself(p, fqn)}
    return CollectedState(tensors, sources, objects, paths, tuple(empty))


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
