"""Per-rank state is never collapsed silently (issue 20, point 4).

Each rank's data loader position differs. Under one plain name a checkpoint can keep
only one copy: the save must fail on every rank, naming the name, the ranks, their
values and the wrapper to use, and commit nothing. Equal copies (replicated weights, an
LR scheduler, a global step) save as before, with no extra collective. Wrapped in
``quicksave.PerRank`` every rank gets its own value back. Each in the three async modes:
the engine's multi-rank planning (process, thread) and ``quicksave.save``'s DCP planning
(disabled).

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

import quicksave
from helpers.collectives import CollectiveLog
from quicksave.errors import IncompatibleStateError
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=150.0, grace_s=10.0, collective_timeout_s=60.0)
MODES = ["process", "thread", "disabled"]


class Position:
    """A stateful data loader's position (``Stateful``): batches drawn so far."""

    def __init__(self, batches: int) -> None:
        self.batches = batches

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = int(state_dict["batches"])


class Counters:
    """Per-rank state kept in a small tensor (e.g. samples seen per bucket)."""

    def __init__(self, values: list[int]) -> None:
        self.seen = torch.tensor(values, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen.copy_(state_dict["seen"])


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank: replicated, written once
    return nn.Linear(8, 4)


def _manager(root: str, mode: str, states: dict[str, Any]) -> CheckpointManager:
    folder = os.path.join(root, f"ckpt-{mode}")
    return CheckpointManager(CheckpointConfig(folder=folder, interval=1, async_mode=mode), states)


def _listing(root: str, mode: str) -> list[str]:
    folder = os.path.join(root, f"ckpt-{mode}")
    return sorted(n for n in os.listdir(folder) if n.startswith("step-"))


def _rank_plain_key(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    model, loader = _model(), Position(100 + rank)
    manager = _manager(root, mode, {"model": ModelState(model), "dataloader": loader})
    out: dict[str, Any] = {}
    try:
        manager.save(1)
        manager.wait()
        out["error"] = None
    except IncompatibleStateError as e:
        out["error"] = str(e)
    dist.barrier()
    out["committed_after_error"] = manager.committed_steps()
    out["listing_after_error"] = _listing(root, mode)
    # Equal values under the plain name (a position every rank shares) save as before;
    # after the first of them, a save whose equal values changed exchanges no plans
    # (the comparison rides on the planning all-reduce).
    log = CollectiveLog(thread=threading.main_thread()).install()
    for step in (2, 3, 4):
        loader.batches = 10 * step
        log.step = step
        assert manager.save(step)
    manager.wait()
    log.uninstall()
    out["exchanges"] = [
        sum(c.name in ("gather_object", "scatter_object_list") for c in log.calls if c.step == s)
        for s in (2, 3, 4)
    ]
    out["committed"] = manager.committed_steps()
    manager.close()
    resumed = Position(0)
    again = _manager(root, mode, {"model": ModelState(_model()), "dataloader": resumed})
    out["loaded"] = again.load()
    out["batches"] = resumed.batches
    again.close()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_different_values_under_a_plain_name_fail_the_save_on_every_rank(tmp_path, mode):
    results = run_ranks(_rank_plain_key, 2, str(tmp_path), mode, config=LAUNCH)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    message = errors[0]
    assert "fqn=dataloader.batches" in message
    assert "rank 0: 100" in message and "rank 1: 101" in message
    assert "quicksave.PerRank" in message
    assert "nothing was saved" in message and f"path={tmp_path}" in message
    for r in results:
        assert r["committed_after_error"] == [] and r["listing_after_error"] == [], r
        # Equal values: committed, and once planned, one all-reduce per save.
        assert r["committed"] == [2, 3, 4], r
        assert r["loaded"] == 4 and r["batches"] == 40, r
        if mode != "disabled":  # the engine's plan cache (DCP gathers plans each save)
            assert r["exchanges"] == [2, 0, 0], r["exchanges"]


def _rank_small_tensor(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    counters = Counters([rank, 7, 2 * rank])
    manager = _manager(root, mode, {"model": ModelState(_model()), "counters": counters})
    out: dict[str, Any] = {}
    try:
        manager.save(1)
        manager.wait()
        out["error"] = None
    except IncompatibleStateError as e:
        out["error"] = str(e)
    dist.barrier()
    out["listing"] = _listing(root, mode)
    manager.close()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_small_tensors_that_differ_under_a_plain_name_fail_the_save(tmp_path, mode):
    results = run_ranks(_rank_small_tensor, 2, str(tmp_path), mode, config=LAUNCH)
    message = results[0]["error"]
    assert message is not None and results[1]["error"] == message, results
    assert "fqn=counters.seen" in message
    assert "rank 0: int64[3] [0, 7, 0]" in message and "rank 1: int64[3] [1, 7, 2]" in message
    assert "quicksave.PerRank" in message
    assert all(r["listing"] == [] for r in results)


def _rank_wrapped(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    loader, counters = Position(100 + rank), Counters([rank, 7, 2 * rank])
    states = {
        "model": ModelState(_model()),
        "dataloader": quicksave.PerRank(loader),
        "counters": quicksave.PerRank(counters),
    }
    manager = _manager(root, mode, states)
    assert manager.save(1)
    loader.batches += 5
    assert manager.save(2)
    manager.close()
    loader2, counters2 = Position(0), Counters([0, 0, 0])
    again = _manager(
        root,
        mode,
        {
            "model": ModelState(_model()),
            "dataloader": quicksave.PerRank(loader2),
            "counters": quicksave.PerRank(counters2),
        },
    )
    loaded = again.load()
    again.close()
    return {"loaded": loaded, "batches": loader2.batches, "seen": counters2.seen.tolist()}


@pytest.mark.parametrize("mode", MODES)
def test_per_rank_wrapper_gives_every_rank_its_own_value_back(tmp_path, mode):
    results = run_ranks(_rank_wrapped, 2, str(tmp_path), mode, config=LAUNCH)
    assert results == [
        {"loaded": 2, "batches": 105, "seen": [0, 7, 0]},
        {"loaded": 2, "batches": 106, "seen": [1, 7, 2]},
    ]
    # On another world size the default refuses to guess, before reading anything.
    folder = str(tmp_path / f"ckpt-{mode}")
    alone = Position(0)
    manager = CheckpointManager(
        CheckpointConfig(folder=folder, async_mode="disabled"),
        {
            "model": ModelState(_model()),
            "dataloader": quicksave.PerRank(alone),
            "counters": quicksave.PerRank(Counters([0, 0, 0])),
        },
    )
    with pytest.raises(IncompatibleStateError, match="saved by 2 ranks") as info:
        manager.load()
    assert "on_resize='keep'" in str(info.value) and alone.batches == 0
    manager.close()
    # on_resize="keep": a rank with an entry of its own loads it (rank 0 here).
    kept = Position(0)
    manager = CheckpointManager(
        CheckpointConfig(folder=folder, async_mode="disabled"),
        {
            "model": ModelState(_model()),
            "dataloader": quicksave.PerRank(kept, on_resize="keep"),
            "counters": quicksave.PerRank(Counters([0, 0, 0]), on_resize="keep"),
        },
    )
    assert manager.load() == 2 and kept.batches == 105
    manager.close()
