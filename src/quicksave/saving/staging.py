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
import operator
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch

from quicksave.saving.engine_plan import EnginePlan
from quicksave.stage.pool import Item, StagingPool

_IS_CUDA = operator.attrgetter("is_cuda")
_PTR = torch.Tensor.data_ptr

# ``deferred(fqn, tensor)``: whether ``save()`` may leave the tensor to the background copy
Deferred = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True)
class DeferredAt:
    """A :data:`Deferred` by address: the tensors with elements whose memory starts at
    one of ``ptrs``. :func:`split` tests all the tensors of a save against it at once."""

    ptrs: frozenset[int]

    def __call__(self, fqn: str, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.data_ptr() in self.ptrs


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
    if isinstance(deferred, DeferredAt):
        picked = deferred.ptrs - unguarded
        names = list(tensors)
        at = [n for n, p in zip(names, map(_PTR, tensors.values()), strict=True) if p in picked]
        later = [n for n in at if tensors[n].numel() > 0 and not tensors[n].is_inference()]
        late = set(later)
        return ([n for n in names if n not in late] if late else names), later
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


@dataclass(frozen=True)
class _Batch:
    """The places of one list of staged names in one pool, for copies without hashing:
    the names with bytes, the pool's typed views for them, and the bytes in all."""

    plan_key: Hashable
    pool: StagingPool
    fqns: list[str]
    names: list[str]
    views: list[torch.Tensor] | None  # None: a dtype without typed views (bits*)
    nbytes: int


def _copied(pool: StagingPool, batch: _Batch, sources: list[torch.Tensor]) -> bool:
    """Copy ``sources`` into ``batch``'s views in one call; False where torch has no
    typed view or copy kernel for a dtype (the caller stages them one by one)."""
    if batch.views is None:
        return False
    try:
        pool.copy_views(batch.views, sources, non_blocking=pool.pinned)
    except (RuntimeError, TypeError):
        return False
    return True


class PoolCopier:
    """Copies staged tensors into pools (keeps the latest plan's pool offsets, and the
    pool views of the latest names copied without hashing)."""

    def __init__(self) -> None:
        self._span_cache: tuple[tuple, StagingPool, dict[str, tuple[int, int]]] | None = None
        self._batch: _Batch | None = None

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
        Without, all of them in one torch call (``StagingPool.copy_views``), into pool
        views made once per plan, pool and list of names (a steady save's).
        CUDA copies run on a side stream that first waits for ``ready`` (recorded on the
        training thread's stream at ``save()``: the kernels that wrote the state, e.g.
        the optimizer step, may still be queued there)."""
        batch = None if digests is not None else self._batch_of(pool, plan, tensors, fqns)
        sources = [] if batch is None else [tensors[n] for n in batch.names]
        cuda = any(map(_IS_CUDA, sources if batch is not None else map(tensors.get, fqns)))
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        after: list[tuple[str, int, int]] = []
        with ctx:
            if batch is not None and _copied(pool, batch, sources):
                copied = batch.nbytes
            else:
                items = self._items(pool, plan, tensors, fqns)
                after = pool.stage_many(items, digests, non_blocking=pool.pinned)
                copied = sum(it[2] for it in items)
        if stream is not None:
            stream.synchronize()
        for key, offset, length in after:
            assert digests is not None
            digests[key] = pool.digest(offset, length)
        return copied

    def forget(self) -> None:
        """Drop what is kept of the latest plan and pool (its views hold the pool's
        memory): the saver closes."""
        self._span_cache = None
        self._batch = None

    def _items(
        self,
        pool: StagingPool,
        plan: EnginePlan,
        tensors: Mapping[str, torch.Tensor],
        fqns: list[str],
    ) -> list[Item]:
        """``(chunk key, pool offset, length, tensor)`` of each of ``fqns``."""
        spans = self._spans(plan, pool)
        keys = plan.keys
        return [(keys.get(n, n), *spans[n], tensors[n]) for n in fqns]

    def _batch_of(
        self,
        pool: StagingPool,
        plan: EnginePlan,
        tensors: Mapping[str, torch.Tensor],
        fqns: list[str],
    ) -> _Batch:
        """The views of ``fqns`` in ``pool`` (kept for the latest plan, pool and names:
        the plan fixes each name's dtype, shape and place)."""
        b = self._batch
        if b is not None and b.pool is pool and b.plan_key == plan.key and b.fqns == fqns:
            return b
        items = self._items(pool, plan, tensors, fqns)
        names = [fqn for fqn, it in zip(fqns, items, strict=True) if it[2] > 0]
        nbytes = sum(it[2] for it in items)
        try:
            views: list[torch.Tensor] | None = pool.views(items)
        except (RuntimeError, TypeError):
            views = None
        b = _Batch(plan.key, pool, list(fqns), names, views, nbytes)
        self._batch = b
        return b

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
