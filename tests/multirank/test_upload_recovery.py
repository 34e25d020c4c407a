"""The object-store tier on a simulated 2-node job: 4 gloo ranks as 2 nodes × 2 ranks,
an FSDP2 model with AdamW, each node with its own tmpfs root (memory tier every step),
the job's folder every 2 steps, and every 2 steps an upload of it to a real S3 server
(SeaweedFS on loopback), each rank copying its own files.

Then everything is lost but the object store: every rank SIGKILLed, each node's agent
SIGKILLed and its memory removed, the folder removed. A new job of 4 ranks resumes from
the object store, bit-exact against what each rank held at that step.

The folder is one folder shared by the nodes (a multi-rank checkpoint commits where the
coordinator sees every rank's files); losing it is losing every node's disk. Functions
whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from launcher import LaunchConfig, run_ranks

from helpers.node_sim import fingerprints, fsdp_job, kill_agents, node_roots, train_step
from helpers.s3_server import seaweed_server
from quicksave_tools.testing.seaweed import SeaweedServer

pytestmark = pytest.mark.slow

WORLD = 4
PER_NODE = 2
STEPS = 4
LAUNCH = LaunchConfig(timeout_s=300.0, collective_timeout_s=60.0, preload=("torch._dynamo",))
CRASH = LaunchConfig(
    timeout_s=300.0,
    collective_timeout_s=60.0,
    preload=("torch._dynamo",),
    crash_after_result=True,
)
LEASE_EXPIRY_S = 2.0  # the killed job's store lease: expired before the next job starts


@pytest.fixture(scope="module")
def server() -> Iterator[SeaweedServer]:
    with seaweed_server() as s:
        yield s


@pytest.fixture
def nodes() -> Iterator[Path]:
    with node_roots("qs-upload", WORLD // PER_NODE) as base:
        yield base


def _rank_run(
    rank: int, world_size: int, base: str, store: dict[str, str], train_to: int, close: bool
) -> dict[str, Any]:
    import torch.distributed as dist

    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        MemoryTierConfig,
        ModelState,
        OptimizerState,
        UploadTierConfig,
    )
    from quicksave.storage import S3Options, StorageOptions

    assert world_size == WORLD
    s3 = S3Options(
        endpoint_url=store["endpoint"],
        access_key_id=store["key"],
        secret_access_key=store["secret"],
        region=store["region"],
    )
    storage = StorageOptions(s3=s3, lease_expiry_s=LEASE_EXPIRY_S, lease_renew_s=0.5)
    memory = MemoryTierConfig(
        every=1, keep=2, root=os.path.join(base, f"node-{rank // PER_NODE}"), job_id="upload"
    )
    config = CheckpointConfig(
        folder=os.path.join(base, "ckpt"),
        interval=2,
        keep_latest_k=1,
        async_mode="thread",
        storage=storage,
        memory=memory,
        upload=UploadTierConfig(store["url"], every=2, keep=2),
    )
    model, optim = fsdp_job(rank + 100 * train_to, WORLD)  # other weights each run
    manager = CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    )
    start = manager.load() or 0
    record = manager.last_load
    loaded = fingerprints(model, optim)
    by_step = {}
    tier = manager.upload_tier
    assert tier is not None and tier.uploader is not None
    for step in range(start + 1, train_to + 1):
        train_step(model, optim, step)
        by_step[str(step)] = fingerprints(model, optim)
        manager.save(step)
        manager.wait()  # the folder's save: committed, so that its upload is offered now
        tier.poll()
        deadline = time.monotonic() + 120
        while not tier.uploader.idle():  # every rank's copy, and rank 0's commit
            assert time.monotonic() < deadline, "the upload did not end"
            time.sleep(0.02)
    result = {
        "start": start,
        "tier": record.tier if record else None,
        "loaded": loaded,
        "by_step": by_step,
        "committed": tier.uploader.log.committed,
        "sent": tier.uploader.log.sent,
        "failures": tier.uploader.failures,
        "stopped": tier.uploader.stopped,
        "store": tier.steps(),
        "job_dir": str(manager.memory_tier.node.path) if manager.memory_tier else None,
    }
    dist.barrier()
    if close:
        manager.close()
    return result


def test_everything_lost_but_the_object_store_resumes_from_it_bit_exact(server, nodes) -> None:
    bucket = server.create_bucket(f"upload-{uuid.uuid4().hex[:12]}")
    store = {
        "url": f"s3://{bucket}/job",
        "endpoint": server.endpoint_url,
        "key": server.access_key_id,
        "secret": server.secret_access_key,
        "region": server.region,
    }
    base = str(nodes)
    first = run_ranks(_rank_run, WORLD, base, store, STEPS, False, config=CRASH)
    for rank, r in enumerate(first):
        assert r["start"] == 0 and r["failures"] == 0 and r["stopped"] is None, rank
        assert r["committed"] == [2, 4], rank  # every rank's copy went through, each round
        assert all(sent > 0 for sent in r["sent"]), rank  # each rank copied its own files
    assert first[0]["store"] == [2, 4]

    # everything is lost but the object store: the ranks (dead already), each node's
    # agent and memory, the folder
    kill_agents(nodes)
    for node in range(WORLD // PER_NODE):
        shutil.rmtree(nodes / f"node-{node}")
        (nodes / f"node-{node}").mkdir()  # the replacement nodes' empty tmpfs
    shutil.rmtree(nodes / "ckpt")
    time.sleep(LEASE_EXPIRY_S + 0.5)  # the killed job's lease on the store expires

    second = run_ranks(_rank_run, WORLD, base, store, STEPS + 2, True, config=LAUNCH)
    for rank, r in enumerate(second):
        assert (r["start"], r["tier"]) == (STEPS, "object-store"), rank
        assert r["loaded"] == first[rank]["by_step"][str(STEPS)], f"rank {rank} not bit-exact"
        assert r["failures"] == 0 and r["committed"] == [STEPS + 2], rank
    assert second[0]["store"] == [STEPS, STEPS + 2]  # keep=2
