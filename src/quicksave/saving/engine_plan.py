"""The engine's plan of one save: where every staged tensor goes in the rank's files, and
the manifest entries, chunk keys and DCP ``.metadata`` the worker writes with them.

A single-rank saver plans here (:func:`single_rank_plan`: :func:`plan_one_rank`, the
multi-rank planner over one rank, kept in the saver's ``PlanCache`` while the rank's plan
is unchanged); a multi-rank saver's plan comes from the ranks' collective planning
(``saving/dist_save.py``) and is wrapped with :meth:`EnginePlan.of_dist`. Either way
the engine stages into the pool at ``places`` and hands the rest to the worker. Called
by the training thread (and by ``prepare()``), under the saver's lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from quicksave.format.manifest import FileEntry, Manifest, ObjectEntry, TensorEntry
from quicksave.layout.dcp_metadata import dcp_metadata_bytes
from quicksave.layout.plan import FileLayout, RankLayout
from quicksave.layout.skeleton import chunk_keys_of
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistSave
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.rank_plans import LocalPlan, LocalState, global_plan
from quicksave.stage.pool import StagingPool
from quicksave.storage import Location
from quicksave.worker.job import DistCommit, FileJob, PersistJob, PickledOnce


@dataclass(frozen=True)
class EnginePlan:
    """One rank's layout of a save and what the worker needs besides the bytes."""

    key: tuple
    layout: RankLayout
    chunk_keys: dict[str, tuple[str, int]]
    dcp_metadata: bytes
    tensors: dict[str, TensorEntry]  # checksums empty
    files: dict[str, FileEntry]
    places: dict[str, tuple[str, int, int]]  # staged name -> (file, offset, length)
    keys: dict[str, str] = field(default_factory=dict)  # staged name -> chunk key, if not same
    skeleton: Manifest | None = None  # a single-rank plan's (saving.skeleton)
    # the latest (key paths, manifest tensor entries with them): see tensor_entries
    _entries: list = field(default_factory=list, init=False, compare=False, repr=False)
    # the latest (pool file bases, the worker's files there): see file_jobs
    _files: list = field(default_factory=list, init=False, compare=False, repr=False)
    # the latest (encoded values, key paths, manifest object entries): see object_entries
    _objects: list = field(default_factory=list, init=False, compare=False, repr=False)
    # the latest (a LocalState's key paths, them as a dict): see path_map
    _paths: list = field(default_factory=list, init=False, compare=False, repr=False)

    @classmethod
    def of_dist(cls, ds: DistSave) -> EnginePlan:
        """The plan of a multi-rank save (staged by chunk key: no manifest entries here,
        the coordinator's manifest skeleton comes with ``ds``)."""
        return cls(ds.key, ds.layout, ds.chunk_keys, ds.dcp_metadata, {}, {}, ds.places)

    def path_map(self, paths: tuple[tuple[str, tuple], ...]) -> dict[str, tuple]:
        """A ``LocalState``'s key paths as a dict: the same dict while they are the same
        tuple (a steady save's, from the collect cache), so that the entries made with
        them are seen unchanged by identity."""
        memo = self._paths
        if not memo or memo[0] is not paths:
            memo[:] = [paths, dict(paths)]
        return memo[1]

    def tensor_entries(self, paths: dict[str, tuple]) -> dict[str, TensorEntry]:
        """The manifest's tensor entries of this plan with their key paths (made once
        per plan and paths, not per save)."""
        if self._entries and (self._entries[0] is paths or self._entries[0] == paths):
            return self._entries[1]
        entries = PickledOnce(
            (fqn, dataclasses.replace(t, path=paths.get(fqn))) for fqn, t in self.tensors.items()
        )
        self._entries[:] = [paths, entries]
        return entries

    def object_entries(
        self, objects: dict[str, Any], paths: dict[str, tuple]
    ) -> dict[str, ObjectEntry]:
        """The manifest's object entries of these encoded values with their key paths;
        of the latest ones, only the entries of values that are other objects are made
        again (an optimizer's flattened param_groups hold thousands of values)."""
        memo = self._objects
        if memo and memo[1] is paths and memo[0].keys() == objects.keys():
            last, _, entries = memo
            if last is objects:
                return entries
            changed = [fqn for fqn, v in objects.items() if v is not last[fqn]]
            if changed:
                entries = PickledOnce(entries)
                for fqn in changed:
                    entries[fqn] = ObjectEntry(objects[fqn], paths.get(fqn))
        else:
            entries = PickledOnce(
                (fqn, ObjectEntry(v, paths.get(fqn))) for fqn, v in objects.items()
            )
        self._objects[:] = [objects, paths, entries]
        return entries

    def file_jobs(self, pool: StagingPool) -> tuple[FileJob, ...]:
        """The worker's files of this plan staged in ``pool`` (made once per plan and
        pool file bases: a chunk per tensor, thousands of tuples)."""
        bases = tuple(pf.base for pf in pool.pool.files)
        if self._files and self._files[0] == bases:
            return self._files[1]
        files = tuple(
            FileJob(f.name, base, f.size, _entries_of(f))
            for f, base in zip(self.layout.files, bases, strict=True)
        )
        self._files[:] = [bases, files]
        return files


