"""Peer replicas of the memory tier on a simulated 2-node job: 4 gloo ranks as 2 nodes ×
2 ranks, each node with its own tmpfs root (and so its own agent), an FSDP2 model with
AdamW, a snapshot in node memory every step and a replica of each on the other node.

- a trainer crash (every rank SIGKILLed) resumes from each rank's own node memory;
- a node loss (node 1's ranks and agent SIGKILLed, its memory removed) resumes on the
  replaced node from the replicas node 0 holds, the other ranks from their own memory;

both bit-exact against fingerprints the first run took, and the job's end frees every
node's memory. Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

from helpers.node_sim import fingerprints, fsdp_job, gone, kill_agents, node_roots, train_step

pytestmark = pytest.mark.slow

WORLD = 4
PER_NODE = 2
STEPS = 5
LAUNCH = LaunchConfig(timeout_s=300.0, collective_timeout_s=60.0, preload=("torch._dynamo",))
CRASH = LaunchConfig(
    timeout_s=300.0,
    collective_timeout_s=60.0,
    preload=("torch._dynamo",),
    crash_after_result=True,
)


def _rank_run(rank: int, world_size: int, base: str, train_to: int, close: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        MemoryTierConfig,
        ModelState,
        OptimizerState,
    )

    assert world_size == WORLD
    root = os.path.join(base, f"node-{rank // PER_NODE}")
    memory = MemoryTierConfig(
        every=1,
        keep=2,
        root=root,
        job_id="peers",
        idle_timeout_s=120,
        replicas=1,
        ranks_per_node=PER_NODE,
    )
    # the folder's interval is far away: only the memory tier holds the steps
    config = CheckpointConfig(folder=os.path.join(base, "ckpt"), interval=1000, memory=memory)
    model, optim = fsdp_job(rank + 100 * train_to, WORLD)  # other weights each run
    manager = CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    )
    stepped = []  # optimizer steps inside load(): none (its state is allocated, not stepped)
    hook = optim.register_step_pre_hook(lambda *_: stepped.append(1))
    start = manager.load() or 0
    hook.remove()
    assert not stepped, f"rank {rank}: load() ran {len(stepped)} optimizer step(s)"
    record = manager.last_load
    loaded = fingerprints(model, optim)
    by_step = {}
    for step in range(start + 1, train_to + 1):
        train_step(model, optim, step)
        by_step[str(step)] = fingerprints(model, optim)
        manager.save(step)
    manager.wait()  # the snapshots, and their replicas
    tier = manager.memory_tier
    assert tier is not None and tier.replicas is not None
    log = tier.replicas.log
    result = {
        "start": start,
        "tier": record.tier if record else None,
        "loaded": loaded,
        "trained": fingerprints(model, optim),
        "by_step": by_step,
        "load_s": record.seconds if record else None,
        "own": tier.steps(),
        "held": {str(k): v for k, v in tier.replicas.held().items()},
        "replicated_steps": [s.step for s in log],
        "bytes_sent": [s.sent for s in log],
        "seconds": [s.seconds for s in log],
        "job_dir": str(tier.node.path),
        "failures": tier.failures,
        "replica_error": None if tier.replicas.error is None else str(tier.replicas.error),
    }
    dist.barrier()
    if close:
        manager.close()  # the job's end: each node's agent frees its memory
    return result


@pytest.fixture
def nodes():
    with node_roots("qs-peers", WORLD // PER_NODE) as base:
        yield base


def test_trainer_crash_then_node_loss_resume_bit_exact(nodes, tmp_path) -> None:
    base = str(nodes)
    first = run_ranks(_rank_run, WORLD, base, STEPS, False, config=CRASH)
    for rank, r in enumerate(first):
        assert r["start"] == 0 and r["failures"] == 0 and r["replica_error"] is None
        assert r["own"] == [STEPS - 1, STEPS]  # keep=2
        # rank r holds the replicas of the rank in its position on the other node
        assert r["held"] == {str((rank + PER_NODE) % WORLD): [STEPS - 1, STEPS]}
        assert r["replicated_steps"] == list(range(1, STEPS + 1))
    print(
        "replication per step (bytes sent by rank 0, seconds):",
        [
            (b, round(s, 4))
            for b, s in zip(first[0]["bytes_sent"], first[0]["seconds"], strict=True)
        ],
    )

    # a trainer crash: every rank resumes from its own node's memory
    second = run_ranks(_rank_run, WORLD, base, STEPS, False, config=CRASH)
    for rank, r in enumerate(second):
        assert (r["start"], r["tier"]) == (STEPS, "memory"), rank
        assert r["loaded"] == first[rank]["trained"], f"rank {rank} not bit-exact"

    # node 1 is lost: its ranks (dead already), its agent and its memory
    lost = nodes / "node-1"
    kill_agents(lost)
    shutil.rmtree(lost)
    lost.mkdir()  # the replacement node's empty tmpfs

    third = run_ranks(_rank_run, WORLD, base, STEPS + 2, True, config=LAUNCH)
    print("load() seconds by rank (memory, memory, peer, peer):", [r["load_s"] for r in third])
    assert [r["tier"] for r in third] == ["memory", "memory", "peer", "peer"]
    for rank, r in enumerate(third):
        assert r["start"] == STEPS, rank
        assert r["loaded"] == first[rank]["trained"], f"rank {rank} not bit-exact"
        assert r["failures"] == 0 and r["replica_error"] is None
        # training went on and replicated again, node 1 included
        assert r["held"] == {str((rank + PER_NODE) % WORLD): [STEPS + 1, STEPS + 2]}
    # the job ended (close): no node keeps its memory
    for r in third:
        assert gone(r["job_dir"]), r["job_dir"]


def _lose_node(nodes: Path, node: int) -> None:
    """Node ``node`` is lost: its agent killed, its memory gone (its ranks are dead
    already); the replacement node comes with an empty tmpfs."""
    lost = nodes / f"node-{node}"
    kill_agents(lost)
    shutil.rmtree(lost)
    lost.mkdir()


def test_a_torn_replica_is_skipped_for_the_older_step(nodes) -> None:
    base = str(nodes)
    first = run_ranks(_rank_run, WORLD, base, STEPS, False, config=CRASH)
    # node 0's replica of rank 2's newest snapshot loses bytes; then node 1 is lost
    replica = next(nodes.glob(f"node-0/*/*/world-{WORLD}/replica-of-2/step-{STEPS}"))
    manifest = json.loads((replica / "manifest.json").read_text())
    chunk = max(
        (c for t in manifest["tensors"].values() for c in t["chunks"]), key=lambda c: c["length"]
    )
    with open(replica / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + chunk["length"] // 2)  # in the largest tensor's bytes
        f.write(b"\xff" * 8)
    _lose_node(nodes, 1)
    second = run_ranks(_rank_run, WORLD, base, STEPS, True, config=LAUNCH)
    assert [r["tier"] for r in second] == ["memory", "memory", "peer", "peer"]
    for rank, r in enumerate(second):
        # step 5 fails its checksums on rank 2, so every rank loads step 4
        assert r["start"] == STEPS - 1, rank
        assert r["loaded"] == first[rank]["by_step"][str(STEPS - 1)], f"rank {rank}"
        assert r["trained"] == first[rank]["trained"], f"rank {rank} trained on differently"


def _rank_lonely(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """Rank 1 stops replicating after step 2; rank 0's exchange of step 3 then fails
    at the group's timeout, and rank 0 goes on with its own snapshots."""
    import torch.distributed as dist

    from quicksave.manager import CheckpointConfig, CheckpointManager, MemoryTierConfig, ModelState

    memory = MemoryTierConfig(
        every=1, keep=2, root=base, job_id="lonely", replicas=1, ranks_per_node=1
    )
    config = CheckpointConfig(
        folder=os.path.join(base, "ckpt"), interval=1000, memory=memory, commit_timeout_s=5
    )
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    manager = CheckpointManager(config, {"model": ModelState(model)})
    tier = manager.memory_tier
    assert tier is not None and tier.replicas is not None
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save(step)
        if step == 2:
            manager.wait()
            if rank == 1:
                tier.replicas.close(60)  # this rank's thread ends: no more exchanges
    manager.wait()
    result = {
        "own": tier.steps(),
        "held": {str(k): v for k, v in tier.replicas.held().items()},
        "error": None if tier.replicas.error is None else str(tier.replicas.error),
    }
    dist.barrier()
    manager.close()
    return result


