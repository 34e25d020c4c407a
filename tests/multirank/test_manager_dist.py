"""The CheckpointManager's multi-rank async saves over real gloo ranks: the plan cache's
one collective per save, commit without gathering (parts + store records), and the
failure semantics — one rank's write failing, stalling or losing its worker fails the
save on every rank, commits nothing, hangs nobody, and leaves older checkpoints intact.

Functions whose name starts with ``_rank_`` run inside the spawned ranks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.nn as nn
from launcher import LaunchConfig, run_ranks

import quicksave
from helpers.collectives import CollectiveLog
from quicksave.commit.manifest_reader import read_manifest
from quicksave.errors import CheckpointError
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    ModelState,
    OptimizerState,
    TrainState,
)
from quicksave.worker import multirank
from quicksave.worker.job import PersistJob

pytestmark = pytest.mark.slow

LAUNCH = LaunchConfig(timeout_s=150.0, collective_timeout_s=60.0)


class _Job:
    """The same small model and AdamW on every rank (data parallel: replicated state)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.train_state = TrainState()
        self.x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))

    def states(self) -> dict[str, Any]:
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optim),
            "train_state": self.train_state,
        }

    def step(self) -> None:
        self.optim.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optim.step()
        self.train_state.step += 1


def _digest(model: nn.Module) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()
    }


def _manager(root: str, **config: Any) -> tuple[_Job, CheckpointManager]:
    job = _Job()
    cfg = CheckpointConfig(folder=os.path.join(root, "ckpt"), interval=2, **config)
    return job, CheckpointManager(cfg, job.states())


