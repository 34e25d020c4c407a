"""The memory tier's snapshots are their staging buffers (the engine's ``in_place``):
each snapshot's data file is a hard link to the file-backed pool it was staged into, no
byte is copied after staging, a pool is staged into again only once no kept snapshot
links it, every kept snapshot loads bit-exactly, and nothing but the snapshots is left
in the tier's folder after ``close()``.

Real processes (the worker process of ``async_mode="process"``), a real tmpfs folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
import torch

from quicksave import api
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    MemoryTierConfig,
    ModelState,
    OptimizerState,
)
from quicksave.saving.in_flight import POOL_PREFIX

SHM = Path("/dev/shm")


@pytest.fixture
def shm_root():
    if not SHM.is_dir():
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    root = SHM / f"qs-inplace-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _step(model, optim, x) -> None:
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def _data_file(snapshot: str) -> Path:
    files = [p for p in Path(snapshot).iterdir() if p.name.endswith(".safetensors")]
    assert len(files) == 1, files  # one data file: the pool's whole file
    return files[0]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_each_snapshot_is_its_staging_buffer_and_kept_ones_are_never_overwritten(
    tmp_path, shm_root, mode
) -> None:
    model, optim = _trainer()
    keep = 2
    memory = MemoryTierConfig(every=1, keep=keep, root=str(shm_root), job_id="in-place")
    config = CheckpointConfig(
        folder=str(tmp_path / "ckpt"), interval=10**6, async_mode=mode, memory=memory
    )
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    manager = CheckpointManager(config, states)
    tier = manager.memory_tier
    x = torch.randn(8, 32)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    inodes: dict[int, int] = {}
    try:
        for step in range(1, 13):
            _step(model, optim, x)
            manager.save(step)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            tier.poll(wait_s=60)  # this step's snapshot committed (its outcome known)
            assert step in tier.steps(), (step, tier.steps(), tier.failures)
            data = _data_file(tier.path(step))
            inodes[step] = data.stat().st_ino
            pools = {p.stat().st_ino for p in Path(tier.folder).glob(f"{POOL_PREFIX}*")}
            # no copy: the snapshot's data file is one of the pools' files
            assert inodes[step] in pools, (step, inodes[step], pools)
            # bounded: at most keep + max_in_flight + 1 buffers
            assert len(pools) <= tier.buffers
            # every kept snapshot still holds exactly what was saved at its step
            for kept in tier.steps():
                loaded = {k: torch.zeros_like(v) for k, v in saved[kept].items()}
                api.load({"model": loaded}, tier.path(kept), no_dist=True, strict=False)
                for k, v in saved[kept].items():
                    assert torch.equal(loaded[k], v), (step, kept, k)
        assert tier.failures == 0
        # the buffers were reused, not made anew for every snapshot
        assert len(set(inodes.values())) <= tier.buffers < len(inodes)
    finally:
        manager.close()
    # after close: the kept snapshots only, no pool file left
    assert not list(Path(tier.folder).glob(f"{POOL_PREFIX}*"))


def test_a_dead_trainers_buffers_are_removed_when_the_next_attaches(tmp_path, shm_root) -> None:
    model, optim = _trainer(1)
    memory = MemoryTierConfig(every=1, keep=2, root=str(shm_root), job_id="stale")
    config = CheckpointConfig(
        folder=str(tmp_path / "ckpt"), interval=10**6, async_mode="thread", memory=memory
    )
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    first = CheckpointManager(config, states)
    folder = Path(first.memory_tier.folder)
    first.close()
    stale = folder / f"{POOL_PREFIX}999"  # what a SIGKILLed trainer leaves
    stale.write_bytes(os.urandom(4096))
    second = CheckpointManager(config, states)
    try:
        assert not stale.exists()
    finally:
        second.close()


def test_a_snapshot_stages_beside_one_still_committing_and_none_is_skipped(
    tmp_path, shm_root, monkeypatch, caplog
) -> None:
    """While a snapshot's commit lags (held here until the next ``save()`` has
    returned), the next snapshot stages into another buffer instead of waiting in
    ``save()``; a later save waits for the lagging commit and its retention, so no
    step is skipped for want of a buffer, and every kept snapshot loads bit-exactly."""
    from quicksave.worker import execute

    release = threading.Event()
    commit = execute.commit_files

    def lagging_commit(strategy, draft, loc, manifest, *args, **kwargs):
        if manifest.step == 3:
            release.wait(60)  # the test's own safety net: never a hang
        return commit(strategy, draft, loc, manifest, *args, **kwargs)

    monkeypatch.setattr(execute, "commit_files", lagging_commit)
    caplog.set_level(logging.INFO, logger="quicksave")
    model, optim = _trainer()
    memory = MemoryTierConfig(every=1, keep=2, root=str(shm_root), job_id="lagging")
    config = CheckpointConfig(
        folder=str(tmp_path / "ckpt"), interval=10**6, async_mode="thread", memory=memory
    )
    manager = CheckpointManager(
        config, {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    )
    tier = manager.memory_tier
    tier.replicas = offers = _Offers()  # what the replicas would be handed, and when
    x = torch.randn(8, 32)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for step in range(1, 9):
            _step(model, optim, x)
            manager.save(step)
            # started (or done): not skipped for want of a buffer
            assert step in tier.pending or step in tier.steps(), (step, tier.steps())
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
            if step == 4:  # step 4 was staged while step 3's commit was still held
                assert not release.is_set() and 3 not in tier.steps(), tier.steps()
                assert 4 in tier.pending, "step 4's snapshot was not started"
                threading.Timer(0.2, release.set).start()
        tier.poll(wait_s=60)
        assert release.is_set()
        assert tier.failures == 0
        assert tier.steps() == [7, 8]
        # every step offered once, in order; a snapshot offered is committed then (none
        # before its commit; one retired while step 3's commit held it back: as not made)
        assert [step for step, _, _ in offers.seen] == list(range(1, 9))
        assert all(committed for _, named, committed in offers.seen if named), offers.seen
        retired = {r.args[1] for r in caplog.records if "was retired before" in r.getMessage()}
        assert {step for step, named, _ in offers.seen if not named} == retired, offers.seen
        assert [named for step, named, _ in offers.seen if step in (7, 8)] == [True, True]
        for kept in tier.steps():
            loaded = {k: torch.zeros_like(v) for k, v in saved[kept].items()}
            api.load({"model": loaded}, tier.path(kept), no_dist=True, strict=False)
            for k, v in saved[kept].items():
                assert torch.equal(loaded[k], v), (kept, k)
    finally:
        release.set()
        manager.close()


class _Offers:
    """Stands in for a rank's peer replicas: records each offer, whether it named a
    snapshot and whether that was committed then (``quicksave.tiers.peer_replicas``)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool, bool]] = []  # (step, path given, committed)

    def offer(self, step: int, path: str | None) -> None:
        committed = path is not None and (Path(path) / "manifest.json").is_file()
        self.seen.append((step, path is not None, committed))

    def unsent(self) -> set[int]:
        return set()

    def drain(self, timeout: float) -> bool:
        return True

    def held(self) -> dict[int, list[int]]:
        return {}

    def close(self, timeout: float) -> None:
        pass
