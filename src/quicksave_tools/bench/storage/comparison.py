"""The side-by-side comparison of ``quicksave bench --storage --baseline SRC``: per
workload, this version's quicksave against the baseline's package measured in the same
run (:func:`compare`, called by :func:`~quicksave_tools.bench.storage.run.run_storage_benchmark`
after the measurements), and its Markdown tables (:func:`format_comparison`, called by
:func:`~quicksave_tools.bench.storage.report.format_storage_report`).

Throughput ratios are current / baseline MB/s (above 1: this version is faster); time
and CPU ratios are current / baseline seconds (below 1: this version takes less). A ratio
is None where either side was not measured or the baseline's value is not positive (an
overhead within the noise)."""

from __future__ import annotations

from typing import Any

from quicksave_tools.bench.baseline import BASELINE
from quicksave_tools.bench.storage.config import IN_CHILD

# training-loop numbers compared: report key -> what it is
TRAINING_KEYS = {
    "overhead_per_checkpoint_s": "overhead s / checkpoint",
    "in_loop_overhead_per_checkpoint_s": "without final wait",
    "paired_overhead_per_checkpoint_s": "paired s / checkpoint",
    "blocking_median_s": "blocking s",
    "durable_median_s": "save→durable s",
}


def _ratio(current: float | None, baseline: float | None) -> float | None:
    if current is None or baseline is None or baseline <= 0:
        return None
    return round(current / baseline, 3)


def _throughput(shape: dict[str, Any], method: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for kind in ("save", "load"):
        cur, base = shape[kind].get(method) or {}, shape[kind].get(method + BASELINE) or {}
        row[f"{kind}_mbps"] = cur.get("mbps_median")
        row[f"{kind}_mbps_baseline"] = base.get("mbps_median")
        row[f"{kind}_speed"] = _ratio(cur.get("mbps_median"), base.get("mbps_median"))
        row[f"{kind}_best_speed"] = _ratio(cur.get("mbps_best"), base.get("mbps_best"))
        for cpu in ("client_cpu_s_median", "server_cpu_s_median"):
            row[f"{kind}_{cpu.removesuffix('_s_median')}"] = _ratio(cur.get(cpu), base.get(cpu))
    return row


def compare(report: dict[str, Any]) -> dict[str, Any]:
    """``throughput`` (per shape and quicksave method: MB/s of both and the speed, best
    speed and CPU ratios of save and load) and ``training`` (per target: each of
    :data:`TRAINING_KEYS` for both, their ratio and difference)."""
    out: dict[str, Any] = {"throughput": {}, "training": {}}
    for name, shape in report.get("shapes", {}).items():
        for method in IN_CHILD:
            if method + BASELINE in shape["save"]:
                out["throughput"].setdefault(name, {})[method] = _throughput(shape, method)
    targets = (report.get("training") or {}).get("targets") or {}
    for target, cur in targets.items():
        base = targets.get(target + BASELINE)
        if target.endswith(BASELINE) or base is None:
            continue
        row: dict[str, Any] = {}
        for key in TRAINING_KEYS:
            a, b = cur.get(key), base.get(key)
            row[key] = {
                "current": a,
                "baseline": b,
                "ratio": _ratio(a, b),
                "difference_s": None if a is None or b is None else round(a - b, 4),
            }
        out["training"][target] = row
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def format_comparison(comparison: dict[str, Any], src: str | None) -> list[str]:
    """Markdown lines: the throughput table (one row per workload) and the training
    table (one row per target)."""
    packages = comparison.get("packages") or {}
    where = "; ".join(f"{m}: {p}" for m, p in packages.items()) or src
    lines = [
        "",
        f"**against the baseline** ({where}): current / baseline, in the same run; MB/s "
        "ratios above 1 and seconds ratios below 1 mean this version is faster",
    ]
    if comparison["throughput"]:
        lines += [
            "",
            "| workload | save MB/s (current / baseline) | save speed | load MB/s (current "
            "/ baseline) | load speed | best save / load speed | client CPU save / load |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for shape, per_method in comparison["throughput"].items():
            for method, r in per_method.items():
                label = shape if method == IN_CHILD[0] else f"{shape} ({method})"
                lines.append(
                    f"| {label} | {_f(r['save_mbps'], '.0f')} / "
                    f"{_f(r['save_mbps_baseline'], '.0f')} | {_f(r['save_speed'])}× | "
                    f"{_f(r['load_mbps'], '.0f')} / {_f(r['load_mbps_baseline'], '.0f')} | "
                    f"{_f(r['load_speed'])}× | {_f(r['save_best_speed'])}× / "
                    f"{_f(r['load_best_speed'])}× | {_f(r['save_client_cpu'])}× / "
                    f"{_f(r['load_client_cpu'])}× |"
                )
    if comparison["training"]:
        head = " | ".join(f"{w} (current / baseline) | ratio" for w in TRAINING_KEYS.values())
        lines += [
            "",
            f"| training target | {head} |",
            "|---|" + "---:|" * (2 * len(TRAINING_KEYS)),
        ]
        for target, row in comparison["training"].items():
            cells = " | ".join(
                f"{_f(row[k]['current'], '.3f')} / {_f(row[k]['baseline'], '.3f')} | "
                f"{_f(row[k]['ratio'])}×"
                for k in TRAINING_KEYS
            )
            lines.append(f"| {target} | {cells} |")
    return lines
