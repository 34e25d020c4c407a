"""The report of ``quicksave bench --storage``: the acceptance targets per shape and
for the training loop (:func:`acceptance`) and the Markdown tables
(:func:`format_storage_report`)."""

from __future__ import annotations

import statistics
from typing import Any

from quicksave_tools.bench.baseline import BASELINE, plain
from quicksave_tools.bench.storage.comparison import format_comparison
from quicksave_tools.bench.storage.config import MiB

TARGETS = (  # (what, section, ratio key, at least)
    ("quicksave save ≥ 0.8× raw", "save_ratios", "vs_raw", 0.8),
    ("quicksave save ≥ 3× dcp+MSC", "save_ratios", "vs_dcp_msc", 3.0),
    ("quicksave load ≥ 0.8× raw", "load_ratios", "vs_raw", 0.8),
    ("quicksave load ≥ 4× dcp+MSC", "load_ratios", "vs_dcp_msc", 4.0),
)


def acceptance(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The acceptance targets (:data:`TARGETS` per shape, and the training loop's), with
    the measured ratio and whether it is met."""
    out = []
    for what, section, key, least in TARGETS:
        for shape, s in report["shapes"].items():
            value = s[section].get(key)
            out.append(
                {
                    "target": what,
                    "shape": shape,
                    "value": value,
                    "met": value is not None and value >= least,
                }
            )
    t = report.get("training") or {}
    if "targets" in t:
        for key, what in (
            ("s3_vs_local_overhead", "training overhead per checkpoint: S3 ≤ 1.3× local"),
            ("s3_vs_local_in_loop_overhead", "the same, final wait left out"),
        ):
            value = t.get(key)
            out.append(
                {
                    "target": what,
                    "shape": f"training ({t.get('placement', 'shared')})",
                    "value": value,
                    # None: not measurable (the local overhead is within the noise, ≤ 0)
                    "met": None if value is None else value <= 1.3,
                }
            )
    return out


def _f(x: float | None, fmt: str = ".2f", none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def format_storage_report(report: dict[str, Any]) -> str:
    """Markdown: one table per shape (save and load side by side), the ratios, the
    training-loop table and the acceptance targets."""
    c, m, srv = report["config"], report["machine"], report["server"]
    weed = f" {srv['weed']}" if srv.get("weed") else ""
    lines = [
        f"{srv['kind']}{weed} at {srv['endpoint']}; {c['repeat']} repeat(s) per method, "
        f"medians; raw: {c['part_mib']} MiB parts, {c['concurrency']} in flight; "
        f"{m['cpus']} CPUs, torch {m['torch']}, load average {m['loadavg_before'][0]} → "
        f"{m['loadavg_after'][0]}",
    ]
    for shape, s in report["shapes"].items():
        lines += [
            "",
            f"**{shape}**: {s['bytes'] / MiB:.0f} MiB in {s['tensors']} tensors "
            f"(largest {s['largest_tensor_bytes'] / MiB:.0f} MiB)",
            "",
            "| method | save s | save MB/s | load s | load MB/s | client CPU s (save/load) "
            "| server CPU s (save/load) | how |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name in s["save"]:
            sv, ld = s["save"][name], s["load"][name]
            if "median_s" not in sv or "median_s" not in ld:
                why = sv.get("unavailable") or sv.get("failed") or ld.get("failed")
                label = "not available" if "unavailable" in sv else "failed"
                lines.append(f"| {name} | – | – | – | – | – | – | {label}: {why} |")
                continue
            lines.append(
                f"| {name} | {sv['median_s']:.2f} | {sv['mbps_median']:.0f} | "
                f"{ld['median_s']:.2f} | {ld['mbps_median']:.0f} | "
                f"{sv['client_cpu_s_median']:.2f} / {ld['client_cpu_s_median']:.2f} | "
                f"{_f(sv['server_cpu_s_median'])} / {_f(ld['server_cpu_s_median'])} | "
                f"{sv['note']} |"
            )
        sr, lr = s["save_ratios"], s["load_ratios"]
        lines += [
            "",
            f"quicksave save: {_f(sr['vs_raw'])}× raw ({sr['raw_method']}), "
            f"{_f(sr['vs_dcp_msc'])}× dcp+MSC, {_f(sr['vs_dcp_s3tc'])}× dcp+s3torchconnector; "
            f"load: {_f(lr['vs_raw'])}× raw ({lr['raw_method']}), {_f(lr['vs_dcp_msc'])}× "
            f"dcp+MSC, {_f(lr['vs_dcp_s3tc'])}× dcp+s3torchconnector",
            "",
            f"ceiling (raw vs dcp+MSC): save {_f(sr['raw_vs_dcp_msc'])}×, load "
            f"{_f(lr['raw_vs_dcp_msc'])}×",
        ]
    t = report.get("training") or {}
    if "targets" in t:
        md = t["model"]
        gb = (md["state_bytes"] or 0) / 1e9
        lines += [
            "",
            f"**training loop**: MLP {md['layers']}×{md['hidden']} + AdamW ({gb:.2f} GB of "
            f"state), {t['steps']} steps, a checkpoint every {t['interval']} steps, "
            "CheckpointManager(async_mode='process', default staging); median step "
            f"{_f(t['baseline']['step_median_s'], '.3f')} s without checkpoints; "
            + (
                "pinned: trainer on one CPU, worker and server on the others"
                if t.get("placement") == "pinned"
                else "shared: trainer, worker and server on the same CPUs"
            ),
            "",
            "| target | loop s (median) | checkpoints | overhead s / checkpoint | without "
            "final wait | paired s / checkpoint | blocking s | save→durable s | server CPU s "
            "| worker CPU s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| no checkpoints | {_f(t['baseline']['loop_median_s'])} | 0 | – | – | – | – | – "
            "| – | – |",
        ]
        labels = {"local": "local directory", "s3": "s3://"}
        for kind in t["targets"]:
            label = labels.get(kind) or labels[plain(kind)] + " " + BASELINE
            r = t["targets"][kind]
            if "failed" in r:
                lines.append(f"| {label} | failed: {r['failed']} | | | | | | | | |")
                continue
            cpu, wcpu = r["server_cpu_s"], r["worker_cpu_s"]
            lines.append(
                f"| {label} | {r['loop_median_s']:.2f} | {r['checkpoints']} | "
                f"{_f(r['overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['in_loop_overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['paired_overhead_per_checkpoint_s'], '.3f')} | "
                f"{_f(r['blocking_median_s'], '.3f')} | {_f(r['durable_median_s'])} | "
                f"{_f(statistics.median(cpu) if cpu else None, '.1f')} | "
                f"{_f(statistics.median(wcpu) if wcpu else None, '.1f')} |"
            )
        lines += [
            "",
            f"overhead per checkpoint, S3 / local: {_f(t['s3_vs_local_overhead'])}× "
            f"(without the final wait: {_f(t['s3_vs_local_in_loop_overhead'])}×; paired: "
            f"{_f(t['s3_vs_local_paired_overhead'])}×; – where the local overhead "
            f"is ≤ 0, i.e. within the noise); S3 − local: "
            f"{_f(t['s3_minus_local_overhead_s'], '.3f')} s per checkpoint",
        ]
    if "baseline" in report:
        lines += format_comparison(report["baseline"], c.get("baseline"))
    acc = report.get("acceptance") or []
    if acc:
        lines += ["", "| target | shape | measured | met |", "|---|---|---:|---|"]
        for a in acc:
            lines.append(
                f"| {a['target']} | {a['shape']} | {_f(a['value'])}× | "
                f"{'n/a' if a['met'] is None else 'yes' if a['met'] else 'NO'} |"
            )
    return "\n".join(lines)