def test_a_peer_that_stops_replicating_never_stops_the_training(nodes) -> None:
    lonely, other = run_ranks(_rank_lonely, 2, str(nodes / "node-0"), config=LAUNCH)
    assert lonely["own"] == other["own"] == [4, 5]  # the snapshots went on
    assert lonely["held"] == {"1": [1, 2]} and other["held"] == {"0": [1, 2]}
    assert lonely["error"] is not None  # rank 0 stopped replicating, and said why
    print("rank 0 stopped replicating:", lonely["error"].splitlines()[0])
    assert other["error"] is None


def _rank_plain(
    rank: int, world_size: int, base: str, train_to: int, close: bool = False
) -> dict[str, Any]:
    """One node per rank, a replica on each other node (``replicas = world_size - 1``);
    a plain model whose weights differ per rank (each rank's snapshot is its own); the
    optimizer state streamed in behind the model's at a resume. ``close``: the job ends
    (then which of its threads still serve a peer)."""
    import threading

    import torch.distributed as dist

    from quicksave.manager import (
        CheckpointConfig,
        CheckpointManager,
        MemoryTierConfig,
        ModelState,
        OptimizerState,
    )

    memory = MemoryTierConfig(
        every=1,
        keep=2,
        root=os.path.join(base, f"node-{rank}"),
        job_id="plain",
        replicas=world_size - 1,
        ranks_per_node=1,
    )
    config = CheckpointConfig(
        folder=os.path.join(base, "ckpt"), interval=1000, memory=memory, stream_load=True
    )
    torch.manual_seed(rank + 10 * train_to)
    model = nn.Linear(16, 16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    )
    stepped = []  # optimizer steps inside load(): none (its state is allocated, not stepped)
    hook = optim.register_step_pre_hook(lambda *_: stepped.append(1))
    start = manager.load() or 0
    hook.remove()
    assert not stepped, f"rank {rank}: load() ran {len(stepped)} optimizer step(s)"
    record = manager.last_load
    streamed = record is not None and record.stream is not None
    optim.state_dict()  # waits for the optimizer's state (a streamed resume)
    loaded = fingerprints(model, optim)
    for step in range(start + 1, train_to + 1):
        g = torch.Generator().manual_seed(step * 10 + rank)
        optim.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        optim.step()
        manager.save(step)
        manager.wait()  # every step snapshotted (a save finding every buffer held is skipped)
    tier = manager.memory_tier
    assert tier is not None and tier.replicas is not None
    result = {
        "start": start,
        "tier": record.tier if record else None,
        "streamed": streamed,
        "loaded": loaded,
        "trained": fingerprints(model, optim),
        "held": {str(k): v for k, v in sorted(tier.replicas.held().items())},
    }
    dist.barrier()
    if close:
        manager.close()
        result["serving"] = [t.name for t in threading.enumerate() if "serve" in t.name]
    return result


