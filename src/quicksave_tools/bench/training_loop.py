"""One method of the training-loop benchmark, run in a fresh process (the child side of
:mod:`quicksave_tools.bench.training`).

The child builds the same seeded model (one of :mod:`.shapes`) + AdamW as every other
child of that shape. With ``build="cold"`` (what a job that starts training gets) the
saver is built right away, before the optimizer's first step (its state does not exist
yet), and the timed loop starts with the first step; ``calibration_steps`` timed steps
without checkpoints (the paired baseline) follow the restores. With ``build="warm"``
it trains ``warmup`` untimed steps (so the optimizer state exists) and the calibration
steps first, then builds the saver. Either way it times ``steps`` steps, checkpointing
every ``interval`` steps with one method (:mod:`.savers`), waits for the last checkpoint
to be durable, times restores of the last checkpoint into the live state, and one
restore into a fresh job (a new model and optimizer without state, as a resumed job
has; values checked). The method ``raw`` trains nothing:
it times a raw write+fsync, an ``O_DIRECT`` write, a raw read and in-memory copies of
the same bytes, and the floor: the CPU seconds of one single-threaded ``memcpy`` of the
state into warm memory plus one xxh3-64 pass over it. The result is one JSON file.

Entry point: ``python -c "...; child_main([spec_path])"`` (see ``training.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import re
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import xxhash

from quicksave.manager import ModelState, OptimizerState
from quicksave_tools.bench.methods import (
    direct_io_error,
    pid_cpu_s,
    raw_direct_save,
    raw_load,
    raw_save,
)
from quicksave_tools.bench.savers import Saver, Unavailable, make_saver
from quicksave_tools.bench.shapes import build, mlp, optimizer


# --------------------------------------------------------------------- memory probes
def _status_kib(field: str, pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(rf"{field}:\s+(\d+)", f.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _descendants(root: int) -> list[int]:
    """Pids of every live descendant of ``root`` (from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


class _WorkerMonitor:
    """Samples the peak RSS (VmHWM) and the CPU seconds of this process's descendants
    (checkpoint workers) five times a second; a worker that exits before the end still
    counts, with its CPU as last seen (up to 0.2 s of it may be missed)."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self.cpu: dict[int, float] = {}  # pid -> CPU seconds last seen
        self._start: dict[int, float] = {}  # pid -> CPU seconds when first seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for pid in _descendants(os.getpid()):
            self.peak_kib = max(self.peak_kib, _status_kib("VmHWM", pid) or 0)
            cpu = pid_cpu_s(pid)
            if cpu is not None:
                self.cpu[pid] = cpu

    def baseline(self) -> None:
        """Descendants' CPU so far is not the loop's (a worker started before it)."""
        self.sample()
        self._start = dict(self.cpu)

    def cpu_s(self) -> float:
        return sum(c - self._start.get(pid, 0.0) for pid, c in self.cpu.items())

    def __enter__(self) -> _WorkerMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample()
        self._stop.set()
        self._thread.join()


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# ------------------------------------------------------------------ model and state
def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _state_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint holds, in a fixed order (model, then optimizer)."""
    out = [t.detach() for t in model.state_dict().values()]
    for st in optim.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _fingerprint(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # A strided sample of every tensor: small, yet a load that misses a tensor or
    # shifts its bytes changes it.
    return [t.reshape(-1)[:: 4099 if t.numel() > 4099 else 1].clone() for t in tensors]


# ------------------------------------------------------------------------ the loop
Guard = Callable[[], contextlib.AbstractContextManager[Any]]


def build_trainer(
    spec: dict[str, Any], seed: int | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., float]]:
    """The model, its optimizer (the shape's, else AdamW) and one training step: the
    shape ``spec["shape"]`` (see :mod:`.shapes`), or an MLP of ``spec["hidden"]`` ×
    ``spec["layers"]``; ``seed`` (default ``spec["seed"]``) seeds the weights and the
    data. The step runs ``optimizer.step()`` inside ``guard()`` (a saver that stages
    beside training may need its lock there)."""
    seed = spec["seed"] if seed is None else seed
    if spec.get("shape"):
        size = spec.get("lora_mb") if spec["shape"] == "lora" else None
        model, batches, loss_fn = build(spec["shape"], seed, bool(spec.get("quick")), size)
    else:
        model = mlp(spec["hidden"], spec["layers"], seed)
        g = torch.Generator().manual_seed(seed + 1)
        batches = [
            (
                torch.randn(spec["batch"], spec["hidden"], generator=g),
                torch.randn(spec["batch"], spec["hidden"], generator=g),
            )
            for _ in range(4)
        ]
        loss_fn = nn.functional.mse_loss
    optim = optimizer(spec.get("shape"), model)
    counter = [0]

    def step(guard: Guard = contextlib.nullcontext) -> float:
        x, y = batches[counter[0] % len(batches)]
        counter[0] += 1
        optim.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        with guard():
            optim.step()
        return float(loss.detach())

    return model, optim, step


def _run_loop(
    spec: dict[str, Any],
    saver: Saver,
    train_step: Callable[..., float],
    touched: Callable[[], int] | None = None,
) -> dict:
    """The timed loop; ``touched`` (a model that counts the rows its steps looked up):
    every save's event gets ``rows_touched``, the rows looked up since the previous save
    (the first: since the loop began)."""
    steps, interval = spec["steps"], spec["interval"]
    step_s, save_s, events = [], [], []
    loss = 0.0
    _reset_peak_rss()
    with _WorkerMonitor() as monitor:
        monitor.baseline()
        if touched is not None:
            touched()  # the rows of steps before the loop are not its saves'
        cpu0 = time.process_time()
        begin = time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            loss = train_step(saver.step_guard)
            t1 = time.perf_counter()
            if spec["method"] != "none" and step % interval == 0:
                waited = saver.save(step)
                t2 = time.perf_counter()
                events.append(
                    {
                        "step": step,
                        "start_s": t1 - begin,
                        "blocking_s": t2 - t1,
                        "waited_for_previous_s": waited,
                    }
                )
                if touched is not None:
                    events[-1]["rows_touched"] = touched()
            else:
                t2 = t1
            step_s.append(t2 - t0)
            save_s.append(t2 - t1)
        t_drain = time.perf_counter()
        saver.finish()
        end = time.perf_counter()
        cpu = time.process_time() - cpu0
        monitor.sample()
    for ev in events:
        ev["durable_s"] = saver.durable.get(ev["step"])
    return {
        "loop_s": end - begin,
        "drain_s": end - t_drain,
        "step_s": step_s,
        "save_s": save_s,
        "events": events,
        "final_loss": loss,
        "peak_rss_mib": (_status_kib("VmHWM") or 0) / 1024,
        "worker_peak_rss_mib": monitor.peak_kib / 1024,
        "trainer_cpu_s": cpu,
        "workers_cpu_s": monitor.cpu_s(),
    }


def _same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and all(
        torch.equal(a, b) for a, b in zip(expected, got, strict=True)
    )


def _restore_times(
    saver: Saver, step: int, tensors: Callable[[], list[torch.Tensor]], repeats: int
) -> list[float]:
    # ``tensors()`` is asked again after each load: an optimizer's load_state_dict may
    # replace its state tensors instead of filling them.
    expected = _fingerprint(tensors())
    times = []
    for _ in range(repeats):
        with torch.no_grad():
            for t in tensors():
                t.zero_()  # a load that leaves old bytes in place must not pass
        gc.collect()
        t0 = time.perf_counter()
        saver.restore(step)
        times.append(time.perf_counter() - t0)
        if not _same(expected, _fingerprint(tensors())):
            raise RuntimeError(f"restore of {saver.path(step)} gave different values")
    return times


def _fresh_restore(
    spec: dict[str, Any], saver: Saver, step: int, expected: list[torch.Tensor]
) -> dict[str, float]:
    """Restore the checkpoint of ``step`` into a fresh job: a model of other weights and
    an optimizer without state, as a resumed job has them (the optimizer's state must be
    created by the load). Returns the seconds of the load (and of building the method's
    loader, if it has one), after checking the values against ``expected``."""
    model, optim, _ = build_trainer(spec, seed=spec["seed"] + 1)
    states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
    gc.collect()
    times = saver.restore_fresh(step, states)
    if not _same(expected, _fingerprint(_state_tensors(model, optim))):
        raise RuntimeError(f"restore of {saver.path(step)} into a fresh job gave other values")
    return times


def _floor(tensors: list[torch.Tensor], warm: list[torch.Tensor]) -> tuple[float, float]:
    """CPU seconds of one ``memcpy`` of every tensor into ``warm`` (touched memory of the
    same sizes) on one thread, and of one xxh3-64 pass over every tensor: the least any
    checkpoint that copies and checksums the state can cost the machine."""
    t0 = time.thread_time()
    for w, t in zip(warm, tensors, strict=True):
        ctypes.memmove(w.data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    t1 = time.thread_time()
    for t in tensors:
        xxhash.xxh3_64(t.reshape(-1).view(torch.uint8).numpy()).intdigest()
    return t1 - t0, time.thread_time() - t1


def _raw(spec: dict[str, Any], tensors: list[torch.Tensor], folder: str) -> dict[str, Any]:
    """Raw baselines on the same bytes: write+fsync, O_DIRECT write, read, memcpy, and
    the floor (memcpy + xxh3 CPU seconds)."""
    sd = {str(i): t for i, t in enumerate(tensors)}
    path = os.path.join(folder, "raw.bin")
    out: dict[str, Any] = {"write_s": [], "direct_s": [], "read_s": [], "copy_warm_s": []}
    out.update(copy_fresh_s=[], floor_copy_cpu_s=[], floor_hash_cpu_s=[])
    no_direct = direct_io_error(folder)
    bounce_map = None if no_direct else mmap.mmap(-1, 32 << 20)
    warm = [torch.empty_like(t).zero_() for t in tensors]  # touched once, like a pool
    for _ in range(spec["raw_repeats"]):
        for key, fn in (
            ("write_s", lambda: raw_save(sd, path)),
            ("read_s", lambda: raw_load(sd, path)),
            ("copy_warm_s", lambda: [w.copy_(t) for w, t in zip(warm, tensors, strict=True)]),
            ("copy_fresh_s", lambda: [t.clone() for t in tensors]),
        ):
            gc.collect()
            os.sync()
            t0 = time.perf_counter()
            fn()
            out[key].append(time.perf_counter() - t0)
        gc.collect()
        copy_cpu, hash_cpu = _floor(tensors, warm)
        out["floor_copy_cpu_s"].append(copy_cpu)
        out["floor_hash_cpu_s"].append(hash_cpu)
        if bounce_map is not None:
            os.sync()
            t0 = time.perf_counter()
            raw_direct_save(sd, path + ".direct", memoryview(bounce_map))
            out["direct_s"].append(time.perf_counter() - t0)
    if bounce_map is not None:
        bounce_map.close()
    else:
        out["direct_unavailable"] = no_direct
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one method as ``spec`` says and return its JSON-serializable result."""
    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's process executor needs one
    folder = spec["folder"]
    os.makedirs(folder, exist_ok=True)
    # A one-rank gloo group: DCP's process executor needs torch.distributed; every method
    # gets it so that all of them run in the same setting.
    store = dist.FileStore(os.path.join(folder, ".store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, optim, train_step = build_trainer(spec)
        cold = spec.get("build", "warm") == "cold" and spec["method"] != "raw"
        if not cold:
            for _ in range(spec["warmup"]):
                train_step()  # allocates AdamW's state: not part of any method's time
        states = {"model": ModelState(model), "optimizer": OptimizerState(model, optim)}
        result: dict[str, Any] = {
            "method": spec["method"],
            "build": "cold" if cold else "warm",
            "params": sum(p.numel() for p in model.parameters()),
            "rss_before_mib": (_status_kib("VmRSS") or 0) / 1024,
        }
        if spec["method"] == "raw":
            tensors = _state_tensors(model, optim)
            result.update(bytes=_nbytes(tensors), tensors=len(tensors))
            result.update(_raw(spec, tensors, folder))
            return result
        # The process's own step time without checkpoints: a paired baseline that follows
        # the machine's load better than the separate runs. Warm: taken before the saver
        # exists, so that anything the saver prepares at the next optimizer step (a
        # staging pool) falls into the timed loop. Cold: taken at the end (before it the
        # optimizer has no state, and the loop must start with its first step).
        if not cold:
            _calibrate(spec, train_step, result)
        t0 = time.perf_counter()
        try:
            block = spec.get("incremental_block_kb")
            saver = make_saver(
                spec["method"], folder, states, spec["interval"], block and block << 10
            )
        except Unavailable as e:
            return {**result, "unavailable": str(e)}
        result["setup_s"] = time.perf_counter() - t0
        result["staging_bytes"] = saver.staging_bytes()
        try:
            touched = getattr(model, "take_touched", None)
            result.update(_run_loop(spec, saver, train_step, touched))
            tensors = _state_tensors(model, optim)
            result.update(bytes=_nbytes(tensors), tensors=len(tensors))
            records = saver.records()
            if records is not None:
                result["manager_records"] = records
            steps = [e["step"] for e in result["events"]]
            result["disk_bytes"] = _disk_bytes(saver, steps)
            result["manifest_bytes"] = _disk_bytes(saver, steps, "manifest.json")
            if touched is not None:
                result["changed_bytes"] = _changed_bytes(model, optim, result["events"])
            result["trainable_bytes"] = _trainable_bytes(model, optim)
            if result["events"] and saver.restorable:
                last = result["events"][-1]["step"]
                expected = _fingerprint(tensors)
                result["restore_s"] = _restore_times(
                    saver, last, lambda: _state_tensors(model, optim), spec["restore_repeats"]
                )
                del tensors
                fresh = _fresh_restore(spec, saver, last, expected)
                result["fresh_restore_s"] = fresh["load_s"]
                result["fresh_setup_s"] = fresh.get("setup_s", 0.0)
        finally:
            saver.close()
        if cold:
            _calibrate(spec, train_step, result)
        return result
    finally:
        dist.destroy_process_group()


def _disk_bytes(saver: Saver, steps: list[int], only: str | None = None) -> dict[str, int]:
    """Bytes each step's checkpoint occupies on disk (``st_blocks``: the holes of an
    incremental checkpoint take none), by step (``only``: its file of that name, e.g.
    the manifest); steps that left no folder (or no such file) are absent."""
    out = {}
    for step in steps:
        path = saver.path(step)
        if os.path.isdir(path):
            names = [n for n in os.listdir(path) if only is None or n == only]
            if names:
                out[str(step)] = sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in names)
        elif os.path.isfile(path) and only is None:
            out[str(step)] = os.stat(path).st_blocks * 512
    return out


def _changed_bytes(
    model: nn.Module, optim: torch.optim.Optimizer, events: list[dict[str, Any]]
) -> dict[str, int]:
    """The bytes of the state that changed since the previous save, by step, for a model
    whose table changes only in the rows looked up (``model.table``; the events'
    ``rows_touched``): those rows of the table and of its optimizer state of the same
    shape, plus every other tensor of the state whole (the MLP, its optimizer state,
    the step counters: changed at every step)."""
    table = model.table.weight
    rowwise = [
        t for t in _tensors(optim.state.get(table, {})) if t.shape == table.shape
    ]  # an optimizer's per-row state (Adagrad's sum, Adam's moments)
    per_row = sum(t[0].numel() * t.element_size() for t in [table, *rowwise])
    whole = _nbytes(_state_tensors(model, optim)) - per_row * table.shape[0]
    return {str(e["step"]): e["rows_touched"] * per_row + whole for e in events}


def _trainable_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of the state that training changes: the parameters that require a gradient
    and the optimizer's state."""
    params = [p for p in model.parameters() if p.requires_grad]
    return _nbytes(params) + _nbytes([t for st in optim.state.values() for t in _tensors(st)])


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _calibrate(spec: dict[str, Any], train_step: Callable[..., float], result: dict) -> None:
    """Time ``calibration_steps`` steps without checkpoints (the paired baseline)."""
    calibration = result["calibration_step_s"] = []
    cpu0 = time.process_time()
    for _ in range(spec["calibration_steps"]):
        t0 = time.perf_counter()
        train_step()
        calibration.append(time.perf_counter() - t0)
    result["calibration_cpu_s"] = time.process_time() - cpu0


def child_main(argv: list[str]) -> int:
    """``child_main([spec_path])``: read the spec, run, write ``spec["result"]``."""
    from quicksave_tools.bench.child import child_entry

    return child_entry(argv, run_child)


def median(values: list[float]) -> float | None:
    """Median, or None for no values."""
    return statistics.median(values) if values else None
