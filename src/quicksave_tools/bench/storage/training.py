"""The training-loop part of ``quicksave bench --storage``: a seeded MLP + AdamW with a
``CheckpointManager`` (``async_mode="process"``) checkpointing to ``s3://`` and to a
local directory, each run in a fresh process (:func:`train_child` is the child's entry,
:func:`run_training` the parent's schedule: ``none`` / ``local`` / ``s3``, and with a
baseline ``local@baseline`` / ``s3@baseline`` run with the baseline's package), and the
overhead per checkpoint against the runs without checkpoints."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from quicksave_tools.bench.baseline import BASELINE, baseline_env, is_baseline, plain
from quicksave_tools.bench.child import child_entry, run_in_fresh_process
from quicksave_tools.bench.storage.buckets import Buckets, delete_prefix
from quicksave_tools.bench.storage.config import StorageBenchConfig
from quicksave_tools.bench.storage.log import say
from quicksave_tools.bench.storage.target import Target, server_on

TARGETS = ("local", "s3")
_CHILD = (
    "import sys; from quicksave_tools.bench.storage.training import train_child; "
    "sys.exit(train_child(sys.argv[1:]))"
)


def train_child(argv: list[str]) -> int:
    """One training run (``argv = [spec_path]``): writes its result JSON, 0 on success."""
    return child_entry(argv, _train_run)


def _train_run(spec: dict[str, Any]) -> dict[str, Any]:
    from quicksave import (  # the public API only: a baseline's package has it too
        CheckpointConfig,
        CheckpointManager,
        ModelState,
        OptimizerState,
        S3Options,
        StorageOptions,
    )
    from quicksave_tools.bench.training_loop import build_trainer

    if spec.get("trainer_cpus"):  # before torch starts its threads: they inherit it
        os.sched_setaffinity(0, spec["trainer_cpus"])
    torch.set_num_threads(spec["threads"])
    model, optim, train_step = build_trainer(spec)
    for _ in range(spec["warmup"]):
        train_step()  # allocates AdamW's state
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    result: dict[str, Any] = {
        "target": spec["target"],
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": sum(
            t.numel() * t.element_size()
            for t in [*model.state_dict().values()]
            + [v for st in optim.state.values() for v in st.values() if torch.is_tensor(v)]
        ),
    }
    calibration = result["calibration_step_s"] = []
    for _ in range(spec["calibration_steps"]):
        t0 = time.perf_counter()
        train_step()
        calibration.append(time.perf_counter() - t0)
    manager = None
    if spec["target"] != "none":
        t0 = time.perf_counter()
        storage = StorageOptions()
        if spec["target"] == "s3":  # credentials: the AWS chain (this process's env)
            storage = StorageOptions(
                s3=S3Options(endpoint_url=spec["endpoint_url"], region=spec["region"])
            )
        cfg = CheckpointConfig(
            folder=spec["folder"],
            interval=spec["interval"],
            async_mode="process",
            storage=storage,
            worker_cpus=tuple(spec["worker_cpus"]) if spec.get("worker_cpus") else None,
        )
        manager = CheckpointManager(cfg, states)
        result["setup_s"] = time.perf_counter() - t0
    step_s, save_s, saved = [], [], []
    cpu0 = time.process_time()
    begin = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        t0 = time.perf_counter()
        train_step()
        t1 = time.perf_counter()
        if manager is not None and manager.save(step):
            saved.append(step)
        t2 = time.perf_counter()
        step_s.append(t2 - t0)
        save_s.append(t2 - t1)
    t_drain = time.perf_counter()
    records: list[dict[str, Any]] = []
    if manager is not None:
        manager.close()  # waits for the checkpoints in flight: part of the loop's time
    end = time.perf_counter()
    loop_cpu = time.process_time() - cpu0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the worker, reaped by close()
    if manager is not None:
        keys = ("step", "bytes", "blocking_s", "staging_s", "durable_s", "write_s", "status")
        records = [
            {k: getattr(r, k) for k in keys if getattr(r, k, None) is not None}
            for r in manager.metrics
        ]
        bad = [r for r in records if r.get("status") != "committed"]
        if bad or len(records) != len(saved):
            raise RuntimeError(f"not every checkpoint committed: {records}")
    result.update(
        loop_s=end - begin,
        steps_loop_s=t_drain - begin,  # the steps alone: the final wait left out
        drain_s=end - t_drain,
        step_s=step_s,
        save_s=save_s,
        saved_steps=saved,
        records=records,
        trainer_cpu_s=loop_cpu,
        worker_cpu_s=children.ru_utime + children.ru_stime,
    )
    return result


def _placement(config: StorageBenchConfig, log: Any) -> tuple[list[int] | None, list[int] | None]:
    """``train_pin``: (the trainer's CPUs, the worker's and server's); (None, None) when
    not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not config.train_pin:
        return None, None
    if len(cpus) < 2:
        say(log, "  training: --train-pin needs two CPUs; running unpinned")
        return None, None
    say(log, f"  training: trainer on CPUs {cpus[:1]}, worker and server on {cpus[1:]}")
    return cpus[:1], cpus[1:]


def train_targets(config: StorageBenchConfig) -> tuple[str, ...]:
    """The checkpointing targets: local and S3, with a baseline each also as
    ``<target>@baseline``."""
    if config.baseline is None:
        return TARGETS
    return tuple(k for t in TARGETS for k in (t, t + BASELINE))


def train_schedule(config: StorageBenchConfig) -> list[str]:
    """``none`` first, then per repeat every target (:func:`train_targets`, order
    reversed every other repeat), followed by ``none``."""
    runs = ["none"]
    targets = list(train_targets(config))
    for r in range(config.train_repeat):
        runs += (targets if r % 2 == 0 else targets[::-1]) + ["none"]
    return runs


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_training(
    config: StorageBenchConfig, target: Target, buckets: Buckets, run_id: str, log: Any
) -> dict[str, Any]:
    parent = os.path.abspath(config.directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    base = tempfile.mkdtemp(prefix="quicksave-storage-bench-", dir=parent)
    tag = "train"
    bucket = buckets.make(tag)
    trainer_cpus, worker_cpus = _placement(config, log)
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        with server_on(target, worker_cpus):
            for i, kind in enumerate(train_schedule(config)):
                prefix = f"{run_id}/train/{i:02d}"
                folder = {
                    "none": os.path.join(base, f"{i:02d}-none"),
                    "local": os.path.join(base, f"{i:02d}-local"),
                    "s3": f"s3://{bucket}/{prefix}",
                }[plain(kind)]
                env = None
                if is_baseline(kind):
                    assert config.baseline is not None
                    env = baseline_env(config.baseline, base)
                spec = {
                    "target": plain(kind),
                    "folder": folder,
                    "endpoint_url": target.endpoint_url,
                    "region": target.region,
                    "hidden": config.train_hidden,
                    "layers": config.train_layers,
                    "batch": config.train_batch,
                    "seed": config.seed,
                    "steps": config.train_steps,
                    "interval": config.train_interval,
                    "threads": config.train_threads,
                    "trainer_cpus": trainer_cpus,
                    "worker_cpus": worker_cpus,
                    "warmup": config.train_warmup,
                    "calibration_steps": config.train_calibration_steps,
                    "result": os.path.join(base, f"{i:02d}-result.json"),
                }
                t0 = time.perf_counter()
                s0 = target.server_cpu_s()
                try:
                    result = run_in_fresh_process(
                        _CHILD,
                        spec,
                        os.path.join(base, f"{i:02d}-spec.json"),
                        config.train_timeout_s,
                        env,
                    )
                    s1 = target.server_cpu_s()
                finally:
                    if plain(kind) == "s3":
                        with contextlib.suppress(Exception):
                            delete_prefix(buckets.client, bucket, prefix + "/")
                    else:
                        shutil.rmtree(folder, ignore_errors=True)
                result["wall_s"] = time.perf_counter() - t0
                if s0 is not None and s1 is not None:
                    result["server_cpu_s"] = s1 - s0
                runs.setdefault(kind, []).append(result)
                state = result.get("failed") or f"loop {result['loop_s']:.2f} s"
                say(log, f"  training [{i + 1}] {kind}: {state}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        buckets.drop(tag)
    return _training_report(config, runs)


def _training_report(config: StorageBenchConfig, runs: dict[str, list[dict]]) -> dict[str, Any]:
    none_ok = [r for r in runs.get("none", []) if "failed" not in r]
    baseline = _median([r["loop_s"] for r in none_ok])
    baseline_steps = _median([r.get("steps_loop_s", r["loop_s"]) for r in none_ok])
    out: dict[str, Any] = {
        "placement": "pinned" if config.train_pin else "shared",
        "model": {
            "hidden": config.train_hidden,
            "layers": config.train_layers,
            "batch": config.train_batch,
            "params": none_ok[0]["params"] if none_ok else None,
            "state_bytes": none_ok[0]["bytes"] if none_ok else None,
        },
        "steps": config.train_steps,
        "interval": config.train_interval,
        "order": train_schedule(config),
        "baseline": {
            "loop_s": [round(r["loop_s"], 4) for r in none_ok],
            "loop_median_s": baseline,
            "step_median_s": _median([s for r in none_ok for s in r["step_s"]]),
        },
        "targets": {},
    }
    if not none_ok:
        bad = runs.get("none", [{}])
        out["baseline"]["failed"] = bad[0].get("failed", "not run") if bad else "not run"
    for kind in train_targets(config):
        rs = runs.get(kind, [])
        ok = [r for r in rs if "failed" not in r]
        if not ok:
            out["targets"][kind] = {"failed": rs[0]["failed"] if rs else "not run"}
            continue
        n = len(ok[0]["saved_steps"])
        loop = _median([r["loop_s"] for r in ok])
        steps_loop = _median([r["steps_loop_s"] for r in ok])
        assert steps_loop is not None
        assert loop is not None
        paired = [
            (r["loop_s"] - len(r["step_s"]) * statistics.median(r["calibration_step_s"])) / n
            for r in ok
            if n and r["calibration_step_s"]
        ]
        recs = [rec for r in ok for rec in r["records"]]
        out["targets"][kind] = {
            "loop_s": [round(r["loop_s"], 4) for r in ok],
            "loop_median_s": loop,
            "checkpoints": n,
            "overhead_per_checkpoint_s": (loop - baseline) / n if n and baseline else None,
            # the same without the final wait for the last checkpoint (a one-off at the
            # end of a job, which dominates a short loop's per-checkpoint share)
            "in_loop_overhead_per_checkpoint_s": (
                (steps_loop - baseline_steps) / n if n and baseline_steps else None
            ),
            "paired_overhead_per_checkpoint_s": _median(paired),
            "blocking_median_s": _median([x["blocking_s"] for x in recs if "blocking_s" in x]),
            "durable_median_s": _median([x["durable_s"] for x in recs if "durable_s" in x]),
            "drain_median_s": _median([r["drain_s"] for r in ok]),
            "setup_median_s": _median([r.get("setup_s", 0.0) for r in ok]),
            "server_cpu_s": [round(r["server_cpu_s"], 3) for r in ok if "server_cpu_s" in r],
            "worker_cpu_s": [round(r["worker_cpu_s"], 3) for r in ok if "worker_cpu_s" in r],
            "trainer_cpu_s": [round(r["trainer_cpu_s"], 3) for r in ok if "trainer_cpu_s" in r],
        }
    local, s3 = out["targets"].get("local", {}), out["targets"].get("s3", {})
    a, b = s3.get("overhead_per_checkpoint_s"), local.get("overhead_per_checkpoint_s")
    out["s3_minus_local_overhead_s"] = round(a - b, 4) if a is not None and b is not None else None
    for key in (
        "overhead_per_checkpoint_s",
        "paired_overhead_per_checkpoint_s",
        "in_loop_overhead_per_checkpoint_s",
    ):
        a, b = s3.get(key), local.get(key)
        out[f"s3_vs_local_{key.removesuffix('_per_checkpoint_s')}"] = (
            round(a / b, 3) if a is not None and b and b > 0 else None
        )
    return out
