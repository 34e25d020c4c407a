"""Hung means not progressing (issue 20, point 2): a checkpoint worker that is starved of
CPU is slow, not dead; a stopped or deadlocked one is still an error within seconds.

The starved worker is real: every thread of the worker process is put in ``SCHED_IDLE``
and pinned to one CPU beside busy-looping processes, with a ``worker_timeout_s`` so small
that a heartbeat-only rule declares it hung while the save is in flight (the test checks
that its heartbeat did go that stale). The rule itself (``quicksave.worker.liveness``) is
also tested on scripted /proc samples, without processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers_engine.engine_util import WORK_TMP, big_state, load_back, same_bytes, wait_dead
from quicksave.errors import CheckpointError, WorkerFailedError
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.worker.config import WorkerConfig
from quicksave.worker.liveness import Liveness, Progress, read_progress
from quicksave.worker.persisters import ProcessPersister

TIMEOUT_S = 0.5  # worker_timeout_s of the process tests: a starved heartbeat exceeds it
STARVE_S = 4.0  # how long the worker is starved


@pytest.fixture
def root() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="qs-liveness-", dir=WORK_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


@contextlib.contextmanager
def _starved(pid: int, hogs: int = 2) -> Iterator[None]:
    """Starve ``pid``: each of its threads (and those it starts) in ``SCHED_IDLE`` on one
    CPU, beside ``hogs`` busy-looping processes pinned to that CPU; undone on exit."""
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(pid)
    procs: list[subprocess.Popen] = []
    try:
        for tid in _threads(pid):
            os.sched_setaffinity(tid, {cpu})
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        for _ in range(hogs):
            p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            procs.append(p)
            os.sched_setaffinity(p.pid, {cpu})
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
        with contextlib.suppress(OSError):  # the worker may be gone (the old rule)
            for tid in _threads(pid):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.sched_setaffinity(tid, before)


def _assert_loads(like: dict, path: Path) -> None:
    out = load_back(like, path)
    assert all(same_bytes(out[k], v) for k, v in like.items())


# ------------------------------------------------------------------ the rule, scripted


def _progress(cpu: int = 0, io: int = 0, states: str = "SS") -> Progress:
    return Progress(cpu_ticks=cpu, io_bytes=io, states=states)


class _Script:
    """Feeds a Liveness the /proc samples of a test, one per check."""

    def __init__(self, *samples: Progress | None) -> None:
        self.samples = list(samples)

    def __call__(self, pid: int) -> Progress | None:
        return self.samples.pop(0)


def test_a_beating_worker_is_never_read() -> None:
    live = Liveness(pid=1, timeout_s=5.0, read=_Script())  # any read would fail
    for t in range(20):
        assert live.check(now=100.0 + t, beat=100.0 + t - 1.0) is None


def test_a_stopped_worker_is_hung_once_its_heartbeat_is_stale() -> None:
    script = _Script(_progress(states="TT"), _progress(states="tT"))
    live = Liveness(pid=1, timeout_s=5.0, read=script)
    assert live.check(now=103.0, beat=100.0) is None  # still within worker_timeout_s
    why = live.check(now=105.5, beat=100.0)
    assert why is not None and "it is stopped" in why


def test_a_runnable_worker_is_starved_not_hung_however_long() -> None:
    samples = [_progress(states="SRS")] * 200  # never any CPU or I/O: only runnable
    live = Liveness(pid=1, timeout_s=5.0, read=_Script(*samples))
    for t in range(200):
        assert live.check(now=103.0 + t, beat=100.0) is None


def test_cpu_or_io_progress_keeps_a_sleeping_worker_alive() -> None:
    samples = [_progress(cpu=t // 3, io=t // 5) for t in range(100)]
    live = Liveness(pid=1, timeout_s=5.0, read=_Script(*samples))
    for t in range(100):  # one check per second: something moves every 3 s at most
        assert live.check(now=103.0 + t, beat=100.0) is None


def test_a_sleeping_worker_without_progress_is_hung() -> None:
    live = Liveness(pid=1, timeout_s=5.0, read=_Script(*[_progress(cpu=7, io=9)] * 40))
    verdicts = [live.check(now=100.0 + 0.25 * i, beat=100.0) for i in range(30)]
    # watched from its first look past half the timeout (2.75 s); hung once the heartbeat
    # is older than the timeout and it was seen still for more than half of it (5.5 s)
    assert verdicts[:22] == [None] * 22
    assert all(v is not None for v in verdicts[22:])
    assert "not progressing for 2.8 s" in verdicts[22] and "no CPU time" in verdicts[22]


def test_a_worker_first_seen_late_gets_a_window_to_show_progress() -> None:
    """Checks can be far apart (the trainer calls save() every few minutes): a stale
    heartbeat seen for the first time is watched for half the timeout before it counts."""
    samples = [_progress(cpu=1), _progress(cpu=1), _progress(cpu=2), _progress(cpu=2)]
    live = Liveness(pid=1, timeout_s=4.0, read=_Script(*samples))
    assert live.check(now=400.0, beat=100.0) is None  # first look
    assert live.check(now=401.0, beat=100.0) is None  # still, but not for 2 s yet
    assert live.check(now=401.9, beat=100.0) is None  # it moved
    assert live.check(now=404.0, beat=100.0) is not None  # still for 2.1 s


def test_a_worker_beating_again_starts_afresh() -> None:
    samples = [_progress(cpu=1)] * 4
    live = Liveness(pid=1, timeout_s=4.0, read=_Script(*samples))
    assert live.check(now=103.0, beat=100.0) is None
    assert live.check(now=103.5, beat=103.4) is None  # it beat: nothing read
    assert live.check(now=106.0, beat=103.4) is None  # stale again: a new window
    assert live.check(now=107.0, beat=103.4) is None
    assert live.check(now=108.1, beat=103.4) is not None


def test_without_proc_the_heartbeat_alone_decides() -> None:
    live = Liveness(pid=1, timeout_s=5.0, read=_Script(None, None))
    assert live.check(now=103.0, beat=100.0) is None
    why = live.check(now=105.5, beat=100.0)
    assert why is not None and "hung?" in why


def test_progress_of_this_process_is_read_from_proc() -> None:
    a = read_progress(os.getpid())
    assert a is not None
    assert len(a.states) == len(_threads(os.getpid()))
    assert "R" in a.states  # this thread, reading
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:  # 5 clock ticks of CPU
        pass
    with tempfile.TemporaryFile(dir=WORK_TMP) as f:
        f.write(b"x" * 65536)
    b = read_progress(os.getpid())
    assert b is not None
    assert b.cpu_ticks > a.cpu_ticks and b.io_bytes >= a.io_bytes + 65536
    assert read_progress(2**22 + 1) is None  # no such process


# --------------------------------------------------------------------- real workers


def test_a_starved_worker_commits_its_save(root: Path) -> None:
    """SCHED_IDLE on one CPU beside two busy loops, first idle, then with a save in
    hand: the worker's heartbeat goes staler than worker_timeout_s (a heartbeat-only
    rule fails the save), yet it is runnable and progressing, so the same worker goes
    on and commits the save once the CPU is free again."""
    cfg = EngineConfig(mode="process", worker=WorkerConfig(worker_timeout_s=TIMEOUT_S))
    saver = AsyncSaver(cfg)
    try:
        saver.save(big_state(1, 1.0), root / "warm", step=1).wait(60)
        pid = saver.worker_pid
        persister = saver._worker.persister
        assert isinstance(persister, ProcessPersister)
        sd = big_state(16, 2.0)
        stalest = 0.0
        with _starved(pid):
            time.sleep(1.0)  # idle and starved
            h = saver.save(sd, root / "starved", step=2)
            until = time.monotonic() + STARVE_S
            while time.monotonic() < until and not h.done():  # done() checks the worker
                stalest = max(stalest, time.monotonic() - persister._heartbeat())
                time.sleep(0.02)
        result = h.wait(120)
        print(
            f"starved worker: heartbeat up to {stalest:.2f} s old, save durable after "
            f"{result.durable_s:.2f} s (worker_timeout_s={TIMEOUT_S})"
        )
        assert saver.worker_pid == pid  # the same worker, never declared hung
        # the precondition: a heartbeat-only rule would have failed this save
        assert stalest > TIMEOUT_S, f"the worker was not starved (heartbeat {stalest:.2f} s)"
        assert result.step == 2
        _assert_loads(sd, root / "starved")
        assert saver.finalize(blocking=True) == []
    finally:
        saver.close()


def test_a_stopped_worker_fails_the_save_naming_rank_and_state(root: Path) -> None:
    cfg = EngineConfig(mode="process", worker=WorkerConfig(worker_timeout_s=1.0))
    saver = AsyncSaver(cfg, rank=3)
    try:
        saver.save(big_state(1, 1.0), root / "a", step=1).wait(60)
        pid = saver.worker_pid
        os.kill(pid, signal.SIGSTOP)
        h = saver.save(big_state(1, 2.0), root / "b", step=2)
        with pytest.raises(WorkerFailedError) as ei:
            h.wait(60)  # generous: only that it is raised counts
        e = ei.value
        assert isinstance(e, CheckpointError) and e.rank == 3
        assert "it is stopped" in str(e) and "rank=3" in str(e)
        assert e.path == str(root / "b")
        assert wait_dead(pid, 10) is not None  # killed, not left stopped
        saver.save(big_state(1, 3.0), root / "c", step=3).wait(60)  # a new worker
        assert sorted(os.listdir(root)) == ["a", "c"]
    finally:
        saver.close()


def _hold_the_gil_forever() -> None:
    """Deadlock the calling process: libc's pause() called with the GIL held (PyDLL),
    so no other thread (the heartbeat's included) can run; no CPU, no I/O."""
    import ctypes

    ctypes.PyDLL(None).pause()


def test_a_deadlocked_worker_is_hung() -> None:
    p = ProcessPersister(WorkerConfig(worker_timeout_s=1.0), rank=1)
    try:
        p.sync(120)  # started and answering
        p.submit_call(1, _hold_the_gil_forever, (), {})
        with pytest.raises(WorkerFailedError) as ei:
            deadline = time.monotonic() + 60  # generous: only that it is raised counts
            while time.monotonic() < deadline:
                p.poll(0.5)
        e = ei.value
        assert e.rank == 1
        assert "not progressing" in str(e) and "no CPU time" in str(e)
        assert wait_dead(p.pid, 10) is not None
    finally:
        p.close(1.0)
