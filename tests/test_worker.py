"""The persistent worker process under failure: real processes, real signals, no mocks.

Each test builds its own AsyncSaver in process mode (a fresh worker interpreter) and
attacks the worker or the trainer with signals, then checks what the trainer sees,
what is on disk, and that the next save works.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers_engine.engine_util import (
    WORK_TMP,
    big_state,
    load_back,
    open_fds,
    pool_mappings,
    proc_alive,
    same_bytes,
    start_child,
    wait_dead,
    wait_partial_file,
)
from quicksave.commit import CheckpointKind, classify
from quicksave.errors import CheckpointError, WorkerFailedError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.worker.config import WorkerConfig

BIG_MIB = 160  # big enough that the worker is still writing when the test strikes


@pytest.fixture
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory on the work disk (real fsync), removed afterwards."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="qs-worker-", dir=WORK_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _assert_loads(like: dict, path: Path) -> None:
    out = load_back(like, path)
    assert all(same_bytes(out[k], v) for k, v in like.items())


def test_sigkill_worker_mid_save(root: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="process"))
    try:
        prev = big_state(1, 1.0)
        saver.save(prev, root / "prev", step=1).wait(60)
        pid = saver.worker_pid
        h = saver.save(big_state(BIG_MIB, 2.0), root / "big", step=2)
        partial = wait_partial_file(root / "big")
        os.kill(pid, signal.SIGSTOP)  # freeze it mid-write to look at the partial state
        assert os.path.getsize(partial) < BIG_MIB * 2**20 // 2  # 2 files: half each
        assert classify(str(root / "big")) is CheckpointKind.MISSING
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError) as ei:
            h.wait(30)
        detect_s = time.monotonic() - t0
        print(f"SIGKILL mid-save detected after {detect_s:.3f} s")
        assert detect_s < 10.0  # the bound
        e = ei.value
        assert f"checkpoint worker process (pid {pid}) failed while writing step 2" in str(e)
        assert "killed by signal 9" in str(e)
        assert e.path == str(root / "big") and e.rank == 0
        # nothing half-written is left, the previous checkpoint loads and verifies
        assert sorted(os.listdir(root)) == ["prev"]
        _assert_loads(prev, root / "prev")
        # reported once (by wait): the next save starts a new worker and works
        nxt = big_state(1, 3.0)
        saver.save(nxt, root / "next", step=3).wait(60)
        assert saver.worker_pid not in (None, pid)
        _assert_loads(nxt, root / "next")
        assert saver.finalize(blocking=True) == []  # nothing left to raise
    finally:
        saver.close()


def test_hung_worker_is_detected_then_replaced(root: Path) -> None:
    cfg = EngineConfig(mode="process", worker=WorkerConfig(worker_timeout_s=2.0))
    saver = AsyncSaver(cfg)
    try:
        prev = big_state(1, 1.0)
        saver.save(prev, root / "prev", step=1).wait(60)
        pid = saver.worker_pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        h = saver.save(big_state(1, 2.0), root / "hung", step=2)
        with pytest.raises(
            WorkerFailedError,
            match=r"no heartbeat for \d+\.\d s: it is stopped \(state T: SIGSTOP",
        ):
            h.wait(30)
        detect_s = time.monotonic() - t0
        print(f"SIGSTOPped worker detected after {detect_s:.3f} s (worker_timeout_s=2)")
        assert detect_s < 10.0
        assert wait_dead(pid, 30) is not None  # the hung worker was killed, not left behind
        assert sorted(os.listdir(root)) == ["prev"]
        nxt = big_state(1, 3.0)
        # the failure was raised by wait(): save() does not raise it a second time
        saver.save(nxt, root / "next", step=3).wait(60)
        assert saver.worker_pid != pid
        _assert_loads(nxt, root / "next")
        _assert_loads(prev, root / "prev")
    finally:
        saver.close()


def test_failure_seen_only_through_finalize_is_raised_once(root: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="process"))
    try:
        saver.save(big_state(1, 1.0), root / "a", step=1).wait(60)
        pid = saver.worker_pid
        os.kill(pid, signal.SIGSTOP)
        saver.save(big_state(1, 2.0), root / "b", step=2)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match="killed by signal 9"):
            saver.finalize(blocking=True)
        assert saver.finalize(blocking=True) == []  # raised once only
        saver.save(big_state(1, 3.0), root / "c", step=3).wait(60)
        assert sorted(os.listdir(root)) == ["a", "c"]
    finally:
        saver.close()


def test_sigterm_finishes_the_job_in_hand(root: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="process"))
    try:
        sd = big_state(BIG_MIB // 2, 5.0)
        h = saver.save(sd, root / "big", step=5)
        pid = saver.worker_pid
        wait_partial_file(root / "big")
        os.kill(pid, signal.SIGTERM)
        r = h.wait(120)  # committed despite the SIGTERM
        assert r.bytes > BIG_MIB // 2 * 2**20
        assert wait_dead(pid, 10) is not None  # ... and then it exits by itself
        _assert_loads(sd, root / "big")
        # a worker that exited while idle is replaced without losing the next save
        nxt = big_state(1, 6.0)
        saver.save(nxt, root / "next", step=6).wait(60)
        assert saver.worker_pid != pid
        _assert_loads(nxt, root / "next")
    finally:
        saver.close()


def test_sigkill_trainer_leaves_no_worker(root: Path) -> None:
    child = start_child("trainer", str(root), str(BIG_MIB))
    wpid = None
    try:
        line = child.stdout.readline().split()
        assert line[0] == "worker", (line, child.stderr.read())
        wpid = int(line[1])
        assert child.stdout.readline().strip() == "saving"
        wait_partial_file(root / "ckpt")
        child.kill()  # SIGKILL the trainer mid-save
        child.wait(10)
        gone_s = wait_dead(wpid, 30.0)  # a hang guard: it goes at once, a loaded machine aside
        print(f"worker gone {gone_s} s after its trainer was SIGKILLed")
        assert gone_s is not None, f"worker {wpid} survived its trainer by 30 s"
        # whatever is visible is complete: never a half-written checkpoint
        kind = classify(str(root / "ckpt"))
        assert kind in (CheckpointKind.MISSING, CheckpointKind.QUICKSAVE)
        if kind is CheckpointKind.QUICKSAVE:
            _assert_loads(big_state(BIG_MIB, 1.0), root / "ckpt")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if wpid is not None and proc_alive(wpid):
            os.kill(wpid, signal.SIGKILL)


def test_close_with_a_stuck_worker_is_bounded(root: Path) -> None:
    cfg = EngineConfig(mode="process", worker=WorkerConfig(worker_timeout_s=2.0))
    saver = AsyncSaver(cfg)
    saver.save(big_state(1, 1.0), root / "a", step=1).wait(60)
    pid = saver.worker_pid
    os.kill(pid, signal.SIGSTOP)
    h = saver.save(big_state(1, 2.0), root / "b", step=2)
    t0 = time.monotonic()
    saver.close()  # does not hang on the stopped worker
    print(f"close() with a stopped worker returned after {time.monotonic() - t0:.3f} s")
    assert isinstance(h.exception(), WorkerFailedError)
    assert wait_dead(pid, 30) is not None
    assert sorted(os.listdir(root)) == ["a"]


def test_close_timeout_abandons_a_slow_save_cleanly(root: Path) -> None:
    """A healthy but slow save outlives close_timeout_s: the worker is stopped, the save
    fails (or, if it won the race, is complete), and nothing partial stays."""
    saver = AsyncSaver(EngineConfig(mode="process", close_timeout_s=0.2))
    h = saver.save(big_state(BIG_MIB, 1.0), root / "slow", step=1)
    pid = saver.worker_pid
    wait_partial_file(root / "slow")
    saver.close()
    assert wait_dead(pid, 30) is not None
    assert h.done()
    if h.exception() is not None:
        assert isinstance(h.exception(), CheckpointError)
        assert "closed before this save was durable" in str(h.exception())
        assert os.listdir(root) == []
    else:
        _assert_loads(big_state(BIG_MIB, 1.0), root / "slow")
    with pytest.raises(CheckpointError, match="the saver is closed"):
        saver.save(big_state(1, 1.0), root / "late")
    saver.close(abort=True)  # idempotent


def test_worker_keeps_no_fds_or_mappings_across_pool_rebuilds(root: Path) -> None:
    others = pool_mappings()  # pools of savers earlier tests have not released yet
    saver = AsyncSaver(EngineConfig(mode="process", fsync=False))
    try:
        sd: dict[str, torch.Tensor] = {"w": torch.ones(1 << 16)}
        saver.save(sd, root / "s0", step=0).wait(60)
        pid = saver.worker_pid
        base_fds, base_maps = open_fds(pid), pool_mappings(pid)
        my_fds, my_maps = open_fds(), pool_mappings()
        assert base_maps == 1 and my_maps == others + 1
        for i in range(1, 6):  # a new tensor each time: the plan changes, the pool rebuilds
            sd[f"extra{i}"] = torch.full((1000 * i,), float(i))
            saver.save(sd, root / f"s{i}", step=i).wait(60)
            assert pool_mappings(pid) == 1, "the worker kept an old pool mapped"
            assert open_fds(pid) == base_fds
            assert pool_mappings() == others + 1 and open_fds() == my_fds
        assert saver.worker_pid == pid
        _assert_loads(sd, root / "s5")
    finally:
        saver.close()
    assert pool_mappings() == others


def test_worker_killed_while_idle_costs_no_save(root: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="process"))
    try:
        saver.save(big_state(1, 1.0), root / "a", step=1).wait(60)
        pid = saver.worker_pid
        os.kill(pid, signal.SIGKILL)
        saver._worker.persister.process.wait(30)  # dead and reaped before the next save
        nxt = big_state(1, 2.0)
        saver.save(nxt, root / "b", step=2).wait(60)  # a new worker writes it
        assert saver.worker_pid not in (None, pid)
        _assert_loads(nxt, root / "b")
    finally:
        saver.close()


def test_worker_runs_on_the_configured_cpus(root: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = (allowed[-1],)  # one CPU: differs from the trainer's set wherever it has two
    saver = AsyncSaver(EngineConfig(mode="process", worker=WorkerConfig(cpus=cpus)))
    try:
        state = big_state(1, 3.0)
        saver.save(state, root / "pinned", step=1).wait(60)
        assert os.sched_getaffinity(saver.worker_pid) == set(cpus)
        assert os.sched_getaffinity(0) == set(allowed)  # the trainer is left as it was
        _assert_loads(state, root / "pinned")
    finally:
        saver.close()


def test_worker_cpus_must_be_cpus_this_process_may_use(tmp_path: Path) -> None:
    from quicksave.manager import CheckpointConfig

    outside = os.cpu_count()
    with pytest.raises(CheckpointError, match=rf"worker_cpus \[{outside}\] are not CPUs"):
        CheckpointConfig(folder=str(tmp_path), worker_cpus=(outside,))
    with pytest.raises(CheckpointError, match="non-empty"):
        CheckpointConfig(folder=str(tmp_path), worker_cpus=())
    with pytest.raises(CheckpointError, match="async_mode='process'"):
        CheckpointConfig(folder=str(tmp_path), worker_cpus=(0,), async_mode="thread")
    cfg = CheckpointConfig(folder=str(tmp_path), worker_cpus=[min(os.sched_getaffinity(0))])
    assert cfg.engine_config().worker.cpus == (min(os.sched_getaffinity(0)),)


def test_the_collector_is_paused_while_any_job_runs_and_restored_after() -> None:
    import gc
    import threading

    from quicksave.worker.main import _PausedCollector

    paused = _PausedCollector()
    assert gc.isenabled()
    first_in, second_out = threading.Event(), threading.Event()
    seen: list[bool] = []

    def in_place_job() -> None:  # (an in-place job runs on a thread of its own)
        with paused:
            first_in.set()
            second_out.wait(30)
            seen.append(gc.isenabled())  # the other job ended: still paused for this one

    t = threading.Thread(target=in_place_job)
    t.start()
    first_in.wait(30)
    with paused:
        assert not gc.isenabled()
    second_out.set()
    t.join(30)
    assert seen == [False]
    assert gc.isenabled()  # the last one out resumes collection
    gc.disable()
    try:
        with paused:
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
