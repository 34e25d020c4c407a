"""A fresh job's resume from a local-disk checkpoint whose files are not in the page
cache, against the least such a resume can cost: a plain parallel ``pread`` of the same
bytes into fresh memory.

The parent builds the MLP of :func:`~.shapes.mlp` with AdamW, runs one step (so the
optimizer has state), saves it with a ``CheckpointManager`` (and, for comparison, with
``dcp.save`` and torch_checkpointing), then runs each measurement in a fresh process
(:mod:`.child`). Each child first evicts the files it reads from the page cache
(``fsync`` + ``posix_fadvise(DONTNEED)`` per file, then ``mincore`` to confirm that no
page is left), and times:

* ``floor``: ``threads`` threads ``pread`` every file, in 64 MiB pieces, into fresh
  memory (allocated inside the timing: its first touch is part of any resume);
* ``quicksave``: ``CheckpointManager.load()`` into a fresh model and an AdamW without
  state (the manager's construction timed apart, ``setup_s``);
* ``dcp``: ``get_state_dict`` → ``dcp.load`` → ``set_state_dict``, as DCP documents a
  resume;
* ``torch_checkpointing``: its ``CheckpointManager.load`` into the states' dicts;

then (all but the floor) three training steps: ``first_step_extra_s`` is the first
step's seconds minus the later ones' (state the load left cold is paid for there).
``resume_s`` = ``load_s`` + ``first_step_extra_s``.

Run: ``python -m quicksave_tools.bench.cold_restore --dir /path/on/local/disk``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quicksave_tools.bench.page_cache import evict, files_under, resident_bytes

__all__ = ["METHODS", "run_cold_restore"]

METHODS = ("floor", "quicksave", "dcp", "torch_checkpointing")
_PIECE = 64 << 20
_CHILD = (
    "import sys; from quicksave_tools.bench.cold_restore import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)


def _floor(root: str, threads: int) -> float:
    """Seconds to ``pread`` every file under ``root`` into fresh memory on ``threads``
    threads (64 MiB pieces, spread over the threads)."""
    import torch

    pieces = []
    for path in files_under(root):
        size = os.path.getsize(path)
        pieces += [(path, off, min(_PIECE, size - off)) for off in range(0, size, _PIECE)]
    t0 = time.perf_counter()
    fds = {p: os.open(p, os.O_RDONLY) for p in {p for p, _, _ in pieces}}

    def read(piece: tuple[str, int, int]) -> torch.Tensor:
        path, off, n = piece
        buf = torch.empty(n, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        got = 0
        while got < n:
            got += os.preadv(fds[path], [view[got:]], off + got)
        return buf

    with ThreadPoolExecutor(threads) as pool:
        kept = list(pool.map(read, pieces))
    for fd in fds.values():
        os.close(fd)
    seconds = time.perf_counter() - t0
    del kept
    return seconds


def _trainer(spec: dict[str, Any], seed: int) -> tuple[Any, Any, Any]:
    import torch

    from quicksave_tools.bench.shapes import mlp

    torch.set_num_threads(spec["torch_threads"])
    model = mlp(spec["hidden"], spec["layers"], seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(spec["batch"], spec["hidden"], generator=g)
    y = torch.randn(spec["batch"], spec["hidden"], generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        return time.perf_counter() - t0

    return model, optim, step


def _tensors(model: Any, optim: Any) -> list[Any]:
    out = [p.detach() for p in model.parameters()]
    for p in model.parameters():
        out += [v for _, v in sorted(optim.state[p].items()) if hasattr(v, "shape")]
    return out


def _fingerprint(tensors: list[Any]) -> list[float]:
    return [float(t.double().sum()) for t in tensors]


def _save(spec: dict[str, Any]) -> list[float]:
    """The parent's part: train one step, save with every method; returns the
    fingerprint of the saved state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from quicksave.manager import CheckpointConfig, CheckpointManager
    from quicksave.manager.states import ModelState, OptimizerState

    model, optim, step = _trainer(spec, spec["seed"])
    step()
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    config = CheckpointConfig(folder=spec["dirs"]["quicksave"], async_mode="disabled")
    with CheckpointManager(config, states) as manager:
        manager.save(1, force=True)
    if "dcp" in spec["methods"]:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=spec["dirs"]["dcp"])
    if "torch_checkpointing" in spec["methods"]:
        from quicksave_tools.bench.savers import _TorchCheckpointingSaver

        saver = _TorchCheckpointingSaver(spec["dirs"]["torch_checkpointing"], states)
        saver.save(1)
        saver.finish()
        saver.close()
    return _fingerprint(_tensors(model, optim))


