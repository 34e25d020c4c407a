"""The save/load throughput part of ``quicksave bench --storage``: every method once on
a tiny state dict (:func:`warm_up`), then ``repeat`` timed runs per shape
(:func:`measure_shape`: save, load, check the values, delete; the method order rotates
per repeat; quicksave's round trips, and with a baseline its ``@baseline`` twin's, each
in a fresh process), summarized as median/best seconds, MB/s, CPU seconds and quicksave's
ratios against raw and the DCP methods."""

from __future__ import annotations

import gc
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quicksave_tools.bench.baseline import plain
from quicksave_tools.bench.methods import nbytes_of
from quicksave_tools.bench.storage.buckets import Buckets, delete_prefix
from quicksave_tools.bench.storage.config import (
    DCP_MSC,
    DCP_S3TC,
    IN_CHILD,
    QUICKSAVE,
    RAW_METHODS,
    RAW_THREADS,
    WARMUP_BYTES,
    MiB,
    StorageBenchConfig,
    all_methods,
    note,
)
from quicksave_tools.bench.storage.log import say, why
from quicksave_tools.bench.storage.methods import Methods
from quicksave_tools.bench.storage.target import Target
from quicksave_tools.bench.storage.workloads import build_shape, pack


def _cpu() -> float:
    return time.process_time()


@dataclass
class _Sample:
    seconds: float
    client_cpu_s: float
    server_cpu_s: float | None


def _timed(target: Target, fn: Callable[[], Any]) -> _Sample:
    gc.collect()
    s0, c0 = target.server_cpu_s(), _cpu()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    c1, s1 = _cpu(), target.server_cpu_s()
    server = None if s0 is None or s1 is None else s1 - s0
    return _Sample(dt, c1 - c0, server)


@dataclass
class _Data:
    """One shape's source and destination, as tensors and as packed buffers."""

    sd: dict[str, torch.Tensor]
    dest: dict[str, torch.Tensor]
    flat: torch.Tensor
    flat_dest: torch.Tensor
    shape: str
    total: int
    seed: int  # with shape and total: what a child process builds the same sd from

    @classmethod
    def build(cls, shape: str, total: int, seed: int) -> _Data:
        sd = build_shape(shape, total, seed)
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # preallocated, touched
        flat = pack(sd)
        return cls(sd, dest, flat, torch.zeros_like(flat), shape, total, seed)

    def clear_dest(self, method: str) -> None:
        if method in RAW_METHODS:
            self.flat_dest.zero_()
        else:
            for t in self.dest.values():
                t.zero_()  # a load that leaves old bytes in place must not pass

    def check(self, method: str) -> None:
        if method in RAW_METHODS:
            if not torch.equal(self.flat, self.flat_dest):
                raise RuntimeError(f"{method} read back different bytes")
            return
        for name, t in self.sd.items():
            if not torch.equal(self.dest[name], t):
                raise RuntimeError(f"{method} loaded wrong values for {name}")


