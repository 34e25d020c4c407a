"""Which tensors overlapped staging may copy after ``save()`` returns.

Only tensors that nothing but the manager's optimizers writes: their step pre-hooks wait
for the background copy, so no write can land in it. The manager cannot see every
writer, but it can watch: torch counts in-place writes to a tensor in its version
counter, and the optimizers' step hooks bracket the only writes that are guarded. A
tensor whose counter moved between one step's post-hook and the next step's pre-hook (or
before ``save()``) has another writer — an optimizer the manager was not given, an update
by hand, clipping, a weight sync, an EMA swap — and is copied inside ``save()`` from then
on. A tensor is overlapped only once it has been seen through a whole interval between
steps with no other writer; parameters that no registered optimizer holds never are.

The engine's guard (``saving/guard.py``) still checks every overlapped tensor at the end of its
copy: what the watch did not see coming fails that one save, never commits it.

Call order (training thread): ``before_step`` / ``after_step`` from each optimizer's step
hooks → ``deferred()`` at each ``save()``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from quicksave.saving.staging import Deferred, DeferredAt

_VERSION = operator.attrgetter("_version")


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer.step()`` writes: its parameters and its state tensors."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = optimizer.state
    moments = [
        v for p in params if p in state for v in state[p].values() if isinstance(v, torch.Tensor)
    ]
    return params + moments


class WriterWatch:
    """Learns, from the step hooks of ``optimizers``, which of their tensors only they
    write.

    Args:
        optimizers: the manager's optimizers (each gets the manager's step hooks).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        # id(optimizer) -> (its tensors, their versions) at its last step's end
        self._after: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        # id(optimizer) -> ids of its tensors the last interval between steps left alone
        self._clean: dict[int, set[int]] = {}
        self._outside: set[int] = set()  # ids of tensors seen written outside any step

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Pre-hook: what changed since this optimizer's last step was written by
        someone else."""
        last = self._after.get(id(optimizer))
        if last is None:
            return
        tensors, versions = last
        now = list(map(_VERSION, tensors))
        if now == versions:
            self._clean[id(optimizer)] = set(map(id, tensors))
            return
        moved = {id(t) for t, a, b in zip(tensors, versions, now, strict=True) if a != b}
        self._outside |= moved
        self._clean[id(optimizer)] = set(map(id, tensors)) - moved

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Post-hook: the versions this optimizer's step leaves."""
        tensors = optimizer_tensors(optimizer)
        self._after[id(optimizer)] = (tensors, list(map(_VERSION, tensors)))

    def deferred(self) -> Deferred | None:
        """At ``save()``: a predicate over (fqn, staged tensor) that holds for the
        tensors seen written by the registered optimizers alone and unchanged since
        their last step; None when there are none."""
        ptrs: set[int] = set()
        outside = self._outside
        for optimizer in self._optimizers:
            last = self._after.get(id(optimizer))
            clean = self._clean.get(id(optimizer), set())
            if last is None:
                continue
            tensors, versions = last
            now = list(map(_VERSION, tensors))
            if now != versions:  # some were written since the step, before save()
                outside.update(
                    id(t) for t, a, b in zip(tensors, versions, now, strict=True) if a != b
                )
            kept = [t for t in tensors if id(t) in clean and id(t) not in outside]
            plain = set(map(type, kept)) <= {torch.Tensor, torch.nn.Parameter}
            ptrs.update(map(torch.Tensor.data_ptr if plain else local_ptr, kept))
        ptrs.discard(0)
        return DeferredAt(frozenset(ptrs)) if ptrs else None


def local_ptr(t: torch.Tensor) -> int:
    """Address of this rank's bytes of ``t`` (a DTensor's local shard; 0 if none)."""
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    try:
        return t.data_ptr()
    except RuntimeError:  # a tensor subclass without storage
        return 0
