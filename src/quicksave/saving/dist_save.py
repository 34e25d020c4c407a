"""The async engine's multi-rank save: plan with the plan cache, then describe this
rank's share of the work for the worker (files, part, records; see ``records``).

Call order (training thread of every rank, once per save): ``DistSaving.plan(state_dict,
final, ...)`` → the engine stages ``DistSave.tensors`` into the pool at ``places`` and
submits a ``PersistJob`` built from the rest. The only collective is inside
``plan_vote.plan_save`` (one small all-reduce on a cache hit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from quicksave.commit import rank_records as records
from quicksave.errors import CheckpointError
from quicksave.format.manifest import Manifest
from quicksave.layout.dcp_metadata import dcp_metadata_bytes
from quicksave.layout.plan import RankLayout
from quicksave.layout.skeleton import chunk_keys_of
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.plan_vote import Rider, plan_save
from quicksave.saving.rank_plans import LocalState
from quicksave.worker.job import DistCommit


@dataclass(frozen=True)
class DistContext:
    """Where a rank's multi-rank saves coordinate.

    Args:
        group: process group for the planning collective (gloo: it runs on the CPU).
        store: the ranks' ``torch.distributed`` store (commit records).
        rank: this rank in ``group``.
        world_size: ranks in ``group``.
        coordinator: the rank whose writer commits.
        commit_timeout_s: how long the coordinator's writer waits for every rank's files
            (a rank that never arrives fails the save after this long, on every rank).
        rider: the owner's integers that ride on every save's vote (``plan_vote.Rider``:
            the manager settles the outcome of earlier saves with them), or None.
    """

    group: Any
    store: Any
    rank: int
    world_size: int
    coordinator: int = 0
    commit_timeout_s: float = 120.0
    rider: Rider | None = None


@dataclass(frozen=True)
class DistSave:
    """One rank's share of one save, ready for staging and the worker."""

    key: tuple  # identifies the layout (the pool is reused while it is unchanged)
    layout: RankLayout
    tensors: dict[str, torch.Tensor]  # chunk key -> this rank's local tensor to write
    sources: dict[str, torch.Tensor]  # chunk key -> its writes' version counter (guard.py)
    places: dict[str, tuple[str, int, int]]  # chunk key -> (file, offset, length)
    manifest: Manifest | None  # the coordinator's skeleton (step, metadata filled)
    chunk_keys: dict[str, tuple[str, int]]  # every rank's chunks (coordinator), else {}
    dcp_metadata: bytes  # the coordinator's .metadata, else b""
    dist: DistCommit
    collectives: int
    tracked: Mapping[str, str] = dataclasses.field(default_factory=dict)  # (incremental)


class DistSaving:
    """Plans multi-rank saves for one AsyncSaver; holds its plan cache."""

    def __init__(
        self, ctx: DistContext, blocked: Callable[[LocalState], LocalState] | None = None
    ) -> None:
        self.ctx = ctx
        self.blocked = blocked  # incremental saves: the collect's split (plan_vote.plan_save)
        self.cache = PlanCache()
        self.address = records.store_address(ctx.store)
        # The records live in the base store, where the workers (connected from
        # ``address``) read them: not under the PrefixStore the default group wraps
        # around it, or a trainer's post would never reach the coordinator's writer.
        self.store = records.base_store(ctx.store)
        self._dcp_metadata: tuple[str, bytes] | None = None  # (global plan key, bytes)

    def plan(
        self,
        state_dict: Mapping[str, Any],
        final: str,
        *,
        step: int | None,
        user_metadata: dict[str, Any] | None,
        thread_count: int,
        go: bool = True,
        ready: Callable[[], bool | None] | None = None,
    ) -> DistSave | None:
        """Plan this save (runs the planning collective) and describe this rank's part.

        Returns None, on every rank, if some rank said it cannot save now (``go``).
        ``ready``: waits, bounded, until this rank can take the save now (see
        ``plan_vote.plan_save``); every rank votes again while one is not ready.

        Raises:
            CheckpointError: bad input (names fqn and rank) or a failed exchange.
        """
        ctx = self.ctx
        try:
            planned = plan_save(
                state_dict,
                self.cache,
                ctx.group,
                ctx.coordinator,
                ctx.rank,
                ctx.world_size,
                thread_count,
                go,
                ready,
                ctx.rider,
                self.blocked,
            )
        except CheckpointError as e:
            if e.path is None:  # planning knows no path; this save's is worth naming
                e.path = final
            raise
        if planned is None:
            return None
        tensors: dict[str, torch.Tensor] = {}
        sources: dict[str, torch.Tensor] = {}
        places: dict[str, tuple[str, int, int]] = {}
        for f in planned.layout.files:
            for e in f.entries:
                key = e.item.key
                t = planned.tensors.get(key)
                if t is None:
                    raise CheckpointError(
                        "the plan gives this rank a chunk it does not hold",
                        path=final,
                        fqn=e.item.fqn,
                        rank=ctx.rank,
                    )
                tensors[key] = t
                sources[key] = planned.sources.get(key, t)
                places[key] = (f.name, e.offset, e.length)
        manifest = None
        chunk_keys: dict[str, tuple[str, int]] = {}
        dcp_metadata = b""
        if planned.skeleton is not None:
            skeleton = planned.skeleton
            if self._dcp_metadata is None or self._dcp_metadata[0] != planned.key:
                self._dcp_metadata = (planned.key, dcp_metadata_bytes(skeleton))
            dcp_metadata = self._dcp_metadata[1]
            manifest = dataclasses.replace(
                skeleton, step=step, user_metadata=dict(user_metadata or {})
            )
            chunk_keys = chunk_keys_of(skeleton)
        return DistSave(
            key=("dist", planned.key, ctx.rank),
            layout=planned.layout,
            tensors=tensors,
            sources=sources,
            places=places,
            manifest=manifest,
            chunk_keys=chunk_keys,
            dcp_metadata=dcp_metadata,
            dist=DistCommit(
                token=planned.token,
                world_size=ctx.world_size,
                coordinator=ctx.coordinator,
                store=self.address,
                objects=planned.values,
                timeout_s=ctx.commit_timeout_s,
            ),
            collectives=planned.collectives,
            tracked=planned.tracked,
        )

    def settled(self, token: str) -> bool:
        """Whether the outcome of the save ``token`` is posted (see ``records``); True
        if the store cannot be asked (nothing to wait for then)."""
        try:
            return records.posted_commit(self.store, token)
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            return True

    @property
    def outcome_wait_s(self) -> float:
        """How long after a save starts every rank's writer has its outcome, at the
        latest (the coordinator's verdict, or its own timeout waiting for it)."""
        return records.commit_wait_s(self.ctx.commit_timeout_s)

    def worker_failed(self, token: str, error: str) -> None:
        """This rank's writer died mid-save: tell the others now, not at the timeout."""
        try:
            records.post_rank(self.store, token, self.ctx.rank, error)
            if self.ctx.rank == self.ctx.coordinator:
                records.post_commit(self.store, token, f"rank {self.ctx.rank}: {error}")
        except Exception:  # noqa: BLE001 - the store may be gone with the job
            pass
