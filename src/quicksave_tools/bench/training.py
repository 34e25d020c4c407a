"""``quicksave bench --training``: what checkpointing costs a real training loop.

Three model shapes of the same ~1.6 GB state with AdamW (:mod:`.shapes`: a wide MLP, a
24-layer language model of ~1,550 state tensors, an embedding-heavy recommender), so
that no one layout of tensors decides the result. Each trains ``steps`` steps and
checkpoints every ``interval`` steps, once per method, each method in a **fresh
process** (so memory, threads and worker processes do not leak from one method into
the next, and the peak RSS is per method). Per shape, the loop without checkpoints
(``none``) runs before, in the middle of and after the methods, and its median is the
baseline.

When the saver is built (``build``): ``"cold"`` (default) builds it right after the
model and the optimizer, before the optimizer's first step — as a job that starts
training does (real loops, torchtitan) — so the loop holds the first step and the first
save with whatever the saver left for them; ``"warm"`` builds it after a warm-up step
and the calibration steps, when the optimizer's state exists (a resumed job's case).
Methods:

* ``torch.save`` — the whole state dict to one file, then ``fsync``.
* ``dcp.save`` — stock ``torch.distributed.checkpoint.save`` (``FileSystemWriter``).
* ``dcp.async_save-thread`` — ``dcp.async_save`` with the thread executor and DCP's
  default staging (a fresh CPU copy per save).
* ``dcp.async_save-process`` — ``dcp.async_save`` with the process executor and one
  shared-memory ``DefaultStager`` created once and passed to every save.
* ``torch_checkpointing`` — torch_checkpointing's ``CheckpointManager`` with its default
  asynchronous saver, ``optimizer.step()`` inside its ``lock()`` (see :mod:`.savers`).
* ``quicksave-sync`` / ``-thread`` / ``-process`` / ``-process-blocking`` /
  ``-process-paced`` — a ``CheckpointManager`` with ``async_mode`` disabled / thread /
  process (overlapped staging: the default) / process with blocking staging / the
  default with ``write_rate_mbps=300`` (its writes paced).
* ``raw`` (always run, once per shape) — a raw write+fsync, an ``O_DIRECT`` write, a raw
  read, in-memory copies of the same bytes, and the floor: CPU seconds of one
  single-threaded ``memcpy`` of the state plus one xxh3-64 pass over it.

Every save is waited for before the next one starts (DCP: ``future.result()``; the
manager does it itself) and at the end of the loop; that waiting is part of the loop's
time. Reported per method: loop seconds, extra seconds per checkpoint against the
baseline, blocking time of the first and of later saves, seconds from ``save`` to
durable commit, write GB/s against the raw write, restore time (torch.load,
``dcp.load`` or ``quicksave.load`` of the last checkpoint, values checked) against
``dcp.load`` and the raw read, the restore into a fresh job (a new model and an
optimizer without state; the manager's ``load()`` for quicksave), peak RSS of the
trainer and of its worker processes, CPU seconds per checkpoint of the trainer (beyond
its training) and of the workers, the first step after the saver was built against the
process's steady step (warm) or the baseline's first step (cold), the extra loop seconds
of the first save and of a later one (the save's step and the next against the same
steps of the baseline), the final wait against the last save's time to durable, and the
staging memory against the state's bytes. The ``acceptance`` rows check quicksave's
default mode against issue 12's and issue 20's targets; every save, the first one
included, counts in the loop overhead.

Example::

    quicksave bench --training --json > report.json
    quicksave bench --training --quick --methods torch.save,quicksave-sync
    quicksave bench --training --build warm   # the saver built after a warm-up step
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

from quicksave_tools.bench.savers import DCP_ASYNC, QUICKSAVE_MODES, TORCH_CHECKPOINTING
from quicksave_tools.bench.shapes import SHAPES
from quicksave_tools.bench.training_loop import median
from quicksave_tools.bench.training_report import format_training_report, plot_training_report

__all__ = [
    "METHODS",
    "TrainingBenchConfig",
    "format_training_report",
    "main",
    "plot_training_report",
    "run_training_benchmark",
    "schedule",
]

METHODS = ("torch.save", "dcp.save", *DCP_ASYNC, TORCH_CHECKPOINTING, *QUICKSAVE_MODES)
BUILDS = ("cold", "warm")
REFERENCE = "dcp.async_save-process"  # the best of PyTorch's own options
DEFAULT = "quicksave-process"  # CheckpointConfig's defaults: process worker, overlap
_CHILD = (
    "import sys; from quicksave_tools.bench.training_loop import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)


@dataclass(frozen=True)
class TrainingBenchConfig:
    """What the training-loop benchmark measures.

    Args:
        steps: timed training steps per run.
        interval: checkpoint every ``interval`` steps.
        shapes: model shapes (:data:`quicksave_tools.bench.shapes.SHAPES`), each with every
            method.
        quick: tiny versions of the shapes (tests, smoke runs).
        repeats: runs of every method (their order is rotated each repeat).
        methods: which methods to run (see :data:`METHODS`).
        directory: where checkpoints are written (a sub-folder is made and removed).
        threads: ``torch.set_num_threads`` in every run.
        build: ``"cold"``: the saver is built before the optimizer's first step, which
            the loop starts with; ``"warm"``: after ``warmup`` steps (module docstring).
        warmup: untimed steps before the saver is built (they allocate AdamW's state);
            ``"warm"`` only.
        calibration_steps: steps timed without checkpoints in the same process (just
            before the saver is built; cold: after the restores): the paired baseline.
        restore_repeats: timed restores of the last checkpoint per run.
        raw_repeats: timed raw writes, reads and copies.
        seed: seed of the model and the data.
        timeout_s: a run that takes longer is stopped and reported as failed.
    """

    steps: int = 30
    interval: int = 5
    shapes: tuple[str, ...] = tuple(SHAPES)
    quick: bool = False
    repeats: int = 2
    methods: tuple[str, ...] = METHODS
    directory: str | None = None
    threads: int = 2
    build: str = "cold"
    warmup: int = 1
    calibration_steps: int = 6
    restore_repeats: int = 2
    raw_repeats: int = 3
    seed: int = 0
    timeout_s: float = 1800.0


QUICK = {
    "steps": 6,
    "interval": 2,
    "quick": True,
    "repeats": 1,
    "threads": 1,
    "calibration_steps": 2,
}


def schedule(config: TrainingBenchConfig) -> list[tuple[str, str]]:
    """The order of the runs, as (shape, method): ``raw`` of every shape first; then per
    repeat and shape the methods rotated by the repeat's index, with the baseline
    ``none`` first and (from four methods on) in the middle; one more baseline per shape
    at the end."""
    runs = [(shape, "raw") for shape in config.shapes]
    methods = list(config.methods)
    for r in range(config.repeats):
        shift = r % len(methods) if methods else 0
        order = methods[shift:] + methods[:shift]
        half = len(order) // 2 if len(order) >= 4 else len(order)
        for shape in config.shapes:
            runs += [(shape, m) for m in ("none", *order[:half])]
            if half < len(order):
                runs += [(shape, m) for m in ("none", *order[half:])]
    return [*runs, *((shape, "none") for shape in config.shapes)]


def _check(config: TrainingBenchConfig, parent: str) -> None:
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    bad = [s for s in config.shapes if s not in SHAPES]
    if bad or not config.shapes:
        raise ValueError(
            f"unknown shape(s) {', '.join(bad) or '(none)'}; known: {', '.join(SHAPES)}"
        )
    if config.build not in BUILDS:
        raise ValueError(f"unknown build {config.build!r}; known: {', '.join(BUILDS)}")
    for name in ("steps", "interval", "repeats", "threads"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    if config.interval > config.steps:
        raise ValueError("interval must not exceed steps (no checkpoint would be written)")
    state_bytes = 0 if config.quick else 1_700_000_000
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


def _run_one(
    shape: str, method: str, config: TrainingBenchConfig, base: str, index: int
) -> dict[str, Any]:
    folder = os.path.join(base, f"{index:02d}-{method}")
    spec = {**asdict(config), "methods": None, "shapes": None, "method": method}
    spec.update(shape=shape, folder=folder)
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
_RUN_KEYS = (
    "step_s",
    "save_s",
    "events",
    "loop_s",
    "drain_s",
    "calibration_step_s",
    "trainer_cpu_s",
    "workers_cpu_s",
    "setup_s",
    "fresh_restore_s",
    "fresh_setup_s",
)


def _paired_extra_s(run: dict[str, Any]) -> float | None:
    """Loop seconds beyond ``steps`` × the run's own median step time without
    checkpoints (measured in the same process)."""
    calib = median(run.get("calibration_step_s") or [])
    return None if calib is None else run["loop_s"] - len(run["step_s"]) * calib


def _extra_cpu_s(run: dict[str, Any]) -> float | None:
    """The trainer's CPU seconds over the loop beyond its steps at its calibration rate."""
    if not run.get("calibration_step_s") or "trainer_cpu_s" not in run:
        return None
    steady = len(run["step_s"]) * run["calibration_cpu_s"] / len(run["calibration_step_s"])
    return run["trainer_cpu_s"] - steady


@dataclass(frozen=True)
class _Baseline:
    """What the runs without checkpoints (``none``) of one shape give the methods'."""

    loop_s: float | None  # median loop seconds
    step_s: list[float]  # the median of every step (by its index in the loop)
    step_median_s: float | None  # the median step
    # Cold: what the paired estimates find without checkpoints (the loop's first
    # optimizer step allocates the optimizer's state, the calibration steps do not);
    # subtracted from the methods'. Warm: 0.
    paired_extra_s: float = 0.0
    cpu_extra_s: float = 0.0


def _baseline(nones: list[dict[str, Any]], cold: bool) -> _Baseline:
    steps = min(len(r["step_s"]) for r in nones)
    per_step = [median([r["step_s"][i] for r in nones]) for i in range(steps)]
    paired = [x for r in nones if (x := _paired_extra_s(r)) is not None]
    cpu = [x for r in nones if (x := _extra_cpu_s(r)) is not None]
    return _Baseline(
        median([r["loop_s"] for r in nones]),
        [x for x in per_step if x is not None],
        median([t for r in nones for t in r["step_s"]]),
        (median(paired) or 0.0) if cold else 0.0,
        (median(cpu) or 0.0) if cold else 0.0,
    )


def _save_extra_s(run: dict[str, Any], event: dict[str, Any], base: _Baseline) -> float | None:
    """Extra loop seconds around one save: its step (the save's blocking included) and
    the next one, against the same steps of the baseline; None for the loop's last step
    (its next step is the final wait)."""
    i = event["step"] - 1
    if i + 1 >= min(len(run["step_s"]), len(base.step_s)):
        return None
    return sum(run["step_s"][j] - base.step_s[j] for j in (i, i + 1))


def _summarize(method: str, runs: list[dict], base: _Baseline) -> dict[str, Any]:
    ok = [r for r in runs if "failed" not in r and "unavailable" not in r]
    if not ok:
        bad = runs[0] if runs else {"failed": "not run"}
        key = "unavailable" if "unavailable" in bad else "failed"
        return {key: bad[key], **({"traceback": bad["traceback"]} if "traceback" in bad else {})}
    baseline_s = base.loop_s
    events = [r["events"] for r in ok]
    n_ckpt = len(events[0])
    loop = median([r["loop_s"] for r in ok])
    first = [ev[0]["blocking_s"] for ev in events if ev]
    later = [e["blocking_s"] for ev in events for e in ev[1:]]
    durable_first = [ev[0]["durable_s"] for ev in events if ev and ev[0]["durable_s"]]
    durable_later = [e["durable_s"] for ev in events for e in ev[1:] if e["durable_s"]]
    per_run = [(r["loop_s"] - baseline_s) / n_ckpt for r in ok] if n_ckpt and baseline_s else []
    first_vs_steady = [
        r["step_s"][0] / median(r["calibration_step_s"])
        for r in ok
        if r.get("calibration_step_s") and r["step_s"] and r.get("build") != "cold"
    ]
    first_vs_baseline = [r["step_s"][0] / base.step_s[0] for r in ok if r["step_s"] and base.step_s]
    first_extra = [
        x for r in ok if r["events"] and (x := _save_extra_s(r, r["events"][0], base)) is not None
    ]
    later_extra = [
        x for r in ok for e in r["events"][1:] if (x := _save_extra_s(r, e, base)) is not None
    ]
    first_extra_s, later_extra_s = median(first_extra), median(later_extra)
    close_vs_durable = [
        r["drain_s"] / r["events"][-1]["durable_s"]
        for r in ok
        if r["events"] and r["events"][-1].get("durable_s")
    ]
    trainer_cpu = [
        (x - base.cpu_extra_s) / n_ckpt for r in ok if n_ckpt and (x := _extra_cpu_s(r)) is not None
    ]
    workers_cpu = [r["workers_cpu_s"] / n_ckpt for r in ok if n_ckpt and "workers_cpu_s" in r]
    out: dict[str, Any] = {
        "loop_s": [r["loop_s"] for r in ok],
        "loop_median_s": loop,
        "checkpoints": n_ckpt,
        "overhead_per_checkpoint_runs_s": per_run,
        "first_step_vs_steady": median(first_vs_steady),
        "first_step_vs_steady_runs": first_vs_steady,
        "first_step_vs_baseline": median(first_vs_baseline),
        "first_save_extra_s": first_extra_s,
        "first_save_extra_runs_s": first_extra,
        "later_save_extra_median_s": later_extra_s,
        # the first save's extra loop time beyond a later one's, in steady steps
        "first_save_excess_steps": (
            (first_extra_s - later_extra_s) / base.step_median_s
            if first_extra_s is not None and later_extra_s is not None and base.step_median_s
            else None
        ),
        "close_vs_last_durable": median(close_vs_durable),
        "close_vs_last_durable_runs": close_vs_durable,
        "trainer_cpu_per_checkpoint_s": median(trainer_cpu),
        "workers_cpu_per_checkpoint_s": median(workers_cpu),
        "staging_bytes": max(r.get("staging_bytes", 0) for r in ok),
        "overhead_per_checkpoint_s": (
            (loop - baseline_s) / n_ckpt if n_ckpt and baseline_s is not None else None
        ),
        "paired_overhead_per_checkpoint_s": (
            median(
                [
                    (x - base.paired_extra_s) / n_ckpt
                    for r in ok
                    if (x := _paired_extra_s(r)) is not None
                ]
            )
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
        "fresh_restore_s": [r["fresh_restore_s"] for r in ok if "fresh_restore_s" in r],
        "fresh_setup_s": [r["fresh_setup_s"] for r in ok if "fresh_setup_s" in r],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ok),
        "worker_peak_rss_mib": max(r["worker_peak_rss_mib"] for r in ok),
        "final_loss": ok[0]["final_loss"],
        "runs": [{k: r[k] for k in _RUN_KEYS if k in r} for r in ok],
    }
    out["restore_median_s"] = median(out["restore_s"])
    out["fresh_restore_median_s"] = median(out["fresh_restore_s"])
    if "manager_records" in ok[0]:
        out["manager_records"] = ok[0]["manager_records"]
        recs = [rec for r in ok for rec in r.get("manager_records", [])]
        for key in ("trainer_cpu_s", "worker_cpu_s"):
            values = [rec[key] for rec in recs if rec.get(key) is not None]
            out[f"save_{key}_median"] = median(values)
    return out


def run_training_benchmark(config: TrainingBenchConfig, log: Any = None) -> dict[str, Any]:
    """Run every (shape, method) in its own process and return the report.

    Args:
        config: shapes, loop length, methods, repeats and folder.
        log: a text stream for one progress line per run (None: quiet).

    Returns:
        A JSON-serializable dict: ``config``, ``machine``, ``shapes`` (per shape:
        ``state`` (parameters, tensors, bytes), ``raw`` (write/O_DIRECT/read/copy
        seconds), ``floor`` (memcpy + xxh3 CPU seconds), ``baseline`` (loop seconds of
        every run without checkpoints) and ``methods`` (per method: loop seconds,
        overhead per checkpoint and its spread, blocking, durable, GB/s, restore, RSS,
        CPU per checkpoint, first step and final wait ratios, the per-step timings, or
        ``failed`` / ``unavailable``)), ``acceptance`` (issue 12's checks of the default
        mode, per shape) and ``order``.

    Raises:
        ValueError: bad arguments or too little free disk space.
        RuntimeError: a baseline or raw run failed (nothing to compare with).

    Example::

        report = run_training_benchmark(TrainingBenchConfig(**QUICK, methods=("torch.save",)))
    """
    parent = os.path.abspath(config.directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    _check(config, parent)
    load_before = os.getloadavg()
    base = tempfile.mkdtemp(prefix="quicksave-train-bench-", dir=parent)
    results: dict[tuple[str, str], list[dict]] = {}
    order = schedule(config)
    try:
        for i, (shape, method) in enumerate(order):
            r = _run_one(shape, method, config, base, i)
            results.setdefault((shape, method), []).append(r)
            if log is not None:
                state = r.get("failed") or r.get("unavailable")
                if not state:
                    state = (
                        f"raw write+fsync {median(r['write_s']):.2f} s"
                        if method == "raw"
                        else f"loop {r['loop_s']:.1f} s"
                    )
                print(
                    f"[{i + 1}/{len(order)}] {shape} {method}: {state} ({r['wall_s']:.0f} s)",
                    file=log,
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    shapes = {shape: _shape_report(shape, config, results) for shape in config.shapes}
    return _round(
        {
            "config": {
                **asdict(config),
                "directory": parent,
                "methods": list(config.methods),
                "shapes": list(config.shapes),
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": _torch_version(),
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            },
            "shapes": shapes,
            "reference": REFERENCE,
            "default": DEFAULT,
            "acceptance": [
                row for name, sh in shapes.items() for row in _acceptance(name, sh, config.build)
            ],
            "order": [list(run) for run in order],
        }
    )


def _shape_report(
    shape: str, config: TrainingBenchConfig, results: dict[tuple[str, str], list[dict]]
) -> dict[str, Any]:
    for needed in ("raw", "none"):
        bad = [r for r in results[(shape, needed)] if "failed" in r]
        if bad:
            raise RuntimeError(f"the {needed} run of {shape} failed: {bad[0]['failed']}")
    raw = results[(shape, "raw")][0]
    nones = results[(shape, "none")]
    baseline = [r["loop_s"] for r in nones]
    base = _baseline(nones, config.build == "cold")
    nbytes = raw["bytes"]
    methods = {m: _summarize(m, results.get((shape, m), []), base) for m in config.methods}
    ref = methods.get(REFERENCE, {}).get("overhead_per_checkpoint_s")
    paired_ref = methods.get(REFERENCE, {}).get("paired_overhead_per_checkpoint_s")
    write_s, read_s = median(raw["write_s"]), median(raw["read_s"])
    floor_copy, floor_hash = median(raw["floor_copy_cpu_s"]), median(raw["floor_hash_cpu_s"])
    floor = floor_copy + floor_hash
    dcp_restore = methods.get("dcp.save", {}).get("restore_median_s")
    # Training itself is not bit-reproducible across processes here (multi-threaded
    # reductions, e.g. EmbeddingBag's backward): the baseline runs end with a few
    # different losses, and a method must end with one of them.
    base_losses = sorted({r["final_loss"] for r in nones})
    for name, m in methods.items():
        if "loop_median_s" not in m:
            continue
        over, dur, rest = m["overhead_per_checkpoint_s"], m["later_durable_median_s"], None
        m["overhead_vs_reference"] = over / ref if ref and over is not None else None
        m["overhead_vs_floor"] = over / floor if floor and over is not None else None
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
        m["staging_vs_state"] = m["staging_bytes"] / nbytes if m["staging_bytes"] else None
        fresh = m["fresh_restore_median_s"]
        others = [
            o["fresh_restore_median_s"]
            for n, o in methods.items()
            if _library(n) != _library(name) and o.get("fresh_restore_median_s")
        ]
        m["fresh_restore_vs_others"] = fresh / min(others) if fresh and others else None
        rest = m["restore_median_s"]
        m["restore_gbps"] = nbytes / 1e9 / rest if rest else None
        m["restore_speedup_vs_dcp_load"] = dcp_restore / rest if rest and dcp_restore else None
        m["restore_vs_raw_read"] = rest / read_s if rest else None
        m["same_loss_as_baseline"] = m["final_loss"] in base_losses
    return {
        "about": SHAPES[shape].about,
        "state": {"params": raw["params"], "tensors": raw["tensors"], "bytes": nbytes},
        "raw": {
            k: raw.get(k)
            for k in (
                "write_s",
                "direct_s",
                "read_s",
                "copy_warm_s",
                "copy_fresh_s",
                "floor_copy_cpu_s",
                "floor_hash_cpu_s",
                "direct_unavailable",
            )
            if raw.get(k) is not None
        },
        "floor": {"copy_cpu_s": floor_copy, "hash_cpu_s": floor_hash, "cpu_s": floor},
        "baseline": {
            "loop_s": baseline,
            "loop_median_s": median(baseline),
            "step_s": nones[0]["step_s"],
            "step_median_s": base.step_median_s,
            "step_by_index_s": base.step_s,
            # cold: subtracted from the methods' paired estimates and CPU seconds
            "first_step_extra_s": base.paired_extra_s,
            "first_step_extra_cpu_s": base.cpu_extra_s,
            # what the paired estimate gives where there is nothing to find
            "paired_extra_s": [_paired_extra_s(r) for r in nones],
            "trainer_cpu_s": [r.get("trainer_cpu_s") for r in nones],
            "final_losses": base_losses,
        },
        "methods": methods,
    }


# issue 12's and issue 20's targets for the default mode: (name, key in the method
# summary, limit); the first-step row depends on the build (see targets())
TARGETS = (
    (
        "loop overhead per checkpoint vs dcp.async_save (process), every save counted",
        "overhead_vs_reference",
        0.15,
    ),
    ("loop overhead per checkpoint vs the floor (memcpy + xxh3 CPU s)", "overhead_vs_floor", 2.5),
    ("first step after building the saver vs a steady step", "first_step_vs_steady", 1.2),
    (
        "first save's extra loop time (its step + the next) beyond a later save's, in steps",
        "first_save_excess_steps",
        0.5,
    ),
    ("close() wait vs the last save's time to durable", "close_vs_last_durable", 1.1),
    ("time to durable vs a raw write+fsync of the same bytes", "durable_vs_raw_write", 1.15),
    ("staging memory vs the state's bytes", "staging_vs_state", 1.05),
    (
        "restore into a fresh job vs the fastest other library's",
        "fresh_restore_vs_others",
        1.0,
    ),
)
_COLD_FIRST_STEP = (
    "first step after building the saver (the optimizer's first) vs the baseline's",
    "first_step_vs_baseline",
    1.2,
)


def targets(build: str) -> tuple[tuple[str, str, float], ...]:
    """The acceptance targets of a run whose savers were built ``build`` (cold: the
    first step is the optimizer's first for every method, baseline included, so it is
    compared with the baseline's first step, not with a steady one)."""
    if build != "cold":
        return TARGETS
    return tuple(_COLD_FIRST_STEP if t[1] == "first_step_vs_steady" else t for t in TARGETS)


def _library(method: str) -> str:
    """``quicksave-process`` → ``quicksave``, ``dcp.save`` → ``dcp``, ``torch.save`` →
    ``torch``: methods of one library are not compared with each other."""
    return method.split("-")[0].split(".")[0]


def _acceptance(shape: str, report: dict[str, Any], build: str) -> list[dict[str, Any]]:
    m = report["methods"].get(DEFAULT, {})
    rows = []
    for what, key, limit in targets(build):
        value = m.get(key)
        rows.append(
            {
                "shape": shape,
                "target": what,
                "value": value,
                "unit": " steps" if key.endswith("_steps") else "×",
                "limit": limit,
                # a negative overhead is a baseline slower than the method: the machine's
                # load changed between runs, nothing was measured
                "met": value is not None
                and value <= limit
                and not (key.startswith("overhead") and value < 0),
            }
        )
    cpu = (m.get("save_trainer_cpu_s_median"), m.get("save_worker_cpu_s_median"))
    rows.append(
        {
            "shape": shape,
            "target": "CPU seconds per save in the save's metrics (trainer, worker)",
            "value": list(cpu),
            "limit": None,
            "met": all(c is not None for c in cpu),
        }
    )
    return rows


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``quicksave bench --training``."""
    d = TrainingBenchConfig()
    p = argparse.ArgumentParser(
        prog="quicksave bench --training",
        description="Training-loop overhead of checkpointing: torch.save, DCP (sync, async "
        "thread, async process), torch_checkpointing and quicksave's modes, each in a fresh "
        "process.",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed steps ({d.steps})")
    p.add_argument("--interval", type=int, default=d.interval, help="checkpoint every N steps")
    p.add_argument(
        "--shapes", default=",".join(d.shapes), help=f"model shapes ({', '.join(SHAPES)})"
    )
    p.add_argument(
        "--repeats", type=int, default=d.repeats, help=f"runs of every method ({d.repeats})"
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--dir", default=None, help="folder to write in (default: current)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (2)")
    p.add_argument(
        "--build",
        default=d.build,
        help="build the saver before the optimizer's first step (cold, default) or after "
        "a warm-up step (warm)",
    )
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
        shapes=tuple(x.strip() for x in args.shapes.split(",") if x.strip()),
        repeats=args.repeats,
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        directory=args.dir,
        threads=args.threads,
        build=args.build,
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
