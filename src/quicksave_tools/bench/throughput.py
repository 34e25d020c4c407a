"""Save and load throughput of quicksave against the disk's limit, ``torch.save`` and DCP.

Every method writes and reads the same tensor bytes in the same folder, in one process,
interleaved and repeated, so that the numbers of one run can be compared with each
other (and only with each other: the machine's load changes between runs).

Per repeat, for each method in a rotated order: save → (drop the page cache if
``cold``) → load into the destination → check every loaded byte → delete. So the disk
holds one checkpoint at a time and a method never reads a file another one wrote.

Save methods (all timed until the call returns):

* ``raw write+fsync`` — each tensor's bytes appended to one file with ``os.write``,
  then ``fsync``: the cost of durably storing these bytes and nothing else.
* ``raw O_DIRECT`` — the same bytes and file with ``O_DIRECT`` (through an aligned
  32 MiB bounce buffer), then ``fsync``: the device's limit without the page cache.
* ``torch.save+fsync`` — ``torch.save`` of the whole dict to one file, then ``fsync``.
* ``torch.save (no fsync)`` — the same without ``fsync``: the data may still be only in
  the page cache, so it is not durable; shown because this is how it is usually called.
* ``dcp.save`` — ``torch.distributed.checkpoint.save`` with a stock
  ``FileSystemWriter`` (defaults: ``sync_files=True``, ``thread_count=1``).
* ``quicksave.save`` — defaults (2 writer threads, fsync of files and directories,
  atomic rename).

Load methods (the destination is a preallocated, already touched state dict):

* ``raw readinto`` — the raw file read with ``readv`` straight into the destination.
* ``torch.load`` — ``torch.load(weights_only=True, mmap=False)`` of the
  ``torch.save+fsync`` file; it returns fresh tensors (nothing is copied).
* ``torch.load+copy_`` — the same, plus ``copy_`` into the destination, which is what a
  restore into an existing model costs.
* ``dcp.load`` — ``torch.distributed.checkpoint.load`` with a stock ``FileSystemReader``.
* ``quicksave.load`` — defaults (4 reader threads, xxh3-64 of every chunk verified).
"""

from __future__ import annotations

import gc
import mmap
import os
import platform
import re
import resource
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import quicksave.api as quicksave_api
from quicksave_tools.bench.methods import (
    build_state_dict,
    dcp_load,
    dcp_save,
    direct_io_error,
    nbytes_of,
    raw_direct_save,
    raw_load,
    raw_save,
    torch_save,
)

SAVE_METHODS = (
    "raw write+fsync",
    "raw O_DIRECT",
    "torch.save+fsync",
    "torch.save (no fsync)",
    "dcp.save",
    "quicksave.save",
)
LOAD_METHODS = ("raw readinto", "torch.load", "torch.load+copy_", "dcp.load", "quicksave.load")
# save method -> the load methods that read what it wrote (timed in this order)
_PAIRS = (
    ("raw write+fsync", ("raw readinto",)),
    ("raw O_DIRECT", ()),
    ("torch.save+fsync", ("torch.load",)),  # torch.load+copy_ is derived from this one run
    ("torch.save (no fsync)", ()),
    ("dcp.save", ("dcp.load",)),
    ("quicksave.save", ("quicksave.load",)),
)
NOTES = {
    "raw write+fsync": "os.write of every tensor into one file, fsync",
    "raw O_DIRECT": "same file through a 32 MiB aligned buffer, O_DIRECT, fsync",
    "torch.save+fsync": "one file, then fsync",
    "torch.save (no fsync)": "page cache only: not durable",
    "dcp.save": "stock FileSystemWriter: sync_files=True, thread_count=1",
    "quicksave.save": "thread_count=2, fsync files+dirs, atomic rename",
    "raw readinto": "one file, readv into the destination, 1 thread",
    "torch.load": "weights_only=True, mmap=False; fresh tensors",
    "torch.load+copy_": "torch.load, then copy_ into the destination",
    "dcp.load": "stock FileSystemReader, in place",
    "quicksave.load": "thread_count=4, xxh3-64 verified, in place",
}


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Args:
        size_mib: approximate size of the state dict in MiB.
        repeats: how many times every method runs (medians and minima are reported).
        directory: where checkpoints are written; a fresh sub-folder is made and removed.
        cold: drop the page cache (``/proc/sys/vm/drop_caches``, needs root) before loads.
        seed: seed of the tensor values.
    """

    size_mib: int = 1024
    repeats: int = 3
    directory: str | None = None
    cold: bool = False
    seed: int = 0


# ------------------------------------------------------------------------ measuring
def _hwm_kib() -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)", f.read())
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmRSS:\s+(\d+)", f.read())
        if m:
            return int(m.group(1))
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux ≥ 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def drop_page_cache() -> None:
    """Write back dirty pages and drop the page cache (needs root; affects the machine)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


