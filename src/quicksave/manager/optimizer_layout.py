"""The state an optimizer's first step creates, known before that step.

A manager is usually built before training starts, when the optimizers hold no state
yet (torch creates AdamW's moments lazily, at the first ``step()``). The staging pool
depends on the full state's names, dtypes and shapes, so without this module it could
only be built after every optimizer has stepped once. For the optimizers whose lazy
state is known — it is a function of the parameters and the hyper-parameters — this
module says what the first step will create, and lends the optimizer stand-ins of that
layout for as long as the state is collected to plan the pool:

* ``Adam`` / ``AdamW``: per parameter that gets a gradient, ``step`` (a 0-dim tensor:
  ``float32`` on the parameter's device with ``capturable`` or ``fused``, else on the
  CPU in the scalar dtype, ``float64`` only when that is torch's default dtype), then
  ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``) like the
  parameter;
* ``SGD`` with momentum: ``momentum_buffer`` like the parameter (without momentum SGD
  keeps no state, and nothing is predicted).

Anything else (other optimizers, subclasses, whose ``step`` may differ, and parameters
that are tensor subclasses such as DTensors) is unknown: the
pool is then planned after the first step. A prediction is only a guess of
the plan: parameters that get no gradient at the first step get no state, and the
prediction is then wrong. :func:`matches` checks it against the real state once it
exists, and the engine rebuilds a pool whose plan is not the one a save needs; a wrong
guess costs a pool build, never a wrong checkpoint.

The stand-ins are zero-stride views of one zero (no memory per parameter); they are in
the optimizer's ``state`` only inside :func:`stand_ins`, on the calling thread, and the
state is exactly as it was (empty) when it returns.

Call order (training thread): ``first_step_state`` → ``stand_ins`` around one
collection of the state → after the first real step, ``matches``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Predicted", "StateSpec", "first_step_state", "matches", "stand_ins"]


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a parameter's optimizer state: its key, shape, dtype and device."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


# (parameter, its state tensors in the order the step creates them), per parameter in
# the order the step creates their state
Predicted = list[tuple[torch.Tensor, tuple[StateSpec, ...]]]


def _like(key: str, p: torch.Tensor) -> StateSpec:
    return StateSpec(key, tuple(p.shape), p.dtype, p.device)


def _adam(group: dict, p: torch.Tensor) -> tuple[StateSpec, ...]:
    if group.get("capturable") or group.get("fused"):
        step = StateSpec("step", (), torch.float32, p.device)
    else:
        wide = torch.get_default_dtype() == torch.float64
        step = StateSpec("step", (), torch.float64 if wide else torch.float32, torch.device("cpu"))
    moments = [_like("exp_avg", p), _like("exp_avg_sq", p)]
    if group.get("amsgrad"):
        moments.append(_like("max_exp_avg_sq", p))
    return (step, *moments)


def _sgd(group: dict, p: torch.Tensor) -> tuple[StateSpec, ...]:
    return (_like("momentum_buffer", p),) if group.get("momentum") else ()


# exact types only: a subclass may create other state
_KNOWN = {torch.optim.Adam: _adam, torch.optim.AdamW: _adam, torch.optim.SGD: _sgd}


def first_step_state(optimizer: torch.optim.Optimizer) -> Predicted | None:
    """The state ``optimizer``'s first step will create, assuming every parameter that
    requires a gradient gets one; None if that is not known (an optimizer not listed in
    this module's docstring, one that holds state already, or one whose first step
    creates none)."""
    layout = _KNOWN.get(type(optimizer))
    if layout is None or optimizer.state:
        return None
    out: Predicted = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or id(p) in seen:
                continue
            if type(p.detach()) is not torch.Tensor:
                return None  # a DTensor or other subclass: its state is one too
            seen.add(id(p))
            specs = layout(group, p)
            if specs:
                out.append((p, specs))
    return out or None


def _stand_in(spec: StateSpec) -> torch.Tensor:
    return torch.zeros((), dtype=spec.dtype, device=spec.device).expand(spec.shape)


@contextlib.contextmanager
def stand_ins(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[list[Predicted] | None]:
    """Inside: every one of ``optimizers`` holds zero-stride stand-ins of the state its
    first step will create, so that collecting the state gives the names, dtypes and
    shapes of the first save's state. Yields the predictions (one per optimizer, for
    :func:`matches`), or None — and changes nothing — if any optimizer's first-step
    state is not known. On exit the optimizers' states are empty again."""
    predicted = [first_step_state(o) for o in optimizers]
    if not optimizers or any(p is None for p in predicted):
        yield None
        return
    lent: list[tuple[torch.optim.Optimizer, torch.Tensor]] = []
    try:
        for optimizer, entries in zip(optimizers, predicted, strict=True):
            assert entries is not None
            for p, specs in entries:
                optimizer.state[p] = {s.key: _stand_in(s) for s in specs}
                lent.append((optimizer, p))
        yield predicted  # type: ignore[misc]
    finally:
        for optimizer, p in lent:
            optimizer.state.pop(p, None)


def matches(optimizers: Sequence[torch.optim.Optimizer], predicted: list[Predicted]) -> bool:
    """Whether the optimizers' real state (after their first step, or a load) holds the
    predicted tensors: the same parameters, each with the same keys, shapes and dtypes.
    Reads no values. The order is not compared: the files' layout is sorted by name, so
    a pool planned from another order fits (a load lists the keys alphabetically)."""
    for optimizer, entries in zip(optimizers, predicted, strict=True):
        state = optimizer.state
        if len(state) != len(entries):
            return False
        for p, specs in entries:
            values = state.get(p)
            if values is None or len(values) != len(specs):
                return False
            for spec in specs:
                v = values.get(spec.key)
                if (
                    not isinstance(v, torch.Tensor)
                    or tuple(v.shape) != spec.shape
                    or v.dtype != spec.dtype
                ):
                    return False
    return True
