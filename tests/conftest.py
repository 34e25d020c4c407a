"""Shared fixtures. Helpers live in tests/helpers/ (importable as ``helpers``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The multi-rank launcher (tests/multirank/launcher.py) is imported as a top-level module
# by tests in several folders; put its folder on the path whatever is collected first.
sys.path.insert(0, str(Path(__file__).parent / "multirank"))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint path that does not exist yet, in a fresh parent directory."""
    return tmp_path / "ckpt"
