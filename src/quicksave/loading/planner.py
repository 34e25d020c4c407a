"""The load planner: DCP's default load planner plus quicksave's checks, and the steps
around it that hand a load's destinations to it and back.

Call order (one load, every rank): :func:`prepare_destinations` (a fresh optimizer's
state allocated from the checkpoint's metadata) → :func:`plain_state_dict` (what the
planner loads into) → the planner's steps (:mod:`.steps`) → :func:`hand_back` (each
``Stateful`` gets what was loaded for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.stateful import Stateful

from quicksave.errors import CheckpointError, IncompatibleStateError, rank_of_this_process
from quicksave.format.dtypes import dtype_name
from quicksave.loading.dcp_stock import RestrictedObjectsMixin


def _real_path(root: Any, path: tuple) -> tuple:
    """``path`` with each string key replaced by the destination's own key whose ``str``
    it is (e.g. an optimizer's int parameter ids), so values land where they came from."""
    out = []
    node = root
    for key in path:
        if isinstance(node, Mapping) and key not in node:
            key = next((k for k in node if str(k) == key), key)
        out.append(key)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _LoadedKeys:
    """The fqns one rank loads, sent to the coordinator in its local plan."""

    fqns: tuple[str, ...]


def _some(fqns: list[str], limit: int = 20) -> str:
    return ", ".join(fqns[:limit]) + (f" … ({len(fqns)} in all)" if len(fqns) > limit else "")


class LoadPlanner(RestrictedObjectsMixin, DefaultLoadPlanner):
    """DCP's default load planner plus quicksave's checks and object hand-off.

    Before any read it compares the destination with the checkpoint and raises
    IncompatibleStateError, naming the offending fqns, for shape or dtype mismatches
    and (when strict) for missing or unexpected keys.

    Strictness is a property of the whole group, not of one rank: in a pipeline-
    parallel job, or with per-rank entries, each rank loads only its own keys.

    - missing: a key this rank asks for that the checkpoint lacks, raised by that rank
      in DCP's local planning step (every failing rank is named);
    - unexpected: a key of the checkpoint that *no* rank asks for, found by the
      coordinator in DCP's global planning step from the key sets the ranks' local
      plans carry (``planner_data``). That rides on the plan exchange DCP makes anyway:
      no extra collective. Keys under a name of ``leave`` (top-level names another load
      of the same checkpoint reads) are not unexpected.
    """

    def __init__(
        self,
        *,
        strict: bool = True,
        path: str = "",
        allow_pickle: bool = False,
        leave: tuple[str, ...] = (),
    ) -> None:
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.path = path
        self.allow_pickle = allow_pickle  # stock DCP objects (RestrictedObjectsMixin)
        self.leave = tuple(f"{name}." for name in leave)

    def set_up_planner(
        self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        assert metadata is not None
        if self.mappings:  # DCP stringifies dict keys in paths: map back to the real keys
            self.mappings = {
                fqn: _real_path(self.original_state_dict, p) for fqn, p in self.mappings.items()
            }
        self._check(metadata)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if not self.strict:
            return plan
        loaded = sorted(set(self.state_dict) & set(self.metadata.state_dict_metadata))
        return dataclasses.replace(plan, planner_data=_LoadedKeys(tuple(loaded)))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if self.strict:
            loaded: set[str] = set()
            for plan in global_plan:
                if isinstance(plan.planner_data, _LoadedKeys):
                    loaded.update(plan.planner_data.fqns)
            unexpected = sorted(
                k
                for k in set(self.metadata.state_dict_metadata) - loaded
                if not k.startswith(self.leave)
            )
            if unexpected:
                who = "this process" if len(global_plan) == 1 else "any rank"
                raise IncompatibleStateError(
                    f"state dict keys do not match the checkpoint (in the checkpoint but "
                    f"not in the state dict of {who}: {_some(unexpected)}); "
                    "pass strict=False to load the intersection",
                    path=self.path,
                    fqn=unexpected[0],
                )
            # Only the coordinator needs the key sets: do not send them back.
            global_plan = [dataclasses.replace(p, planner_data=None) for p in global_plan]
        return super().create_global_plan(global_plan)

    def _check(self, metadata: Metadata) -> None:
        rank = rank_of_this_process()
        stored = metadata.state_dict_metadata
        dest_keys = set(self.state_dict)
        missing = sorted(dest_keys - set(stored))
        if self.strict and missing:
            raise IncompatibleStateError(
                f"state dict keys do not match the checkpoint (missing from checkpoint: "
                f"{_some(missing)}); pass strict=False to load the intersection",
                path=self.path,
                fqn=missing[0],
                rank=rank,
            )
        for fqn in sorted(dest_keys & set(stored)):
            md, value = stored[fqn], self.state_dict[fqn]
            is_tensor = (
                hasattr(value, "size") and hasattr(value, "dtype") and not isinstance(value, type)
            )
            if isinstance(md, TensorStorageMetadata):
                if not is_tensor:
                    raise IncompatibleStateError(
                        "checkpoint holds a tensor here but the state dict has a value of type "
                        f"{type(value).__name__}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
                if tuple(value.size()) != tuple(md.size):
                    raise IncompatibleStateError(
                        f"shape mismatch: checkpoint {list(md.size)}, "
                        f"state dict {list(value.size())}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
                if value.dtype != md.properties.dtype:
                    raise IncompatibleStateError(
                        f"dtype mismatch: checkpoint {dtype_name(md.properties.dtype)}, "
                        f"state dict {dtype_name(value.dtype)}",
                        path=self.path,
                        fqn=fqn,
                        rank=rank,
                    )
            elif (
                isinstance(md, BytesStorageMetadata)
                and is_tensor
                and isinstance(value, torch.Tensor)
            ):
                raise IncompatibleStateError(
                    "checkpoint holds a non-tensor value here but the state dict has a tensor",
                    path=self.path,
                    fqn=fqn,
                    rank=rank,
                )

    def load_value(self, read_item, value: Any) -> None:
        """Take a value ``StorageReader`` decoded from JSON (no ``torch.save`` round trip)."""
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value


def plain_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """What the planner loads into: each ``Stateful`` value's ``state_dict()`` in its
    place (as ``dcp.load``), the other values as they are."""
    return {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key, value in state_dict.items()
    }


def hand_back(state_dict: Mapping[str, Any], plain: dict[str, Any]) -> None:
    """After every read: each ``Stateful`` gets ``load_state_dict`` of what was loaded
    for it, and the other top-level values are replaced by the loaded ones."""
    for key, value in list(state_dict.items()):
        if isinstance(value, Stateful):
            value.load_state_dict(plain[key])
        else:
            state_dict[key] = plain[key]  # type: ignore[index]


def prepare_destinations(
    state_dict: Mapping[str, Any], metadata: Metadata, path: str
) -> list[Callable[[], None]]:
    """Let each top-level value with a ``prepare_load(stored, prefix)`` method shape its
    destinations from the checkpoint's metadata before DCP asks for its state dict (an
    ``OptimizerState`` whose optimizer has no state yet allocates it, instead of
    torch's zero-gradient step). Returns the functions that undo it, for a failed load;
    an error it raises is given ``path`` (the checkpoint) if it names none."""
    undos = []
    try:
        for key, value in state_dict.items():
            if not callable(getattr(value, "prepare_load", None)):
                continue
            undo = value.prepare_load(metadata.state_dict_metadata, f"{key}.")
            if undo is not None:
                undos.append(undo)
    except BaseException as e:  # e.g. a per-rank state refusing the checkpoint
        for undo in undos:
            undo()
        if isinstance(e, CheckpointError) and e.path is None:
            e.path = path
        raise
    return undos
