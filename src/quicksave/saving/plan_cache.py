"""The plan cache: a save reuses the last plan while what it was made from is unchanged.

Planning a save — where every chunk goes, which rank writes what, the manifest skeleton,
on several ranks one gather/scatter with the coordinator — costs far more than checking
that nothing changed. Every save path keeps one ``PlanCache`` per saver (per rank) and
plans only on a miss:

* a multi-rank save (``saving/plan_vote.plan_save``): the key is this rank's local plan
  key; every rank votes its hit in the one all-reduce a save runs, and all reuse only
  when all hit the same global plan; the share is this rank's ``rank_plans.RankShare``,
  the whole plan the coordinator's ``GlobalPlan``; a checkpoint's stored plans seed it
  after a restart (``rank_plans.seeded_cache``);
* a single-rank save (``saving/engine``): the key is the names, dtypes and shapes of the
  tensors (``rank_plans.LocalState.shape_key``), the share the ``EnginePlan``;
* the NVRx-compatible API (``compat/nvrx/state_dict_saver``): the key is DCP's local
  plan as the manifest records it, the share DCP's central plan, the whole plan DCP's
  global metadata (coordinator), the seed a loaded checkpoint's ``all_local_plans``;
  ``CheckpointMetadataCache`` is NVRx's view of one of these.

One entry only: plans change rarely, and the latest is the one the next save needs. A
cache is used by the training thread of one saver (no locking here). Pure: no I/O, no
collective.

Example::

    cache = PlanCache()
    share = cache.lookup(key, context)
    if share is None:
        share = make_plan(...)
        cache.store(key, context, share)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

S = TypeVar("S")


@dataclass
class PlanCache(Generic[S]):
    """One saver's cached plan.

    Attributes:
        key: what the cached plan was made from (compared with ``==``).
        context: the parameters it was made under (e.g. world size, coordinator rank,
            files per rank): a plan is reused only under the same ones.
        local: this rank's local plan then, in the planner's own type (what a delta
            exchange or a later comparison needs).
        share: this rank's part of the plan (None: nothing cached).
        plan: the whole plan (the coordinator's; any rank's when replayed locally).
        seed: every rank's local plan restored from a loaded checkpoint, until a save
            adopts or replaces it.
        hits / misses: how many saves reused / planned anew (for logs and tests).
    """

    key: Hashable | None = None
    context: tuple[int, ...] | None = None
    local: Any = None
    share: S | None = None
    plan: Any = None
    seed: Any = None
    hits: int = 0
    misses: int = 0

    def lookup(self, key: Hashable, context: tuple[int, ...]) -> S | None:
        """This rank's share of the cached plan if it was made from ``key`` under
        ``context``, else None (a miss). Counts nothing: the caller counts
        ``hits`` / ``misses`` once every rank agreed."""
        if self.share is not None and self.context == context and self.key == key:
            return self.share
        return None

    def store(
        self,
        key: Hashable,
        context: tuple[int, ...],
        share: S,
        *,
        local: Any = None,
        plan: Any = None,
    ) -> None:
        """Remember a plan just made (or adopted) for ``key`` under ``context``."""
        self.key, self.context, self.share = key, context, share
        self.local, self.plan = local, plan

    def clear(self) -> None:
        """Forget every plan (after a failed exchange every rank plans anew); the
        counters stay."""
        self.key = self.context = self.local = self.share = self.plan = self.seed = None
