"""Campaign 1: random damage to every file of committed checkpoints. ``verify`` flags
every trial; ``load`` refuses or gives bit-exact values, never silently wrong ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaign import check, scales


@pytest.mark.parametrize("scale", scales())
def test_corruption_is_never_silent(scale: float, tmp_path: Path) -> None:
    res = check("corruption", scale, tmp_path)
    trials = res.size["trials"]
    assert res.outcomes["verify_flagged"] == trials
    assert res.outcomes.get("load_refused", 0) + res.outcomes.get("load_correct", 0) == trials
    # every file and every region of a data file was hit
    rows = set(res.rows)
    assert {"data chunk", "data header", "data padding", "data truncate"} <= rows, rows
    assert any(r.startswith("manifest.json") for r in rows)
    assert any(r.startswith(".metadata") for r in rows)
    # damaged chunks and manifests can never load: their checksums are checked on load
    assert res.rows["data chunk"].get("load correct", 0) == 0
    for row, cells in res.rows.items():
        if row.startswith("manifest.json"):
            assert cells.get("load correct", 0) == 0, row
