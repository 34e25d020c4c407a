"""A multi-rank saver's worker is ready for multi-rank saves from the constructor (issue
20, point 8): it connects to the ranks' store, which imports torch, at start-up and in
the background, instead of at the first save (which then took seconds longer to become
durable than the next). Checked by counts, not times: the worker has its store client
(and torch mapped) before any save is submitted, and the saves make no new connection.
A single-rank worker stays torch-free."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from launcher import LaunchConfig, run_ranks

from quicksave.format import MANIFEST_NAME
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistContext
from quicksave.saving.engine import AsyncSaver
from quicksave.worker.persisters import ProcessPersister

pytestmark = pytest.mark.slow


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _ready(p: ProcessPersister, within_s: float) -> dict[str, int]:
    """The worker's status once its start-up connection is done (or ``within_s`` passed)."""
    deadline = time.monotonic() + within_s
    status = p.status(30)
    while status["connecting"] and time.monotonic() < deadline:
        time.sleep(0.05)
        status = p.status(30)
    return status


def _rank_first_save(rank: int, world: int, root: str) -> dict[str, Any]:
    ctx = DistContext(None, dist.distributed_c10d._get_default_store(), rank, world)
    with AsyncSaver(EngineConfig(mode="process"), dist_context=ctx) as saver:
        p = saver._worker.persister
        assert isinstance(p, ProcessPersister)
        before = _ready(p, 90.0)  # no save submitted yet
        torch_before = _maps_torch(p.pid)
        state = {f"rank{rank}.w": torch.full((4096,), float(rank))}
        for step in (1, 2):
            saver.save(state, os.path.join(root, f"step-{step}"), step=step).wait(60)
        return {
            "before": before,
            "torch_before": torch_before,
            "after": p.status(30),
            "same_worker": saver.worker_pid == p.pid,
        }


def test_a_multi_rank_worker_is_connected_before_the_first_save(tmp_path) -> None:
    config = LaunchConfig(timeout_s=180.0, grace_s=10.0)
    out = run_ranks(_rank_first_save, 2, str(tmp_path), config=config)
    for r in out:
        assert r["before"] == {"stores": 1, "connecting": 0, "connects": 1}, r
        assert r["torch_before"], r
        assert r["after"]["connects"] == 1, r  # the saves used the start-up connection
        assert r["same_worker"], r
    for step in (1, 2):
        assert os.path.isfile(tmp_path / f"step-{step}" / MANIFEST_NAME)


def test_a_single_rank_worker_stays_torch_free(tmp_path) -> None:
    with AsyncSaver(EngineConfig(mode="process")) as saver:
        p = saver._worker.persister
        assert isinstance(p, ProcessPersister)
        saver.save({"w": torch.ones(4096)}, tmp_path / "s1", step=1).wait(60)
        assert p.status(30) == {"stores": 0, "connecting": 0, "connects": 0}
        assert not _maps_torch(p.pid)
