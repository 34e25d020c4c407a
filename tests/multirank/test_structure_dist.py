"""Multi-rank saves record the nested structure too (FORMAT.md §2.1): a 2-rank
``CheckpointManager`` (async process mode: plans exchanged through the plan cache)
saves optimizer-like state with int keys and empty dicts, on each rank its own, and a
templateless load in the parent process gives it back exactly, keys typed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launcher import LaunchConfig, run_ranks
from tests.helpers.state import Holder

import quicksave

pytestmark = pytest.mark.slow


def rank_state(rank: int) -> dict[str, Any]:
    return {
        "state": {rank: {"exp_avg": torch.full((3,), float(rank)), "step": torch.tensor(2.0)}},
        "param_groups": [{"params": [rank], "lr": 0.1, "betas": (0.9, 0.99)}],
        "empty": {},
        "flags": {True: "yes", None: 1.5},
    }


def _rank_save(rank: int, world_size: int, folder: str) -> str:
    config = quicksave.CheckpointConfig(folder=folder, interval=1, async_mode="process")
    states = {"shared": Holder({"ids": {0: torch.arange(4)}}), f"r{rank}": Holder(rank_state(rank))}
    with quicksave.CheckpointManager(config, states) as manager:
        manager.save(1)
        manager.save(2)  # the second save reuses the cached plans
    return manager.step_path(2)


def test_multi_rank_saves_keep_key_types_and_empty_dicts(tmp_path: Path) -> None:
    config = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=60.0)
    paths = run_ranks(_rank_save, 2, str(tmp_path), config=config)
    assert paths[0] == paths[1]
    got = quicksave.load_state(paths[0])
    assert set(got) == {"shared", "r0", "r1"}
    assert list(got["shared"]["ids"]) == [0] and torch.equal(
        got["shared"]["ids"][0], torch.arange(4)
    )
    for rank in (0, 1):
        want = rank_state(rank)
        r = got[f"r{rank}"]
        assert list(r["state"]) == [rank] and type(next(iter(r["state"]))) is int
        assert torch.equal(r["state"][rank]["exp_avg"], want["state"][rank]["exp_avg"])
        assert r["param_groups"] == want["param_groups"]
        assert r["empty"] == {} and r["flags"] == {True: "yes", None: 1.5}
