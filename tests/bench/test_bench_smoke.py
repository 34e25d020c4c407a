"""A tiny run of ``quicksave bench``: every method measured, sane numbers, nothing left behind."""

from __future__ import annotations

import json
import os

import matplotlib.image
import torch

from quicksave_tools.bench import format_report, main
from quicksave_tools.bench.methods import build_state_dict, direct_io_error, nbytes_of, tensor_specs
from quicksave_tools.bench.throughput import LOAD_METHODS, SAVE_METHODS
from quicksave_tools.bench.throughput_plot import plot_path, throughput_figure


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
    work, out_json = tmp_path / "work", tmp_path / "results" / "bench.json"
    args = ["--size-mib", "8", "--repeats", "2", "--dir", str(work), "--json"]
    rc = main([*args, "--out", str(out_json)])
    captured = capsys.readouterr()
    out = captured.out
    assert rc == 0
    report = json.loads(out)
    # --out: the same report as a file, and its plot beside it
    assert json.loads(out_json.read_text()) == report
    png = tmp_path / "results" / "bench.png"
    assert f"wrote {out_json} and {png}" in captured.err
    assert sorted(os.listdir(out_json.parent)) == ["bench.json", "bench.png"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # something was drawn
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
    assert os.listdir(work) == []
    table = format_report(report)
    for name in SAVE_METHODS + LOAD_METHODS:
        assert f"| {name} |" in table


def test_bench_bad_arguments(tmp_path, capsys) -> None:
    assert main(["--size-mib", "0", "--dir", str(tmp_path)]) == 2
    assert "size_mib and repeats must be at least 1" in capsys.readouterr().err
    assert main(["--size-mib", str(1 << 30), "--dir", str(tmp_path)]) == 2
    assert "MiB free; this run needs" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_the_plot_shows_every_measured_method_at_its_median() -> None:
    def row(*seconds: float) -> dict:
        return {"seconds": list(seconds), "gbps_median": 1e9 / 1e9 / sorted(seconds)[1]}

    report = {
        "config": {"bytes": 10**9, "tensors": 3, "repeats": 3, "cache": "warm"},
        "machine": {"filesystem": "ext4", "cpus": 2},
        "save": {"raw write+fsync": row(1.0, 2.0, 4.0), "quicksave": row(0.5, 1.0, 2.0),
                 "raw O_DIRECT": {"unavailable": "no O_DIRECT here"}},
        "load": {"raw readinto": row(0.25, 0.5, 1.0)},
    }  # fmt: skip
    fig = throughput_figure(report)
    save, load = fig.axes
    names = [t.get_text() for t in save.get_yticklabels()]
    assert names == ["quicksave", "raw write+fsync"]  # the first method on top; none unmeasured
    assert [b.get_width() for b in save.patches] == [1.0, 0.5]  # GB/s of the median runs
    assert [sorted(line.get_xdata()) for line in save.lines[:2]] == [[0.5, 1.0, 2.0],
                                                                    [0.25, 0.5, 1.0]]  # fmt: skip
    assert [t.get_text() for t in load.get_yticklabels()] == ["raw readinto"]
    assert plot_path("out/bench.json") == "out/bench.png"
