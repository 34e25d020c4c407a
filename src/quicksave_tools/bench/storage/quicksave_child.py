"""quicksave's method of ``quicksave bench --storage``, run in a fresh process per
measured round trip, with this installation's ``quicksave`` or (``<method>@baseline``)
another version's: the parent (:func:`round_trip_in_child`, called by the throughput
part for every quicksave sample) writes the spec, the child (:func:`child_main`) builds
the shape's state dict, saves and loads a tiny one once untimed (imports, clients,
pools), then times ``quicksave.save`` and ``quicksave.load`` of the full one, checks the
loaded values and writes its timings; the parent deletes what it wrote. The child uses
only quicksave's public API (``save``, ``load``, ``StorageOptions``, ``S3Options``), so
that it runs against other versions too."""

from __future__ import annotations

import os
import time
from typing import Any

_CHILD = (
    "import sys; from quicksave_tools.bench.storage.quicksave_child import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)


def child_main(argv: list[str]) -> int:
    """One round trip (``argv = [spec_path]``): writes its result JSON, 0 on success."""
    from quicksave_tools.bench.child import child_entry

    return child_entry(argv, _round_trip)


def _timed(fn: Any, server_pid: int | None) -> dict[str, Any]:
    import gc

    from quicksave_tools.bench.methods import pid_cpu_s

    gc.collect()
    s0 = pid_cpu_s(server_pid) if server_pid else None
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    c1 = time.process_time()
    s1 = pid_cpu_s(server_pid) if server_pid else None
    server = None if s0 is None or s1 is None else s1 - s0
    return {"seconds": dt, "client_cpu_s": c1 - c0, "server_cpu_s": server}


def _round_trip(spec: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch

    import quicksave
    from quicksave_tools.bench.storage.workloads import build_shape

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    storage = None
    if spec["url"].startswith("s3://"):  # credentials: the AWS chain (this process's env)
        s3 = quicksave.S3Options(endpoint_url=spec["endpoint_url"], region=spec["region"])
        storage = quicksave.StorageOptions(s3=s3)
    shape, total, seed = spec["shape"], spec["bytes"], spec["seed"]
    warm = build_shape(shape, min(spec["warmup_bytes"], total), seed + 1)
    quicksave.save(warm, spec["warmup_url"], storage=storage)
    quicksave.load({k: torch.zeros_like(v) for k, v in warm.items()}, spec["warmup_url"],
                   storage=storage)  # fmt: skip
    del warm
    sd = build_shape(shape, total, seed)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}  # preallocated, touched
    server_pid = spec.get("server_pid")
    save = _timed(lambda: quicksave.save(sd, spec["url"], storage=storage), server_pid)
    load = _timed(lambda: quicksave.load(dest, spec["url"], storage=storage), server_pid)
    for name, t in sd.items():
        if not torch.equal(dest[name], t):
            raise RuntimeError(f"loaded wrong values for {name}")
    return {
        "save": save,
        "load": load,
        "quicksave": os.path.dirname(os.path.abspath(quicksave.__file__)),
    }


def round_trip_in_child(
    spec: dict[str, Any], workdir: str, index: int, timeout_s: float, env: dict[str, str] | None
) -> dict[str, Any]:
    """Run one round trip in a fresh process (``spec``: shape, bytes, seed, url,
    warmup_url, warmup_bytes, endpoint_url, region, server_pid; ``env``: the child's
    environment, None: this process's). Returns ``{"save": ..., "load": ...}`` (each
    seconds, client_cpu_s, server_cpu_s).

    Raises:
        RuntimeError: the child failed (its reason).
    """
    from quicksave_tools.bench.child import run_in_fresh_process

    spec = {**spec, "result": os.path.join(workdir, f"{index:03d}-result.json")}
    result = run_in_fresh_process(
        _CHILD, spec, os.path.join(workdir, f"{index:03d}-spec.json"), timeout_s, env
    )
    if "failed" in result:
        raise RuntimeError(result["failed"])
    return result
