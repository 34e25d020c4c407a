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


def _rank_dtensors(rank: int, world_size: int, root: str) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = {
        "rows": torch.arange(512 * 256, dtype=torch.float32).reshape(512, 256),
        "cols": -torch.arange(256 * 512, dtype=torch.float32).reshape(256, 512),
    }
    state = {
        "rows": distribute_tensor(full["rows"].clone(), mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"].clone(), mesh, [Shard(1)]),
    }

    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return dict(state)

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            state.update(sd)

    incremental = quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10)
    config = CheckpointConfig(
        folder=os.path.join(root, "ckpt"), interval=1, async_mode="thread", incremental=incremental
    )
    expected = {}
    with CheckpointManager(config, {"m": Holder()}) as manager:
        for step in (1, 2, 3):
            if step == 3:
                if rank == 1:  # row 300: rank 1's shard holds rows 256..511
                    state["rows"].to_local()[300 - 256] += 1.0
                full["rows"][300] += 1.0
            manager.save(step)
            manager.wait()
            expected[step] = {k: v.clone() for k, v in full.items()}
    same = []
    for step in (1, 2, 3):  # read back replicated: another placement than the saved one
        out = {
            k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()]) for k, v in full.items()
        }
        quicksave.load({"m": out}, os.path.join(root, "ckpt", f"step-{step}"))
        same.append(all(torch.equal(out[k].to_local(), expected[step][k]) for k in full))
    return same


def test_dtensor_shards_refer_block_by_block(tmp_path: Any) -> None:
    results = run_ranks(_rank_dtensors, 2, str(tmp_path), config=LAUNCH)
    assert results == [[True, True, True]] * 2
    docs = {
        s: json.loads((tmp_path / "ckpt" / f"step-{s}" / "manifest.json").read_bytes())
        for s in (1, 2, 3)
    }
    for step in (1, 2, 3):
        assert verify_checkpoint(tmp_path / "ckpt" / f"step-{step}").ok
    rows = {tuple(c["offsets"]): c.get("base") for c in docs[3]["tensors"]["m.rows"]["chunks"]}
    # 8 blocks of 64 rows (each rank's 256 rows in 4); row 300 is in the block at 256
    assert len(rows) == 8 and rows[(256, 0)] is None
    assert all(base == 1 for at, base in rows.items() if at != (256, 0))
    cols = docs[2]["tensors"]["m.cols"]["chunks"]
    assert {c.get("base") for c in cols} == {1}
