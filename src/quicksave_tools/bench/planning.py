"""``quicksave bench --planning``: the coordinator's per-save planning cost at scale,
simulated in one process, quicksave vs stock DCP's ``DefaultSavePlanner``.

Every rank's local plan is built for a model sharded over all ranks (a mix of row-sharded
and replicated tensors). Measured, as medians over ``repeats``:

- quicksave uncached: ``global_plan`` of every rank's plan (dedup, layouts, skeleton);
- quicksave cached: what the coordinator does on a hit: the key of its own local plan
  and the cache lookup. The one tiny ``all_reduce`` every rank runs is not simulated;
- DCP uncached: ``DefaultSavePlanner.create_global_plan`` over the equivalent SavePlans;
- DCP cached (``enable_plan_caching=True``, plans unchanged): the coordinator's local
  plan comparison plus ``create_global_plan`` over the "unchanged" plans it receives
  (DCP still runs its gather/scatter collectives here; not simulated either);
- the bytes each system pickles for the plans a coordinator gathers on a miss.

Example::

    quicksave bench --planning --ranks 256 --tensors 500
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from quicksave.layout.plan import ItemSpec
from quicksave.saving.plan_cache import PlanCache
from quicksave.saving.rank_plans import (
    GlobalPlan,
    LocalPlan,
    RankShare,
    global_plan,
    make_local_plan,
    reusable_key,
)

ROWS_PER_RANK = 64  # rows of a sharded tensor on each rank
HIDDEN = 1024


@dataclass(frozen=True)
class PlanningBenchConfig:
    """Args: ranks / tensors: simulated world size and tensors per rank; repeats: timed
    runs per method (median reported); thread_count: data files per rank; dcp: also time
    stock DCP (the slow part)."""

    ranks: int = 256
    tensors: int = 500
    repeats: int = 3
    thread_count: int = 2
    dcp: bool = True


def simulated_plans(ranks: int, tensors: int) -> list[LocalPlan]:
    """Local plans of a model sharded over ``ranks``: 3 of 5 tensors row-sharded (bf16,
    one chunk per rank), 2 of 5 replicated on every rank (fp32 norms and biases), and
    two values per rank (a shared step, a per-rank RNG state)."""
    plans = []
    for r in range(ranks):
        items = []
        for t in range(tensors):
            fqn = f"model.layers.{t // 5}.p{t % 5}"
            if t % 5 < 3:
                rows = ROWS_PER_RANK * ranks
                items.append(
                    ItemSpec(
                        fqn,
                        (r * ROWS_PER_RANK, 0),
                        (ROWS_PER_RANK, HIDDEN),
                        (rows, HIDDEN),
                        "bfloat16",
                        ROWS_PER_RANK * HIDDEN * 2,
                    )
                )
            else:
                n = HIDDEN + t
                items.append(ItemSpec(fqn, (0,), (n,), (n,), "float32", n * 4))
        plans.append(make_local_plan(r, items, ("train.step", f"rng.rank{r}")))
    return plans


def dcp_plans(plans: list[LocalPlan]) -> list[Any]:
    """The SavePlans DCP's ``create_local_plan`` would make for the same chunks."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    out = []
    for p in plans:
        items = []
        for it in p.items:
            whole = it.sizes == it.global_shape and not any(it.offsets)
            items.append(
                WriteItem(
                    index=MetadataIndex(it.fqn, torch.Size(it.offsets)),
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(it.offsets), torch.Size(it.sizes)),
                        properties=TensorProperties(dtype=getattr(torch, it.dtype)),
                        size=torch.Size(it.global_shape),
                    ),
                )
            )
        for fqn in p.objects:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        # DCP's local plan carries the rank's flattening mappings (fqn -> nested path).
        mappings = {i.index.fqn: tuple(i.index.fqn.split(".")) for i in items}
        out.append(SavePlan(items, planner_data=mappings))
    return out


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _quicksave_cached_step(own: LocalPlan, cache: PlanCache, context: tuple[int, int, int]):
    """The coordinator's work on a hit: key its local plan, look the cache up, hand out
    the cached layout and skeleton."""
    plan = make_local_plan(own.rank, own.items, own.objects, own.paths)
    key = reusable_key(cache, plan, 0, context)
    assert key is not None and cache.share is not None and cache.plan is not None
    return cache.share.layout, cache.plan.skeleton


def _dcp_times(plans: list[LocalPlan], repeats: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

    save_plans = dcp_plans(plans)
    t0 = time.perf_counter()
    blob = pickle.dumps(save_plans, protocol=pickle.HIGHEST_PROTOCOL)
    pickle_s = time.perf_counter() - t0
    uncached = _median_s(lambda: DefaultSavePlanner().create_global_plan(save_plans), repeats)

    caches = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans",
              "_cached_global_plan", "_cached_metadata")  # fmt: skip
    saved = {name: dict(getattr(SavePlanner, name)) for name in caches}
    try:
        for name in caches:  # DCP keeps these on the class: start from a clean slate
            getattr(SavePlanner, name).clear()
        DefaultSavePlanner(enable_plan_caching=True).create_global_plan(save_plans)  # prime
        unchanged = [SavePlan([], usable=False)] * len(save_plans)
        cached_own = save_plans[0]
        own = dcp_plans(plans[:1])[0]  # this save's plan: equal, but a new object

        def cached_step() -> None:
            # create_local_plan's comparison on the coordinator, then the global step.
            assert _compare_save_plans(own, cached_own)
            DefaultSavePlanner(enable_plan_caching=True).create_global_plan(unchanged)

        cached = _median_s(cached_step, repeats)
    finally:
        for name in caches:
            getattr(SavePlanner, name).clear()
            getattr(SavePlanner, name).update(saved[name])
    return {
        "uncached_s": uncached,
        "cached_s": cached,
        "plans_pickle_bytes": len(blob),
        "plans_pickle_s": pickle_s,
    }


