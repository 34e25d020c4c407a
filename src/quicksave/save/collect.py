"""Collect: turn what the user passes (dicts, ``Stateful`` objects) into a state dict,
and check every leaf before any I/O happens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from quicksave.errors import IncompatibleStateError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import check_storable
from quicksave.save import keypaths


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


DUPLICATE_FQN = (
    "two values get this name (dict keys whose str() is the same, e.g. 0 and '0', are "
    "named alike when the state dict is flattened); rename one"
)


def flatten(
    nested: Mapping[str, Any], rank: int | None = None
) -> tuple[dict[str, Any], dict[str, tuple]]:
    """DCP's ``flatten_state_dict`` (fqn -> leaf, fqn -> path), its duplicate-name
    ``ValueError`` turned into an IncompatibleStateError naming the fqn."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    try:
        return flatten_state_dict(nested)
    except ValueError as e:  # "duplicated flatten key <fqn>"
        raise _duplicate(e, rank) from None


def flatten_with_paths(
    nested: Mapping[str, Any], rank: int | None = None
) -> tuple[dict[str, Any], dict[str, tuple], list[tuple]]:
    """:func:`flatten` and ``keypaths.structure`` in one walk (``keypaths.
    flatten_with_paths``): fqn -> leaf, fqn -> typed path, the empty dicts' paths."""
    try:
        return keypaths.flatten_with_paths(nested)
    except ValueError as e:
        raise _duplicate(e, rank) from None


def _duplicate(e: ValueError, rank: int | None) -> IncompatibleStateError:
    fqn = str(e).removeprefix("duplicated flatten key ")
    return IncompatibleStateError(DUPLICATE_FQN, fqn=fqn, rank=rank)


def validate_for_save(state_dict: Mapping[str, Any], rank: int | None = None) -> None:
    """Raise IncompatibleStateError for anything quicksave cannot store, naming the fqn."""
    seen: set[str] = set()
    for fqn, leaf in iter_leaves(state_dict):
        if fqn in seen:
            raise IncompatibleStateError(DUPLICATE_FQN, fqn=fqn, rank=rank)
        seen.add(fqn)
        if isinstance(leaf, torch.Tensor):
            check_tensor(fqn, leaf, rank)
        else:
            try:
                objcodec.encode(leaf, fqn)
            except IncompatibleStateError as e:
                raise IncompatibleStateError(e.message, fqn=fqn, rank=rank) from None
