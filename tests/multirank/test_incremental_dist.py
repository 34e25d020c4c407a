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


def _rank_uploads(rank: int, world_size: int, root: str, store: dict[str, str]) -> dict[str, Any]:
    import time

    from quicksave.manager import UploadTierConfig
    from quicksave.storage import S3Options, StorageOptions

    storage = StorageOptions(
        s3=S3Options(
            endpoint_url=store["endpoint"],
            access_key_id=store["key"],
            secret_access_key=store["secret"],
            region=store["region"],
        )
    )
    torch.manual_seed(0)
    frozen = nn.Linear(256, 512)
    frozen.requires_grad_(False)
    head = nn.Linear(512, 8)
    model = nn.Sequential(frozen, head)
    optim = torch.optim.AdamW(head.parameters(), lr=0.01)
    config = CheckpointConfig(
        folder=os.path.join(root, "ckpt"),
        interval=1,
        keep_latest_k=1,
        async_mode="thread",
        storage=storage,
        incremental=quicksave.IncrementalConfig(enabled=True, block_bytes=64 << 10),
        upload=UploadTierConfig(store["url"], every=2, keep=2),
    )
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    snaps = {}
    referred: dict[int, bool] = {}  # step -> its checkpoint in the folder refers to another
    with CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    ) as manager:
        tier = manager.upload_tier
        assert tier is not None and tier.uploader is not None
        for step in range(1, 7):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            manager.save(step)
            manager.wait()
            local = os.path.join(root, "ckpt", f"step-{step}", "manifest.json")
            with open(local, "rb") as f:
                doc = json.loads(f.read())
            referred[step] = any("base" in c for t in doc["tensors"].values() for c in t["chunks"])
            tier.poll()
            deadline = time.monotonic() + 120
            while not tier.uploader.idle():  # every rank's copy, and rank 0's commit
                assert time.monotonic() < deadline, "the upload did not end"
                time.sleep(0.02)
            snaps[step] = {k: v.clone() for k, v in model.state_dict().items()}
        committed, failures = tier.uploader.log.committed, tier.uploader.failures
    same = {}
    for step in (4, 6):  # from the store, after the folder's retention deleted step 4
        out = {k: torch.zeros_like(v) for k, v in snaps[step].items()}
        quicksave.load({"model": out}, f"{store['url']}/step-{step}", strict=False, storage=storage)
        same[step] = all(torch.equal(out[k], v) for k, v in snaps[step].items())
    return {"committed": committed, "failures": failures, "same": same, "referred": referred}


def test_several_ranks_upload_self_contained_copies(tmp_path: Any) -> None:
    """The object-store tier on 2 ranks with incremental saves: each rank fills the holes
    of its own files from the folder's bases; every step on the store refers to nothing,
    verifies and loads bit-exactly once the folder kept only its newest step (and the
    base it refers to)."""
    import uuid

    from helpers.s3_server import seaweed_server
    from quicksave.loading.run_folder import committed_steps
    from quicksave.storage import S3Options, StorageOptions, parse_location

    with seaweed_server() as server:
        bucket = server.create_bucket(f"incr-{uuid.uuid4().hex[:12]}")
        store = {
            "url": f"s3://{bucket}/job",
            "endpoint": server.endpoint_url,
            "key": server.access_key_id,
            "secret": server.secret_access_key,
            "region": server.region,
        }
        results = run_ranks(_rank_uploads, 2, str(tmp_path), store, config=LAUNCH)
        for rank, r in enumerate(results):
            assert r["committed"] == [2, 4, 6] and r["failures"] == 0, rank
            assert r["same"] == {4: True, 6: True}, rank
            assert [s for s, yes in r["referred"].items() if yes] == [2, 3, 4, 5, 6], rank
        storage = StorageOptions(
            s3=S3Options(
                endpoint_url=server.endpoint_url,
                access_key_id=server.access_key_id,
                secret_access_key=server.secret_access_key,
                region=server.region,
            )
        )
        assert committed_steps(tmp_path / "ckpt") == [1, 6]  # 6 and its base
        target = parse_location(store["url"], options=storage)
        assert committed_steps(target, allow_dcp=False) == [4, 6]
        client = server.client()
        try:
            for step in (4, 6):
                key = f"job/step-{step}/manifest.json"
                doc = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
                assert doc["format_version"] == 1 and doc["world_size"] == 2
                chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
                assert not any("base" in c for c in chunks)
                assert len({c["file"][:10] for c in chunks}) == 2  # both ranks' files
                assert verify_checkpoint(f"{store['url']}/step-{step}", storage=storage).ok
        finally:
            client.close()