@dataclass(frozen=True)
class PlannedSave:
    """One save, collected and planned: what ``save()`` stages and hands to the worker."""

    plan: EnginePlan
    tensors: dict[str, torch.Tensor]  # staged name -> the tensor to copy
    sources: dict[str, torch.Tensor]  # staged name -> its writes' version counter
    manifest: Manifest | None  # None: a multi-rank save's non-coordinator rank
    token: str  # names the save's temporary directory (and its commit records)
    dist: DistCommit | None = None  # several ranks: how this rank's part commits
    # staged name -> fqn of the chunks an incremental save may refer to (incremental.py)
    tracked: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of_state(
        cls, plan: EnginePlan, state: LocalState, manifest: Manifest, token: str
    ) -> PlannedSave:
        """A single-rank save of ``state`` (collected whole, or tracked in blocks)."""
        return cls(plan, state.tensors, state.sources, manifest, token, None, state.tracked)

    @classmethod
    def of_dist(cls, ds: DistSave) -> PlannedSave:
        plan = EnginePlan.of_dist(ds)
        return cls(plan, ds.tensors, ds.sources, ds.manifest, ds.dist.token, ds.dist, ds.tracked)

    def job(
        self,
        job_id: int,
        pool_id: int,
        pool: StagingPool,
        loc: Location,
        draft: str,
        step: int | None,
        rank: int,
        config: EngineConfig,
        replace: bool,
    ) -> PersistJob:
        """The worker's job for this save, staged in ``pool`` (``pool_id`` in the worker),
        written under ``draft`` (its commit strategy's) and committed at ``loc``."""
        plan = self.plan
        return PersistJob(
            job_id=job_id,
            pool_id=pool_id,
            step=step,
            rank=rank,
            final_path=loc.url,
            draft=draft,
            files=plan.file_jobs(pool),
            manifest=self.manifest,
            chunk_keys=plan.chunk_keys,
            dcp_metadata=plan.dcp_metadata,
            fsync=config.fsync,
            o_direct=config.o_direct,
            thread_count=config.thread_count,
            dist=self.dist,
            location=loc,
            replace=replace,
            clear_uncommitted=config.clear_uncommitted,
            write_rate=None if (mbps := config.write_rate_mbps) is None else mbps * 1e6,
        )


def _entries_of(f: FileLayout) -> tuple[tuple[str, int, int], ...]:
    """(chunk key, file offset, length) of each chunk of the layout's file ``f``."""
    return tuple((e.item.key, e.offset, e.length) for e in f.entries)


def plan_one_rank(local: LocalPlan, thread_count: int) -> EnginePlan:
    """The plan of a single-rank save: the multi-rank planner (``rank_plans.global_plan``)
    over this one rank's plan (every tensor whole, one chunk each named by its fqn), laid
    out over ``thread_count`` files, with the manifest entries and ``.metadata`` to match."""
    gp = global_plan([local], thread_count)
    skeleton = gp.skeleton
    layout = gp.layouts[0]
    chunk_keys = PickledOnce(chunk_keys_of(skeleton))  # in every job of this plan
    places = {e.item.key: (f.name, e.offset, e.length) for f in layout.files for e in f.entries}
    keys = {fqn: key for key, (fqn, _) in chunk_keys.items() if key != fqn}
    return EnginePlan(
        ("one", gp.key, local.rank),
        layout,
        chunk_keys,
        dcp_metadata_bytes(skeleton),
        skeleton.tensors,
        skeleton.files,
        places,
        keys,
        skeleton,
    )


def fqns_of(layout: RankLayout) -> dict[str, str]:
    """Chunk key -> fqn of every chunk in ``layout`` (several ranks stage by chunk key)."""
    return {e.item.key: e.item.fqn for f in layout.files for e in f.entries}


def single_rank_plan(
    cache: PlanCache[EnginePlan], state: LocalState, thread_count: int
) -> EnginePlan:
    """The plan of a single-rank save of ``state`` (collected with ``whole=True``): the
    cached one while the names, dtypes and shapes (and the values' names) are unchanged,
    else a new one, cached."""
    key = state.shape_key
    context = (1, state.rank, thread_count)
    plan = cache.lookup(key, context)
    if plan is not None:
        cache.hits += 1
        return plan
    cache.misses += 1
    plan = plan_one_rank(state.plan, thread_count)
    cache.store(key, context, plan)
    return plan


def single_rank_manifest(
    plan: EnginePlan,
    state: LocalState,
    step: int | None,
    user_metadata: dict[str, Any] | None,
) -> Manifest:
    """The manifest of a single-rank save of ``state``: the plan's skeleton with the
    step, the key paths and the values (tensor checksums empty: the writer fills them,
    ``commit.parts.manifest_from_parts``)."""
    assert plan.skeleton is not None, "a multi-rank plan's manifest is the coordinator's"
    paths = plan.path_map(state.paths)
    return dataclasses.replace(
        plan.skeleton,
        step=step,
        tensors=plan.tensor_entries(paths),
        objects=plan.object_entries(state.values, paths),
        user_metadata=dict(user_metadata or {}),
        empty_dicts=state.empty,
    )
