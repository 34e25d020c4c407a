"""Incremental saves under SIGKILL: a trainer saving every step incrementally (keep the
latest 2; its chains bounded by a full save every 4, or, at every other restart, by
compaction: ``max_unused``) is killed at random moments and restarted in the same
folder; after every kill, every listed checkpoint verifies and loads bit-exactly (its
bases kept by retention, whatever the kill interrupted: a write, a commit, a deletion),
and the restarted trainer resumes from the newest one. The campaign checks that retention
did delete older checkpoints and did keep one beyond the latest 2 because a kept one
refers to it, and that compactions happened (a save wrote again a block whose bytes
the save before it referred to).

``QUICKSAVE_INCREMENTAL_KILLS`` sets the number of kills (default 5); the acceptance
campaign is ``QUICKSAVE_INCREMENTAL_KILLS=100 pytest tests/faults/test_incremental_kills.py``
(``QUICKSAVE_CAMPAIGN_SEED`` picks the kill moments)."""

from __future__ import annotations

import json
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
    incremental_seen = deleted_seen = kept_as_base_seen = False
    compacted = 0
    for kill in range(KILLS):
        policy = "compact" if kill % 2 else "every4"
        child = subprocess.Popen(
            [sys.executable, "-u", str(CHILD), str(folder), policy],
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
        # retention ran: steps are gone (the loads above are after it deleted them) ...
        deleted_seen = deleted_seen or len(steps) < newest
        # ... and kept one beyond the latest 2 that a kept checkpoint refers to
        kept_as_base_seen = kept_as_base_seen or any(
            _refers_to(folder / f"step-{s}", old) for s in steps[-2:] for old in steps[:-2]
        )
        if policy == "compact":
            compacted += sum(_rewrote(folder, s) for s in steps[1:] if s - 1 in steps)
    assert incremental_seen and deleted_seen and kept_as_base_seen
    assert KILLS < 4 or compacted, "no compaction happened"


def _bases(value: object) -> set[int]:
    """Every chunk entry's ``base`` in a parsed manifest (docs/FORMAT.md §9)."""
    if isinstance(value, dict):
        found = {value["base"]} if isinstance(value.get("base"), int) else set()
        return found.union(*(_bases(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_bases(v) for v in value))
    return set()


def _rewrote(folder: Path, step: int) -> bool:
    """Whether the save of ``step``, referring to earlier ones (not full: a resumed
    trainer's first save is), wrote a block again that the save of ``step - 1`` referred
    to with the same bytes (a compaction: it stopped referring to that step)."""
    now, before = (
        json.loads((folder / f"step-{s}" / "manifest.json").read_text())["tensors"]
        for s in (step, step - 1)
    )
    return any("base" in c for t in now.values() for c in t["chunks"]) and any(
        "base" not in c and "base" in was and c["xxh3_64"] == was["xxh3_64"]
        for fqn, t in now.items()
        for c, was in zip(t["chunks"], before[fqn]["chunks"], strict=True)
    )


def _refers_to(path: Path, step: int) -> bool:
    """Whether the checkpoint at ``path`` refers to the one of ``step`` for some bytes."""
    return step in _bases(json.loads((path / "manifest.json").read_text()))
