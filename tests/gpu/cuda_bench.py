"""The CUDA path measured on a GPU machine: a manager's save() blocking time, staging
time and time to durable, overlapped vs blocking staging, beside the floor of the same
bytes (one device-to-host copy into pinned memory, then write + fsync), in one run, on
two model shapes. Prints one JSON line per (shape, staging); docs/benchmarks.md keeps
the numbers.

Usage (on the GPU machine)::

    PYTHONPATH=src python3 tests/gpu/cuda_bench.py --gb 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn

from quicksave.manager import CheckpointConfig, CheckpointManager, ModelState, OptimizerState


def shapes(gb: float) -> dict[str, tuple[int, int]]:
    """name -> (layers, dim): fp32 parameters plus two AdamW moments = 12 B/element."""
    per = gb * 1e9 / 12
    wide = 8192
    small = 512
    return {
        "wide": (max(1, int(per // wide**2)), wide),
        "many-small": (int(per // small**2), small),
    }


def floor_s(tensors: list[torch.Tensor], folder: str) -> tuple[float, float]:
    """(D2H copy into pinned memory, write + fsync) of the same bytes, in seconds."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        host[off : off + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        off += n
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    path = os.path.join(folder, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(host.numpy()))
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    os.unlink(path)
    return d2h, write


def run(layers: int, dim: int, staging: str, folder: str, steps: int = 9) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)]).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(8, dim, device="cuda")
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    config = CheckpointConfig(folder=folder, interval=3, staging=staging, async_mode="process")
    step_s: list[float] = []
    with CheckpointManager(config, states) as manager:
        for step in range(1, steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            optim.zero_grad()
            model(x).square().mean().backward()
            optim.step()
            if step % 3 == 0:
                manager.wait()  # the last save durable: this one meets no backpressure
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            manager.save(step)
            torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
        manager.wait()
        records = [r for r in manager.metrics if r.status == "committed"]
    state_gb = sum(p.numel() for p in model.parameters()) * 12 / 1e9
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in optim.state.values() for v in s.values() if v.dim() > 0]
    d2h, write = floor_s(tensors, folder)
    return {
        "state_gb": round(state_gb, 2),
        "tensors": len(tensors),
        "blocking_s": [round(r.blocking_s, 4) for r in records],
        "staging_s": [round(r.staging_s or 0, 3) for r in records],
        "durable_s": [round(r.durable_s or 0, 3) for r in records],
        "step_s_median": round(statistics.median(step_s), 4),
        "save_call_s": [round(step_s[i - 1], 4) for i in (3, 6, 9)],
        "floor_d2h_s": round(d2h, 3),
        "floor_write_fsync_s": round(write, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=4.0)
    args = parser.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    for name, (layers, dim) in shapes(args.gb).items():
        for staging in ("overlap", "blocking"):
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as folder:
                out = run(layers, dim, staging, os.path.join(folder, "ckpt"))
                out.update(shape=name, layers=layers, dim=dim, staging=staging)
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
