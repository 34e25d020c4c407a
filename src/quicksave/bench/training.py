"""``quicksave bench --training``: what checkpointing costs a real training loop.

A seeded MLP (``layers`` × Linear(hidden, hidden); the defaults give 134M parameters,
a 1.61 GB state dict with AdamW) trains ``steps`` steps and checkpoints every
``interval`` steps, once per method, each method in a **fresh process** (so memory,
threads and worker processes do not leak from one method into the next, and the peak
RSS is per method). The loop without checkpoints (``none``) runs before, in the middle
of and after the methods, and its median is the baseline. Methods:

* ``torch.save`` — the whole state dict to one file, then ``fsync``.
* ``dcp.save`` — stock ``torch.distributed.checkpoint.save`` (``FileSystemWriter``).
* ``dcp.async_save-thread`` — ``dcp.async_save`` with the thread executor and DCP's
  default staging (a fresh CPU copy per save).
* ``dcp.async_save-process`` — ``dcp.async_save`` with the process executor and one
  shared-memory ``DefaultStager`` created once and passed to every save.
* ``quicksave-sync`` / ``-thread`` / ``-process`` / ``-process-blocking`` — a
  ``CheckpointManager`` with ``async_mode`` disabled / thread / process (overlapped
  staging) / process with blocking staging.
* ``raw`` (always run) — a raw write+fsync, an ``O_DIRECT`` write, a raw read and
  in-memory copies of the same bytes.

Every save is waited for before the next one starts (DCP: ``future.result()``; the
manager does it itself) and at the end of the loop; that waiting is part of the loop's
time. Reported per method: loop seconds, extra seconds per checkpoint against the
baseline, blocking time of the first and of later saves, seconds from ``save`` to
durable commit, write GB/s against the raw write, restore time (torch.load,
``dcp.load`` or ``quicksave.load`` of the last checkpoint, values checked) against
``dcp.load`` and the raw read, and peak RSS of the trainer and of its worker processes.

Example::

    quicksave bench --training --json > report.json
    quicksave bench --training --quick --methods torch.save,quicksave-sync
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from .savers import DCP_ASYNC, QUICKSAVE_MODES
from .training_loop import median
from .training_report import format_training_report, plot_training_report

__all__ = [
    "METHODS",
    "TrainingBenchConfig",
    "format_training_report",
    "main",
    "plot_training_report",
    "run_training_benchmark",
    "schedule",
]

METHODS = ("torch.save", "dcp.save", *DCP_ASYNC, *QUICKSAVE_MODES)
REFERENCE = "dcp.async_save-process"  # the best of PyTorch's own options
_CHILD = (
    "import sys; from quicksave.bench.training_loop import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)


@dataclass(frozen=True)
class TrainingBenchConfig:
    """What the training-loop benchmark measures.

    Args:
        steps: timed training steps per run.
        interval: checkpoint every ``interval`` steps.
        hidden: width of the MLP (4096 with 8 layers: 134M parameters).
        layers: number of Linear layers.
        batch: rows per batch.
        repeats: runs of every method (their order is rotated each repeat).
        methods: which methods to run (see :data:`METHODS`).
        directory: where checkpoints are written (a sub-folder is made and removed).
        threads: ``torch.set_num_threads`` in every run.
        warmup: untimed steps before the loop (they allocate AdamW's state).
        calibration_steps: steps timed without checkpoints just before the loop, in the
            same process: the paired baseline (see :func:`run_training_benchmark`).
        restore_repeats: timed restores of the last checkpoint per run.
        raw_repeats: timed raw writes, reads and copies.
        seed: seed of the model and the data.
        timeout_s: a run that takes longer is stopped and reported as failed.
    """

    steps: int = 30
    interval: int = 5
    hidden: int = 4096
    layers: int = 8
    batch: int = 32
    repeats: int = 1
    methods: tuple[str, ...] = METHODS
    directory: str | None = None
    threads: int = 2
    warmup: int = 1
    calibration_steps: int = 8
    restore_repeats: int = 3
    raw_repeats: int = 3
    seed: int = 0
    timeout_s: float = 1800.0


QUICK = {
    "steps": 6,
    "interval": 2,
    "hidden": 256,
    "layers": 4,
    "batch": 8,
    "threads": 1,
    "calibration_steps": 2,
}


def schedule(config: TrainingBenchConfig) -> list[str]:
    """The order of the runs: per repeat the methods rotated by the repeat's index, with
    the baseline ``none`` first and (from four methods on) in the middle; one more
    baseline at the end. ``raw`` runs first."""
    runs = ["raw"]
    methods = list(config.methods)
    for r in range(config.repeats):
        shift = r % len(methods) if methods else 0
        order = methods[shift:] + methods[:shift]
        half = len(order) // 2 if len(order) >= 4 else len(order)
        runs += ["none", *order[:half]]
        if half < len(order):
            runs += ["none", *order[half:]]
    return [*runs, "none"]


def _check(config: TrainingBenchConfig, parent: str) -> None:
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    for name in ("steps", "interval", "hidden", "layers", "batch", "repeats", "threads"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    if config.interval > config.steps:
        raise ValueError("interval must not exceed steps (no checkpoint would be written)")
    state_bytes = 12 * config.layers * (config.hidden**2 + config.hidden)
    need = (config.steps // config.interval + 2) * state_bytes + (512 << 20)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ValueError(f"{parent} has {free >> 20} MiB free; this run needs {need >> 20} MiB")


def run_child(child: str, spec: dict[str, Any], spec_path: str, timeout_s: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter: ``python -c child spec_path``, where
    ``spec`` (written to ``spec_path``) names the JSON file the child writes its result
    to (``spec["result"]``). Returns that result, or ``{"failed": why}`` with the tail of
    the child's stderr when it wrote none (crashed, or ran past ``timeout_s``)."""
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", child, spec_path],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        tail = (proc.stderr or "")[-2000:]
    except subprocess.TimeoutExpired:
        proc, tail = None, f"timed out after {timeout_s:.0f} s"
    try:
        with open(spec["result"]) as f:
            return json.load(f)
    except (OSError, ValueError):
        code = "" if proc is None else f" (exit code {proc.returncode})"
        return {"failed": f"no result{code}: {tail.strip()}"}


def _run_one(method: str, config: TrainingBenchConfig, base: str, index: int) -> dict[str, Any]:
    folder = os.path.join(base, f"{index:02d}-{method}")
    spec = {**asdict(config), "methods": None, "method": method, "folder": folder}
    spec["result"] = os.path.join(base, f"{index:02d}-result.json")
    t0 = time.perf_counter()
    try:
        result = run_child(
            _CHILD, spec, os.path.join(base, f"{index:02d}-spec.json"), config.timeout_s
        )
        result.setdefault("method", method)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # one method's checkpoints at a time
    result["wall_s"] = time.perf_counter() - t0
    return result


def _round(value: Any, digits: int = 4) -> Any:
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, list):
        return [_round(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    return value


# what the report keeps of every run (for --json and --plot)
_RUN_KEYS = ("step_s", "save_s", "events", "loop_s", "drain_s", "calibration_step_s")


def _paired_extra_s(run: dict[str, Any]) -> float | None:
    """Loop seconds beyond ``steps`` × the run's own median step time without
    checkpoints (measured just before its loop)."""
    calib = median(run.get("calibration_step_s") or [])
    return None if calib is None else run["loop_s"] - len(run["step_s"]) * calib


def _summarize(method: str, runs: list[dict], baseline_s: float | None) -> dict[str, Any]:
    ok = [r for r in runs if "failed" not in r and "unavailable" not in r]
    if not ok:
        bad = runs[0] if runs else {"failed": "not run"}
        key = "unavailable" if "unavailable" in bad else "failed"
        return {key: bad[key], **({"traceback": bad["traceback"]} if "traceback" in bad else {})}
    events = [r["events"] for r in ok]
    n_ckpt = len(events[0])
    loop = median([r["loop_s"] for r in ok])
    first = [ev[0]["blocking_s"] for ev in events if ev]
    later = [e["blocking_s"] for ev in events for e in ev[1:]]
    durable_first = [ev[0]["durable_s"] for ev in events if ev and ev[0]["durable_s"]]
    durable_later = [e["durable_s"] for ev in events for e in ev[1:] if e["durable_s"]]
    out: dict[str, Any] = {
        "loop_s": [r["loop_s"] for r in ok],
        "loop_median_s": loop,
        "checkpoints": n_ckpt,
        "overhead_per_checkpoint_s": (
            (loop - baseline_s) / n_ckpt if n_ckpt and baseline_s is not None else None
        ),
        "paired_overhead_per_checkpoint_s": (
            median([x / n_ckpt for r in ok if (x := _paired_extra_s(r)) is not None])
            if n_ckpt
            else None
        ),
        "first_blocking_s": median(first),
        "later_blocking_median_s": median(later),
        "later_waited_for_previous_median_s": median(
            [e["waited_for_previous_s"] for ev in events for e in ev[1:]]
        ),
        "first_durable_s": median(durable_first),
        "later_durable_median_s": median(durable_later),
        "drain_median_s": median([r["drain_s"] for r in ok]),
        "setup_median_s": median([r.get("setup_s", 0.0) for r in ok]),
        "restore_s": [t for r in ok for t in r.get("restore_s", [])],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
        "worker_peak_rss_mib": max(r["worker_peak_rss_mib"] for r in ok),
        "final_loss": ok[0]["final_loss"],
        "runs": [{k: r[k] for k in _RUN_KEYS if k in r} for r in ok],
    }
    out["restore_median_s"] = median(out["restore_s"])
    if "manager_records" in ok[0]:
        out["manager_records"] = ok[0]["manager_records"]
    return out


def run_training_benchmark(config: TrainingBenchConfig, log: Any = None) -> dict[str, Any]:
    """Run every method in its own process and return the report.

    Args:
        config: model size, loop length, methods, repeats and folder.
        log: a text stream for one progress line per run (None: quiet).

    Returns:
        A JSON-serializable dict: ``config``, ``machine``, ``state`` (parameters, bytes),
        ``raw`` (write/O_DIRECT/read/copy seconds), ``baseline`` (loop seconds of every
        run without checkpoints) and ``methods`` (per method: loop seconds, overhead per
        checkpoint, blocking, durable, GB/s, restore, RSS, the per-step timings), plus
        ``failed`` / ``unavailable`` entries for methods that could not run.

    Raises:
        ValueError: bad arguments or too little free disk space.
        RuntimeError: the baseline or the raw run failed (nothing to compare with).

    Example::

        report = run_training_benchmark(TrainingBenchConfig(**QUICK, methods=("torch.save",)))
    """
    parent = os.path.abspath(config.directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    _check(config, parent)
    load_before = os.getloadavg()
    base = tempfile.mkdtemp(prefix="quicksave-train-bench-", dir=parent)
    results: dict[str, list[dict]] = {}
    try:
        for i, method in enumerate(schedule(config)):
            r = _run_one(method, config, base, i)
            results.setdefault(method, []).append(r)
            if log is not None:
                state = r.get("failed") or r.get("unavailable")
                if not state:
                    state = (
                        f"raw write+fsync {median(r['write_s']):.2f} s"
                        if method == "raw"
                        else f"loop {r['loop_s']:.1f} s"
                    )
                print(f"[{i + 1}] {method}: {state} ({r['wall_s']:.0f} s)", file=log, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for needed in ("raw", "none"):
        bad = [r for r in results[needed] if "failed" in r]
        if bad:
            raise RuntimeError(f"the {needed} run failed: {bad[0]['failed']}")
    raw = results["raw"][0]
    baseline = [r["loop_s"] for r in results["none"]]
    nbytes = raw["bytes"]
    methods = {m: _summarize(m, results.get(m, []), median(baseline)) for m in config.methods}
    ref = methods.get(REFERENCE, {}).get("overhead_per_checkpoint_s")
    paired_ref = methods.get(REFERENCE, {}).get("paired_overhead_per_checkpoint_s")
    write_s, read_s = median(raw["write_s"]), median(raw["read_s"])
    dcp_restore = methods.get("dcp.save", {}).get("restore_median_s")
    base_loss = results["none"][0]["final_loss"]
    for m in methods.values():
        if "loop_median_s" not in m:
            continue
        over, dur, rest = m["overhead_per_checkpoint_s"], m["later_durable_median_s"], None
        m["overhead_vs_reference"] = over / ref if ref and over is not None else None
        paired = m["paired_overhead_per_checkpoint_s"]
        m["paired_overhead_vs_reference"] = (
            paired / paired_ref if paired_ref and paired is not None else None
        )
        m["first_vs_later_blocking"] = (
            m["first_blocking_s"] / m["later_blocking_median_s"]
            if m["later_blocking_median_s"]
            else None
        )
        m["write_gbps"] = nbytes / 1e9 / dur if dur else None
        m["durable_vs_raw_write"] = dur / write_s if dur else None
        rest = m["restore_median_s"]
        m["restore_gbps"] = nbytes / 1e9 / rest if rest else None
        m["restore_speedup_vs_dcp_load"] = dcp_restore / rest if rest and dcp_restore else None
        m["restore_vs_raw_read"] = rest / read_s if rest else None
        m["same_loss_as_baseline"] = m["final_loss"] == base_loss
    return _round(
        {
            "config": {**asdict(config), "directory": parent, "methods": list(config.methods)},
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": _torch_version(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            },
            "state": {"params": raw["params"], "bytes": nbytes},
            "raw": {
                k: raw.get(k)
                for k in (
                    "write_s",
                    "direct_s",
                    "read_s",
                    "copy_warm_s",
                    "copy_fresh_s",
                    "direct_unavailable",
                )
                if raw.get(k) is not None
            },
            "baseline": {
                "loop_s": baseline,
                "loop_median_s": median(baseline),
                "step_s": results["none"][0]["step_s"],
                # what the paired estimate gives where there is nothing to find
                "paired_extra_s": [_paired_extra_s(r) for r in results["none"]],
                "final_loss": base_loss,
            },
            "reference": REFERENCE,
            "methods": methods,
            "order": schedule(config),
        }
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``quicksave bench --training``."""
    d = TrainingBenchConfig()
    p = argparse.ArgumentParser(
        prog="quicksave bench --training",
        description="Training-loop overhead of checkpointing: torch.save, DCP (sync, async "
        "thread, async process) and quicksave's modes, each in a fresh process.",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed steps ({d.steps})")
    p.add_argument("--interval", type=int, default=d.interval, help="checkpoint every N steps")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"MLP width ({d.hidden})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"MLP depth ({d.layers})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"batch rows ({d.batch})")
    p.add_argument("--repeats", type=int, default=d.repeats, help="runs of every method")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--dir", default=None, help="folder to write in (default: current)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (2)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quick", action="store_true", help="a tiny model and loop (tests)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw step times and checkpoints (PNG/SVG)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --training``.

    Args:
        argv: the arguments after ``--training``.

    Returns:
        0 on success, 2 on bad arguments, 1 if the baseline or raw run failed.

    Example::

        quicksave bench --training --repeats 1 --plot steps.png
    """
    args = build_parser().parse_args(argv)
    config = TrainingBenchConfig(
        steps=args.steps,
        interval=args.interval,
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        repeats=args.repeats,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        directory=args.dir,
        threads=args.threads,
        seed=args.seed,
    )
    if args.quick:
        config = replace(config, restore_repeats=1, raw_repeats=1, **QUICK)
    try:
        report = run_training_benchmark(config, log=sys.stderr)
    except ValueError as e:
        print(f"quicksave bench --training: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"quicksave bench --training: {e}", file=sys.stderr)
        return 1
    if args.plot:
        plot_training_report(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else format_training_report(report))
    return 0
