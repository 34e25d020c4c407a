"""Shared fixtures. Helpers live in tests/helpers/ (importable as ``helpers``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The multi-rank launcher (tests/multirank/launcher.py) is imported as a top-level module
# by tests in several folders; put its folder on the path whatever is collected first.
sys.path.insert(0, str(Path(__file__).parent / "multirank"))


def pytest_configure(config: pytest.Config) -> None:
    # A skip fails the run unless it is "needs a CUDA device" or a root-only fault
    # injection (tests/helpers/skip_policy.py): the suite cannot go quietly green.
    from helpers.skip_policy import SkipPolicy

    config.pluginmanager.register(SkipPolicy(), "quicksave-skip-policy")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint path that does not exist yet, in a fresh parent directory."""
    return tmp_path / "ckpt"
