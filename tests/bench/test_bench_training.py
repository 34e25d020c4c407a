"""``quicksave bench --training``: a tiny real run (fresh processes per method) and the
pure parts (run order, argument checks)."""

from __future__ import annotations

import json
import os

from quicksave.bench import main
from quicksave.bench.training import (
    METHODS,
    TrainingBenchConfig,
    format_training_report,
    schedule,
)


def test_quick_run_reports_every_method(tmp_path, capsys) -> None:
    plot = tmp_path / "steps.png"
    work = tmp_path / "work"
    argv = ["--training", "--quick", "--methods", "torch.save,quicksave-sync"]
    rc = main([*argv, "--dir", str(work), "--json", "--plot", str(plot)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert report["config"]["steps"] == 6 and report["config"]["interval"] == 2
    assert report["state"]["params"] == 4 * (256 * 256 + 256)
    assert report["state"]["bytes"] > 3 * 4 * report["state"]["params"]  # model + 2 moments
    # baseline before and after the methods; raw baselines measured
    assert len(report["baseline"]["loop_s"]) == 2
    assert len(report["baseline"]["step_s"]) == 6
    assert all(s > 0 for s in report["baseline"]["loop_s"])
    assert len(report["baseline"]["paired_extra_s"]) == 2
    for key in ("write_s", "read_s", "copy_warm_s", "copy_fresh_s"):
        assert report["raw"][key] and all(s > 0 for s in report["raw"][key]), key
    assert set(report["methods"]) == {"torch.save", "quicksave-sync"}
    for name, m in report["methods"].items():
        assert "failed" not in m and "unavailable" not in m, (name, m)
        assert m["checkpoints"] == 3, name
        assert m["loop_median_s"] > 0, name
        assert m["first_blocking_s"] > 0 and m["later_blocking_median_s"] > 0, name
        # synchronous methods: durable when save() returns
        assert 0 < m["later_durable_median_s"] <= m["later_blocking_median_s"] + 1e-3, name
        assert m["write_gbps"] > 0 and m["durable_vs_raw_write"] > 0, name
        assert m["restore_median_s"] > 0 and m["restore_vs_raw_read"] > 0, name
        assert m["peak_rss_mib"] > 0, name
        assert m["paired_overhead_per_checkpoint_s"] is not None, name
        assert m["overhead_per_checkpoint_s"] is not None, name
        # checkpointing must not change training: same final loss as without it
        assert m["same_loss_as_baseline"] is True, name
        run = m["runs"][0]
        assert len(run["step_s"]) == 6
        assert [e["step"] for e in run["events"]] == [2, 4, 6]
        assert all(e["durable_s"] > 0 for e in run["events"])
    # quicksave's manager metrics came through
    assert [r["step"] for r in report["methods"]["quicksave-sync"]["manager_records"]] == [2, 4, 6]
    # the checkpoints and the run's folder are gone; the plot is a PNG
    assert os.listdir(work) == []
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_training_report(report)
    assert "| torch.save |" in table and "| quicksave-sync |" in table
    assert "| raw read |" in table


def test_schedule_interleaves_the_baseline_and_rotates_methods() -> None:
    runs = schedule(TrainingBenchConfig(repeats=2))
    assert runs[0] == "raw" and runs[-1] == "none"
    assert runs.count("none") == 5  # start and middle of each repeat, and the end
    for m in METHODS:
        assert runs.count(m) == 2
    first = [r for r in runs[1:] if r not in ("none", "raw")]
    assert first[: len(METHODS)] == list(METHODS)
    assert first[len(METHODS) :] == [*METHODS[1:], METHODS[0]]
    assert schedule(TrainingBenchConfig(methods=("torch.save",))) == [
        "raw",
        "none",
        "torch.save",
        "none",
    ]


def test_bad_arguments(tmp_path, capsys) -> None:
    assert main(["--training", "--methods", "torch.save,nope", "--dir", str(tmp_path)]) == 2
    assert "unknown method(s) nope; known: torch.save" in capsys.readouterr().err
    assert main(["--training", "--steps", "4", "--interval", "5", "--dir", str(tmp_path)]) == 2
    assert "interval must not exceed steps" in capsys.readouterr().err
    assert main(["--training", "--hidden", "0", "--dir", str(tmp_path)]) == 2
    assert "hidden must be at least 1" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
