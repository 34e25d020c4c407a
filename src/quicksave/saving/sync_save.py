"""A synchronous save over the engine's planner: what ``quicksave.save`` runs.

The same pipeline as the engine's, less the staging (a synchronous save has nothing to
overlap, so the bytes are written straight from the tensors):

    collect    rank_plans.collect_local: this rank's chunks (DTensor, ShardedTensor and
               plain tensors alike), its values encoded and checked (once), its key
               paths
    plan       ── central_round: every local plan (and the copies of what ranks may
               share, ranks/replicas.py) to the coordinator, which refuses copies that
               differ, makes the global plan (rank_plans.global_plan: each chunk once, the
               files laid out, the manifest's skeleton) and opens the draft at the
               location's commit strategy; each rank gets its share back ──
    persist    worker/persist.write_rank: this rank's files, xxh3 on the way, fsync
    commit     ── central_round: each rank's part (its chunks' checksums, its values) to
               the coordinator, which fills the skeleton
               (commit.parts.manifest_from_parts) and commits, or discards what was
               written if any rank failed; every rank returns once the checkpoint is
               committed, or raises the same error ──

Every rank of the group calls :func:`save_sync` (``distributed=False``: this process
alone, no collective). A failure on any rank — a value that cannot be stored, a write,
the commit — is raised on every rank, naming the rank and the path; nothing half-written
is ever visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from quicksave.commit import CommitStrategy, new_token, strategy_for
from quicksave.commit.parts import RankPart, manifest_from_parts
from quicksave.errors import CheckpointError, IncompatibleStateError, combined_failure
from quicksave.format.manifest import check_user_metadata
from quicksave.layout.dcp_metadata import dcp_metadata_bytes
from quicksave.layout.plan import RankLayout
from quicksave.layout.skeleton import chunk_keys_of
from quicksave.ranks import replicas
from quicksave.ranks.exchange import central_round, failures_in, sendable
from quicksave.saving.rank_plans import (
    GlobalPlan,
    LocalPlan,
    LocalState,
    collect_local,
    global_plan,
    local_copies,
)
from quicksave.storage.location import Location
from quicksave.trace import phase
from quicksave.worker import persist
from quicksave.worker.files import commit_files


@dataclass(frozen=True)
class _Share:
    """What the coordinator's plan gives one rank: where to write, what, which values."""

    draft: str
    layout: RankLayout
    objects: tuple[str, ...]


@dataclass(frozen=True)
class SyncSave:
    """One synchronous save's parameters (``quicksave.save``'s arguments)."""

    step: int | None = None
    thread_count: int = 2
    user_metadata: dict[str, Any] | None = None
    overwrite: bool = False
    fsync: bool = True


def save_sync(
    state_dict: Mapping[str, Any],
    loc: Location,
    options: SyncSave,
    *,
    group: Any = None,
    rank: int = 0,
    distributed: bool = False,
) -> None:
    """Save ``state_dict`` at ``loc`` and commit it; collective over ``group``.

    Args:
        state_dict: this rank's state (``Stateful`` values at the top level).
        loc: where the checkpoint goes (every rank the same).
        options: step, files per rank, user metadata, overwrite, fsync.
        group: the process group (None: the default one); ``rank``: this process's
            rank in it; ``distributed``: False for one process alone (errors then name
            no rank).

    Raises:
        IncompatibleStateError, CheckpointExistsError, CheckpointError: on every rank
            alike, naming the rank at fault and the path; nothing was committed.
    """
    strategy = strategy_for(loc, loc.open(fsync=options.fsync, rank=rank), owned=True)
    run = _Run(strategy, loc, options, group, rank, distributed)
    try:
        run.write_and_commit(run.plan(state_dict))
    except BaseException:
        run.discard()  # the coordinator, when a collective broke before the commit
        raise
    finally:
        strategy.close()


