"""The failed-save policy on one rank (``on_save_error``, ``max_consecutive_failures``),
retention that never fails a save, and ``log_level`` (issue 20, points 6 and 8).

Writes fail for real: the folder is swapped for a file while training goes on (every
write under it fails), then put back. Two ranks against an S3 server that goes down are
in tests/storage/test_store_outage.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.state import ManagerJob
from quicksave.errors import CheckpointError
from quicksave.manager import (
    CheckpointConfig,
    CheckpointManager,
)
from quicksave.manager import tiers as tiers_module


def Job() -> ManagerJob:
    return ManagerJob(8, 4, torch.optim.SGD)


def make(folder: Path, job: ManagerJob, **config: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(folder=str(folder), **config), job.states())


def break_folder(folder: Path) -> Path:
    """Every write under ``folder`` fails (ENOTDIR) until :func:`repair`."""
    aside = folder.with_name(folder.name + ".aside")
    os.rename(folder, aside)
    folder.write_text("not a folder")
    return aside


def repair(folder: Path, aside: Path) -> None:
    folder.unlink()
    os.rename(aside, folder)


@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_log_policy_goes_on_through_failed_saves_then_commits_and_resumes(
    tmp_path: Path, mode: str, caplog
) -> None:
    folder = tmp_path / "ckpt"
    job = Job()
    m = make(folder, job, interval=1, async_mode=mode, on_save_error="log")
    assert m.save(job.step())
    m.wait()
    aside = break_folder(folder)
    with caplog.at_level(logging.INFO, logger="quicksave"):
        for _ in range(2):  # steps 2 and 3: both fail, neither raises
            m.save(job.step())
        m.wait()
    assert (m.failed_saves, m.consecutive_failures) == (2, 2)
    for step in (2, 3):
        assert f"the save of step {step} failed (on_save_error='log'" in caplog.text
    repair(folder, aside)
    assert m.save(job.step())  # step 4
    m.wait()
    assert (m.failed_saves, m.consecutive_failures) == (2, 0)
    assert m.committed_steps() == [1, 4]
    m.close()
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == ["step-1", "step-4"]
    fresh = Job()
    with make(folder, fresh, interval=1, async_mode=mode) as resumed:
        assert resumed.load() == 4
    assert torch.equal(fresh.model.weight, job.model.weight)
    assert fresh.train_state.step == 4


def test_log_policy_raises_after_max_consecutive_failures(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    job = Job()
    m = make(
        folder,
        job,
        interval=1,
        async_mode="disabled",
        on_save_error="log",
        max_consecutive_failures=2,
    )
    m.save(job.step())
    aside = break_folder(folder)
    assert not m.save(job.step())  # step 2 fails: logged
    with pytest.raises(CheckpointError) as info:
        m.save(job.step())  # step 3: the second in a row
    repair(folder, aside)
    text = str(info.value)
    assert "2 saves in a row failed (step 2, step 3; max_consecutive_failures=2)" in text
    assert "newest committed checkpoint: step 1" in text and "step-3" in text
    assert m.save(job.step())  # the caller may go on: the next save commits
    m.close()
    assert m.committed_steps() == [1, 4]


def test_raise_policy_is_the_default_and_raises_the_failed_save(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    job = Job()
    m = make(folder, job, interval=1, async_mode="disabled")
    assert m.config.on_save_error == "raise"
    aside = break_folder(folder)
    with pytest.raises(CheckpointError) as info:
        m.save(job.step())
    repair(folder, aside)
    assert str(folder / "step-1") in str(info.value) and info.value.rank == 0
    assert m.failed_saves == 1
    assert m.save(job.step())
    m.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"on_save_error": "ignore"}, "on_save_error must be one of 'raise', 'log'"),
        ({"max_consecutive_failures": 0}, "max_consecutive_failures must be an integer >= 1"),
        ({"log_level": "loud"}, "log_level must be None or one of 'debug', 'info'"),
    ],
)
def test_bad_policy_values(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        CheckpointConfig(folder=str(tmp_path), **config)


# ---------------------------------------------------------------- retention


class FlakyRetention:
    """``apply_retention`` that fails its first ``n`` calls, as a LIST during an outage."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.calls = 0
        self.real = tiers_module.apply_retention

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1
        if self.left > 0:
            self.left -= 1
            raise CheckpointError("LIST failed after 12 attempt(s) in 30.0 s", path="s3://b/x")
        self.real(*args, **kwargs)


def test_a_save_with_nothing_due_never_raises_for_retention(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    # issue 20: save(11), nothing due, raised because retention's LIST after step 5's
    # commit failed. Retention now logs, and runs again after the next commit.
    flaky = FlakyRetention(1)
    monkeypatch.setattr(tiers_module, "apply_retention", flaky)
    folder = tmp_path / "ckpt"
    job = Job()
    m = make(folder, job, interval=5, async_mode="thread", keep_latest_k=1)
    for _ in range(5):
        m.save(job.step())
    writer = m.session.writer
    assert writer is not None and writer.drain(60)  # step 5 is committed, unseen
    with caplog.at_level(logging.WARNING, logger="quicksave"):
        assert not m.save(job.step())  # step 6: sees the commit, retention fails
        m.session.housekeep(wait=True)  # (it runs in the housekeeping thread)
    assert flaky.calls == 1
    assert "retention or clean-up in" in caplog.text and "runs again after the next" in caplog.text
    for _ in range(3):  # no commit since: retention is not retried at every call
        assert not m.save(job.step())
    m.session.housekeep(wait=True)
    assert flaky.calls == 1
    for _ in range(1):
        m.save(job.step())  # step 10
    m.wait()
    assert flaky.calls == 2
    assert m.committed_steps() == [10]
    m.close()


# ---------------------------------------------------------------- log_level


_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState

    folder, level = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    model = torch.nn.Linear(2, 2)
    config = CheckpointConfig(folder=folder, interval=1, async_mode="disabled",
                              log_level=level)
    with CheckpointManager(config, {"model": ModelState(model)}) as manager:
        start = manager.load() or 0
        manager.save(start + 1)
    """
)


def _run(folder: Path, *level: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(folder), *level],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout == ""
    return done.stderr


def test_log_level_info_shows_the_resume_and_commit_lines_on_stderr(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    quiet = _run(tmp_path / "quiet")  # default: nothing shown
    assert "quicksave" not in quiet, quiet
    first = _run(folder, "info")
    assert "INFO quicksave: no committed checkpoint in" in first
    assert "committed full checkpoint of step 1" in first
    second = _run(folder, "info")
    assert f"INFO quicksave: resumed from {folder / 'step-1'} step 1 in " in second
    assert "committed full checkpoint of step 2" in second


def test_log_level_sets_the_logger_and_close_restores_it(tmp_path: Path) -> None:
    logger = logging.getLogger("quicksave")
    before = logger.level
    m = make(tmp_path / "ckpt", Job(), async_mode="disabled", log_level="debug")
    assert logger.level == logging.DEBUG
    m.close()
    assert logger.level == before
