"""AsyncSaver end to end: values, overlap staging, backpressure, memory, exit, disk errors.

Real worker processes, real files, real mounts (tmpfs needs root, which CI has). Where a
save must be "slow", the worker is SIGSTOPped around it: deterministic, no sleeps racing.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch

import quicksave
from helpers_engine.engine_util import (
    WORK_TMP,
    big_state,
    load_back,
    pool_mappings,
    remount_ro,
    rss_bytes,
    run_child,
    same_bytes,
    tmpfs,
)
from quicksave.errors import CheckpointError
from quicksave.loading.verify import verify_checkpoint
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.stage import pool as stage

MODES = ["process", "thread"]


@pytest.fixture
def root() -> Path:
    """A directory on the work disk (real fsync), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="qs-engine-", dir=WORK_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _assert_same(like: dict[str, torch.Tensor], path: Path) -> None:
    out = load_back(like, path)
    for k, v in like.items():
        assert same_bytes(out[k], v), k


def _odd_state() -> dict:
    g = torch.Generator().manual_seed(3)
    nan_payload = torch.tensor([0x7FC1, -1, -32768, 1], dtype=torch.int16).view(torch.bfloat16)
    base = torch.randn(64, 48, generator=g)
    return {
        "f32": base,
        "f64": torch.randn(7, 3, dtype=torch.float64, generator=g),
        "f16": torch.randn(33, generator=g).half(),
        "bf16": torch.cat([torch.randn(61, generator=g).bfloat16(), nan_payload]),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::3, 1::2],  # non-contiguous, offset storage
        "scalar": torch.tensor(2.5),  # 0-dim
        "step": torch.tensor(123456789012, dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "i8": torch.arange(-100, 100, dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8),
        "u16": torch.arange(70, dtype=torch.int32).to(torch.uint16),
        "mask": torch.rand(50, generator=g) > 0.5,
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "meta": {"name": "run-1", "lr": 3e-4, "inf": math.inf, "ids": [1, 2, 3]},
    }


@pytest.mark.parametrize("mode", MODES)
def test_values_are_bit_exact(root: Path, mode: str) -> None:
    sd = _odd_state()
    with AsyncSaver(EngineConfig(mode=mode)) as saver:
        r = saver.save(sd, root / "ckpt", step=9, user_metadata={"who": "test"}).wait(60)
    assert r.step == 9 and r.bytes > 0 and r.durable_s >= r.staging_s
    assert verify_checkpoint(root / "ckpt").ok
    out = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out["meta"] = {"name": "", "lr": 0.0, "inf": 0.0, "ids": []}
    quicksave.load(out, root / "ckpt")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert same_bytes(out[k], v), k
    assert out["meta"] == sd["meta"]
    assert os.listdir(root) == ["ckpt"]


