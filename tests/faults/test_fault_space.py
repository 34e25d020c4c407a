"""Campaigns 3 and 4: a full disk (a real tmpfs of a few MiB), and the folder made
read-only while a job saves (permission bits, or the immutable flag)."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaign import check, scales
from forkserver import ForkServer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scale", scales())
def test_full_disk(scale: float, tmp_path: Path) -> None:
    res = check("full_disk", scale, tmp_path)
    assert res.outcomes["errors_raised"] >= res.size["cycles"]  # every cycle filled up
    assert res.outcomes["committed_before_full"] > 0


@pytest.mark.parametrize("how", ["chmod", "chattr"])
@pytest.mark.parametrize("scale", scales())
def test_permission_flips(scale: float, how: str, tmp_path: Path, fork_server: ForkServer) -> None:
    res = check(f"permission_flips_{how}", scale, tmp_path, fork_server)
    assert res.outcomes["flips_with_an_error"] >= 1
    assert res.outcomes["saves_committed"] > 0