def _rank_saves(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    log = CollectiveLog(thread=threading.main_thread()).install()  # the training thread's
    job, manager = _manager(root, async_mode=mode)
    per_save = []
    for step in range(1, 9):
        job.step()
        before = len(log)
        assert manager.save(step) == (step % 2 == 0)
        per_save.append(len(log) - before)
    manager.close()
    fresh, resumed = _manager(root, async_mode=mode)  # a restarted job resumes
    assert resumed.load() == 8
    resumed.close()
    return {
        "committed": manager.committed_steps(),
        "per_save": per_save,
        "statuses": [r.status for r in manager.metrics],
        "digest": _digest(job.model),
        "reloaded": _digest(fresh.model) == _digest(job.model),
    }


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_ranks_save_in_the_background_with_one_collective_per_save(tmp_path, mode) -> None:
    results = run_ranks(_rank_saves, 2, str(tmp_path), mode, config=LAUNCH)
    for rank, r in enumerate(results):
        assert r["committed"] == [2, 4, 6, 8], rank
        assert r["statuses"] == ["committed"] * 4, rank
        assert r["reloaded"], rank
        # Steps 1, 3, 5, 7 save nothing: no collective. The first save plans (agree +
        # gather + scatter); every later save with unchanged plans runs one all-reduce,
        # the vote, which carries the outcome of the earlier saves too (the settling
        # of manager/failures.py needs no collective of its own).
        assert r["per_save"][0::2] == [0, 0, 0, 0], rank
        assert r["per_save"][1] == 3, (rank, r["per_save"])
        assert r["per_save"][3::2] == [1] * 3, (rank, r["per_save"])
    assert results[0]["digest"] == results[1]["digest"]
    # Both ranks wrote (the replicated tensors were spread over them), one manifest.
    step8 = tmp_path / "ckpt" / "step-8"
    m = read_manifest(str(step8))
    assert m.world_size == 2
    assert {f.rank for f in m.files.values() if f.rank is not None} == {0, 1}
    assert sorted(os.listdir(step8)) == sorted(["manifest.json", *m.files])
    fresh = _Job()  # and a plain process (no group) loads it bit for bit
    quicksave.load(fresh.states(), str(step8))
    assert _digest(fresh.model) == results[0]["digest"]


def _rank_outcome_rides_on_the_vote(rank: int, world_size: int, root: str) -> dict[str, Any]:
    log = CollectiveLog(thread=threading.main_thread()).install()  # the training thread's
    job, manager = _manager(root, async_mode="thread", on_save_error="log")
    per_save: dict[int, list[str]] = {}
    for step in range(1, 9):
        job.step()
        if step == 6 and rank == 1:  # a failure only rank 1 knows of, before a due save
            manager.session.ledger.failed((5, "full"), CheckpointError("injected", rank=1))
        before = len(log)
        manager.save(step)
        per_save[step] = [c.name for c in log.calls[before:]]
        if step == 6:
            failed_after_6 = manager.failed_saves
    manager.close()
    return {"per_save": per_save, "failed_after_6": failed_after_6, "failed": manager.failed_saves}


def test_the_outcome_of_saves_rides_on_the_save_vote(tmp_path) -> None:
    """A steady save makes one collective on the training thread, the plan vote, which
    also settles the outcome of the saves before it; a failure one rank alone knows of
    is settled alike on every rank at the save whose vote carried it (one gather more)."""
    results = run_ranks(_rank_outcome_rides_on_the_vote, 2, str(tmp_path), config=LAUNCH)
    for rank, r in enumerate(results):
        saves = r["per_save"]
        assert [saves[s] for s in (1, 3, 5, 7)] == [[]] * 4, (rank, saves)
        assert saves[2] == ["all_reduce", "gather_object", "scatter_object_list"], (rank, saves)
        assert saves[4] == ["all_reduce"], (rank, saves)
        assert saves[6] == ["all_reduce", "all_gather_object"], (rank, saves)
        assert saves[8] == ["all_reduce"], (rank, saves)
        assert r["failed_after_6"] == 1 and r["failed"] == 1, (rank, r)


def _fail_rank_1_at_step_4(
    job: PersistJob, pool: memoryview, backend: Any, usage: Any
) -> dict[str, str]:
    if job.rank == 1 and job.step == 4:
        raise OSError(errno.EACCES, "Permission denied", os.path.join(job.draft, "x"))
    return _ORIGINAL_WRITE(job, pool, backend, usage)


# The coordinator's commit timeout of the failure tests: generous, so that no healthy save
# of a loaded machine outlasts it; the injected stalls are longer still.
COMMIT_TIMEOUT_S = 10.0


def _stall_rank_1_at_step_4(
    job: PersistJob, pool: memoryview, backend: Any, usage: Any
) -> dict[str, str]:
    if job.rank == 1 and job.step == 4:
        # longer than commit_timeout_s: the coordinator gives up first
        time.sleep(COMMIT_TIMEOUT_S * 1.6)
    return _ORIGINAL_WRITE(job, pool, backend, usage)


def _slow_rank_1_at_step_4(
    job: PersistJob, pool: memoryview, backend: Any, usage: Any
) -> dict[str, str]:
    if job.rank == 1 and job.step == 4:
        # Past twice commit_timeout_s: rank 0 is ready for step 6 long before rank 1's
        # writer is done with step 4 (it must not wait in a collective meanwhile).
        time.sleep(COMMIT_TIMEOUT_S * 2.5)
    return _ORIGINAL_WRITE(job, pool, backend, usage)


_ORIGINAL_WRITE = multirank.write_files


def _rank_one_rank_fails(rank: int, world_size: int, root: str, how: str) -> dict[str, Any]:
    mode = "process" if how == "kill" else "thread"
    job, manager = _manager(root, async_mode=mode, commit_timeout_s=COMMIT_TIMEOUT_S)
    if how == "eacces":
        multirank.write_files = _fail_rank_1_at_step_4
    elif how == "stall":
        multirank.write_files = _stall_rank_1_at_step_4
    elif how == "slow":
        multirank.write_files = _slow_rank_1_at_step_4
    errors: list[str] = []
    began = time.monotonic()
    for step in range(1, 11):
        job.step()
        if how == "kill" and step == 4 and rank == 1:
            while manager.session.writer.saver.in_flight:  # step 2 is done: its worker is idle
                manager.session.writer.saver.finalize(blocking=True)
            pid = manager.session.writer.saver.worker_pid
            os.kill(pid, signal.SIGSTOP)  # its job waits in the pipe, then it dies
        try:
            manager.save(step)
        except CheckpointError as e:
            errors.append(str(e))
        if how == "kill" and step == 4 and rank == 1:
            os.kill(pid, signal.SIGKILL)
    try:
        manager.close()
    except CheckpointError as e:
        errors.append(str(e))
    return {
        "errors": errors,
        "committed": manager.committed_steps(),
        "seconds": time.monotonic() - began,
        "leftovers": sorted(n for n in os.listdir(os.path.join(root, "ckpt")) if ".tmp-" in n),
    }


@pytest.mark.parametrize("how", ["eacces", "stall", "slow", "kill"])
def test_one_rank_failing_fails_the_save_on_every_rank(tmp_path, how) -> None:
    results = run_ranks(_rank_one_rank_fails, 2, str(tmp_path), how, config=LAUNCH)
    for rank, r in enumerate(results):
        assert len(r["errors"]) == 1, (rank, r)
        assert re.search(r"rank[ =]1\b", r["errors"][0]), (rank, r["errors"][0])
        assert "step-4" in r["errors"][0], (rank, r["errors"][0])
        assert 4 not in r["committed"] and 2 in r["committed"] and 10 in r["committed"], r
        assert r["seconds"] < LAUNCH.timeout_s, r  # bounded by commit_timeout_s, never a hang
    if how == "eacces":
        assert "EACCES" in results[1]["errors"][0]
    if how in ("stall", "slow"):
        assert f"within {COMMIT_TIMEOUT_S:g} s" in results[0]["errors"][0]
    if how in ("slow", "kill"):  # the saves after the failed one all commit
        assert all(r["committed"] == [2, 6, 8, 10] for r in results), results
    fresh = _Job()  # the checkpoint before the failure still loads
    quicksave.load(fresh.states(), str(tmp_path / "ckpt" / "step-2"))
    assert not (tmp_path / "ckpt" / "step-4").exists()


def _rank_beside_a_live_writer(rank: int, world_size: int, root: str) -> dict[str, Any]:
    job, manager = _manager(root, async_mode="process")
    refused = []
    for step in (2, 4):  # every rank refuses alike: nobody waits in a collective
        job.step()
        try:
            manager.save(step)
        except CheckpointError as e:
            refused.append(str(e))
    loaded = manager.load()
    manager.close()
    return {
        "reason": manager.read_only_reason,
        "refused": refused,
        "loaded": loaded,
        "worker": manager.session.writer is not None,
    }


def test_ranks_beside_a_live_writer_all_refuse_to_save(tmp_path) -> None:
    from quicksave.manager.lease import FolderLease

    job = _Job()
    quicksave.save(job.states(), str(tmp_path / "ckpt" / "step-1"), step=1)
    other_job = FolderLease(str(tmp_path / "ckpt"))
    assert other_job.try_acquire()
    try:
        results = run_ranks(_rank_beside_a_live_writer, 2, str(tmp_path), config=LAUNCH)
    finally:
        other_job.release()
    assert f"pid {os.getpid()}" in results[0]["reason"]
    assert "coordinator" in results[1]["reason"]
    for rank, r in enumerate(results):
        assert len(r["refused"]) == 2 and "does not write" in r["refused"][0], (rank, r)
        assert r["loaded"] == 1 and not r["worker"], (rank, r)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-1"]


def _rank_resume_past_a_torn_newest(rank: int, world_size: int, root: str) -> dict[str, Any]:
    job, manager = _manager(root, async_mode="disabled")
    for step in range(1, 5):
        job.step()
        manager.save(step)  # commits steps 2 and 4
    manager.close()
    torch.distributed.barrier()
    if rank == 0:  # tear the newest: one of its data files is lost
        step4 = os.path.join(root, "ckpt", "step-4")
        os.unlink(os.path.join(step4, sorted(f for f in os.listdir(step4) if "rank-" in f)[-1]))
    torch.distributed.barrier()
    fresh, resumed = _manager(root, async_mode="disabled")
    loaded = resumed.load()
    committed = resumed.committed_steps()
    resumed.close()
    reference = _Job()  # replay two steps: the state of step 2
    for _ in range(2):
        reference.step()
    return {
        "loaded": loaded,
        "committed": committed,
        "exact": _digest(fresh.model) == _digest(reference.model),
    }


def test_ranks_resume_together_past_a_torn_newest(tmp_path) -> None:
    results = run_ranks(_rank_resume_past_a_torn_newest, 2, str(tmp_path), config=LAUNCH)
    for rank, r in enumerate(results):
        assert r["loaded"] == 2 and r["exact"], (rank, r)
        assert r["committed"] == [2], (rank, r)  # step 4 quarantined by the coordinator
    assert len(list((tmp_path / "ckpt").glob("step-4.corrupt-*"))) == 1
