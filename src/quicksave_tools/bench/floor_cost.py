"""What the floor of any asynchronous checkpoint costs a training loop on this machine.

The least an asynchronous checkpointer does in the trainer is to copy every state tensor
out once and checksum it, beside training, before the next optimizer step changes the
tensors. This measures exactly that and nothing else (no file, no worker): every
``interval`` steps a thread copies every parameter and optimizer-state tensor into a
preallocated, warm buffer (one thread, ``memmove``) and hashes each copy (xxh3-64); the
next optimizer step waits for it. Loops with and without it are interleaved; the result
is the extra loop seconds per checkpoint beside the thread's own CPU seconds. On a
machine whose cores training keeps busy, this is the lowest loop overhead a checkpoint
can have: a library's figure is best read against it.

Usage::

    python -m quicksave_tools.bench.floor_cost --shape mlp --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from quicksave_tools.bench.shapes import SHAPES
from quicksave_tools.bench.training_loop import build_trainer


def _state_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.data for p in model.parameters()]
    for state in optim.state.values():
        out += [v for v in state.values() if torch.is_tensor(v) and v.dim()]
    return out


class _FloorCopy:
    """One copy + checksum of ``tensors`` per ``start()``, on its own thread."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.buffer.fill_(0)  # warm pages: the copy measures copying, not page faults
        self.cpu_s: list[float] = []
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        cpu0, at = time.thread_time(), 0
        view = memoryview(self.buffer.numpy())
        for t in self.tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(self.buffer.data_ptr() + at, t.data_ptr(), n)
            xxhash.xxh3_64_intdigest(view[at : at + n])
            at += n
        self.cpu_s.append(time.thread_time() - cpu0)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="floor-copy")
        self.thread.start()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around ``optimizer.step()``: wait for a copy still reading the tensors."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        yield


def run_loop(shape: str, steps: int, interval: int, copy: bool, quick: bool = False) -> dict:
    """One loop of ``steps`` steps (after one warm-up step that creates the optimizer
    state); with ``copy``, the floor copy every ``interval`` steps."""
    model, optim, step = build_trainer({"shape": shape, "seed": 0, "quick": quick})
    step()
    floor = _FloorCopy(_state_tensors(model, optim))
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        step(floor.guard)
        if copy and s % interval == 0:
            floor.start()
    with floor.guard():
        pass
    return {
        "loop_s": time.perf_counter() - t0,
        "copy_cpu_s": statistics.mean(floor.cpu_s) if floor.cpu_s else 0.0,
        "bytes": floor.buffer.numel(),
    }


def measure(
    shape: str, repeats: int, steps: int = 30, interval: int = 5, quick: bool = False
) -> dict[str, Any]:
    """``repeats`` pairs of loops (without, with the floor copy), interleaved; the extra
    seconds per checkpoint of each loop with it against the median loop without."""
    runs: dict[str, list[dict]] = {"none": [], "copy": []}
    for _ in range(repeats):
        for kind in ("none", "copy"):
            runs[kind].append(run_loop(shape, steps, interval, kind == "copy", quick))
    base = statistics.median(r["loop_s"] for r in runs["none"])
    checkpoints = steps // interval
    extra = [(r["loop_s"] - base) / checkpoints for r in runs["copy"]]
    return {
        "shape": shape,
        "steps": steps,
        "interval": interval,
        "bytes": runs["copy"][0]["bytes"],
        "baseline_loop_s": [r["loop_s"] for r in runs["none"]],
        "copy_loop_s": [r["loop_s"] for r in runs["copy"]],
        "extra_s_per_ckpt": extra,
        "median_extra_s_per_ckpt": statistics.median(extra),
        "copy_cpu_s_per_ckpt": statistics.mean(r["copy_cpu_s"] for r in runs["copy"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m quicksave_tools.bench.floor_cost")
    p.add_argument("--shape", choices=sorted(SHAPES), default="mlp")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads (2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.shape, args.repeats, args.steps, args.interval)))


if __name__ == "__main__":
    main()
