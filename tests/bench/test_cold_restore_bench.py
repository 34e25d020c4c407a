"""``python -m quicksave_tools.bench.cold_restore`` on a small MLP: each method in a
fresh process, its files out of the page cache first, the restored state checked, and
its folders removed."""

from __future__ import annotations

from pathlib import Path

from quicksave_tools.bench.cold_restore import run_cold_restore


def test_cold_restore_report(tmp_path: Path) -> None:
    report = run_cold_restore(
        str(tmp_path),
        methods=("floor", "quicksave", "dcp"),
        hidden=256,
        layers=2,
        batch=4,
        async_mode="disabled",
        timeout_s=300,
    )
    runs = report["runs"]
    assert set(runs) == {"floor", "quicksave", "dcp"}
    for method, results in runs.items():
        (r,) = results
        assert "failed" not in r, (method, r)
        assert r["bytes"] > 256 * 256 * 4 * 3  # weights and AdamW's two moments
        assert r["load_s"] > 0 and r["load_cpu_s"] >= 0
    for method in ("quicksave", "dcp"):  # checked against the saved state in the child
        assert len(runs[method][0]["steps_s"]) == 3
        assert "resume_s" in report["median"][method]
    assert set(report["ratio_to_floor"]) == {"quicksave", "dcp"}
    assert list(tmp_path.iterdir()) == []