def test_two_replicas_on_three_nodes_survive_the_loss_of_two(nodes) -> None:
    base = str(nodes)
    (nodes / "node-2").mkdir()
    first = run_ranks(_rank_plain, 3, base, 3, config=CRASH)
    for rank, r in enumerate(first):
        others = sorted(str(o) for o in range(3) if o != rank)
        assert r["held"] == dict.fromkeys(others, [2, 3]), rank
    _lose_node(nodes, 1)
    _lose_node(nodes, 2)
    second = run_ranks(_rank_plain, 3, base, 3, config=CRASH)
    assert [r["tier"] for r in second] == ["memory", "peer", "peer"]
    assert [r["streamed"] for r in second] == [True, True, True]
    for rank, r in enumerate(second):
        assert r["start"] == 3 and r["loaded"] == first[rank]["trained"], rank


def test_a_replaced_node_streams_its_optimizer_state_from_the_peer(nodes) -> None:
    base = str(nodes)
    first = run_ranks(_rank_plain, 2, base, STEPS, config=CRASH)
    _lose_node(nodes, 1)
    second = run_ranks(_rank_plain, 2, base, STEPS + 2, True, config=LAUNCH)
    assert [r["tier"] for r in second] == ["memory", "peer"]
    # both resumed with load() returning before the optimizer's state was in
    assert [r["streamed"] for r in second] == [True, True]
    for rank, r in enumerate(second):
        assert r["start"] == STEPS, rank
        assert r["loaded"] == first[rank]["trained"], f"rank {rank} not bit-exact"
        assert r["serving"] == [], rank  # the holder's serving ended with the stream