def _load(spec: dict[str, Any], model: Any, optim: Any) -> dict[str, float]:
    method = spec["method"]
    if method == "quicksave":
        from quicksave.manager import CheckpointConfig, CheckpointManager
        from quicksave.manager.states import ModelState, OptimizerState

        t0, cpu0 = time.perf_counter(), _cpu_s()
        states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
        config = CheckpointConfig(folder=spec["dirs"]["quicksave"], async_mode=spec["async_mode"])
        manager = CheckpointManager(config, states)
        t1, cpu1 = time.perf_counter(), _cpu_s()
        manager.load()
        t2 = time.perf_counter()
        manager.close()
        return {"setup_s": t1 - t0, "setup_cpu_s": cpu1 - cpu0, "load_s": t2 - t1}
    if method == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=spec["dirs"]["dcp"])
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return {"load_s": time.perf_counter() - t0}
    if method == "torch_checkpointing":
        from quicksave.manager.states import ModelState, OptimizerState
        from quicksave_tools.bench.savers import _TorchCheckpointingSaver

        states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
        saver = _TorchCheckpointingSaver(spec["dirs"]["torch_checkpointing"], states)
        times = saver.restore_fresh(1, states)  # its own manager, built there: setup_s
        saver.close()
        return {"load_s": times["load_s"], "setup_s": times.get("setup_s", 0.0)}
    raise ValueError(f"unknown method {method!r}")


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement in a fresh process: evict, confirm, time (see the module)."""
    import gc

    method = spec["method"]
    root = spec["dirs"]["quicksave" if method == "floor" else method]
    out: dict[str, Any] = {"method": method}
    model = optim = step = None
    if method != "floor":
        model, optim, step = _trainer(spec, spec["seed"] + 1)
        gc.collect()
    evict(root)
    out["resident_before_bytes"] = resident_bytes(root)
    out["bytes"] = sum(os.path.getsize(p) for p in files_under(root))
    cpu0 = _cpu_s()
    if method == "floor":
        out["load_s"] = _floor(root, spec["threads"])
        out["load_cpu_s"] = _cpu_s() - cpu0
        return out
    out.update(_load(spec, model, optim))
    out["load_cpu_s"] = _cpu_s() - cpu0 - out.get("setup_cpu_s", 0.0)
    if _fingerprint(_tensors(model, optim)) != spec["expected"]:
        raise RuntimeError(f"{method}: the restored state differs from the saved one")
    steps = [step() for _ in range(spec["steps"])]
    out["steps_s"] = steps
    out["first_step_extra_s"] = steps[0] - statistics.median(steps[1:])
    out["resume_s"] = out["load_s"] + out["first_step_extra_s"]
    return out


def _cpu_s() -> float:
    """CPU seconds of this process so far, user and system (on a busy machine a steadier
    measure of the work than the wall clock)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_main(argv: list[str]) -> int:
    """Entry point of a measurement's fresh process (``python -c _CHILD spec.json``)."""
    from quicksave_tools.bench.child import child_entry

    return child_entry(argv, run_child)


def run_cold_restore(
    folder: str,
    *,
    methods: tuple[str, ...] = METHODS,
    hidden: int = 4096,
    layers: int = 8,
    batch: int = 32,
    threads: int = 4,
    repeats: int = 1,
    async_mode: str = "process",
    torch_threads: int = 2,
    keep: bool = False,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Save the MLP + AdamW under ``folder`` (a local disk), then time each of
    ``methods`` ``repeats`` times, each in a fresh process with a cold page cache.

    Returns ``{"runs": {method: [result, ...]}, "median": {method: {...}}, ...}``;
    ``ratio_to_floor``: each method's median ``resume_s`` over the floor's ``load_s``.
    ``async_mode``: the fresh job's manager (the checkpoint is saved synchronously).
    """
    from quicksave_tools.bench.child import run_in_fresh_process

    os.makedirs(folder, exist_ok=True)
    base = tempfile.mkdtemp(prefix="cold-restore-", dir=folder)
    dirs = {m: os.path.join(base, m) for m in ("quicksave", "dcp", "torch_checkpointing")}
    spec: dict[str, Any] = {
        "hidden": hidden,
        "layers": layers,
        "batch": batch,
        "seed": 0,
        "threads": threads,
        "torch_threads": torch_threads,
        "async_mode": async_mode,
        "steps": 3,
        "dirs": dirs,
        "methods": list(methods),
    }
    try:
        spec["expected"] = _save(spec)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for i in range(repeats):
            for m in methods:
                one = {**spec, "method": m, "result": os.path.join(base, f"{m}-{i}.json")}
                runs[m].append(
                    run_in_fresh_process(
                        _CHILD, one, os.path.join(base, f"{m}-{i}-spec.json"), timeout_s
                    )
                )
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    median: dict[str, dict[str, float]] = {}
    for m, rs in runs.items():
        ok = [r for r in rs if "failed" not in r]
        keys = ("load_s", "setup_s", "load_cpu_s", "first_step_extra_s", "resume_s")
        median[m] = {k: statistics.median(r[k] for r in ok) for k in keys if ok and k in ok[0]}
    floor = median.get("floor", {}).get("load_s")
    ratio = {
        m: round(v["resume_s"] / floor, 2) for m, v in median.items() if floor and "resume_s" in v
    }
    return {
        "folder": folder,
        "filesystem": _fs(folder),
        "threads": threads,
        "async_mode": async_mode,
        "cpus": os.cpu_count(),
        "median": median,
        "ratio_to_floor": ratio,
        "runs": runs,
    }


def _fs(path: str) -> str:
    """The filesystem type and device holding ``path`` (from /proc/mounts)."""
    best = ("", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, kind = line.split()[:3]
                real = os.path.realpath(path)
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(
                    best[0]
                ):
                    best = (mnt, f"{kind} ({dev} at {mnt})")
    except OSError:
        pass
    return best[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a folder on the local disk to measure")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=4, help="the floor's reader threads")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--async-mode", default="process", help="the fresh job's manager")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    a = p.parse_args(argv)
    report = run_cold_restore(
        a.dir,
        methods=tuple(a.methods.split(",")),
        hidden=a.hidden,
        layers=a.layers,
        threads=a.threads,
        repeats=a.repeats,
        async_mode=a.async_mode,
        keep=a.keep,
    )
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
