"""The engine's copies into a staging pool: which tensors ``save()`` copies now and which
a background copy takes later (``split``), and the copy itself (:class:`PoolCopier`),
hashing what it copies when asked.

Call order (per save): ``cuda_ready(tensors)`` on the training thread at ``save()`` →
``split()`` → ``PoolCopier.stage(now)`` on the training thread → in overlap mode
``PoolCopier.stage(later, digests)`` on the background copy's thread
(``background_copy.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

from quicksave.saving.engine_plan import EnginePlan
from quicksave.stage.pool import StagingPool

# ``deferred(fqn, tensor)``: whether ``save()`` may leave the tensor to the background copy
Deferred = Callable[[str, torch.Tensor], bool]


def split(
    staging: str,
    tensors: Mapping[str, torch.Tensor],
    deferred: Deferred | None,
    unguarded: set[int],
) -> tuple[list[str], list[str]]:
    """(copied in save(), copied in the background): ``deferred`` picks the second,
    less the tensors (by address) a background copy has already seen written
    (``unguarded``, see guard.py). Blocking staging copies everything in save()."""
    if staging == "blocking" or deferred is None:
        return list(tensors), []
    now, later = [], []
    for fqn, t in tensors.items():
        late = deferred(fqn, t) and t.data_ptr() not in unguarded and not t.is_inference()
        (later if late else now).append(fqn)
    return now, later


def cuda_ready(tensors: Mapping[str, torch.Tensor]) -> torch.cuda.Event | None:
    """An event on the calling thread's current CUDA stream, if any tensor is on a GPU:
    the staging stream waits for it, so it copies what the queued kernels leave."""
    device = next((t.device for t in tensors.values() if t.is_cuda), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class PoolCopier:
    """Copies staged tensors into pools (keeps the latest plan's pool offsets)."""

    def __init__(self) -> None:
        self._span_cache: tuple[tuple, StagingPool, dict[str, tuple[int, int]]] | None = None

    def stage(
        self,
        pool: StagingPool,
        plan: EnginePlan,
        tensors: Mapping[str, torch.Tensor],
        fqns: list[str],
        digests: dict[str, str] | None = None,
        *,
        ready: torch.cuda.Event | None = None,
    ) -> int:
        """Copy ``fqns`` into the pool; return the bytes copied. With ``digests``, also
        hash every copied chunk into it (chunk key -> xxh3-64 hex): CPU tensors right as
        they are copied, CUDA ones from the pool once their copies are done
        (``StagingPool.stage_many``: small tensors in batches, one torch call each).
        CUDA copies run on a side stream that first waits for ``ready`` (recorded on the
        training thread's stream at ``save()``: the kernels that wrote the state, e.g.
        the optimizer step, may still be queued there)."""
        spans = self._spans(plan, pool)
        keys = plan.keys
        items = [(keys.get(n, n), *spans[n], tensors[n]) for n in fqns]
        cuda = any(it[3].is_cuda for it in items)
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            after = pool.stage_many(items, digests, non_blocking=pool.pinned)
        if stream is not None:
            stream.synchronize()
        for key, offset, length in after:
            assert digests is not None
            digests[key] = pool.digest(offset, length)
        return sum(it[2] for it in items)

    def _spans(self, plan: EnginePlan, pool: StagingPool) -> dict[str, tuple[int, int]]:
        """Staged name -> (pool offset, length) of ``plan`` (kept for the latest plan)."""
        cached = self._span_cache
        if cached is not None and cached[0] == plan.key and cached[1] is pool:
            return cached[2]
        spans = {
            name: (pool.pool.base_of(file) + offset, length)
            for name, (file, offset, length) in plan.places.items()
        }
        self._span_cache = (plan.key, pool, spans)
        return spans
