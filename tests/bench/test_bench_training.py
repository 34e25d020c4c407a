"""``quicksave bench --training``: a tiny real run (fresh processes per method) and the
pure parts (run order, argument checks)."""

from __future__ import annotations

import json
import os

import pytest

from quicksave_tools.bench import main
from quicksave_tools.bench.training import METHODS, TrainingBenchConfig, schedule
from quicksave_tools.bench.training_report import format_training_report


def test_quick_run_reports_every_method(tmp_path, capsys) -> None:
    plot = tmp_path / "steps.png"
    work = tmp_path / "work"
    methods = "torch.save,torch_checkpointing,quicksave-sync,quicksave-process"
    argv = ["--training", "--quick", "--methods", methods]
    argv += ["--shapes", "mlp,transformer"]
    rc = main([*argv, "--dir", str(work), "--json", "--plot", str(plot)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert report["config"]["steps"] == 6 and report["config"]["interval"] == 2
    assert report["config"]["build"] == "cold"  # the saver before the optimizer's first step
    assert set(report["shapes"]) == {"mlp", "transformer"}
    mlp, lm = report["shapes"]["mlp"], report["shapes"]["transformer"]
    assert mlp["state"]["params"] == 4 * (256 * 256 + 256)
    assert mlp["state"]["bytes"] > 3 * 4 * mlp["state"]["params"]  # model + 2 moments
    # the quick LM keeps the real one's layout: 24 layers of 16 parameters, ~4 per state
    assert lm["state"]["tensors"] >= 4 * (24 * 16 + 4) - 4
    for sh in (mlp, lm):
        # baseline before, in the middle of and after the 4 methods; raw and floor measured
        assert len(sh["baseline"]["loop_s"]) == 3
        assert len(sh["baseline"]["step_s"]) == 6
        assert all(s > 0 for s in sh["baseline"]["loop_s"])
        assert len(sh["baseline"]["paired_extra_s"]) == 3
        for key in ("write_s", "read_s", "copy_warm_s", "copy_fresh_s", "floor_hash_cpu_s"):
            assert sh["raw"][key] and all(s > 0 for s in sh["raw"][key]), key
        assert sh["floor"]["cpu_s"] == pytest.approx(
            sh["floor"]["copy_cpu_s"] + sh["floor"]["hash_cpu_s"], abs=1e-3
        )
        assert set(sh["methods"]) == set(methods.split(","))
        assert len(sh["baseline"]["step_by_index_s"]) == 6
        for name, m in sh["methods"].items():
            assert "failed" not in m and "unavailable" not in m, (name, m)
            assert m["checkpoints"] == 3, name
            assert m["loop_median_s"] > 0, name
            assert m["first_blocking_s"] > 0 and m["later_blocking_median_s"] > 0, name
            assert m["write_gbps"] > 0 and m["durable_vs_raw_write"] > 0, name
            assert m["restore_median_s"] > 0 and m["restore_vs_raw_read"] > 0, name
            assert m["peak_rss_mib"] > 0, name
            assert m["paired_overhead_per_checkpoint_s"] is not None, name
            assert m["overhead_per_checkpoint_s"] is not None, name
            assert len(m["overhead_per_checkpoint_runs_s"]) == 1, name
            # cold: the first step is the optimizer's first, compared with the baseline's
            assert m["first_step_vs_steady"] is None and m["first_step_vs_baseline"] > 0, name
            # the first save (step 2) and a later one (step 4; step 6 has no next step)
            assert len(m["first_save_extra_runs_s"]) == 1, name
            assert m["later_save_extra_median_s"] is not None, name
            assert m["first_save_excess_steps"] is not None, name
            # restored into a fresh job too (a new model and optimizer), values checked
            assert len(m["fresh_restore_s"]) == 1 and m["fresh_restore_median_s"] > 0, name
            assert m["fresh_restore_vs_others"] > 0, name
            assert m["trainer_cpu_per_checkpoint_s"] is not None, name
            # checkpointing must not change training: same final loss as without it
            assert m["same_loss_as_baseline"] is True, name
            run = m["runs"][0]
            assert len(run["step_s"]) == 6
            assert [e["step"] for e in run["events"]] == [2, 4, 6]
            assert all(e["durable_s"] > 0 for e in run["events"])
        sync = sh["methods"]["quicksave-sync"]
        # synchronous: durable when save() returns, no staging memory, no worker
        assert 0 < sync["later_durable_median_s"] <= sync["later_blocking_median_s"] + 1e-3
        assert sync["staging_bytes"] == 0 and sync["workers_cpu_per_checkpoint_s"] == 0
        proc = sh["methods"]["quicksave-process"]
        # built before any optimizer step, the manager built its pool at construction
        assert proc["staging_bytes"] >= sh["state"]["bytes"]
        assert all(r["setup_s"] > 0 for r in proc["runs"])
        # the manager's own metrics came through, with CPU per save of both processes
        assert [r["step"] for r in proc["manager_records"]] == [2, 4, 6]
        assert all(r["trainer_cpu_s"] > 0 for r in proc["manager_records"])
        assert all(r["worker_cpu_s"] > 0 for r in proc["manager_records"])
        assert proc["staging_bytes"] >= sh["state"]["bytes"]
        assert proc["workers_cpu_per_checkpoint_s"] >= 0  # sampled: a short loop may miss it
        assert proc["close_vs_last_durable"] > 0
    # one acceptance row per target and shape, for the default mode
    assert {r["shape"] for r in report["acceptance"]} == {"mlp", "transformer"}
    assert all(isinstance(r["met"], bool) for r in report["acceptance"])
    # the checkpoints and the run's folder are gone; the plot is a PNG
    assert os.listdir(work) == []
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_training_report(report)
    assert "| torch.save |" in table and "| quicksave-sync |" in table
    assert "| raw read |" in table and "### transformer" in table
    assert "| mlp | first step after building the saver (the optimizer's first) vs" in table
    assert "every save counted" in table and "restore into a fresh job" in table
    assert "saver built before the optimizer's first step (cold)" in table


def test_quick_run_with_the_saver_built_after_a_warm_up_step(tmp_path, capsys) -> None:
    argv = ["--training", "--quick", "--build", "warm", "--methods", "quicksave-process"]
    rc = main([*argv, "--shapes", "mlp", "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    assert report["config"]["build"] == "warm"
    m = report["shapes"]["mlp"]["methods"]["quicksave-process"]
    assert m["first_step_vs_steady"] > 0 and m["fresh_restore_median_s"] > 0
    rows = {r["target"]: r for r in report["acceptance"]}
    assert "first step after building the saver vs a steady step" in rows
    assert rows["restore into a fresh job vs the fastest other library's"]["value"] is None


def test_schedule_interleaves_the_baseline_and_rotates_methods() -> None:
    config = TrainingBenchConfig(repeats=2, shapes=("mlp", "embedding"))
    runs = schedule(config)
    assert runs[:2] == [("mlp", "raw"), ("embedding", "raw")]
    assert runs[-2:] == [("mlp", "none"), ("embedding", "none")]
    for shape in config.shapes:
        mine = [m for s, m in runs if s == shape]
        assert mine.count("none") == 5  # start and middle of each repeat, and the end
        for m in METHODS:
            assert mine.count(m) == 2
        first = [m for m in mine if m not in ("none", "raw")]
        assert first[: len(METHODS)] == list(METHODS)
        assert first[len(METHODS) :] == [*METHODS[1:], METHODS[0]]
    assert schedule(TrainingBenchConfig(methods=("torch.save",), shapes=("mlp",), repeats=1)) == [
        ("mlp", "raw"),
        ("mlp", "none"),
        ("mlp", "torch.save"),
        ("mlp", "none"),
    ]


def test_bad_arguments(tmp_path, capsys) -> None:
    assert main(["--training", "--methods", "torch.save,nope", "--dir", str(tmp_path)]) == 2
    assert "unknown method(s) nope; known: torch.save" in capsys.readouterr().err
    assert main(["--training", "--steps", "4", "--interval", "5", "--dir", str(tmp_path)]) == 2
    assert "interval must not exceed steps" in capsys.readouterr().err
    assert main(["--training", "--shapes", "mlp,cnn", "--dir", str(tmp_path)]) == 2
    assert "unknown shape(s) cnn; known: mlp, transformer, embedding" in capsys.readouterr().err
    assert main(["--training", "--build", "hot", "--dir", str(tmp_path)]) == 2
    assert "unknown build 'hot'; known: cold, warm" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_baseline_runs_every_quicksave_method_twice_with_its_own_package(tmp_path) -> None:
    from quicksave_tools.bench.baseline import baseline_env

    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    config = TrainingBenchConfig(
        shapes=("mlp",), repeats=1, methods=("torch.save", "quicksave-process"), baseline=src
    )
    runs = [m for _, m in schedule(config)]
    assert runs.count("quicksave-process@baseline") == 1
    assert runs.count("quicksave-process") == 1 and "torch.save@baseline" not in runs
    env = baseline_env(src, str(tmp_path))
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert os.listdir(first) == ["quicksave"]  # the baseline's package, and only it, first
    assert os.path.samefile(os.path.join(first, "quicksave"), os.path.join(src, "quicksave"))


def test_a_baseline_without_a_package_is_refused(tmp_path, capsys) -> None:
    rc = main(["--training", "--quick", "--baseline", str(tmp_path), "--dir", str(tmp_path)])
    assert rc == 2
    assert "holds no quicksave package" in capsys.readouterr().err


def test_quick_lora_run_reports_bytes_on_disk_per_save(tmp_path, capsys) -> None:
    methods = "quicksave-process,quicksave-incremental,quicksave-trainable"
    argv = ["--training", "--quick", "--shapes", "lora", "--methods", methods]
    rc = main([*argv, "--dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)
    ms = report["shapes"]["lora"]["methods"]
    full, incr, trainable = (ms[m] for m in methods.split(","))
    # every byte at every save; the incremental saves write the frozen base once
    assert full["disk_later_vs_first"] == 1.0
    assert incr["disk_first_bytes"] == full["disk_first_bytes"]
    assert incr["disk_later_median_bytes"] < full["disk_later_median_bytes"] / 4
    # the trainable state alone is what changes; it is restored nowhere (the base is not in it)
    assert trainable["disk_first_bytes"] < full["disk_first_bytes"] / 4
    assert (
        incr["restore_median_s"] and incr["fresh_restore_median_s"] and not trainable["restore_s"]
    )
    # side by side: the overhead against the trainable state's save (≤ 1.2× is the goal)
    # and the bytes against the trainable state plus the manifest (≤ 1.1×), as ratios
    rows = {r["what"]: r for r in report["incremental"] if r["method"] == "quicksave-incremental"}
    over = rows["loop overhead per checkpoint: this / quicksave-trainable"]
    assert over["limit"] == 1.2 and over["values"] == [
        incr["overhead_per_checkpoint_s"],
        trainable["overhead_per_checkpoint_s"],
    ]
    lora_bytes = rows["bytes on disk per later save / (trainable state + this manifest)"]
    want = incr["disk_later_median_bytes"] / (
        incr["trainable_bytes"] + incr["manifest_later_median_bytes"]
    )
    assert lora_bytes["limit"] == 1.1 and lora_bytes["value"] == pytest.approx(want, rel=1e-3)
    text = format_training_report(report)
    assert "| bytes on disk |" in text
    row = "| lora | quicksave-incremental | loop overhead per checkpoint: this / "
    assert row + "quicksave-trainable |" in text


def test_a_commit_seen_by_save_and_by_the_watcher_counts_once(tmp_path) -> None:
    """``save()`` may see a fast commit before the watcher's poll, which listed the step
    before: the second sighting is a no-op (it used to raise in the watcher's thread,
    which then stopped timing every later commit)."""
    from quicksave_tools.bench.savers import Saver, _CommitWatcher

    saver = Saver(str(tmp_path), {})
    watcher = _CommitWatcher(saver)
    watcher.close()  # (its poller stopped: the sightings below are the test's)
    watcher.add(3, 100.0)
    watcher.committed(3, 100.0)  # save() saw it
    first = saver.durable[3]
    watcher.committed(3, 100.0)  # the poll that listed it before
    assert saver.durable == {3: first} and watcher.todo == {}
