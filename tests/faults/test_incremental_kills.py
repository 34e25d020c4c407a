"""Incremental saves under SIGKILL: a trainer saving every step incrementally (a full
save every 4, keep the latest 2) is killed at random moments and restarted in the same
folder; after every kill, every listed checkpoint verifies and loads bit-exactly (its
bases kept by retention, whatever the kill interrupted: a write, a commit, a deletion),
and the restarted trainer resumes from the newest one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quicksave
from helpers import incremental_child
from helpers.state import assert_bit_equal
from quicksave.loading.verify import verify_checkpoint

CHILD = Path(incremental_child.__file__)
KILLS = int(os.environ.get("QUICKSAVE_INCREMENTAL_KILLS", "5"))


def _committed(folder: Path) -> list[int]:
    return sorted(
        int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / "manifest.json").is_file()
    )


def _check(folder: Path) -> list[int]:
    steps = _committed(folder)
    for step in steps:
        path = folder / f"step-{step}"
        report = verify_checkpoint(path)
        assert report.ok, (step, report.problems)
        want = incremental_child.expected(step)
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        quicksave.load({"s": out}, path)
        for k, v in want.items():
            assert_bit_equal(out[k], v, f"step {step}: {k}")
    return steps


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL and the rename commit: Linux")
def test_every_listed_checkpoint_loads_after_each_kill(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("QUICKSAVE_CAMPAIGN_SEED", 1)))
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    newest = 0
    incremental_seen = False
    for _ in range(KILLS):
        child = subprocess.Popen(
            [sys.executable, "-u", str(CHILD), str(folder)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        resumed = child.stdout.readline().split()
        assert resumed[0] == "resumed" and int(resumed[1]) == newest, resumed
        for _ in range(rng.randint(2, 12)):  # some saves, then a kill anywhere after
            line = child.stdout.readline()
            assert line.startswith("saved"), line
        os.kill(child.pid, signal.SIGKILL)
        child.wait(60)
        steps = _check(folder)
        assert steps, "nothing committed"
        newest = steps[-1]
        incremental_seen = incremental_seen or any(
            b'"base":' in (folder / f"step-{s}" / "manifest.json").read_bytes() for s in steps
        )
    assert incremental_seen
