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
default mode against its targets (:mod:`.training_summary`); every save, the first one
included, counts in the loop overhead.

Incremental saves (issue 30): the shapes ``lora``, ``embedding-sparse`` and
``embedding-sparse-zipf`` and the methods ``quicksave-incremental``, ``-counters``,
``-hashed`` (no kernel write tracking) and ``quicksave-trainable`` run when named;
``--incremental-block-kb`` sets the incremental methods' block size. The report then
sets bytes on disk per save against the full save, the trainable state and the state
that changed, and each incremental method's loop overhead against the full save's and
the trainable state's (:mod:`.training_incremental`).

Example::

    quicksave bench --training --json > report.json
    quicksave bench --training --shapes embedding-sparse --incremental-block-kb 1024 \
        --methods quicksave-process,quicksave-incremental
    quicksave bench --training --quick --methods torch.save,quicksave-sync
    quicksave bench --training --build warm   # the saver built after a warm-up step
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from quicksave_tools.bench.baseline import (
    BASELINE,
    baseline_env,
    check_baseline,
    is_baseline,
    plain,
)
from quicksave_tools.bench.child import run_in_fresh_process
from quicksave_tools.bench.savers import (
    DCP_ASYNC,
    EXTRA_QUICKSAVE_MODES,
    QUICKSAVE_MODES,
    TORCH_CHECKPOINTING,
)
from quicksave_tools.bench.shapes import DEFAULT_SHAPES, LORA_MB, SHAPES
from quicksave_tools.bench.training_incremental import incremental_rows
from quicksave_tools.bench.training_loop import median
from quicksave_tools.bench.training_report import format_training_report, plot_training_report
from quicksave_tools.bench.training_summary import DEFAULT, REFERENCE, acceptance, shape_report

__all__ = [
    "METHODS",
    "TrainingBenchConfig",
    "main",
    "run_training_benchmark",
    "schedule",
]

METHODS = ("torch.save", "dcp.save", *DCP_ASYNC, TORCH_CHECKPOINTING, *QUICKSAVE_MODES)
KNOWN_METHODS = (*METHODS, *EXTRA_QUICKSAVE_MODES)  # (the extra ones when asked for)
BUILDS = ("cold", "warm")
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
        baseline: a folder holding another version of the ``quicksave`` package (e.g. an
            earlier commit's ``src``): every quicksave method also runs with it, as
            ``<method>@baseline``, side by side in the same schedule.
        lora_mb: the frozen base of the ``lora`` shape, in MB.
        incremental_block_kb: ``IncrementalConfig.block_bytes`` of the incremental
            methods, in KiB (None: its default, 4 MiB).
    """

    steps: int = 30
    interval: int = 5
    shapes: tuple[str, ...] = DEFAULT_SHAPES
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
    baseline: str | None = None
    lora_mb: int = LORA_MB
    incremental_block_kb: int | None = None


QUICK = {
    "steps": 6,
    "interval": 2,
    "quick": True,
    "repeats": 1,
    "threads": 1,
    "calibration_steps": 2,
}


def all_methods(config: TrainingBenchConfig) -> tuple[str, ...]:
    """The methods run: ``config.methods``, and with a baseline each quicksave method
    again with the baseline's package."""
    if config.baseline is None:
        return tuple(config.methods)
    twins = [m + BASELINE for m in config.methods if m.startswith("quicksave")]
    return (*config.methods, *twins)


def schedule(config: TrainingBenchConfig) -> list[tuple[str, str]]:
    """The order of the runs, as (shape, method): ``raw`` of every shape first; then per
    repeat and shape the methods rotated by the repeat's index, with the baseline
    ``none`` first and (from four methods on) in the middle; one more baseline per shape
    at the end."""
    runs = [(shape, "raw") for shape in config.shapes]
    methods = list(all_methods(config))
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
    unknown = [m for m in config.methods if m not in KNOWN_METHODS]
    if unknown:
        known = ", ".join(KNOWN_METHODS)
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {known}")
    bad = [s for s in config.shapes if s not in SHAPES]
    if bad or not config.shapes:
        raise ValueError(
            f"unknown shape(s) {', '.join(bad) or '(none)'}; known: {', '.join(SHAPES)}"
        )
    if config.baseline is not None:
        check_baseline(config.baseline)
    if config.build not in BUILDS:
        raise ValueError(f"unknown build {config.build!r}; known: {', '.join(BUILDS)}")
    for name in ("steps", "interval", "repeats", "threads", "lora_mb"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    if config.incremental_block_kb is not None and config.incremental_block_kb < 1:
        raise ValueError("incremental_block_kb must be at least 1")
    if config.interval > config.steps:
        raise ValueError("interval must not exceed steps (no checkpoint would be written)")
    state_bytes = 0 if config.quick else 1_700_000_000
    need = (config.steps // config.interval + 2) * state_bytes + (512 << 20)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ValueError(f"{parent} has {free >> 20} MiB free; this run needs {need >> 20} MiB")


def _run_one(
    shape: str, method: str, config: TrainingBenchConfig, base: str, index: int
) -> dict[str, Any]:
    folder = os.path.join(base, f"{index:02d}-{method}")
    env = None
    if is_baseline(method):
        assert config.baseline is not None
        env = baseline_env(config.baseline, base)
    spec = {**asdict(config), "methods": None, "shapes": None, "method": plain(method)}
    spec.update(shape=shape, folder=folder)
    spec["result"] = os.path.join(base, f"{index:02d}-result.json")
    t0 = time.perf_counter()
    try:
        result = run_in_fresh_process(
            _CHILD, spec, os.path.join(base, f"{index:02d}-spec.json"), config.timeout_s, env
        )
        result["method"] = method
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
        ``failed`` / ``unavailable``)), ``acceptance`` (the checks of the default
        mode, per shape), ``incremental`` (each incremental method against the full
        save and the trainable state's, per shape: :mod:`.training_incremental`) and
        ``order``.

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
    shapes = {
        shape: shape_report(shape, all_methods(config), config.build, results)
        for shape in config.shapes
    }
    return _round(
        {
            "config": {
                **asdict(config),
                "directory": parent,
                "methods": list(all_methods(config)),
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
                row for name, sh in shapes.items() for row in acceptance(name, sh, config.build)
            ],
            "incremental": [
                row for name, sh in shapes.items() for row in incremental_rows(name, sh)
            ],
            "order": [list(run) for run in order],
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
    p.add_argument(
        "--lora-mb",
        type=int,
        default=d.lora_mb,
        help=f"the frozen base of the lora shape, in MB ({d.lora_mb})",
    )
    p.add_argument(
        "--incremental-block-kb",
        type=int,
        default=None,
        metavar="KB",
        help="block size of the incremental methods, in KiB (IncrementalConfig.block_bytes; "
        "default 4096)",
    )
    p.add_argument(
        "--baseline",
        metavar="SRC",
        help="a folder holding another quicksave package (an earlier commit's src): "
        "each quicksave method also runs with it, as <method>@baseline",
    )
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
        baseline=args.baseline,
        lora_mb=args.lora_mb,
        incremental_block_kb=args.incremental_block_kb,
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
