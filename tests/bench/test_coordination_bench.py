"""``quicksave bench --coordination`` on 2 real gloo ranks, 2 saves of 4 tiny tensors:
the report's structure, and that every save of both methods committed."""

from __future__ import annotations

import json

import pytest

from quicksave_tools.bench import main as bench_main
from quicksave_tools.bench.coordination import format_coordination_report

pytestmark = pytest.mark.slow


def test_coordination_report_structure(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    argv = ["--coordination", "--ranks", "2", "--saves", "2", "--tensors", "4", "--json"]
    assert bench_main([*argv, "--dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["ranks"] == [2] and report["config"]["saves"] == 2
    assert report["state_bytes"] == 4 * 4096
    (run,) = report["runs"]
    assert run["world_size"] == 2
    for method in ("quicksave", "dcp"):
        s = run[method]
        assert s["all_committed"] is True, method
        for key in ("first_block_s", "steady_block_s", "first_committed_s", "steady_committed_s"):
            assert s[key] > 0, (method, key)
        # Committed comes after the call returned, on every rank and every save.
        per_rank = run["per_rank"][method]
        assert len(per_rank) == 2
        for r in per_rank:
            assert len(r["block_s"]) == len(r["committed_s"]) == 2
            assert all(c >= b for b, c in zip(r["block_s"], r["committed_s"], strict=True))
    q = run["quicksave"]
    assert q["steady_write_s"] > 0 and q["steady_commit_s"] > 0
    assert q["steady_coordination_est_s"] == pytest.approx(
        q["steady_committed_s"] - q["steady_write_s"]
    )
    assert all(len(r["write_s"]) == 2 for r in run["per_rank"]["quicksave"])
    assert list(tmp_path.iterdir()) == []  # its temporary folder is removed
    table = format_coordination_report(report)
    assert "| 2 | quicksave |" in table and "| 2 | dcp |" in table


def test_coordination_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--coordination", "--ranks", "1"]) == 2
    assert "--ranks" in capsys.readouterr().err
    assert bench_main(["--coordination", "--saves", "1"]) == 2
    assert "--saves" in capsys.readouterr().err
