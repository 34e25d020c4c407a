"""A load that fails on one rank fails on every rank, with the same error naming that
rank, and leaves no rank waiting in a collective: a checkpoint one rank cannot find
(before any planning), and a chunk only one rank reads that turns out damaged.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import LaunchConfig, run_ranks

import quicksave
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError

pytestmark = pytest.mark.slow

CONFIG = LaunchConfig(timeout_s=120.0, grace_s=10.0, collective_timeout_s=60.0)


def _failure(fn) -> dict[str, Any]:
    try:
        fn()
    except CheckpointError as e:
        return {"type": type(e).__name__, "rank": e.rank, "text": str(e)}
    return {"type": None}


def _rank_load_failures(rank: int, world_size: int, root: str) -> dict[str, Any]:
    path = f"{root}/ckpt"
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(4096)}
    if rank == 0:
        quicksave.save(state, path, thread_count=2, no_dist=True)  # a, b in two files
    dist.barrier()
    out: dict[str, Any] = {}

    # Rank 1 names a checkpoint that is not there; rank 0 a good one.
    where = path if rank == 0 else f"{root}/no-such-ckpt"
    out["missing"] = _failure(lambda: quicksave.load({"a": torch.zeros(4096)}, where, strict=False))
    dist.barrier()

    # Damage b's bytes; only rank 1 reads b.
    if rank == 0:
        chunk = read_manifest(path).tensors["b"].chunks[0]
        with open(f"{path}/{chunk.file}", "r+b") as f:
            f.seek(chunk.offset + 100)
            byte = f.read(1)
            f.seek(chunk.offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    key = "a" if rank == 0 else "b"
    dest = {key: torch.zeros(4096)}
    out["corrupt"] = _failure(lambda: quicksave.load(dest, path, strict=False))
    out["a_loaded"] = rank == 0 and torch.equal(dest["a"], state["a"])
    return out


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    results = run_ranks(_rank_load_failures, 2, str(tmp_path), config=CONFIG)
    for rank, r in enumerate(results):
        missing = r["missing"]
        assert missing["type"] == CheckpointNotFoundError.__name__, (rank, r)
        assert missing["rank"] == 1 and "no-such-ckpt" in missing["text"], (rank, r)
        corrupt = r["corrupt"]
        assert corrupt["type"] == CorruptCheckpointError.__name__, (rank, r)
        assert corrupt["rank"] == 1 and "fqn=b" in corrupt["text"], (rank, r)
    assert results[0]["a_loaded"]  # rank 0's own reads were whole; the load still failed