def run_planning_benchmark(config: PlanningBenchConfig) -> dict[str, Any]:
    """Time every method; returns the report (plain JSON types).

    Raises:
        ValueError: ranks or tensors < 1.

    Example::

        report = run_planning_benchmark(PlanningBenchConfig(ranks=8, tensors=20))
    """
    if config.ranks < 1 or config.tensors < 1 or config.repeats < 1:
        raise ValueError("--ranks, --tensors and --repeats must be at least 1")
    plans = simulated_plans(config.ranks, config.tensors)
    tc = config.thread_count
    gp_box: list[GlobalPlan] = []
    uncached = _median_s(lambda: gp_box.append(global_plan(plans, tc)), config.repeats)
    gp = gp_box[-1]
    context = (config.ranks, 0, tc)
    cache: PlanCache[RankShare] = PlanCache()
    share = RankShare(gp.layouts[0], gp.objects[0], gp.key)
    cache.store(plans[0].key, context, share, local=plans[0], plan=gp)
    cached = _median_s(lambda: _quicksave_cached_step(plans[0], cache, context), config.repeats)
    t0 = time.perf_counter()
    blob = pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL)
    pickle_s = time.perf_counter() - t0
    quicksave = {
        "uncached_s": uncached,
        "cached_s": cached,
        "cached_over_uncached": cached / uncached if uncached else None,
        "plans_pickle_bytes": len(blob),
        "plans_pickle_s": pickle_s,
        "cached_collectives": 1,
        "cached_collective_bytes": 6 * 8,
        "chunks_written": sum(len(a) for a in gp.assigned),
        "chunks_held": sum(len(p.items) for p in plans),
        "data_files": len(gp.skeleton.files),
    }
    report: dict[str, Any] = {
        "config": asdict(config),
        "items_per_rank": len(plans[0].items) + len(plans[0].objects),
        "quicksave": quicksave,
        "dcp": None,
        "notes": [
            "simulated in one process: collectives are not run (quicksave's cached save runs "
            "one all_reduce of 6 int64s; DCP's runs its gather/scatter of plans)",
            "cached = the coordinator's work when no rank's plan changed",
        ],
    }
    if config.dcp:
        dcp = _dcp_times(plans, config.repeats)
        dcp["cached_over_uncached"] = dcp["cached_s"] / dcp["uncached_s"]
        report["dcp"] = dcp
        report["quicksave_cached_vs_dcp_cached"] = cached / dcp["cached_s"]
        report["quicksave_uncached_vs_dcp_uncached"] = uncached / dcp["uncached_s"]
    return report


def _ms(s: float) -> str:
    return f"{s * 1e3:10.3f} ms"


def format_planning_report(report: dict[str, Any]) -> str:
    """The report as a text table."""
    c = report["config"]
    q = report["quicksave"]
    d = report["dcp"]
    lines = [
        f"coordinator planning per save: {c['ranks']} simulated ranks x "
        f"{report['items_per_rank']} items, median of {c['repeats']}",
        f"{'method':<28}{'uncached':>14}{'cached':>14}{'cached/uncached':>17}",
        f"{'quicksave':<28}{_ms(q['uncached_s']):>14}{_ms(q['cached_s']):>14}"
        f"{q['cached_over_uncached'] * 100:>16.3f}%",
    ]
    if d is not None:
        lines.append(
            f"{'DCP DefaultSavePlanner':<28}{_ms(d['uncached_s']):>14}{_ms(d['cached_s']):>14}"
            f"{d['cached_over_uncached'] * 100:>16.3f}%"
        )
    lines.append(
        f"plans pickled on a miss: quicksave {q['plans_pickle_bytes'] / 1e6:.1f} MB "
        f"({q['plans_pickle_s']:.2f} s)"
        + (
            f", DCP {d['plans_pickle_bytes'] / 1e6:.1f} MB ({d['plans_pickle_s']:.2f} s)"
            if d
            else ""
        )
    )
    if d is not None:
        lines.append(
            f"quicksave cached / DCP cached: {report['quicksave_cached_vs_dcp_cached']:.3f}; "
            f"uncached: {report['quicksave_uncached_vs_dcp_uncached']:.3f}"
        )
    lines.extend(f"note: {n}" for n in report["notes"])
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicksave bench --planning",
        description="Coordinator planning cost per save at scale (simulated ranks), "
        "quicksave vs DCP's DefaultSavePlanner, uncached and cached.",
    )
    p.add_argument("--ranks", type=int, default=256, help="simulated ranks (default 256)")
    p.add_argument("--tensors", type=int, default=500, help="tensors per rank (default 500)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (default 3)")
    p.add_argument("--thread-count", type=int, default=2, help="data files per rank")
    p.add_argument("--no-dcp", action="store_true", help="skip stock DCP (slow at scale)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --planning``.

    Returns:
        0 on success, 2 on bad arguments.

    Example::

        quicksave bench --planning --ranks 256 --tensors 500 --json
    """
    args = build_parser().parse_args(argv)
    config = PlanningBenchConfig(
        args.ranks, args.tensors, args.repeats, args.thread_count, not args.no_dcp
    )
    try:
        report = run_planning_benchmark(config)
    except ValueError as e:
        print(f"quicksave bench --planning: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_planning_report(report))
    return 0
