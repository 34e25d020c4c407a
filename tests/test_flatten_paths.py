"""``keypaths.flatten_with_paths`` (the engine's one walk of a state dict per save) gives
exactly what DCP's ``flatten_state_dict`` followed by ``keypaths.structure`` gives: the
same fqns in the same order, the same leaves, paths and empty dicts, and a refusal of
two leaves of one name (naming the fqn and the rank)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from quicksave.errors import IncompatibleStateError
from quicksave.saving.keypaths import flatten_with_paths as walk
from quicksave.saving.keypaths import structure


def _optimizer_state(flat: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    if flat:
        return get_optimizer_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
        )
    return optim.state_dict()


t = torch.arange(3.0)
STATES: dict[str, dict[str, Any]] = {
    "flat manager state": {
        "model": {"0.weight": t, "0.bias": t[:1]},
        "optimizer": _optimizer_state(flat=True),
        "train_state": {"step": 3, "losses": [0.5, 0.25], "log_steps": [1, 2]},
    },
    "torch optimizer state (int keys, lists of dicts)": {"optim": _optimizer_state(flat=False)},
    "key types and empty dicts": {
        "a": {0: t, 1.5: {"x": t}, True: 1, None: "n", (1, 2): t},
        "empty": {},
        "nested_empty": {"inner": {}, "x": {"y": {}}},
        7: {"z": 1},
    },
    "lists and tuples": {
        "tensors": [t, t, {"k": t}],
        "plain": [1, 2, 3],
        "nested": [[1, 2], [t]],
        "empty_list": [],
        "tuple_of_tensors": (t, t),  # a tuple is one leaf, as DCP has it
        "list_of_lists": [[1], [2, [3]]],
        "dict_in_list": [{"a": 1}, 2],
    },
    "ordered and str subclasses": {
        "od": OrderedDict([("b", t), ("a", 1)]),
        "s": {type("Name", (str,), {})("k"): t},
    },
}


@pytest.mark.parametrize("name", list(STATES))
def test_one_walk_gives_what_dcp_and_structure_give(name: str) -> None:
    nested = STATES[name]
    flat, mappings = flatten_state_dict(nested)
    typed, empty = structure(nested, mappings)
    got_flat, got_paths, got_empty = walk(nested)
    assert list(got_flat) == list(flat)
    assert all(got_flat[k] is flat[k] for k in flat)
    assert got_paths == typed
    for k in typed:  # typed elements are the same kind (DictKey or not), not only equal
        assert [type(e) for e in got_paths[k]] == [type(e) for e in typed[k]], k
    assert got_empty == empty


def test_two_leaves_of_one_name_are_refused_as_dcp_refuses_them() -> None:
    nested = {"a": {0: torch.ones(1), "0": torch.zeros(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key a.0"):
        flatten_state_dict(nested)
    with pytest.raises(IncompatibleStateError) as e:
        walk(nested, rank=1)
    assert e.value.fqn == "a.0" and e.value.rank == 1