@pytest.mark.parametrize("mode", MODES)
def test_overlap_staging_saves_values_at_save_time(
    root: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save(deferred=...) returns before the deferred copies; the checkpoint still holds
    the values at save() time, both for deferred and for immediately staged tensors."""
    release = threading.Event()
    real_stage_many = stage.StagingPool.stage_many  # every copy into a pool goes through it

    def gated(self, items, digests=None, *, non_blocking=False):  # the background copies only
        if threading.current_thread().name == "quicksave-stage":
            assert release.wait(30)
        return real_stage_many(self, items, digests, non_blocking=non_blocking)

    monkeypatch.setattr(stage.StagingPool, "stage_many", gated)
    sd = {f"p{i}": torch.full((4096,), float(i)) for i in range(4)}
    sd["bn_mean"] = torch.full((16,), 0.5)
    expect = {k: v.clone() for k, v in sd.items()}
    with AsyncSaver(EngineConfig(mode=mode, staging="overlap")) as saver:
        h = saver.save(sd, root / "ckpt", step=1, deferred=lambda fqn, t: fqn.startswith("p"))
        assert h.staging_s is None and not h.done()  # returned before copying
        sd["bn_mean"].add_(100)  # staged at once: mutating it now is allowed
        release.set()
        saver.maybe_wait_for_staging()
        for k in sd:
            if k.startswith("p"):
                sd[k].mul_(-1)  # the optimizer step, after the staging wait
        r = h.wait(60)
        assert r.staging_s >= r.blocking_s
    _assert_same(expect, root / "ckpt")


def test_backpressure_waits_and_never_overwrites_the_pool(root: Path) -> None:
    saver = AsyncSaver(EngineConfig(mode="process"))
    try:
        pid = saver.worker_pid
        sd = big_state(4, 1.0)
        first = {k: v.clone() for k, v in sd.items()}
        os.kill(pid, signal.SIGSTOP)  # the first save cannot progress until SIGCONT
        try:
            h1 = saver.save(sd, root / "one", step=1)
            for v in sd.values():  # blocking staging: the caller may mutate at once
                v.add_(10)
            second = {k: v.clone() for k, v in sd.items()}
            box: dict = {}
            t = threading.Thread(target=lambda: box.update(h=saver.save(sd, root / "two", step=2)))
            t.start()
            t.join(0.5)
            assert t.is_alive(), "the second save must wait for the pool"
            assert saver.in_flight == 1 and not (root / "one").exists()
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(60)
        assert not t.is_alive()
        box["h"].wait(60)
        h1.wait(60)
        _assert_same(first, root / "one")  # the pool was not overwritten by save 2
        _assert_same(second, root / "two")
    finally:
        saver.close()


def test_skip_policy_and_two_saves_in_flight(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    saver = AsyncSaver(EngineConfig(mode="process", backpressure="skip", max_in_flight=2))
    try:
        pid = saver.worker_pid
        sd = big_state(2, 1.0)
        snaps = []
        os.kill(pid, signal.SIGSTOP)
        try:
            handles = []
            for step in (1, 2):
                snaps.append({k: v.clone() for k, v in sd.items()})
                handles.append(saver.save(sd, root / f"s{step}", step=step))
                for v in sd.values():
                    v.add_(1)
            assert all(h is not None for h in handles) and saver.in_flight == 2
            with caplog.at_level(logging.WARNING, logger="quicksave"):
                assert saver.save(sd, root / "s3", step=3) is None
            assert "skipped the save of step 3" in caplog.text
        finally:
            os.kill(pid, signal.SIGCONT)
        for h in handles:
            h.wait(60)
        _assert_same(snaps[0], root / "s1")
        _assert_same(snaps[1], root / "s2")
        assert sorted(os.listdir(root)) == ["s1", "s2"]
    finally:
        saver.close()


def test_plan_change_rebuilds_the_pool_once_then_reuses_it(root: Path) -> None:
    others = pool_mappings()  # pools of savers earlier tests have not released yet
    saver = AsyncSaver(EngineConfig(mode="thread", fsync=False))
    try:
        sd = {"w": torch.ones(10000)}
        saver.save(sd, root / "a", step=1).wait(60)
        pool = saver._slots[0].pool
        saver.save(sd, root / "b", step=2).wait(60)
        assert saver._slots[0].pool is pool  # same plan: same pool
        sd["new"] = torch.zeros(3000)
        saver.save(sd, root / "c", step=3).wait(60)
        rebuilt = saver._slots[0].pool
        assert rebuilt is not pool and rebuilt.nbytes > pool.nbytes
        saver.save(sd, root / "d", step=4).wait(60)
        assert saver._slots[0].pool is rebuilt
        assert pool_mappings() == others + 1  # the old pool's memory was released
        _assert_same(sd, root / "d")
    finally:
        saver.close()


@pytest.mark.parametrize("mode", MODES)
def test_rss_is_flat_over_100_saves(root: Path, mode: str) -> None:
    # model-shaped, ~25 MB: a few big matrices, many small vectors, scalars
    sd: dict[str, torch.Tensor] = {}
    for i in range(4):
        sd[f"layer{i}.w"] = torch.randn(1024, 1536)
        sd[f"layer{i}.b"] = torch.randn(1536)
        sd[f"layer{i}.norm"] = torch.ones(1024)
        sd[f"layer{i}.step"] = torch.tensor(float(i))
    saves, warm = 100, 10
    with AsyncSaver(EngineConfig(mode=mode, fsync=True)) as saver:
        for i in range(saves + warm):
            if i == warm:
                before = rss_bytes()
            saver.save(sd, root / f"s{i}", step=i).wait(60)
            if i >= 2:
                shutil.rmtree(root / f"s{i - 2}")
        after = rss_bytes()
    growth = (after - before) / before
    print(f"{mode}: RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB ({growth:+.2%})")
    assert growth <= 0.02


def test_interpreter_exit_commits_the_save_in_flight(root: Path) -> None:
    out = run_child("atexit", str(root), "32")
    print(out.strip())
    assert out.startswith("in_flight ")
    expect = big_state(32, 7.0)
    _assert_same(expect, root / "ckpt")  # committed by the atexit close()
    assert os.listdir(root) == ["ckpt"]


# ------------------------------------------------------------------ disk errors


def _small(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((50000,), value), "b": torch.full((10,), value)}


def _disk_error_case(saver: AsyncSaver, parent: Path, big_mib: int) -> CheckpointError:
    prev = _small(1.0)
    saver.save(prev, parent / "prev", step=1).wait(60)
    h = saver.save(big_state(big_mib, 2.0), parent / "big", step=2)
    with pytest.raises(CheckpointError) as ei:
        h.wait(60)
    assert os.listdir(parent) == ["prev"]  # nothing partial visible or left behind
    _assert_same(prev, parent / "prev")
    return ei.value


@pytest.mark.parametrize("mode", MODES)
def test_enospc_is_reported_and_the_next_save_works(mode: str) -> None:
    with tmpfs("2m") as mnt, AsyncSaver(EngineConfig(mode=mode)) as saver:
        e = _disk_error_case(saver, mnt, 4)
        assert "ENOSPC (No space left on device)" in str(e)
        assert e.path.startswith(str(mnt / ".quicksave.big.tmp-")) and e.rank == 0
        small = _small(3.0)
        saver.save(small, mnt / "next", step=3).wait(60)  # space was freed: works again
        _assert_same(small, mnt / "next")


def test_read_only_filesystem_is_reported() -> None:
    with tmpfs("8m") as mnt, AsyncSaver(EngineConfig(mode="process")) as saver:
        prev = big_state(1, 1.0)
        saver.save(prev, mnt / "prev", step=1).wait(60)
        remount_ro(mnt)
        with pytest.raises(CheckpointError) as ei:
            saver.save(big_state(1, 2.0), mnt / "big", step=2).wait(60)
        assert "EROFS (Read-only file system)" in str(ei.value)
        assert f"[path={mnt / 'big'}, rank=0]" in str(ei.value)  # the checkpoint, by name
        assert os.listdir(mnt) == ["prev"]
        _assert_same(prev, mnt / "prev")


def test_eacces_is_reported(tmp_path: Path) -> None:
    """Root bypasses permission bits, so the child trainer (and its worker) run without
    CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH: the kernel then really answers EACCES."""
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    d = Path(tempfile.mkdtemp(prefix="qs-eacces-", dir=WORK_TMP))
    try:
        drop = "-dac_override,-dac_read_search"
        out = run_child(
            "eacces", str(d), prefix=("setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}")
        )
        lines = out.splitlines()
        assert lines[-1] == "a-ok", out
        kind, message = lines[0].removeprefix("error ").split("|", 1)
        assert kind == "CheckpointError", out
        assert "EACCES (Permission denied)" in message
        assert f"[path={d / 'b'}, rank=0]" in message  # the checkpoint, by name
        assert sorted(os.listdir(d)) == ["a"]
        _assert_same(big_state(1, 1.0), d / "a")
    finally:
        os.chmod(d, 0o755)
        shutil.rmtree(d, ignore_errors=True)


def test_eio_is_reported(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real EIO source here (no device-mapper, a loop device over a full tmpfs reports
    ENOSPC), so the kernel's answer is injected at ``os.pwrite`` in thread mode; the
    translation, cleanup and recovery paths are the real ones."""
    real = os.pwrite
    fail = {"on": True}

    def pwrite(fd, data, offset):
        if fail["on"] and "big.tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        e = _disk_error_case(saver, root, 2)
    assert "EIO (Input/output error)" in str(e)
    assert str(root / ".quicksave.big.tmp-") in str(e) and e.rank == 0


def test_a_state_without_tensors_commits(tmp_path: Path) -> None:
    """No data file to write: the job still prepares its temporary directory for the
    commit's ``.metadata`` and manifest."""
    with AsyncSaver(EngineConfig(mode="thread")) as saver:
        saver.save({"step": 5, "tag": "no tensors"}, tmp_path / "ckpt", step=5).wait()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert quicksave.load_state(tmp_path / "ckpt") == {"step": 5, "tag": "no tensors"}
