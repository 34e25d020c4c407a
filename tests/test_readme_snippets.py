"""Every ```python block of README.md runs as written, as a newcomer runs them: one after
another, each as its own script in one working directory (so the examples must not
step on each other's folders), then the manager example once more, which must resume.

A block that cannot run on its own here (an object store it names, several ranks)
carries ``<!-- readme-test: skip (why) -->`` on the line before its fence; those
reasons are listed in ``SKIPPED``, so that a new exception is a decision made here,
not a block that quietly stopped running.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 300.0  # one block: seconds when the machine is idle

# Why each skipped block cannot run here, in README order.
SKIPPED = ["needs an S3 bucket and an MSC profile"]

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # why it is not run, or None


def readme_blocks(text: str) -> list[Block]:
    """The ```python blocks of ``text`` with the skip mark of each (the line before)."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _SKIP.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(line, match.group(1), mark.group("why") if mark else None))
    return blocks


def run_block(block: Block, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = cwd / f"readme_line_{block.line}.py"
    script.write_text(block.code)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",  # never online: from_pretrained reads the local directory
        "OMP_NUM_THREADS": "1",
    }
    try:
        run = subprocess.run(
            [sys.executable, script.name],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the README block at line {block.line} ran past {TIMEOUT_S} s: {e}")
    assert run.returncode == 0, (
        f"the README block at line {block.line} exited {run.returncode}:\n"
        f"{block.code}\n--- stdout:\n{run.stdout[-4000:]}\n--- stderr:\n{run.stderr[-6000:]}"
    )
    return run


def test_the_skipped_blocks_are_the_listed_ones() -> None:
    text = README.read_text(encoding="utf-8")
    blocks = readme_blocks(text)
    assert [b.skip for b in blocks if b.skip is not None] == SKIPPED
    # every mark stands right before a python block (none is left dangling)
    assert len(_SKIP.findall(text)) == len(SKIPPED)
    assert len([b for b in blocks if b.skip is None]) >= 3  # the parser finds the examples


def test_every_readme_block_runs_as_written_one_after_another(tmp_path: Path) -> None:
    blocks = [b for b in readme_blocks(README.read_text(encoding="utf-8")) if b.skip is None]
    for block in blocks:
        run_block(block, tmp_path)

    managers = [b for b in blocks if "manager.load()" in b.code]
    assert len(managers) == 1, [b.line for b in managers]
    folder = tmp_path / re.search(r'folder="([^"]+)"', managers[0].code).group(1)
    steps = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-100", "step-80", "step-90"]  # interval=10, keep_latest_k=3
    # Run again beside what the other examples wrote: it resumes, saves nothing new.
    again = run_block(managers[0], tmp_path)
    assert f"quicksave: resumed from {folder / 'step-100'} step 100 in " in again.stderr
    assert "committed full checkpoint" not in again.stderr
