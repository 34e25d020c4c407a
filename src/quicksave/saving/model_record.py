"""What a checkpoint records about its model, for exports that know nothing else.

The manager adds two entries to the ``user_metadata`` of every checkpoint it writes
(FORMAT.md §2.1 leaves that mapping to the writer):

- ``model_states``: the names of the states that hold the model (its ``ModelState``
  entries, or the entry named ``"model"``), so that an export can take the model out of
  a full checkpoint that also holds optimizer, RNG and data-loader state;
- ``tied_weights``: per model state, the groups of keys that were one tensor when the
  state was saved (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), each group
  in the state's own order. The bytes of a checkpoint cannot show that two tensors were
  one, and equal values do not prove it (fresh LayerNorm weights are all ones); a
  Hugging Face export drops all but the first key of each group, as ``save_pretrained``
  does, and ``from_pretrained`` ties them again.

Pure functions over state dicts (no I/O, no collectives).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

MODEL_STATES_KEY = "model_states"
TIED_WEIGHTS_KEY = "tied_weights"

AliasKey = tuple[str, int, tuple[int, ...], tuple[int, ...], torch.dtype]
# tensor types whose data_ptr() is their own memory's address (not a DTensor's wrapper)
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def floating_dtype(value: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """``value`` (a ``torch.dtype`` or its name: ``"bfloat16"``, ``"float32"``, ...) as
    a floating ``torch.dtype``.

    Raises:
        CheckpointError: ``value`` names no floating dtype (the message says ``what``).
    """
    from quicksave.errors import CheckpointError

    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(
            f"{what} must be a torch floating dtype or its name (e.g. 'float32', "
            f"'bfloat16', torch.float16), got {value!r}"
        )
    return dtype


def alias_key(t: torch.Tensor) -> AliasKey | None:
    """Equal for two tensors that are the same view of the same memory (a DTensor by
    its local shard); None for a tensor with no memory (empty, or on ``meta``)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (
        str(local.device),
        local.data_ptr(),
        tuple(local.shape),
        tuple(local.stride()),
        local.dtype,
    )


def tied_groups(state: Mapping[str, Any]) -> list[list[str]]:
    """The keys of ``state`` (one model's flat state dict) whose tensors are one tensor,
    grouped, in the state's order: ``[["transformer.wte.weight", "lm_head.weight"]]``.

    Tied tensors start at one address, so only tensors whose address another tensor
    shares are compared by their whole :func:`alias_key`; the addresses of plain tensors
    are read in one pass (``alias_key`` per tensor costs ~100x more: ``str(device)``,
    shape, strides), so a state of thousands of untied tensors costs one list and one
    set."""
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    tensors = [state[k] for k in keys]
    picked = list(zip(keys, tensors, strict=True))
    if set(map(type, tensors)) <= _PLAIN:
        try:
            ptrs = list(map(torch.Tensor.data_ptr, tensors))
        except RuntimeError:  # a layout without one address (sparse): compare them all
            ptrs = None
        if ptrs is not None:
            if len(set(ptrs)) == len(ptrs):
                return []
            seen: set[int] = set()
            shared = {p for p in ptrs if p in seen or seen.add(p)}  # (add returns None)
            picked = [kt for kt, p in zip(picked, ptrs, strict=True) if p in shared]
    groups: dict[AliasKey, list[str]] = {}
    for key, value in picked:
        if (k := alias_key(value)) is not None:
            groups.setdefault(k, []).append(str(key))
    return [names for names in groups.values() if len(names) > 1]


def model_record(state_dict: Mapping[str, Any], model_states: Iterable[str]) -> dict[str, Any]:
    """The ``user_metadata`` entries that describe the model states of ``state_dict``
    (those of ``model_states`` that it holds): their names, and their tied keys where
    any are tied."""
    names = [n for n in model_states if isinstance(state_dict.get(n), Mapping)]
    record: dict[str, Any] = {MODEL_STATES_KEY: names}
    tied = {n: groups for n in names if (groups := tied_groups(state_dict[n]))}
    if tied:
        record[TIED_WEIGHTS_KEY] = tied
    return record


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor (in nested mappings) cast to ``dtype``;
    tensors that were one tensor (tied weights) are still one tensor after the cast."""
    done: dict[AliasKey, torch.Tensor] = {}

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if not v.is_floating_point():
                return v
            key = alias_key(v)
            if key is None:
                return v.to(dtype)
            if key not in done:
                done[key] = v.to(dtype)
            return done[key]
        if isinstance(v, Mapping):
            return {k: cast(x) for k, x in v.items()}
        return v

    return cast(value)
