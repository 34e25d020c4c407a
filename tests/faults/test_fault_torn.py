"""Campaign 7: a torn newest checkpoint. ``load()`` resumes from the newest one that
passes its checks, and retention never deletes that one."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaign import check, scales

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("scale", scales())
def test_torn_newest_falls_back(scale: float, tmp_path: Path) -> None:
    res = check("torn_newest", scale, tmp_path)
    assert res.outcomes["fell_back_correctly"] == res.size["trials"]
    assert res.outcomes["quarantined"] >= res.size["trials"]