@dataclass
class _Tracker:
    """Timings and per-call memory peaks, plus the process-wide peak."""

    seconds: dict[str, list[float]]
    extra_rss_kib: dict[str, int]
    peak_rss_kib: int = 0

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        gc.collect()
        os.sync()  # earlier writes must not be flushed on this call's time
        before = _rss_kib()
        can_reset = _reset_peak()
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        peak = _hwm_kib() if can_reset else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.seconds.setdefault(name, []).append(dt)
        self.extra_rss_kib[name] = max(self.extra_rss_kib.get(name, 0), peak - before)
        self.peak_rss_kib = max(self.peak_rss_kib, peak)
        return result


def _check_equal(src: dict[str, torch.Tensor], got: dict[str, torch.Tensor], method: str) -> None:
    for name, t in src.items():
        if not torch.equal(got[name], t):
            raise RuntimeError(f"{method} loaded wrong values for {name}")


@dataclass
class _Run:
    """What every measured call of one run shares."""

    sd: dict[str, torch.Tensor]
    dest: dict[str, torch.Tensor]
    base: str
    tracker: _Tracker
    cold: bool
    bounce: memoryview | None  # None: O_DIRECT is not available


def _one_pair(save_method: str, load_methods: tuple[str, ...], run: _Run) -> None:
    sd, dest, tracker = run.sd, run.dest, run.tracker
    if save_method == "raw O_DIRECT" and run.bounce is None:
        return
    path = os.path.join(run.base, re.sub(r"[^A-Za-z]+", "-", save_method).strip("-"))
    savers: dict[str, Callable[[], Any]] = {
        "raw write+fsync": lambda: raw_save(sd, path),
        "raw O_DIRECT": lambda: raw_direct_save(sd, path, run.bounce),
        "torch.save+fsync": lambda: torch_save(sd, path),
        "torch.save (no fsync)": lambda: torch_save(sd, path, fsync=False),
        "dcp.save": lambda: dcp_save(sd, path),
        "quicksave.save": lambda: quicksave_api.save(sd, path),
    }
    loaders: dict[str, Callable[[], Any]] = {
        "raw readinto": lambda: raw_load(dest, path),
        "torch.load": lambda: torch.load(path, weights_only=True, mmap=False),
        "dcp.load": lambda: dcp_load(dest, path),
        "quicksave.load": lambda: quicksave_api.load(dest, path),
    }
    try:
        tracker.timed(save_method, savers[save_method])
        for load_method in load_methods:
            for t in dest.values():
                t.zero_()  # a load that leaves old bytes in place must not pass the check
            if run.cold:
                drop_page_cache()
            got = tracker.timed(load_method, loaders[load_method])
            if load_method == "torch.load":
                t0 = time.perf_counter()
                for name, t in dest.items():
                    t.copy_(got[name])
                copy_s = time.perf_counter() - t0
                tracker.seconds.setdefault("torch.load+copy_", []).append(
                    tracker.seconds["torch.load"][-1] + copy_s
                )
                tracker.extra_rss_kib["torch.load+copy_"] = tracker.extra_rss_kib["torch.load"]
                _check_equal(sd, got, load_method)
                del got
            _check_equal(sd, dest, load_method)
    finally:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def _summary(seconds: list[float], nbytes: int) -> dict[str, Any]:
    med, best = statistics.median(seconds), min(seconds)
    return {
        "seconds": [round(s, 4) for s in seconds],
        "median_s": round(med, 4),
        "min_s": round(best, 4),
        "gbps_median": round(nbytes / 1e9 / med, 3),
        "gbps_best": round(nbytes / 1e9 / best, 3),
    }


