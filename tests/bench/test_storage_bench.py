"""A tiny run of ``quicksave bench --storage`` against the tests' SeaweedFS: every method
gives a positive throughput or says why it is not available, the training part reports
both targets, the report formats, nothing is left in the store, and the benchmark's own
server is stopped even when the run is interrupted."""

from __future__ import annotations

import json
import os

import boto3  # noqa: F401  (pinned in the dev extra: missing, collection fails)
import pytest

from helpers.bench_sizes import TINY_TRAINING
from quicksave.cli.main import main as cli_main
from quicksave_tools.bench.storage import main as storage_main
from quicksave_tools.bench.storage import run as storage_run
from quicksave_tools.bench.storage.config import (
    DCP_MSC,
    METHODS,
    QUICKSAVE,
    RAW_METHODS,
    RAW_THREADS,
    SHAPES,
    StorageBenchConfig,
)
from quicksave_tools.bench.storage.report import format_storage_report
from quicksave_tools.bench.storage.run import run_storage_benchmark
from quicksave_tools.bench.storage.target import Target
from quicksave_tools.bench.storage.workloads import (
    MODEL_LAYERS,
    build_shape,
    shape_specs,
)


def _buckets(server) -> set[str]:
    client = server.client()
    try:
        return {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    finally:
        client.close()


def _check_method_rows(report: dict) -> None:
    for shape in ("large", "small"):
        s = report["shapes"][shape]
        assert s["bytes"] >= 8 << 20
        for kind in ("save", "load"):
            assert set(s[kind]) == set(METHODS)
            for name, row in s[kind].items():
                if "unavailable" in row:  # e.g. s3torchconnector cannot run here: says why
                    assert name not in (RAW_THREADS, QUICKSAVE)
                    assert row["unavailable"].strip(), name
                    continue
                assert "failed" not in row, (name, row)
                assert len(row["seconds"]) == 1 and row["seconds"][0] > 0, name
                assert row["mbps_median"] > 0 and row["mbps_best"] > 0, name
                assert row["client_cpu_s_median"] >= 0, name
            ratios = s[f"{kind}_ratios"]
            assert ratios["raw_method"] in RAW_METHODS
            assert ratios["vs_raw"] > 0
            if "median_s" in s[kind][DCP_MSC]:
                assert ratios["vs_dcp_msc"] > 0


def test_storage_bench_tiny(s3_server, tmp_path) -> None:
    before = _buckets(s3_server)
    config = StorageBenchConfig(size_mib=8, repeat=1, directory=str(tmp_path), **TINY_TRAINING)
    env_before = dict(os.environ)
    report = run_storage_benchmark(config, Target.from_server(s3_server))
    assert dict(os.environ) == env_before  # AWS_* and MSC_CONFIG were set only inside
    _check_method_rows(report)

    t = report["training"]
    assert t["order"] == ["none", "local", "s3", "none"]
    assert t["baseline"]["loop_median_s"] > 0
    for kind in ("local", "s3"):
        row = t["targets"][kind]
        assert "failed" not in row, row
        assert row["checkpoints"] == 2 and row["loop_median_s"] > 0
        assert row["overhead_per_checkpoint_s"] is not None
        assert row["durable_median_s"] > 0
    assert t["targets"]["s3"]["server_cpu_s"]  # our server: its CPU time is known
    assert {a["shape"] for a in report["acceptance"]} == {*SHAPES, "training (shared)"}
    assert all(r["in_loop_overhead_per_checkpoint_s"] is not None for r in t["targets"].values())

    text = format_storage_report(report)
    for name in METHODS:
        assert f"| {name} |" in text
    assert "| s3:// |" in text and "| local directory |" in text
    json.dumps(report)  # serializable
    # every bucket, object and local folder of the run is gone
    assert _buckets(s3_server) == before
    assert os.listdir(tmp_path) == []


def test_storage_bench_cli_with_endpoint(s3_server, tmp_path, monkeypatch, capsys) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "report.json"
    argv = ["bench", "--storage", "--endpoint", s3_server.endpoint_url, "--size-mib", "8"]
    argv += ["--repeat", "1", "--shapes", "large", "--no-training", "--json", str(out)]
    argv += ["--methods", f"{RAW_THREADS},{QUICKSAVE}"]
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["server"]["kind"] == "external"
    assert report["training"] == {"skipped": "--no-training"}
    row = report["shapes"]["large"]
    assert set(row["save"]) == {RAW_THREADS, QUICKSAVE}
    assert row["save"][QUICKSAVE]["mbps_median"] > 0
    assert row["load"][QUICKSAVE]["mbps_median"] > 0
    assert "| quicksave |" in capsys.readouterr().out


def test_storage_bench_bad_arguments(capsys) -> None:
    assert storage_main(["--size-mib", "0", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert storage_main(["--shapes", "huge", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert storage_main(["--bucket", "b"]) == 2
    assert "--bucket needs --endpoint" in capsys.readouterr().err


def test_own_server_is_stopped_on_interrupt(monkeypatch, capsys) -> None:
    """Ctrl-C in the middle of a run with the benchmark's own SeaweedFS: exit 130, and
    the server's process is gone (killed and reaped) with its files."""
    import quicksave_tools.testing.seaweed as seaweed

    started = []

    class Recording(seaweed.SeaweedServer):
        def start(self):
            out = super().start()
            started.append((self, self._running.proc.pid))
            return out

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(seaweed, "SeaweedServer", Recording)
    monkeypatch.setattr(storage_run, "warm_up", interrupt)
    assert storage_main(["--size-mib", "8", "--repeat", "1", "--no-training"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert len(started) == 1
    server, pid = started[0]
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing left in its process group
    assert server.tmpdir is not None and not server.tmpdir.exists()


def test_model_shape_is_a_transformer_with_adamw_state() -> None:
    specs = shape_specs("model", 64 << 20)
    assert len(specs) == MODEL_LAYERS * 12 * 4
    total = sum(n for _, _, n in specs)
    assert 0.8 * (64 << 20) <= total <= 64 << 20
    names = {name for name, _, _ in specs}
    assert "optim.model.layers.3.mlp.up.weight.exp_avg_sq" in names
    assert min(n for _, _, n in specs) == 4  # the step counters
    sd = build_shape("model", 8 << 20)
    assert len(sd) == len(shape_specs("model", 8 << 20))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pinned_training_places_trainer_worker_and_server(s3_server, tmp_path) -> None:
    server_pid = s3_server._running.proc.pid
    before = os.sched_getaffinity(server_pid)
    config = StorageBenchConfig(
        size_mib=8,
        repeat=1,
        directory=str(tmp_path),
        throughput=False,
        train_pin=True,
        **TINY_TRAINING,
    )
    report = run_storage_benchmark(config, Target.from_server(s3_server))
    t = report["training"]
    assert t["placement"] == "pinned"
    for kind in ("local", "s3"):
        assert "failed" not in t["targets"][kind], t["targets"][kind]
        assert t["targets"][kind]["checkpoints"] == 2
    assert os.sched_getaffinity(server_pid) == before  # the shared server is given back
    assert "pinned: trainer on one CPU" in format_storage_report(report)
