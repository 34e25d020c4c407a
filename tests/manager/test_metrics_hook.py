"""``CheckpointConfig(on_metrics=...)``: one settled record per save, on the training
thread, committed or failed; a hook that raises never breaks a save."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from helpers.state import ManagerJob
from quicksave.errors import CheckpointError
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
    SaveRecord,
)
from quicksave.trace import COMMIT, PERSIST


def Job() -> ManagerJob:
    return ManagerJob(16, 8, torch.optim.AdamW)


class Hook:
    """Keeps each record it gets, and the thread it got it on."""

    def __init__(self) -> None:
        self.records: list[SaveRecord] = []
        self.threads: set[str] = set()

    def __call__(self, record: SaveRecord) -> None:
        self.records.append(record)
        self.threads.add(threading.current_thread().name)


@pytest.mark.parametrize("mode", ["process", "thread", "disabled"])
def test_each_save_reaches_the_hook_once_when_it_commits(tmp_path: Path, mode: str) -> None:
    hook, job = Hook(), Job()
    config = CheckpointConfig(folder=str(tmp_path), interval=2, async_mode=mode, on_metrics=hook)
    manager = CheckpointManager(config, job.states())
    for _ in range(6):
        manager.save(job.step())
    manager.close()

    assert [r.step for r in hook.records] == [2, 4, 6]
    assert hook.threads == {threading.main_thread().name}
    assert hook.records == manager.metrics  # the settled records, not the in-flight ones
    for r in hook.records:
        assert (r.status, r.error, r.mode) == ("committed", None, mode)
        assert r.bytes > 0 and 0 < r.blocking_s and r.staging_s is not None
        assert r.durable_s is not None and r.durable_s >= r.staging_s
        assert r.throughput_mbps == pytest.approx(r.bytes / r.durable_s / 1e6)
        scalars = r.scalars()
        assert scalars["quicksave/step"] == r.step and scalars["quicksave/failed"] == 0.0
        assert set(scalars) == {
            f"quicksave/{k}"
            for k in ("step", "bytes", "blocking_s", "staging_s", "durable_s", "throughput_mbps",
                      "failed")
        }  # fmt: skip
        if mode == "disabled":
            assert r.spans == ()  # ranges of the training thread
            continue
        persist, commit = r.spans
        assert (persist.name, commit.name) == (PERSIST, COMMIT)
        assert persist.start <= persist.end <= commit.start <= commit.end
        worker = os.getpid() if mode == "thread" else persist.pid
        assert persist.pid == commit.pid == worker
        if mode == "process":
            assert worker != os.getpid()


def break_folder(folder: Path) -> Path:
    """Every write under ``folder`` fails (ENOTDIR) until put back."""
    aside = folder.with_name(folder.name + ".aside")
    os.rename(folder, aside)
    folder.write_text("not a folder")
    return aside


@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_a_failed_save_reaches_the_hook_with_its_error(tmp_path: Path, mode: str) -> None:
    folder = tmp_path / "ckpt"
    hook, job = Hook(), Job()
    config = CheckpointConfig(
        folder=str(folder), interval=1, async_mode=mode, on_save_error="log", on_metrics=hook
    )
    manager = CheckpointManager(config, job.states())
    manager.save(job.step())
    manager.wait()
    aside = break_folder(folder)
    manager.save(job.step())
    manager.wait()
    folder.unlink()
    os.rename(aside, folder)
    manager.save(job.step())
    manager.close()

    assert [(r.step, r.status) for r in hook.records] == [
        (1, "committed"),
        (2, "failed"),
        (3, "committed"),
    ]
    failed = hook.records[1]
    assert failed.error is not None and str(folder) in failed.error
    assert failed.durable_s is None and failed.throughput_mbps is None and failed.spans == ()
    assert failed.scalars()["quicksave/failed"] == 1.0
    assert "quicksave/durable_s" not in failed.scalars()
    assert manager.failed_saves == 1
    assert [r.status for r in manager.metrics] == ["committed", "failed", "committed"]


def test_a_hook_that_raises_is_logged_and_the_saves_go_on(tmp_path: Path, caplog) -> None:
    job = Job()
    calls: list[int] = []

    def broken(record: SaveRecord) -> None:
        calls.append(record.step)
        raise RuntimeError("metrics backend down")

    config = CheckpointConfig(
        folder=str(tmp_path), interval=1, async_mode="thread", on_metrics=broken
    )
    manager = CheckpointManager(config, job.states())
    with caplog.at_level(logging.ERROR, logger="quicksave"):
        for _ in range(3):
            manager.save(job.step())
        manager.close()
    assert calls == [1, 2, 3]
    assert [r.status for r in manager.metrics] == ["committed"] * 3
    assert manager.committed_steps() == [1, 2, 3]
    logged = [r for r in caplog.records if "on_metrics hook raised" in r.getMessage()]
    assert len(logged) == 3 and "metrics backend down" in logged[0].exc_text


def test_on_metrics_must_be_callable(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="on_metrics must be a callable"):
        CheckpointConfig(folder=str(tmp_path), on_metrics="wandb")  # type: ignore[arg-type]
