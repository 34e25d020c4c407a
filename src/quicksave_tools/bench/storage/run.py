"""One whole ``quicksave bench --storage`` run (:func:`run_storage_benchmark`): check
the config, open the target (or start SeaweedFS), make the buckets and the MSC config,
set the AWS_* and MSC_CONFIG variables for the run only, then the warm-up, the
throughput per shape, the training loop, and the report with its acceptance rows (and,
with a baseline, the comparison of this version against it)."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from quicksave_tools.bench.storage.buckets import Buckets
from quicksave_tools.bench.storage.comparison import compare
from quicksave_tools.bench.storage.config import StorageBenchConfig, check_config
from quicksave_tools.bench.storage.log import say
from quicksave_tools.bench.storage.methods import Methods, write_msc_config
from quicksave_tools.bench.storage.report import acceptance
from quicksave_tools.bench.storage.target import (
    Target,
    open_target,
    sigterm_as_interrupt,
    weed_version,
)
from quicksave_tools.bench.storage.throughput import measure_shape, warm_up
from quicksave_tools.bench.storage.training import run_training


@contextlib.contextmanager
def _patched_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_storage_benchmark(
    config: StorageBenchConfig, target: Target | None = None, log: Any = None
) -> dict[str, Any]:
    """Run the whole benchmark and return its report (JSON-serializable).

    Args:
        config: sizes, shapes, methods, repeats and the training loop.
        target: where to write (tests pass their server's); None: ``config.endpoint``,
            or a SeaweedFS started here and stopped at the end, however the run ends.
        log: a text stream for progress lines (None: quiet).

    Returns:
        ``config``, ``machine``, ``server``, ``shapes`` (per shape: ``save`` and
        ``load`` per method — seconds, median, best, MB/s, CPU seconds, or
        ``unavailable``/``failed`` with the reason — and ``save_ratios`` /
        ``load_ratios`` of quicksave against raw and the DCP methods), ``training``,
        ``acceptance`` and, with ``config.baseline``, ``baseline``
        (:func:`~quicksave_tools.bench.storage.comparison.compare`).

    Raises:
        ValueError: bad arguments.
        RuntimeError, CheckpointError: raw or quicksave could not run at all.
    """
    check_config(config)
    if target is None:
        with open_target(config, log) as own:
            return run_storage_benchmark(config, own, log)
    load_before = os.getloadavg()
    run_id = uuid.uuid4().hex[:10]
    client = target.client(config.concurrency)
    buckets = Buckets(client, run_id, config.bucket)
    msc_dir = tempfile.mkdtemp(prefix="quicksave-msc-")
    msc_prefix = f"qsbench{run_id}"
    tags = ["warmup"] + [f"{s}-r{r}" for s in config.shapes for r in range(config.repeat)]
    msc_config = write_msc_config(msc_dir, target, {msc_prefix + t: buckets.name(t) for t in tags})
    env = {**target.env(), "MSC_CONFIG": msc_config}
    methods = Methods(target, client, config, msc_prefix)
    report: dict[str, Any] = {"shapes": {}}
    try:
        with sigterm_as_interrupt(), _patched_env(env), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\..*")
            if config.throughput:
                say(log, "warm-up (every method once, tiny state dict)")
                warm_up(config, methods, buckets, run_id, log)
            for shape in config.shapes if config.throughput else ():
                say(log, f"shape {shape}: {config.size_mib} MiB, {config.repeat} repeat(s)")
                report["shapes"][shape] = measure_shape(
                    shape, config, methods, buckets, run_id, log
                )
            if config.training:
                twins = " (and @baseline)" if config.baseline is not None else ""
                say(log, f"training loop: none / local / s3{twins}, each in a fresh process")
                report["training"] = run_training(config, target, buckets, run_id, log)
            else:
                report["training"] = {"skipped": "--no-training"}
    finally:
        methods.close()
        buckets.close()
        with contextlib.suppress(Exception):
            client.close()
        shutil.rmtree(msc_dir, ignore_errors=True)
    report["config"] = {**asdict(config), "shapes": list(config.shapes)}
    report["config"]["methods"] = list(config.methods)
    report["server"] = {"kind": target.kind, "endpoint": target.endpoint_url}
    if target.server is not None:
        report["server"]["weed"] = weed_version(target.server)
    report["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    report["acceptance"] = acceptance(report)
    keys = ["config", "machine", "server", "shapes", "training", "acceptance"]
    if config.baseline is not None:
        report["baseline"] = {**compare(report), "packages": methods.packages}
        keys.append("baseline")
    return {k: report[k] for k in keys}
