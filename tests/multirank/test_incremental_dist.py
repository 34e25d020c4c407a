"""Incremental saves on several ranks (``IncrementalConfig`` on a multi-rank manager):
the replicated frozen weight is planned in blocks that the ranks share out, each rank
refers to the last committed step for the blocks it writes that did not change (its
part carries the references to the coordinator's commit), and every step verifies and
loads bit-exactly on every rank.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

import quicksave
from quicksave.loading.verify import verify_checkpoint
from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=150.0, collective_timeout_s=60.0)


def _rank_saves(rank: int, world_size: int, root: str) -> list[bool]:
    torch.manual_seed(0)
    frozen = nn.Linear(256, 512)
    frozen.requires_grad_(False)
    head = nn.Linear(512, 8)
    model = nn.Sequential(frozen, head)
    optim = torch.optim.AdamW(head.parameters(), lr=0.01)
    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10)
    config = CheckpointConfig(
        folder=os.path.join(root, "ckpt"), interval=1, async_mode="thread", incremental=incremental
    )
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    snaps = {}
    with CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    ) as manager:
        for step in (1, 2, 3):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            manager.save(step)
            manager.wait()
            snaps[step] = {k: v.clone() for k, v in model.state_dict().items()}
    same = []
    for step, snap in snaps.items():
        out = {k: torch.zeros_like(v) for k, v in snap.items()}
        quicksave.load({"model": out}, os.path.join(root, "ckpt", f"step-{step}"), strict=False)
        same.append(all(torch.equal(out[k], v) for k, v in snap.items()))
    return same


def test_several_ranks_refer_to_the_last_step_and_load(tmp_path: Any) -> None:
    results = run_ranks(_rank_saves, 2, str(tmp_path), config=LAUNCH)
    assert results == [[True, True, True]] * 2
    docs = {}
    for step in (1, 2, 3):
        path = tmp_path / "ckpt" / f"step-{step}"
        docs[step] = json.loads((path / "manifest.json").read_bytes())
        assert docs[step]["world_size"] == 2
        assert verify_checkpoint(path).ok
    assert docs[1]["format_version"] == 1
    frozen = docs[2]["tensors"]["model.0.weight"]["chunks"]
    assert len(frozen) == 8 and [c.get("base") for c in frozen] == [1] * 8
    # the blocks are shared out: both ranks' files hold some of them at step 1
    assert len({c["file"][:10] for c in docs[1]["tensors"]["model.0.weight"]["chunks"]}) == 2
    assert [c.get("base") for c in docs[3]["tensors"]["model.0.weight"]["chunks"]] == [1] * 8
    assert all("base" not in c for c in docs[3]["tensors"]["model.1.weight"]["chunks"])
