"""``quicksave bench --storage --baseline SRC`` on a tiny workload, with SRC = this
tree's own ``src``: quicksave's throughput method and the training targets run also as
``@baseline`` (each in a fresh process with the baseline's package first on its path),
on the same shapes, and the report compares the two. No timing is asserted: only that
the numbers exist and are positive."""

from __future__ import annotations

import json
import os

import boto3  # noqa: F401  (pinned in the dev extra: missing, collection fails)

from helpers.bench_sizes import TINY_TRAINING
from quicksave_tools.bench.storage import main as storage_main
from quicksave_tools.bench.storage.comparison import TRAINING_KEYS
from quicksave_tools.bench.storage.config import (
    QUICKSAVE,
    RAW_THREADS,
    StorageBenchConfig,
    all_methods,
)
from quicksave_tools.bench.storage.report import format_storage_report
from quicksave_tools.bench.storage.run import run_storage_benchmark
from quicksave_tools.bench.storage.target import Target
from quicksave_tools.bench.storage.training import train_schedule

SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
TWIN = QUICKSAVE + "@baseline"


def test_baseline_methods_and_targets_are_twins() -> None:
    config = StorageBenchConfig(methods=(RAW_THREADS, QUICKSAVE), baseline=SRC, train_repeat=2)
    assert all_methods(config) == (RAW_THREADS, QUICKSAVE, TWIN)
    assert all_methods(StorageBenchConfig(methods=(RAW_THREADS, QUICKSAVE))) == (
        RAW_THREADS,
        QUICKSAVE,
    )
    assert train_schedule(config) == [
        "none",
        *("local", "local@baseline", "s3", "s3@baseline"),
        "none",
        *("s3@baseline", "s3", "local@baseline", "local"),
        "none",
    ]


def test_storage_bench_against_a_baseline(s3_server, tmp_path) -> None:
    config = StorageBenchConfig(
        size_mib=8,
        repeat=1,
        shapes=("large", "small"),
        methods=(RAW_THREADS, QUICKSAVE),
        directory=str(tmp_path),
        baseline=SRC,
        **TINY_TRAINING,
    )
    report = run_storage_benchmark(config, Target.from_server(s3_server))
    for shape in ("large", "small"):
        s = report["shapes"][shape]
        for kind in ("save", "load"):
            assert set(s[kind]) == {RAW_THREADS, QUICKSAVE, TWIN}
            for name in (QUICKSAVE, TWIN):
                row = s[kind][name]
                assert "failed" not in row and "unavailable" not in row, (name, row)
                assert row["seconds"][0] > 0 and row["mbps_median"] > 0, name
                assert row["server_cpu_s_median"] is not None  # our server: known
        cmp = report["baseline"]["throughput"][shape][QUICKSAVE]
        for key in ("save_speed", "load_speed", "save_best_speed", "load_best_speed"):
            assert cmp[key] > 0, (shape, key)
        assert cmp["save_mbps_baseline"] > 0 and cmp["load_mbps_baseline"] > 0
    packages = report["baseline"]["packages"]
    # the baseline's child imported quicksave through the link first on its path (gone
    # with the run's folder), the current version's child from this tree
    assert packages[TWIN].endswith(os.path.join("baseline-path", "quicksave"))
    assert os.path.samefile(packages[QUICKSAVE], os.path.join(SRC, "quicksave"))

    t = report["training"]
    for kind in ("local", "s3", "local@baseline", "s3@baseline"):
        row = t["targets"][kind]
        assert "failed" not in row, (kind, row)
        assert row["checkpoints"] == 2 and row["durable_median_s"] > 0, kind
    for target in ("local", "s3"):
        row = report["baseline"]["training"][target]
        assert set(row) == set(TRAINING_KEYS)
        assert row["durable_median_s"]["ratio"] > 0
        assert row["blocking_median_s"]["current"] is not None
        assert row["blocking_median_s"]["baseline"] is not None

    text = format_storage_report(report)
    assert f"| {TWIN} |" in text and "| s3:// @baseline |" in text
    assert "**against the baseline**" in text
    assert "| large |" in text and "| small |" in text
    assert "| local |" in text and "| s3 |" in text
    json.dumps(report)
    assert os.listdir(tmp_path) == []


def test_a_storage_baseline_without_a_package_is_refused(tmp_path, capsys) -> None:
    argv = ["--endpoint", "http://127.0.0.1:1", "--baseline", str(tmp_path)]
    assert storage_main(argv) == 2
    assert "holds no quicksave package" in capsys.readouterr().err
