"""A tiny run of ``quicksave bench``: every method measured, sane numbers, nothing left behind."""

from __future__ import annotations

import json
import os

import torch

from quicksave_tools.bench import format_report, main
from quicksave_tools.bench.methods import build_state_dict, direct_io_error, nbytes_of, tensor_specs
from quicksave_tools.bench.throughput import LOAD_METHODS, SAVE_METHODS


def test_state_dict_is_deterministic_and_model_shaped() -> None:
    total = 8 << 20
    specs = tensor_specs(total)
    assert len(specs) == 532
    assert {dtype for _, dtype, _ in specs} == {torch.float32, torch.bfloat16}
    a, b = build_state_dict(total, seed=3), build_state_dict(total, seed=3)
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed.0.weight"], build_state_dict(total, seed=4)["embed.0.weight"])
    # about the asked size, and the largest tensor is a quarter of it
    assert 0.95 * total <= nbytes_of(a) <= 1.05 * total
    assert a["embed.0.weight"].numel() * 4 == total // 4


def test_bench_reports_every_method(tmp_path, capsys) -> None:
    rc = main(["--size-mib", "8", "--repeats", "2", "--dir", str(tmp_path), "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out)
    assert set(report["save"]) == set(SAVE_METHODS)
    assert set(report["load"]) == set(LOAD_METHODS)
    if direct_io_error(str(tmp_path)) is None:
        assert "unavailable" not in report["save"]["raw O_DIRECT"]
    else:  # e.g. a file system without O_DIRECT: said so, not measured
        assert "O_DIRECT" in report["save"].pop("raw O_DIRECT")["unavailable"]
    for kind in ("save", "load"):
        for name, row in report[kind].items():
            assert len(row["seconds"]) == 2, name
            assert all(s > 0 for s in row["seconds"]), name
            assert row["min_s"] <= row["median_s"], name
            assert row["gbps_median"] > 0 and row["gbps_best"] >= row["gbps_median"], name
            assert row["vs_raw"] > 0, name
    assert report["save"]["raw write+fsync"]["vs_raw"] == 1.0
    assert report["config"]["bytes"] >= 0.95 * (8 << 20)
    assert report["peak_rss_mib"] > 0
    assert report["machine"]["cpus"] >= 1
    # every checkpoint and the run's own folder were deleted
    assert os.listdir(tmp_path) == []
    table = format_report(report)
    for name in SAVE_METHODS + LOAD_METHODS:
        assert f"| {name} |" in table


def test_bench_bad_arguments(tmp_path, capsys) -> None:
    assert main(["--size-mib", "0", "--dir", str(tmp_path)]) == 2
    assert "size_mib and repeats must be at least 1" in capsys.readouterr().err
    assert main(["--size-mib", str(1 << 30), "--dir", str(tmp_path)]) == 2
    assert "MiB free; this run needs" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
