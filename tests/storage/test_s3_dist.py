"""Several gloo ranks checkpointing to S3 (SeaweedFS on loopback): the multi-rank
protocol (per-rank objects and parts, store records, the coordinator commits by writing
the manifest last, no gather) is the same as on a local disk; loads reshard."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
from launcher import LaunchConfig, run_ranks  # noqa: E402

LAUNCH = LaunchConfig(
    timeout_s=240.0, grace_s=20.0, collective_timeout_s=90.0, preload=("torch._dynamo",)
)
SHAPE = (12, 10)


def _full() -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) / 7.0


class _Sharded(torch.nn.Module):
    """A model whose weight is a DTensor sharded over the ranks (dim ``dim``)."""

    def __init__(self, world: int, dim: int, fill: torch.Tensor) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        self.w = torch.nn.Parameter(distribute_tensor(fill, mesh, [Shard(dim)]))
        self.b = torch.nn.Parameter(fill[0].clone())  # replicated plain tensor


def _rank_save(rank: int, world: int, folder: str, env: dict[str, str]) -> list[int]:
    os.environ.update(env)
    import quicksave
    from quicksave.manager import CheckpointConfig, CheckpointManager

    model = _Sharded(world, 0, _full())
    quicksave.save(model.state_dict(), f"{folder}/sync-step-1", step=1)
    config = CheckpointConfig(folder=folder, interval=1, keep_latest_k=2)
    with CheckpointManager(config, {"model": model}) as m:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.b.add_(1.0)
            m.save(step)
    with CheckpointManager(config, {"model": model}) as m:
        return m.committed_steps()


def _rank_load(rank: int, world: int, folder: str, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    import quicksave
    from quicksave.manager import CheckpointConfig, CheckpointManager

    model = _Sharded(world, 1, torch.zeros(SHAPE))
    config = CheckpointConfig(folder=folder, async_mode="disabled", read_only=True)
    with CheckpointManager(config, {"model": model}) as m:
        step = m.load()
    got = model.w.full_tensor()
    sync = {"w": _Sharded(world, 1, torch.zeros(SHAPE)).w, "b": torch.zeros(SHAPE[1])}
    quicksave.load(sync, f"{folder}/sync-step-1")
    return {
        "step": step,
        "w_ok": bool(torch.equal(got, _full())),
        "b": model.b.detach().tolist(),
        "sync_ok": bool(torch.equal(sync["w"].full_tensor(), _full()))
        and bool(torch.equal(sync["b"], _full()[0])),
    }


def test_two_ranks_save_to_s3_and_three_load_resharded(s3_server, s3_bucket) -> None:
    folder = f"s3://{s3_bucket}/dist"
    env = s3_server.env()
    steps = run_ranks(_rank_save, 2, folder, env, config=LAUNCH)
    assert steps == [[2, 3], [2, 3]]
    client = s3_server.client()
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="dist/step-3/").get("Contents", [])
    ]
    client.close()
    names = sorted(k.rsplit("/", 1)[1] for k in keys)
    assert "manifest.json" in names and not [n for n in names if n.startswith("part-")]
    assert {n.split("-")[1] for n in names if n.startswith("rank-")} == {"00000", "00001"}
    for result in run_ranks(_rank_load, 3, folder, env, config=LAUNCH):
        assert result["step"] == 3 and result["w_ok"] and result["sync_ok"], result
        assert result["b"] == (_full()[0] + 1.0 + 1.0 + 1.0).tolist()  # add_(1.0) x3
