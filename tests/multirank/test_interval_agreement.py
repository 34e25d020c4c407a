"""Time-based saves agreed across real gloo ranks whose clocks disagree.

Each rank gets its own fake clock: only rank 1's runs fast enough for the interval to
run out, so only rank 1's policy ever says "due". Every rank must still save at the same
steps (or the save's collectives would deadlock), and the ranks talk only at check
steps: one asynchronous all-reduce there, nothing at the steps in between. Building the
manager makes one more all-reduce on the same group (every rank learns whether the
coordinator got the folder's writer lease): it is not a vote and is counted apart, under
step label 0. Collectives are counted in the ranks by ``helpers.collectives.CollectiveLog``.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

from helpers.collectives import CollectiveLog
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=90.0, grace_s=15.0, collective_timeout_s=45.0)
CHECK_STEPS = 4
STEPS = 16


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as with data parallelism
    return nn.Linear(8, 4)


class NotGlooDist:
    """``torch.distributed`` as the manager module sees it, but with a training group
    that is not gloo (as with NCCL), so that the manager creates its own gloo group."""

    def __init__(self) -> None:
        self.new_groups = 0

    def get_backend(self, group: Any = None) -> str:
        return "nccl"

    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        self.new_groups += 1
        return dist.new_group(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def _rank_skewed_clocks(
    rank: int, world_size: int, root: str, async_mode: str, not_gloo: bool
) -> dict[str, Any]:
    from quicksave.manager import session as session_module

    fake = NotGlooDist()
    if not_gloo:
        session_module.dist = fake  # type: ignore[assignment]
    log = CollectiveLog()
    log.install()
    # Rank 1's clock runs 10 s per step, the others' stand still: with a 25 s interval
    # only rank 1 ever finds a save due (from step 4, and again 3 steps after a save).
    clock = (lambda: 10.0 * log.step) if rank == 1 else (lambda: 0.0)
    config = CheckpointConfig(
        folder=os.path.join(root, "seconds"),
        interval=25,
        interval_type="seconds",
        interval_check_steps=CHECK_STEPS,
        async_mode=async_mode,
        staging="blocking",
    )
    manager = CheckpointManager(config, {"model": ModelState(_model())}, clock=clock)
    setup = list(log.calls)  # construction: the read-only agreement (log.step is 0)
    saved = []
    for step in range(1, STEPS + 1):
        log.step = step
        if manager.save(step):
            saved.append(step)
    log.step = STEPS + 1
    manager.close()
    per_step = {step: log.at(step) for step in range(1, STEPS + 1)}
    group = manager.session.checkpoint_group()
    # The interval's votes: the asynchronous all-reduces of the save() calls (not the
    # construction's read-only agreement, which may run the same kind of all-reduce).
    votes = [
        c.group for c in log.calls if c.name == "all_reduce" and c.async_op and 1 <= c.step <= STEPS
    ]
    return {
        "saved": saved,
        "committed": manager.committed_steps(),
        "setup": [c.name for c in setup],
        "setup_on_checkpoint_group": all(c.group is group for c in setup),
        "at_close": log.at(STEPS + 1),
        "per_step": per_step,
        "new_groups": fake.new_groups,
        "own_group": group is not None,
        "votes": len(votes),
        "votes_on_checkpoint_group": all(g is group for g in votes),
    }


def _rank_step_policy_is_silent(rank: int, world_size: int, root: str) -> dict[str, Any]:
    log = CollectiveLog()
    log.install()
    config = CheckpointConfig(folder=os.path.join(root, "steps"), interval=5, async_mode="disabled")
    manager = CheckpointManager(config, {"model": ModelState(_model())})
    saved = []
    for step in range(1, 8):
        log.step = step
        if manager.save(step):
            saved.append(step)
    log.step = 8  # close() settles the saves' outcomes: not one of the steps
    manager.close()
    return {
        "saved": saved,
        "interval": manager.schedule.agreement is None,
        "per_step": {step: log.at(step) for step in range(1, 8)},
    }


def _check_skewed(results: list[dict[str, Any]]) -> None:
    # Rank 1 voted "due" at check step 4; every rank consumed the vote at 8 and saved
    # there. Rank 1 was due again at 11; the vote of 12 made every rank save at 16.
    for rank, r in enumerate(results):
        assert r["saved"] == [8, 16], f"rank {rank}"
        assert r["committed"] == [8, 16], f"rank {rank}"
        # Construction: one all-reduce, the read-only agreement, on the checkpoint group;
        # close: the settling of the saves' outcomes only, one blocking all-reduce (the
        # vote launched at step 16 is left unconsumed).
        assert r["setup"] == ["all_reduce"], f"rank {rank}: {r['setup']}"
        assert r["setup_on_checkpoint_group"], f"rank {rank}"
        assert r["at_close"] == [("all_reduce", False)], f"rank {rank}: {r['at_close']}"
    check_steps = {1, 4, 8, 12, 16}
    for rank, r in enumerate(results):
        for step, calls in r["per_step"].items():
            if step not in check_steps:
                assert calls == [], f"rank {rank} step {step}: {calls}"
            elif step not in (8, 16):
                assert calls == [("all_reduce", True)], f"rank {rank} step {step}: {calls}"
            else:
                # The vote goes first, asynchronously; the save's own collectives follow.
                assert calls[0] == ("all_reduce", True), f"rank {rank} step {step}: {calls}"


def test_ranks_with_skewed_clocks_save_at_the_same_steps(tmp_path) -> None:
    results = run_ranks(_rank_skewed_clocks, 3, str(tmp_path), "disabled", False, config=LAUNCH)
    _check_skewed(results)
    assert sorted(os.listdir(tmp_path / "seconds")) == ["step-16", "step-8"]
    for r in results:
        # One vote per check step (1, 4, 8, 12, 16); even beside a gloo training group,
        # the votes run on the checkpoint group.
        assert (r["own_group"], r["votes"]) == (True, 5)
        assert r["votes_on_checkpoint_group"]


def test_skewed_clocks_with_the_async_engine_on_its_own_gloo_group(tmp_path) -> None:
    results = run_ranks(_rank_skewed_clocks, 2, str(tmp_path), "thread", True, config=LAUNCH)
    _check_skewed(results)
    assert sorted(os.listdir(tmp_path / "seconds")) == ["step-16", "step-8"]
    for r in results:
        # One gloo group, created once and shared by the votes and the engine's saves.
        assert (r["new_groups"], r["own_group"], r["votes"]) == (1, True, 5)
        assert r["votes_on_checkpoint_group"]


def test_step_based_policy_runs_no_collective_between_saves(tmp_path) -> None:
    results = run_ranks(_rank_step_policy_is_silent, 2, str(tmp_path), config=LAUNCH)
    for rank, r in enumerate(results):
        assert r["saved"] == [5] and r["interval"], f"rank {rank}"
        for step, calls in r["per_step"].items():
            if step == 5:
                assert calls, f"rank {rank}: the save at step 5 ran no collective"
            else:
                assert calls == [], f"rank {rank} step {step}: {calls}"
