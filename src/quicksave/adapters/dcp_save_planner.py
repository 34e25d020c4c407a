"""The DCP ``SavePlanner`` the NVRx-compatible API plans with unless the user passes one.

DCP's planner chunks DTensor / ShardedTensor state and deduplicates replicated tensors;
this subclass adds what quicksave records and checks: the key paths and empty containers
DCP's flattening loses (``saving/keypaths.py``, carried in the plans' ``planner_data``),
a comparison of the copies several ranks hold under one name (``ranks/replicas.py``), and
a dedup that sizes every dtype. Its steps run on every rank as DCP orders them
(``compat/nvrx/dcp_steps.py``); the comparison is made by the coordinator in the global
step, whose failure every rank raises.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from quicksave.adapters.dcp_writer import item_spec
from quicksave.format import objects as objcodec
from quicksave.format.keys import EMPTY_KEY, REPLICAS_KEY
from quicksave.ranks import replicas
from quicksave.saving.keypaths import structure


def _element_bytes(item) -> int:
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


class DcpSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, as the NVRx-compatible API plans with it by default,
    with quicksave's additions: the key paths DCP's flattening loses, and its own dedup
    of replicated chunks (DCP sizes items with ``torch._utils._element_size``, which
    raises for bits*/int1..7/uint1..7).

    DCP deduplicates what several ranks save under one name without comparing the
    copies. This planner compares them (``ranks/replicas.py``): each rank's local plan
    carries its copies' digests (``REPLICAS_KEY`` in ``planner_data``), and the
    coordinator refuses copies that differ in the global planning step, whose failure
    every rank raises. No extra collective.

    ``check_replicas``: send the copies (False in a single process: nothing to compare).
    """

    def __init__(self, *, check_replicas: bool = True) -> None:
        super().__init__()
        self.check_replicas = check_replicas

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # What DCP's flattening loses (saving/keypaths.py), carried to the writer's manifest in
        # the mappings DCP merges into Metadata.planner_data; a tuple key cannot be an fqn.
        self.mappings, empty = structure(state_dict, self.mappings)
        if empty:
            self.mappings[EMPTY_KEY] = tuple(sorted(empty, key=repr))  # type: ignore[index]

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if not self.check_replicas or not (dist.is_available() and dist.is_initialized()):
            return plan
        copies: dict[str, replicas.Copy] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                encoded = objcodec.encode(self.lookup_object(item.index), fqn)
                copies[replicas.value_key(fqn)] = replicas.value_copy(fqn, encoded)
                continue
            spec = item_spec(item)
            if spec.nbytes <= replicas.CHECK_BYTES:
                c = replicas.tensor_copy(fqn, self.lookup_object(item.index))
                if c is not None:
                    copies[replicas.tensor_key(spec.key)] = c
        data = dict(plan.planner_data) if isinstance(plan.planner_data, dict) else {}
        data[REPLICAS_KEY] = copies
        return dataclasses.replace(plan, planner_data=data)

    def create_global_plan(self, all_plans):
        # Compare the copies of what several ranks save, then drop them: only the
        # coordinator needs them.
        copies: list[dict[str, replicas.Copy]] = []
        stripped = []
        for plan in all_plans:
            data = plan.planner_data
            if isinstance(data, dict) and REPLICAS_KEY in data:
                copies.append(data[REPLICAS_KEY])
                data = {k: v for k, v in data.items() if k != REPLICAS_KEY}
                plan = dataclasses.replace(plan, planner_data=data)
            else:
                copies.append({})
            stripped.append(plan)
        all_plans = stripped
        differ = replicas.divergence(copies)
        if differ is not None:
            raise differ
        # DCP merges the ranks' mappings with a ChainMap (the first rank's entry wins):
        # the empty dicts are every rank's.
        empty: set[tuple] = set()
        for plan in all_plans:
            if isinstance(plan.planner_data, dict):
                empty.update(plan.planner_data.get(EMPTY_KEY, ()))
        plans, metadata = super().create_global_plan(all_plans)
        if isinstance(metadata.planner_data, dict):
            merged = {k: v for k, v in metadata.planner_data.items() if k != EMPTY_KEY}
            if empty:
                merged[EMPTY_KEY] = tuple(sorted(empty, key=repr))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        return plans, metadata

    def _dedup_save_plans(self, all_plans):
        owners: dict[Any, list[int]] = {}
        items: dict[Any, Any] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                owners.setdefault(item.index, []).append(rank)
                items[item.index] = item
        load = [0] * len(all_plans)
        keep: list[set] = [set() for _ in all_plans]
        for index, ranks in owners.items():
            # Same policy as DCP: lowest rank, or the rank with the fewest bytes so far.
            lowest = self.dedup_save_to_lowest_rank
            chosen = ranks[0] if lowest else min(ranks, key=load.__getitem__)
            load[chosen] += _element_bytes(items[index])
            keep[chosen].add(index)
        return [
            dataclasses.replace(plan, items=[i for i in plan.items if i.index in keep[rank]])
            for rank, plan in enumerate(all_plans)
        ]
