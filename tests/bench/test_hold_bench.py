"""``quicksave bench --hold`` on a short run: the report's structure (each workload run
in a fresh process, with and without a baseline), and its refusal of bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import quicksave
from quicksave_tools.bench import main as bench_main


def test_hold_report_structure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = str(Path(quicksave.__file__).parent.parent)  # this version as the baseline
    argv = ["--hold", "--workloads", "small", "--repeats", "1", "--saves", "2"]
    rc = bench_main([*argv, "--warmup", "1", "--baseline", src, "--dir", str(tmp_path), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["run"]: r for r in report["rows"]}
    assert set(rows) == {"small", "small@baseline"}
    for row in rows.values():
        assert row["tensors"] == 2000 and row["saves"] == 2
        assert 0 < row["state_dict_ms_median"] < row["hold_ms_median"] <= row["hold_ms_max"]
        assert row["full_gcs"] >= 0
    assert list(tmp_path.iterdir()) == []  # its folders are removed


def test_hold_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--hold", "--workloads", "huge"]) == 2
    assert "workloads: small, lm" in capsys.readouterr().err
