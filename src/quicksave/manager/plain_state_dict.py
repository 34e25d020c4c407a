"""Collect, on every save: the model's and an optimizer's state dicts exactly as
``torch.distributed.checkpoint.state_dict`` returns them, without its per-call walks
when the model is *plain*.

DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` first derive, on every
call, each parameter's fully qualified name by walking the module tree once per
parameter (``_verify_options``, ``_get_fqns``), so that wrappers (DDP, FSDP,
``torch.compile``, ``_fqn_modifiers``, activation checkpointing) are seen through. For
a plain model that renaming is the identity: the names are ``named_parameters()``'s
and ``state_dict()``'s own. Here the model is checked to be plain (every module, on
every call: nothing is remembered between calls, so nothing can go stale) and the
state dicts are then built from the live objects in one pass:

- the model's: ``model.state_dict()`` itself (the call DCP makes too, so the same keys
  and the same detached tensors);
- an optimizer's, flattened (``flatten_optimizer_state_dict=True``): each entry of
  ``optimizer.state`` under ``state.<fqn>.<key>`` (nested dicts joined with dots) and
  each param group's settings under ``param_groups.<fqn>.<key>``, in DCP's order and
  with its values (the optimizer's own tensors and objects, not copies).

Anything else takes DCP's path (the functions return None): a module that is a
wrapper, has state-dict hooks or its own ``state_dict`` / ``_save_to_state_dict``,
DTensor parameters (FSDP2, tensor parallel), an optimizer with state-dict hooks, its
own ``state_dict``, no state yet (DCP creates it), a parameter that appears twice or
is not the model's, or a state value DCP refuses to flatten; DCP then returns its
result or raises its error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

# names DCP's fqn derivation rewrites (FSDP's flat parameter, activation checkpointing)
_REWRITTEN = ("_flat_param", "_checkpoint_wrapped_module")
_WRAPPERS = (DistributedDataParallel, FullyShardedDataParallel)
_LEAVES = (torch.Tensor, int, float)  # what DCP's flattening accepts besides dicts
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """DCP's ``get_model_state_dict(model)``: built here for a plain model, else DCP's."""
    state = plain_model_state_dict(model)
    return get_model_state_dict(model) if state is None else state


def optimizer_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's ``get_optimizer_state_dict(model, optim, options=FLAT)`` (flattened): built
    here for a plain model and an optimizer holding state, else DCP's."""
    state = plain_optimizer_state_dict(model, optim)
    return get_optimizer_state_dict(model, optim, options=FLAT) if state is None else state


def _plain_class(cls: type) -> bool:
    return (
        not issubclass(cls, _WRAPPERS)
        and cls.state_dict is nn.Module.state_dict
        and cls._save_to_state_dict is nn.Module._save_to_state_dict
        and not hasattr(cls, "_fqn_modifiers")
    )


def is_plain(model: nn.Module) -> bool:
    """True if DCP's names of ``model``'s parameters and buffers are their
    ``state_dict()`` names: no module of it is a wrapper (DDP, FSDP, a compiled
    module's ``_orig_mod``), renames keys (``_fqn_modifiers``, state-dict hooks, its own
    ``state_dict`` / ``_save_to_state_dict``)."""
    verdicts: dict[type, bool] = {}
    for module in model.modules():
        cls = type(module)
        plain = verdicts.get(cls)
        if plain is None:
            plain = verdicts[cls] = _plain_class(cls)
        own = module.__dict__
        if (
            not plain
            or module._state_dict_hooks
            or module._state_dict_pre_hooks
            or "_orig_mod" in module._modules
            or "_fqn_modifiers" in own
            or "state_dict" in own
            or "_save_to_state_dict" in own
        ):
            return False
    return True


def plain_model_state_dict(model: nn.Module) -> dict[str, Any] | None:
    """``get_model_state_dict(model)`` of a plain model (same keys, values and
    tensors); None where DCP's path must be taken (see the module docstring)."""
    if not is_plain(model):
        return None
    with torch.no_grad():
        state = model.state_dict()
    if not state:
        return None  # DCP refuses an empty model state dict
    for key, value in state.items():
        if isinstance(value, DTensor) or any(name in key for name in _REWRITTEN):
            return None
    return state


def plain_optimizer_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """``get_optimizer_state_dict(model, optim, options=StateDictOptions(
    flatten_optimizer_state_dict=True))`` for a plain model and an optimizer that
    holds state (same keys in the same order, the optimizer's own values); None where
    DCP's path must be taken (see the module docstring)."""
    if (
        not optim.state
        or type(optim).state_dict is not torch.optim.Optimizer.state_dict
        or "state_dict" in optim.__dict__
        or optim._optimizer_state_dict_pre_hooks
        or optim._optimizer_state_dict_post_hooks
        or not is_plain(model)
    ):
        return None
    fqns: dict[int, str] = {}
    params = []  # held, so that no id in ``fqns`` is reused during this call
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) or any(n in name for n in _REWRITTEN):
            return None
        fqns[id(param)] = name
        params.append(param)
    grouped: dict[int, str] = {}  # the optimizer's parameters: id -> fqn
    for group in optim.param_groups:
        for param in group["params"]:
            fqn = fqns.get(id(param))
            if fqn is None or id(param) in grouped:
                return None  # not the model's (DCP fails), or in two places
            grouped[id(param)] = fqn
    flat: dict[str, Any] = {}
    for param, entry in optim.state.items():
        fqn = grouped.get(id(param)) if isinstance(param, torch.Tensor) else None
        if fqn is None or not _flatten_into(flat, f"state.{fqn}", entry):
            return None
    for group in optim.param_groups:
        settings = [(k, v) for k, v in group.items() if k != "params"]
        for param in group["params"]:
            fqn = grouped[id(param)]
            for key, value in settings:
                flat[f"param_groups.{fqn}.{key}"] = value
    return flat or None


def _flatten_into(flat: dict[str, Any], prefix: str, entry: Any) -> bool:
    """Add ``entry`` (a parameter's optimizer state) to ``flat`` as DCP flattens it:
    ``<prefix>.<key>``, nested dicts joined with dots; False on a value DCP refuses."""
    if not isinstance(entry, dict):
        return False
    for key, value in entry.items():
        full = f"{prefix}.{str(key)}"
        if isinstance(value, dict):
            if not _flatten_into(flat, full, value):
                return False
        elif isinstance(value, _LEAVES):
            flat[full] = value
        else:
            return False
    return True
