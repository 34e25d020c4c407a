"""Shared fixtures. Helpers live in tests/helpers/ (importable as ``helpers``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint path that does not exist yet, in a fresh parent directory."""
    return tmp_path / "ckpt"