def _slug(method: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", method).strip("-").lower()


def _one(
    methods: Methods,
    method: str,
    bucket: str,
    tag: str,
    prefix: str,
    data: _Data,
    samples: dict[str, dict[str, list[_Sample]]] | None,
) -> None:
    """Save, load, check and delete one method's checkpoint (timed into ``samples``;
    the methods of :data:`IN_CHILD` in a fresh process, which times and checks them)."""
    t = methods.target
    try:
        if plain(method) in IN_CHILD:
            got = methods.in_child(method, bucket, prefix, data.shape, data.total, data.seed)
            s, lo = _Sample(**got["save"]), _Sample(**got["load"])
        else:
            s = _timed(t, lambda: methods.save(method, bucket, tag, prefix, data.sd, data.flat))
            data.clear_dest(method)
            lo = _timed(
                t, lambda: methods.load(method, bucket, tag, prefix, data.dest, data.flat_dest)
            )
            data.check(method)
    finally:
        delete_prefix(methods.client, bucket, prefix + "/")
        if plain(method) in IN_CHILD:
            delete_prefix(methods.client, bucket, prefix + "-warmup/")
    if samples is not None:
        samples.setdefault("save", {}).setdefault(method, []).append(s)
        samples.setdefault("load", {}).setdefault(method, []).append(lo)


def _summary(samples: list[_Sample], nbytes: int) -> dict[str, Any]:
    secs = [s.seconds for s in samples]
    med, best = statistics.median(secs), min(secs)
    server = [s.server_cpu_s for s in samples if s.server_cpu_s is not None]
    return {
        "seconds": [round(x, 4) for x in secs],
        "median_s": round(med, 4),
        "min_s": round(best, 4),
        "mbps_median": round(nbytes / 1e6 / med, 1),
        "mbps_best": round(nbytes / 1e6 / best, 1),
        "client_cpu_s_median": round(statistics.median(s.client_cpu_s for s in samples), 3),
        "server_cpu_s_median": round(statistics.median(server), 3) if server else None,
    }


def _ratios(section: dict[str, Any]) -> dict[str, Any]:
    """quicksave's speed (1/median seconds) relative to raw (the faster raw method)
    and to each DCP method; None where one of the two was not measured."""

    def med(m: str) -> float | None:
        row = section.get(m) or {}
        return row.get("median_s")

    raws = [(med(m), m) for m in RAW_METHODS if med(m)]
    raw_s, raw_name = min(raws) if raws else (None, None)
    q = med(QUICKSAVE)
    out: dict[str, Any] = {"raw_method": raw_name}
    msc = med(DCP_MSC)
    # the most any method could get on this server: raw's speed over dcp+MSC's
    out["raw_vs_dcp_msc"] = round(msc / raw_s, 3) if msc and raw_s else None
    for name, ref in (
        ("vs_raw", raw_s),
        ("vs_dcp_msc", med(DCP_MSC)),
        ("vs_dcp_s3tc", med(DCP_S3TC)),
    ):
        out[name] = round(ref / q, 3) if q and ref else None
    return out


def measure_shape(
    shape: str,
    config: StorageBenchConfig,
    methods: Methods,
    buckets: Buckets,
    run_id: str,
    log: Any,
) -> dict[str, Any]:
    """Every method ``config.repeat`` times on ``shape`` (one bucket per repeat)."""
    total = config.size_mib * MiB
    data = _Data.build(shape, total, config.seed)
    nbytes = nbytes_of(data.sd)
    todo = [m for m in all_methods(config) if m not in methods.unavailable]
    samples: dict[str, dict[str, list[_Sample]]] = {}
    failed: dict[str, str] = {}
    for r in range(config.repeat):
        tag = f"{shape}-r{r}"
        bucket = buckets.make(tag)
        try:
            shift = r % len(todo) if todo else 0
            for method in todo[shift:] + todo[:shift]:
                if method in failed or method in methods.unavailable:
                    continue
                prefix = f"{run_id}/{shape}/r{r}/{_slug(method)}"
                try:
                    _one(methods, method, bucket, tag, prefix, data, samples)
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    failed[method] = why(e)
                    say(log, f"  {shape} {method}: FAILED {failed[method]}")
                    continue
                s, lo = samples["save"][method][-1], samples["load"][method][-1]
                say(
                    log,
                    f"  {shape} r{r} {method}: save {s.seconds:.2f} s "
                    f"({nbytes / 1e6 / s.seconds:.0f} MB/s), load {lo.seconds:.2f} s "
                    f"({nbytes / 1e6 / lo.seconds:.0f} MB/s)",
                )
        finally:
            buckets.drop(tag)
    out: dict[str, Any] = {
        "tensors": len(data.sd),
        "bytes": nbytes,
        "largest_tensor_bytes": max(t.numel() * t.element_size() for t in data.sd.values()),
    }
    for kind in ("save", "load"):
        section: dict[str, Any] = {}
        for m in all_methods(config):
            if m in methods.unavailable:
                section[m] = {"unavailable": methods.unavailable[m], "note": note(m)}
            elif m in failed:
                section[m] = {"failed": failed[m], "note": note(m)}
            else:
                section[m] = {**_summary(samples[kind][m], nbytes), "note": note(m)}
        section_ratios = _ratios(section)
        out[kind] = section
        out[f"{kind}_ratios"] = section_ratios
    del data
    gc.collect()
    return out


def warm_up(
    config: StorageBenchConfig, methods: Methods, buckets: Buckets, run_id: str, log: Any
) -> None:
    """Every method once on a tiny state dict (imports, clients, pools); a method that
    fails here is reported as not available, with the reason."""
    tag = "warmup"
    bucket = buckets.make(tag)
    try:
        for shape in config.shapes:
            data = _Data.build(shape, min(WARMUP_BYTES, config.size_mib * MiB), config.seed + 1)
            for method in all_methods(config):
                if method in methods.unavailable:
                    continue
                prefix = f"{run_id}/warmup/{shape}/{_slug(method)}"
                try:
                    _one(methods, method, bucket, tag, prefix, data, None)
                except Exception as e:  # noqa: BLE001
                    if method == RAW_THREADS or plain(method) == QUICKSAVE:
                        raise  # nothing to compare with / the subject itself: a failure
                    methods.unavailable[method] = f"cannot run against this server: {why(e)}"
                    say(log, f"  {method}: not available: {methods.unavailable[method]}")
    finally:
        buckets.drop(tag)
