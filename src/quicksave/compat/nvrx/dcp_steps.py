"""A save driven by a DCP ``SavePlanner`` over quicksave's exchange: the steps of the
NVRx-compatible API's planning (whose users pass DCP planners). A load's steps are the load
engine's (``loading/steps.py``), whose one ``central_round`` per step these share.

The NVRx API's planning, every rank of the group (its writes and commit run in the
checkpoint worker and at finalize, ``compat/nvrx``)::

    local_plan(state_dict, planner, writer, ...)      no communication
    exchange_plans(local, planner, writer, ...)       ── central_round: gather the local
                                                         plans, create_global_plan and
                                                         the writer's layout on the
                                                         coordinator, scatter ──
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from quicksave.errors import CheckpointError, combined_failure
from quicksave.loading.steps import Group, group_round
from quicksave.ranks.exchange import failures_in, sendable


class PlannedWriter(Protocol):
    """What the steps need of a quicksave DCP ``StorageWriter``."""

    path: str

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan: ...
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]: ...


def local_plan(
    state_dict: dict[str, Any],
    planner: SavePlanner,
    writer: PlannedWriter,
    group: Group,
) -> SavePlan | CheckpointError:
    """This rank's local plan, or its failure (sent on, so every rank fails together).
    The planner gets no ``storage_meta`` (as NVRx's saver)."""
    rank = group.get_rank()
    try:
        planner.set_up_planner(state_dict, is_coordinator=group.is_coordinator)
        writer.set_up_storage_writer(group.is_coordinator, rank=rank)
        return writer.prepare_local_plan(planner.create_local_plan())
    except BaseException as e:  # noqa: BLE001 - raised on every rank by the exchange
        return sendable(e, rank)


def exchange_plans(
    local: SavePlan | CheckpointError,
    planner: SavePlanner,
    writer: PlannedWriter,
    group: Group,
    *,
    describe_layout: Any = None,
) -> tuple[SavePlan, Metadata | None]:
    """Collective: every local plan to the coordinator, the planner's global planning
    and the writer's layout there, each rank its central plan back. A failure on any
    rank (its local plan, or the coordinator's planning) is raised on every rank.

    Args:
        describe_layout: called with the global metadata on the coordinator after the
            writer's layout (the NVRx writer records it in ``storage_data``).

    Returns:
        ``(central plan, global metadata on the coordinator, else None)``.
    """
    global_metadata: Metadata | None = None

    def decide(gathered: list[SavePlan | CheckpointError]) -> list[SavePlan]:
        nonlocal global_metadata
        failed = failures_in(gathered)
        if failed:
            raise combined_failure(failed, writer.path)
        plans, global_metadata = planner.create_global_plan(gathered)
        plans = writer.prepare_global_plan(plans)
        if describe_layout is not None:
            describe_layout(global_metadata)
        return plans

    central = group_round(local, decide, group, writer.path)
    return central, global_metadata if group.is_coordinator else None