def _fs_type(path: str) -> str:
    """The file system type of ``path`` from /proc/mounts (longest matching mount point)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run every method ``config.repeats`` times and return the report.

    Args:
        config: sizes, repeats, folder and cache mode.

    Returns:
        A JSON-serializable dict: ``config``, ``machine``, ``save`` and ``load`` (per
        method: seconds of every run, median, min, GB/s, throughput relative to the raw
        method, peak extra RSS of one call in MiB, a note) and ``peak_rss_mib``.

    Raises:
        ValueError: bad sizes, too little free disk space, or ``cold`` without root.
        RuntimeError: a method loaded wrong values.

    Example::

        report = run_benchmark(BenchConfig(size_mib=64, repeats=1))
        print(format_report(report))
    """
    if config.size_mib < 1 or config.repeats < 1:
        raise ValueError("size_mib and repeats must be at least 1")
    parent = os.path.abspath(config.directory or os.getcwd())
    os.makedirs(parent, exist_ok=True)
    total = config.size_mib << 20
    free = shutil.disk_usage(parent).free
    if free < 2 * total + (256 << 20):
        need = (2 * total >> 20) + 256
        raise ValueError(f"{parent} has {free >> 20} MiB free; this run needs {need} MiB")
    if config.cold:
        try:
            drop_page_cache()
        except OSError as e:
            raise ValueError(f"--cold needs write access to /proc/sys/vm/drop_caches: {e}") from e
    load_before = os.getloadavg()
    sd = build_state_dict(total, config.seed)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # preallocated and touched
    nbytes = nbytes_of(sd)
    base = tempfile.mkdtemp(prefix="quicksave-bench-", dir=parent)
    tracker = _Tracker({}, {})
    no_direct = direct_io_error(base)
    bounce_map = None if no_direct else mmap.mmap(-1, 32 << 20)
    bounce = None if bounce_map is None else memoryview(bounce_map)
    if bounce is not None:
        bounce[:] = bytes(len(bounce))  # touched once, like a staging pool
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            # first calls pay imports and lazy initialisation: not part of the timings
            small = build_state_dict(1 << 20, config.seed)
            small_dest = {k: torch.zeros_like(v) for k, v in small.items()}
            warm = _Run(small, small_dest, base, _Tracker({}, {}), False, bounce)
            for save_method, load_methods in _PAIRS:
                _one_pair(save_method, load_methods, warm)
            del small, small_dest, warm
            run = _Run(sd, dest, base, tracker, config.cold, bounce)
            for r in range(config.repeats):
                shift = r % len(_PAIRS)  # each method runs at a different place each repeat
                for save_method, load_methods in _PAIRS[shift:] + _PAIRS[:shift]:
                    _one_pair(save_method, load_methods, run)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if bounce is not None:
            bounce.release()
        if bounce_map is not None:
            bounce_map.close()

    def section(methods: tuple[str, ...], raw: str) -> dict[str, Any]:
        out = {}
        raw_med = statistics.median(tracker.seconds[raw])
        for m in methods:
            if m not in tracker.seconds:
                out[m] = {"unavailable": no_direct or "not measured", "note": NOTES[m]}
                continue
            s = _summary(tracker.seconds[m], nbytes)
            med = statistics.median(tracker.seconds[m])
            s["vs_raw"] = round(raw_med / med, 3) if med else None
            s["peak_extra_rss_mib"] = round(tracker.extra_rss_kib.get(m, 0) / 1024, 1)
            s["note"] = NOTES[m]
            out[m] = s
        return out

    return {
        "config": {
            "size_mib": config.size_mib,
            "repeats": config.repeats,
            "directory": parent,
            "cache": "cold (drop_caches before every load)" if config.cold else "warm",
            "seed": config.seed,
            "tensors": len(sd),
            "bytes": nbytes,
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in sd.values()),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "filesystem": _fs_type(parent),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "save": section(SAVE_METHODS, "raw write+fsync"),
        "load": section(LOAD_METHODS, "raw readinto"),
        "peak_rss_mib": round(tracker.peak_rss_kib / 1024, 1),
    }


def format_report(report: dict[str, Any]) -> str:
    """Two Markdown tables (save, load) and a line about the run."""
    c, m = report["config"], report["machine"]
    lines = [
        f"{c['bytes'] / 2**20:.0f} MiB in {c['tensors']} tensors, {c['repeats']} repeats, "
        f"{c['cache']} page cache, {m['filesystem']} at {c['directory']}; "
        f"{m['cpus']} CPUs, torch {m['torch']}, load average {m['loadavg_before'][0]} → "
        f"{m['loadavg_after'][0]}; peak RSS {report['peak_rss_mib']:.0f} MiB",
    ]
    for kind in ("save", "load"):
        lines += [
            "",
            f"| {kind} | median s | min s | GB/s (median) | GB/s (best) | vs raw | "
            "peak extra RSS MiB | how |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, s in report[kind].items():
            if "unavailable" in s:
                lines.append(f"| {name} | – | – | – | – | – | – | {s['unavailable']} |")
                continue
            lines.append(
                f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f} | {s['gbps_median']:.2f} | "
                f"{s['gbps_best']:.2f} | {s['vs_raw']:.2f}× | {s['peak_extra_rss_mib']:.0f} | "
                f"{s['note']} |"
            )
    return "\n".join(lines)
