"""``quicksave bench --hold``: how long a steady ``CheckpointManager.save()`` holds the
training thread, for states of thousands of small tensors (where per-tensor Python,
not bytes, is the cost), on this machine's CPU.

Workloads (each in a fresh process):

* ``small`` — a model of 2,000 parameters of 256 float32 each (2 MB), the model only;
* ``lm`` — a 24-layer decoder-only language model shaped like the training benchmark's
  ``transformer`` (:mod:`.shapes`, its ``--quick`` sizes: d_model 64, a 512-token
  vocabulary tied to the head) with AdamW: 388 parameters and their moments and steps,
  ~1,550 state tensors under ``ModelState`` and ``OptimizerState``; one optimizer step
  between saves, so that overlapped staging defers what only the optimizer writes.

Each builds a ``CheckpointManager`` (``interval=1``, ``keep_latest_k=2``, the default
``async_mode="process"`` and ``staging="overlap"``), saves ``warmup`` times, then times
``saves`` steady saves: ``save()`` from call to return (wall and the training thread's
CPU seconds), of which the states' own ``state_dict()`` calls, and how many full (gen-2)
garbage collections ran inside ``save()``. Every save is waited for before the next
step, so saves never queue. Reported per workload: median and max over the steady
saves. With ``--baseline SRC`` each workload also runs with the ``quicksave`` package
in ``SRC`` (e.g. an earlier commit's ``src``), interleaved, as ``<workload>@baseline``.

Example::

    quicksave bench --hold
    quicksave bench --hold --baseline ../base/src --repeats 3 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from quicksave_tools.bench.baseline import (
    BASELINE,
    baseline_env,
    check_baseline,
    is_baseline,
    plain,
)
from quicksave_tools.bench.child import run_in_fresh_process

WORKLOADS = ("small", "lm")
_CHILD = (
    "import sys; from quicksave_tools.bench.hold import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)


def _small() -> tuple[dict[str, Any], Callable[[], None]]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(256)) for _ in range(2000)])
    return {"model": model}, lambda: None


def _lm() -> tuple[dict[str, Any], Callable[[], None]]:
    import torch

    from quicksave import ModelState, OptimizerState
    from quicksave_tools.bench.shapes import build

    model, data, loss_fn = build("transformer", 0, quick=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        inputs, target = data[0]
        optim.zero_grad(set_to_none=True)
        loss_fn(model(inputs), target).backward()
        optim.step()

    step()  # the optimizer's state exists from here on
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}, step


def _time_state_dicts(states: dict[str, Any], spent: list[float]) -> None:
    """Add the seconds of every ``state_dict()`` call of ``states`` to ``spent[-1]`` (the
    part of ``save()`` that is the states' own, not the library's). The states keep
    their class: the manager finds its optimizers by it."""
    for state in states.values():
        inner = state.state_dict

        def timed(inner: Callable[[], dict[str, Any]] = inner) -> dict[str, Any]:
            t0 = time.perf_counter()
            try:
                return inner()
            finally:
                spent[-1] += time.perf_counter() - t0

        state.state_dict = timed


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One workload in this process: the steady saves' hold times (see the module doc)."""
    import torch

    from quicksave import CheckpointConfig, CheckpointManager

    torch.set_num_threads(1)
    states, step = {"small": _small, "lm": _lm}[spec["workload"]]()
    n = sum(1 for _ in _tensors(states))
    spent: list[float] = [0.0]
    _time_state_dicts(states, spent)
    full: list[int] = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full[0] += 1

    config = CheckpointConfig(spec["folder"], interval=1, keep_latest_k=2)
    manager = CheckpointManager(config, states)
    walls, cpus, own, gcs = [], [], [], []
    try:
        for i in range(1, spec["warmup"] + spec["saves"] + 1):
            step()
            spent[-1] = 0.0
            full[0] = 0
            gc.callbacks.append(on_gc)
            c0, t0 = time.thread_time(), time.perf_counter()
            manager.save(i)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            gc.callbacks.remove(on_gc)
            manager.wait()
            if i > spec["warmup"]:
                walls.append(wall)
                cpus.append(cpu)
                own.append(spent[-1])
                gcs.append(full[0])
    finally:
        manager.close()
    return {
        "workload": spec["workload"],
        "tensors": n,
        "hold_s": walls,
        "cpu_s": cpus,
        "state_dict_s": own,
        "full_gcs": gcs,
    }


