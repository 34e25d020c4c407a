"""The engine's plan of one save: where every staged tensor goes in the rank's files, and
the manifest entries, chunk keys and DCP ``.metadata`` the worker writes with them.

A single-rank saver plans here (:func:`single_rank_plan`: :func:`plan_one_rank`, kept in
the saver's ``PlanCache`` while the state's names, dtypes and shapes are unchanged); a
multi-rank saver's plan comes from the ranks' collective planning (``ranks/saving.py``)
and is wrapped with :meth:`EnginePlan.of_dist`. Either way the engine stages into the
pool at ``places`` and hands the rest to the worker. Called by the training thread (and
by ``prepare()``), under the saver's lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from quicksave.format.dtypes import dtype_name, element_size
from quicksave.format.manifest import FileEntry, Manifest, ObjectEntry, TensorEntry
from quicksave.layout.dcp_metadata import dcp_metadata_bytes
from quicksave.layout.plan import FileLayout, ItemSpec, RankLayout, layout_rank
from quicksave.layout.skeleton import chunk_keys_of, manifest_skeleton, placed_of
from quicksave.ranks.saving import DistSave
from quicksave.saving.collect import CollectedState
from quicksave.saving.config import EngineConfig
from quicksave.saving.plan_cache import PlanCache
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

    @classmethod
    def of_dist(cls, ds: DistSave) -> EnginePlan:
        """The plan of a multi-rank save (staged by chunk key: no manifest entries here,
        the coordinator's manifest skeleton comes with ``ds``)."""
        return cls(ds.key, ds.layout, ds.chunk_keys, ds.dcp_metadata, {}, {}, ds.places)

    def tensor_entries(self, paths: dict[str, tuple]) -> dict[str, TensorEntry]:
        """The manifest's tensor entries of this plan with their key paths (made once
        per plan and paths: ~1,500 entries cost a save ~10 ms to make)."""
        if self._entries and self._entries[0] == paths:
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

    @classmethod
    def of_dist(cls, ds: DistSave) -> PlannedSave:
        plan = EnginePlan.of_dist(ds)
        return cls(plan, ds.tensors, ds.sources, ds.manifest, ds.dist.token, ds.dist)

    def job(
        self,
        job_id: int,
        pool_id: int,
        pool: StagingPool,
        loc: Location,
        staging: str,
        step: int | None,
        rank: int,
        config: EngineConfig,
        replace: bool,
    ) -> PersistJob:
        """The worker's job for this save, staged in ``pool`` (``pool_id`` in the worker),
        written under ``staging`` (its commit strategy's) and committed at ``loc``."""
        plan = self.plan
        return PersistJob(
            job_id=job_id,
            pool_id=pool_id,
            step=step,
            rank=rank,
            final_path=loc.url,
            tmp_dir=staging,
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


def plan_key(tensors: Mapping[str, torch.Tensor], objects: Mapping[str, Any], threads: int):
    """What a single-rank plan depends on: names, dtypes and shapes, non-tensor names, the
    number of files."""
    return (
        tuple((fqn, t.dtype, tuple(t.shape)) for fqn, t in tensors.items()),
        tuple(objects),
        threads,
    )


def plan_one_rank(
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    objects: Mapping[str, Any],
    thread_count: int,
    key: tuple,
) -> EnginePlan:
    """Lay out every tensor of a single-rank save (whole, one chunk each) over
    ``thread_count`` files, with the manifest entries and ``.metadata`` to match."""
    items = []
    for fqn, t in tensors.items():
        shape = tuple(t.shape)
        items.append(
            ItemSpec(
                fqn,
                (0,) * len(shape),
                shape,
                shape,
                dtype_name(t.dtype),
                t.numel() * element_size(t.dtype),
            )
        )
    layout = layout_rank(rank, items, thread_count)
    files, placed = placed_of([layout])
    skeleton = manifest_skeleton(
        {it.fqn: (it.dtype, it.global_shape) for it in items},
        files,
        placed,
        dict.fromkeys(objects),
        world_size=1,
    )
    entries = skeleton.tensors
    chunk_keys = PickledOnce(chunk_keys_of(skeleton))  # in every job of this plan
    places = {p.item.fqn: (p.file, p.offset, p.length) for p in placed}
    keys = {fqn: key for key, (fqn, _) in chunk_keys.items()}
    return EnginePlan(
        key,
        layout,
        chunk_keys,
        dcp_metadata_bytes(skeleton),
        entries,
        files,
        places,
        keys,
        skeleton,
    )


def fqns_of(layout: RankLayout) -> dict[str, str]:
    """Chunk key -> fqn of every chunk in ``layout`` (several ranks stage by chunk key)."""
    return {e.item.key: e.item.fqn for f in layout.files for e in f.entries}


def single_rank_plan(
    cache: PlanCache[EnginePlan],
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    objects: Mapping[str, Any],
    thread_count: int,
    key: tuple | None = None,
) -> EnginePlan:
    """The plan of a single-rank save: the cached one while the names, dtypes and shapes
    (and the values' names) are unchanged, else a new one, cached. ``key``: their
    :func:`plan_key`, where the caller has it already."""
    if key is None:
        key = plan_key(tensors, objects, thread_count)
    context = (1, rank, thread_count)
    plan = cache.lookup(key, context)
    if plan is not None:
        cache.hits += 1
        return plan
    cache.misses += 1
    plan = plan_one_rank(rank, tensors, objects, thread_count, key)
    cache.store(key, context, plan)
    return plan


def single_rank_manifest(
    plan: EnginePlan,
    state: CollectedState,
    step: int | None,
    user_metadata: dict[str, Any] | None,
) -> Manifest:
    """The manifest of a single-rank save of ``state``: the plan's skeleton with the
    step, the key paths and the values (tensor checksums empty: the writer fills them,
    ``commit.parts.manifest_from_parts``)."""
    assert plan.skeleton is not None, "a multi-rank plan's manifest is the coordinator's"
    return dataclasses.replace(
        plan.skeleton,
        step=step,
        tensors=plan.tensor_entries(state.paths),
        objects=plan.object_entries(state.objects, state.paths),
        user_metadata=dict(user_metadata or {}),
        empty_dicts=state.empty,
    )
