"""The overlap guard: a background copy never commits a value that did not exist.

With ``staging="overlap"`` some tensors are copied into the staging pool after
``save()`` has returned, while the next forward/backward runs. Their bytes are the bytes
at ``save()`` only if nothing wrote them in between. torch counts every in-place write to
a tensor in its version counter (``Tensor._version``: in-place ops, ``copy_``,
``load_state_dict``, the foreach optimizers' updates), so the engine reads the counter of
every deferred tensor at ``save()`` and again once the copy is finished, on the training
thread, before the save is handed to the writer: a counter that moved means the copy may
hold a mix of old and new values, and that save fails, naming the tensors — it is never
committed.

Why the second reading happens on the training thread and not in the copying thread:
torch bumps a counter after the in-place kernel has run, so a write still running when
the copy ends would not show yet. The training thread reads the counters only between
its own operations (an optimizer's step pre-hook, the next ``save()``, ``wait()``), when
every write it started is finished. A write that happened after the copy also fails the
save then: the guard cannot tell it from one during the copy, and errs on the safe side.

What the counters do not see (documented in docs/RELIABILITY.md): writes through
``tensor.data`` or ``tensor.detach()`` copies made before ``save()`` (each has its own
counter), fused optimizers (``fused=True`` kernels update in place without bumping the
counters), writes by other processes or devices into shared memory, and writes from
other threads still running when the training thread reaches its sync point. The
manager therefore overlaps only what its registered optimizers alone write
(``manager/overlap.py``); everything else is copied inside ``save()``.

Call order (training thread): ``Snapshot.take(sources, names)`` at ``save()`` →
(background copy) → ``snapshot.changed()`` at the sync point → ``torn_copy_error`` if
any.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from quicksave.errors import CheckpointError

_NAMED = 5  # tensors named in an error message; the rest are counted


def counter(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor, which keeps none (reading
    it raises): such a tensor is never judged by a counter, only by its bytes."""
    return None if t.is_inference() else t._version


@dataclass(frozen=True)
class Snapshot:
    """The version counters of the deferred tensors at ``save()``.

    Attributes:
        sources: staged name -> the tensor whose counter tracks its writes (for a
            DTensor the DTensor itself: its local shard has a counter of its own that
            in-place ops on the DTensor do not bump).
        versions: staged name -> its counter at ``save()``.
    """

    sources: Mapping[str, torch.Tensor]
    versions: Mapping[str, int]

    @classmethod
    def take(cls, sources: Mapping[str, torch.Tensor], names: Iterable[str]) -> Snapshot:
        picked = {n: sources[n] for n in names}
        return cls(picked, {n: t._version for n, t in picked.items()})

    def changed(self) -> list[str]:
        """Names whose tensor was written since :meth:`take` (in save order)."""
        return [n for n, t in self.sources.items() if t._version != self.versions[n]]


def torn_copy_error(
    names: list[str], fqn_of: Mapping[str, str], step: int | None, path: str, rank: int
) -> CheckpointError:
    """The error of a save whose background copy saw ``names`` change.

    Args:
        names: staged names (fqns, or chunk keys of several-rank saves) that changed.
        fqn_of: staged name -> fqn where they differ.
    """
    fqns = list(dict.fromkeys(fqn_of.get(n, n) for n in names))
    shown = ", ".join(fqns[:_NAMED]) + (
        f" and {len(fqns) - _NAMED} more" if len(fqns) > _NAMED else ""
    )
    return CheckpointError(
        f"the save of step {step} was not committed: {len(fqns)} tensor(s) ({shown}) were "
        "written between save() and the end of their background copy (staging='overlap'), "
        "so the copy may mix values from before and after. Something other than the "
        "manager's optimizers wrote them: an optimizer the manager was not given, an update "
        "by hand, or an in-place edit such as clipping, a weight sync or an EMA swap. "
        "These tensors are now copied inside save(). To overlap them again, give the "
        "manager every optimizer, or call maybe_wait_for_staging() before writing them; "
        "staging='blocking' copies every tensor inside save()",
        path=path,
        fqn=fqns[0],
        rank=rank,
    )