def _tensors(states: dict[str, Any]) -> Any:
    import torch

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from walk(x)
        elif isinstance(v, list):
            for x in v:
                yield from walk(x)

    for s in states.values():
        yield from walk(s.state_dict())


def child_main(argv: list[str]) -> int:
    """Entry point of a workload's fresh process (``python -c _CHILD spec.json``)."""
    from quicksave_tools.bench.child import child_entry

    return child_entry(argv, run_child)


def run(
    workloads: list[str],
    repeats: int,
    saves: int,
    warmup: int,
    baseline: str | None,
    folder: str | None,
) -> dict[str, Any]:
    """Every workload (and ``@baseline``) ``repeats`` times, interleaved; the report."""
    if baseline is not None:
        check_baseline(baseline)
    runs = [w for w in workloads for w in ((w, w + BASELINE) if baseline else (w,))]
    base = tempfile.mkdtemp(prefix="qs-hold-", dir=folder)
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in runs}
    try:
        for repeat in range(repeats):
            order = runs[repeat % len(runs) :] + runs[: repeat % len(runs)]
            for index, name in enumerate(order):
                target = os.path.join(base, f"ckpt-{repeat}-{index}")
                spec = {
                    "workload": plain(name),
                    "folder": target,
                    "saves": saves,
                    "warmup": warmup,
                    "result": os.path.join(base, f"{repeat}-{index}.json"),
                }
                env = baseline_env(baseline, base) if is_baseline(name) else None
                path = os.path.join(base, f"{repeat}-{index}-spec.json")
                results[name].append(run_in_fresh_process(_CHILD, spec, path, 600, env))
                shutil.rmtree(target, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "rows": [_row(name, results[name]) for name in runs],
    }


def _row(name: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    failed = [r["failed"] for r in results if "failed" in r]
    if failed:
        return {"run": name, "failed": failed[0]}
    ms = lambda key: [x * 1e3 for r in results for x in r[key]]  # noqa: E731
    hold, cpu, own = ms("hold_s"), ms("cpu_s"), ms("state_dict_s")
    return {
        "run": name,
        "tensors": results[0]["tensors"],
        "saves": len(hold),
        "hold_ms_median": statistics.median(hold),
        "hold_ms_max": max(hold),
        "cpu_ms_median": statistics.median(cpu),
        "state_dict_ms_median": statistics.median(own),
        "library_ms_median": statistics.median(h - o for h, o in zip(hold, own, strict=True)),
        "full_gcs": sum(g for r in results for g in r["full_gcs"]),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table."""
    lines = [
        f"{report['cpus']} CPUs, load average {report['load_average']:.2f}",
        "",
        "| run | tensors | saves | hold ms median | hold ms max | CPU ms median | "
        "state_dict() ms median | rest ms median | full GCs in save() |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if "failed" in r:
            lines.append(f"| {r['run']} | failed: {r['failed']} |")
            continue
        lines.append(
            f"| {r['run']} | {r['tensors']} | {r['saves']} | {r['hold_ms_median']:.1f} | "
            f"{r['hold_ms_max']:.1f} | {r['cpu_ms_median']:.1f} | "
            f"{r['state_dict_ms_median']:.1f} | {r['library_ms_median']:.1f} | {r['full_gcs']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --hold``; 0, 2 on bad arguments, 1 if a run
    failed."""
    p = argparse.ArgumentParser(prog="quicksave bench --hold", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per workload")
    p.add_argument("--saves", type=int, default=20, help="steady saves timed per process")
    p.add_argument("--warmup", type=int, default=3, help="saves before the timed ones")
    p.add_argument("--baseline", default=None, help="a folder with another quicksave package")
    p.add_argument("--dir", default=None, help="folder to write in (default: the temp dir)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or args.repeats < 1 or args.saves < 1 or args.warmup < 0:
        print(
            f"quicksave bench --hold: bad arguments (workloads: {', '.join(WORKLOADS)})",
            file=sys.stderr,
        )
        return 2
    try:
        report = run(workloads, args.repeats, args.saves, args.warmup, args.baseline, args.dir)
    except ValueError as e:
        print(f"quicksave bench --hold: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any("failed" in r for r in report["rows"]) else 0