class _Run:
    """One :func:`save_sync` on one rank (on the coordinator: the plan and the
    draft)."""

    def __init__(
        self,
        strategy: CommitStrategy,
        loc: Location,
        options: SyncSave,
        group: Any,
        rank: int,
        distributed: bool,
    ) -> None:
        self.strategy = strategy
        self.loc = loc
        self.options = options
        self.group = group
        self.rank = rank
        self.distributed = distributed
        self.named = rank if distributed else None  # the rank errors name
        self.path = loc.url
        self.state: Any = None
        self.global_plan: GlobalPlan | None = None  # the coordinator's
        self.draft: str | None = None  # the coordinator's, until committed or discarded

    def _round(self, mine: Any, decide: Any) -> Any:
        return central_round(
            mine, decide, self.group, 0, self.rank, distributed=self.distributed, path=self.path
        )

    def _with_path(self, e: CheckpointError) -> CheckpointError:
        if e.path is None:
            e.path = self.path
        return e

    # -- collect, plan ----------------------------------------------------------------
    def plan(self, state_dict: Mapping[str, Any]) -> _Share:
        mine: tuple[LocalPlan, dict[str, replicas.Copy]] | CheckpointError
        try:
            with phase("save.collect"):
                self.state = self._collect(state_dict)
                copies = local_copies(self.state) if self.distributed else {}
            mine = (self.state.plan, copies)
        except CheckpointError as e:
            if not self.distributed:
                raise self._with_path(e) from None
            mine = self._with_path(e)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by the exchange
            mine = sendable(e, self.rank)
        with phase("save.plan"):
            return self._round(mine, self._decide_plan)

    def _collect(self, state_dict: Mapping[str, Any]) -> LocalState:
        """This rank's chunks and values, every value encoded (and so checked) once."""
        try:
            return collect_local(state_dict, self.rank)
        except IncompatibleStateError as e:
            e.rank = self.named  # one process alone: its errors name no rank
            raise

    def _decide_plan(self, gathered: list[Any]) -> list[_Share]:
        failed = failures_in(gathered)
        if failed:
            raise combined_failure(failed, self.path)
        differ = replicas.divergence([copies for _, copies in gathered])
        if differ is not None:
            raise self._with_path(differ)
        check_user_metadata(dict(self.options.user_metadata or {}), self.path, self.named)
        gp = global_plan([lp for lp, _ in gathered], max(1, self.options.thread_count))
        self.draft = self.strategy.begin(self.loc, new_token(), replace=self.options.overwrite)
        self.global_plan = gp
        return [
            _Share(self.draft, layout, objects)
            for layout, objects in zip(gp.layouts, gp.objects, strict=True)
        ]

    # -- persist, commit -------------------------------------------------------------
    def write_and_commit(self, share: _Share) -> None:
        mine: RankPart | CheckpointError
        try:
            with phase("save.persist"):
                written = persist.write_rank(
                    self.strategy.backend, share.draft, share.layout, self.state.tensors
                )
            digests = {k: d for f in written for k, d in f.chunk_xxh3_64.items()}
            values = {fqn: self.state.values[fqn] for fqn in share.objects}
            mine = RankPart(self.rank, digests, values)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by the round
            mine = sendable(e, self.rank)
        with phase("save.commit"):
            self._round(mine, self._decide_commit)

    def _decide_commit(self, gathered: list[Any]) -> list[None]:
        gp, draft = self.global_plan, self.draft
        assert gp is not None and draft is not None
        try:
            failed = failures_in(gathered)
            if failed:
                raise combined_failure(failed, self.path)
            skeleton = gp.skeleton  # (one rank's has no plans: FORMAT.md §2)
            manifest = manifest_from_parts(skeleton, chunk_keys_of(skeleton), gathered, draft)
            manifest = replace(
                manifest,
                step=self.options.step,
                user_metadata=dict(self.options.user_metadata or {}),
            )
            commit_files(
                self.strategy,
                draft,
                self.loc,
                manifest,
                dcp_metadata_bytes(manifest),
                replace=self.options.overwrite,
            )
        except BaseException:
            self.discard()  # before the others hear of it: they find nothing left
            raise
        self.draft = None  # committed
        return [None] * len(gathered)

    def discard(self) -> None:
        """Coordinator: remove what this failed save wrote (every rank's data files as
        planned; best effort), unless it was committed."""
        gp, draft, self.draft = self.global_plan, self.draft, None
        if gp is not None and draft is not None:
            self.strategy.discard(draft, [f.name for lay in gp.layouts for f in lay.files])
