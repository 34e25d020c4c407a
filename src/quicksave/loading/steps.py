"""A load driven by a DCP ``LoadPlanner``, step by step, over quicksave's exchange: the
steps of ``quicksave.load`` (so of the manager's and torchtitan's loads) and of
``quicksave.load_state`` of a stock DCP checkpoint (``load_state`` reads a quicksave
checkpoint without a planner, ``tools/read_full.py``).

DCP's load planner resolves resharded reads (any world size, DTensor / ShardedTensor
destinations); quicksave runs its steps itself instead of through ``dcp.load``, so that
the ranks talk through the one plan exchange (``ranks.exchange.central_round``) and
every failure surfaces on every rank as a ``CheckpointError`` naming the rank. Users who
call ``dcp.load`` themselves still get DCP's own driver over the same reader
(``quicksave.StorageReader``).

One load, every rank of the group::

    load_local_plan(state_dict, metadata, ...)        no communication
    exchange_load_plans(local, planner, reader, ...)  ── central_round: the planner's
                                                         global checks (strict keys) on
                                                         the coordinator ──
    read_all(central, planner, reader, ...)           this rank's reads; then
                                                      ── central_round: every rank
                                                         hears of any rank's failure ──
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from quicksave.errors import CheckpointError, combined_failure
from quicksave.ranks.exchange import central_round, failures_in, sendable


class Group(Protocol):
    """Who takes part (DCP's ``_DistWrapper`` is one): the group, its coordinator (a
    group rank), this rank, and whether there is a group at all."""

    group: Any
    coordinator_rank: int
    is_coordinator: bool
    use_dist: bool

    def get_rank(self) -> int: ...


def group_round(mine: Any, decide: Any, group: Group, path: str) -> Any:
    """Collective: one ``central_round`` of ``group`` (``mine`` to the coordinator,
    ``decide`` there, this rank's reply back; a failure anywhere raised on every rank)."""
    return central_round(
        mine,
        decide,
        group.group,
        group.coordinator_rank,
        group.get_rank(),
        distributed=group.use_dist,
        path=path,
    )


class PlannedReader(Protocol):
    """What the load steps need of a reader (quicksave's, or DCP's own for a stock
    checkpoint)."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None: ...
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan: ...
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]: ...
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any: ...


def load_local_plan(
    state_dict: dict[str, Any],
    metadata: Metadata,
    planner: LoadPlanner,
    reader: PlannedReader,
    group: Group,
) -> LoadPlan | CheckpointError:
    """This rank's reads, or its failure (sent on, so every rank fails together)."""
    try:
        planner.set_up_planner(state_dict, metadata, group.is_coordinator)
        reader.set_up_storage_reader(metadata, group.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())
    except BaseException as e:  # noqa: BLE001 - raised on every rank by the exchange
        return sendable(e, group.get_rank())


def exchange_load_plans(
    local: LoadPlan | CheckpointError,
    planner: LoadPlanner | None,
    reader: PlannedReader,
    group: Group,
    path: str,
) -> LoadPlan:
    """Collective: every rank's reads to the coordinator, the planner's global step
    there (strict loading checks that every key of the checkpoint is asked for), each
    rank its plan back. A failure on any rank is raised on every rank (a rank that
    failed before it had a planner or a reader passes None: they are used only when no
    rank failed)."""

    def decide(gathered: list[LoadPlan | CheckpointError]) -> list[LoadPlan]:
        failed = failures_in(gathered)
        if failed:
            raise combined_failure(failed, path)
        assert planner is not None
        return reader.prepare_global_plan(planner.create_global_plan(gathered))

    return group_round(local, decide, group, path)


def read_all(
    central: LoadPlan, planner: LoadPlanner, reader: PlannedReader, group: Group, path: str
) -> None:
    """Collective: this rank reads its share into the state dict, then one
    ``central_round`` tells every rank whether every rank succeeded; each raises the
    same error otherwise."""
    rank = group.get_rank()
    mine: CheckpointError | None = None
    try:
        reader.read_data(planner.finish_plan(central), planner).wait()
    except BaseException as e:  # noqa: BLE001 - raised on every rank by the round
        mine = sendable(e, rank)

    def decide(gathered: list[CheckpointError | None]) -> list[None]:
        failed = failures_in(gathered)
        if failed:
            raise combined_failure(failed, path)
        return [None] * len(gathered)

    group_round(mine, decide, group, path)
