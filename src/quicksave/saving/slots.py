"""The engine's staging slots: one per save that may be in flight (``max_in_flight``),
each holding a staging pool shaped for a plan, and the job that uses it while busy.

A pool the worker still reads is never written: a slot is busy from the save's submit
to its result. Pools are built on demand (``pool_for``, in ``save()``) or ahead of the
first save (``install``, from ``prepare()``), kept while the plan is unchanged, and kept
for a new plan whose file images match (``adopt``). Training thread (and the prepare
thread), under the saver's lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.worker_supervision import WorkerSupervisor
from quicksave.stage.pool import StagingPool


@dataclass
class Slot:
    """One staging pool and the job using it."""

    pool: StagingPool | None = None
    plan_key: tuple | None = None
    pool_id: int = -1
    busy: int | None = None  # job id using the pool


class StagingSlots(Sequence[Slot]):
    """The saver's slots (a sequence of :class:`Slot`).

    Args:
        count: slots, i.e. saves that may be in flight at once.
        ids: the saver's id counter (pools and jobs draw from it: each id is new).
        pin: page-lock pools for CUDA copies (None: when CUDA is available).
    """

    def __init__(self, count: int, ids: itertools.count, pin: bool | None) -> None:
        self._slots = [Slot() for _ in range(count)]
        self._ids = ids
        self.pin = pin

    def __getitem__(self, i):  # type: ignore[override]
        return self._slots[i]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    def free(self) -> Slot | None:
        """A slot whose pool no job uses, if any."""
        return next((s for s in self._slots if s.busy is None), None)

    def pools(self) -> list[tuple[int, StagingPool]]:
        """(pool id, pool) of every slot that has a pool."""
        return [(s.pool_id, s.pool) for s in self._slots if s.pool is not None]

    def any_free(self) -> bool:
        return self.free() is not None

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the pools now."""
        return sum(s.pool.nbytes for s in self._slots if s.pool is not None)

    def pool_for(self, slot: Slot, plan: EnginePlan, worker: WorkerSupervisor) -> StagingPool:
        """``slot``'s pool, (re)built for ``plan`` if needed, and mapped into the worker
        (whose persister the caller made sure of)."""
        persister = worker.persister
        assert persister is not None
        self.adopt(plan)
        if slot.pool is None or slot.plan_key != plan.key:
            if slot.pool is not None:
                persister.unmap_pool(slot.pool_id)
                slot.pool.close()
            slot.pool = self.new_pool(plan)
            slot.plan_key = plan.key
            slot.pool_id = next(self._ids)
        worker.map(slot.pool_id, slot.pool)
        return slot.pool

    def new_pool(self, plan: EnginePlan, populate: bool = True) -> StagingPool:
        """A new pool shaped for ``plan`` (not in a slot yet; see ``StagingPool``)."""
        return StagingPool(plan.layout, pin=self.pin, populate=populate)

    def adopt(self, plan: EnginePlan) -> None:
        """Free pools of another plan whose file images match ``plan``'s are kept for it
        (``StagingPool.adopt``): a plan changes with the order of the state dict (e.g.
        an optimizer state loaded from a checkpoint lists its keys in another order) or
        with its non-tensor names, while the layout, sorted by name, stays the same."""
        for slot in self._slots:
            if (
                slot.busy is None
                and slot.pool is not None
                and slot.plan_key != plan.key
                and slot.pool.adopt(plan.layout)
            ):
                slot.plan_key = plan.key

    def missing(self, plan: EnginePlan) -> int:
        """How many slots have no pool for ``plan``."""
        return sum(s.plan_key != plan.key for s in self._slots)

    def install(self, pool: StagingPool, plan: EnginePlan, worker: WorkerSupervisor) -> Slot | None:
        """Put a pool built ahead for ``plan`` into a free slot without one (the pool it
        had is unmapped and freed); None, and nothing done, if there is no such slot."""
        slot = next((s for s in self._slots if s.busy is None and s.plan_key != plan.key), None)
        if slot is None:
            return None
        if slot.pool is not None:
            if worker.persister is not None:
                worker.persister.unmap_pool(slot.pool_id)
            slot.pool.close()
        slot.pool, slot.plan_key, slot.pool_id = pool, plan.key, next(self._ids)
        return slot

    def close(self) -> None:
        """Free every pool."""
        for slot in self._slots:
            if slot.pool is not None:
                slot.pool.close()
                slot.pool = None
