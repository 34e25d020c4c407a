"""Text and picture of a training-loop benchmark report (see :mod:`.training`)."""

from __future__ import annotations

from typing import Any

from quicksave_tools.bench.training_incremental import incremental_table
from quicksave_tools.bench.training_loop import median


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def _spread(values: list[float] | None, spec: str = ".2f") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:{spec}}"
    return f"{min(values):{spec}}–{max(values):{spec}}"


_BUILT = {
    "cold": "before the optimizer's first step (cold)",
    "warm": "after a warm-up step (warm)",
}


def format_training_report(report: dict[str, Any]) -> str:
    """The report as Markdown: one line about the run (with the incremental methods'
    block size, where they ran); per shape its state, raw figures and floor, the loop
    table, the restore table and the bytes on disk; then the acceptance table and the
    incremental methods side by side."""
    c, m = report["config"], report["machine"]
    lines = [
        f"{len(c['shapes'])} model shape(s), {c['steps']} steps, checkpoint every "
        f"{c['interval']}, {c['repeats']} repeat(s), {c['threads']} torch threads, saver built "
        f"{_BUILT[c.get('build', 'warm')]}; {m['cpus']} "
        f"CPUs, torch {m['torch']}, load average {m['loadavg_before'][0]} → "
        f"{m['loadavg_after'][0]}",
    ]
    if any("incremental" in x for x in c["methods"]):
        kb = c.get("incremental_block_kb")
        lines[0] += f"; incremental blocks {f'{kb} KiB' if kb else '4096 KiB (the default)'}"
    for name, sh in report["shapes"].items():
        lines += ["", *_format_shape(name, sh, c.get("build", "warm"))]
    lines += [
        "",
        f"Acceptance ({report['default']}, the default mode; medians over repeats):",
        "",
        "| shape | target | value | limit | met |",
        "|---|---|---:|---:|---|",
    ]
    for row in report["acceptance"]:
        v = row["value"]
        shown = (
            " / ".join(_fmt(x, ".3f", " s") for x in v)
            if isinstance(v, list)
            else _fmt(v, ".2f", row.get("unit", "×"))
        )
        limit = "–" if row["limit"] is None else f"≤ {row['limit']}{row.get('unit', '×')}"
        lines.append(
            f"| {row['shape']} | {row['target']} | {shown} | {limit} | "
            f"{'yes' if row['met'] else 'NO'} |"
        )
    side = incremental_table(report.get("incremental", []), c.get("incremental_block_kb"))
    if side:
        lines += ["", *side]
    return "\n".join(lines)


def _disk_rows(methods: dict[str, Any]) -> list[str]:
    """Bytes each checkpoint takes on disk (the holes of an incremental one take none)."""
    rows = [
        f"| {name} | {s['disk_first_bytes'] / 1e6:.1f} | "
        f"{s['disk_later_median_bytes'] / 1e6:.1f} | "
        f"{_fmt(s.get('disk_later_vs_first'), '.3f', '×')} | "
        f"{_fmt(s.get('disk_later_vs_trainable'), '.2f', '×')} | "
        f"{_fmt((s.get('changed_later_median_bytes') or 0) / 1e6 or None, '.2f')} "
        f"({_fmt(s.get('rows_touched_later_median'), '.0f')}) | "
        f"{_fmt(s.get('disk_later_vs_changed'), '.2f', '×')} |"
        for name, s in methods.items()
        if s.get("disk_first_bytes") is not None and s.get("disk_later_median_bytes") is not None
    ]
    if not rows:
        return []
    head = (
        "| bytes on disk | 1st save MB | later saves MB (median) | later vs 1st | "
        "later vs trainable state | changed state MB per later save (rows looked up) | "
        "later vs changed |"
    )
    return ["", head, "|---|---:|---:|---:|---:|---:|---:|", *rows]


def _format_shape(name: str, sh: dict[str, Any], build: str) -> list[str]:
    st, raw, fl, base = sh["state"], sh["raw"], sh["floor"], sh["baseline"]
    gb = st["bytes"] / 1e9
    first_key = "first_step_vs_baseline" if build == "cold" else "first_step_vs_steady"
    w, r = median(raw["write_s"]), median(raw["read_s"])
    lines = [
        f"### {name}: {sh['about']}",
        "",
        f"{st['params'] / 1e6:.1f}M parameters, {st['tensors']} state tensors, {gb:.2f} GB state",
        f"baseline loop (no checkpoints): median {base['loop_median_s']:.2f} s of "
        f"{', '.join(f'{x:.2f}' for x in base['loop_s'])} (median step "
        f"{base['step_median_s']:.3f} s); paired estimate without checkpoints (should be 0): "
        + ", ".join(_fmt(x, "+.2f") for x in base.get("paired_extra_s", []))
        + " s",
        f"raw write+fsync {w:.3f} s ({gb / w:.2f} GB/s)"
        + (f", O_DIRECT write {median(raw['direct_s']):.3f} s" if raw.get("direct_s") else "")
        + f", raw read {r:.3f} s, memcpy into warm memory {median(raw['copy_warm_s']):.3f} s "
        f"(torch, 2 threads), into fresh memory {median(raw['copy_fresh_s']):.3f} s",
        f"floor: {fl['cpu_s']:.3f} CPU s = one single-threaded memcpy {fl['copy_cpu_s']:.3f} + "
        f"one xxh3-64 pass {fl['hash_cpu_s']:.3f}",
        "",
        "| method | extra s / ckpt (spread) | vs dcp process | vs floor | paired extra s / ckpt "
        "| 1st save blocks s | later block s | 1st save extra s (later) | save→durable s | "
        "durable vs raw write | "
        + ("1st step vs baseline's 1st" if build == "cold" else "1st step vs steady")
        + " | close wait s (vs last durable) | CPU s / ckpt trainer + "
        "workers | setup s | staging / state | peak RSS MiB (trainer / workers) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, s in sh["methods"].items():
        if "loop_median_s" not in s:
            why = s.get("unavailable") or s.get("failed")
            lines.append(
                f"| {method} | {'unavailable' if 'unavailable' in s else 'failed'}: "
                f"{why.splitlines()[0][:150]} |" + " |" * 15
            )
            continue
        lines.append(
            f"| {method} | {_fmt(s['overhead_per_checkpoint_s'])} "
            f"({_spread(s['overhead_per_checkpoint_runs_s'])}) | "
            f"{_fmt(s['overhead_vs_reference'], '.2f', '×')} | "
            f"{_fmt(s['overhead_vs_floor'], '.1f', '×')} | "
            f"{_fmt(s['paired_overhead_per_checkpoint_s'])} | "
            f"{_fmt(s['first_blocking_s'], '.3f')} | {_fmt(s['later_blocking_median_s'], '.3f')} | "
            f"{_fmt(s.get('first_save_extra_s'))} ({_fmt(s.get('later_save_extra_median_s'))}) | "
            f"{_fmt(s['later_durable_median_s'], '.2f')} | "
            f"{_fmt(s['durable_vs_raw_write'], '.2f', '×')} | "
            f"{_fmt(s.get(first_key), '.2f', '×')} | "
            f"{_fmt(s['drain_median_s'])} ({_fmt(s['close_vs_last_durable'], '.2f', '×')}) | "
            f"{_fmt(s['trainer_cpu_per_checkpoint_s'])} + "
            f"{_fmt(s['workers_cpu_per_checkpoint_s'])} | "
            f"{_fmt(s['setup_median_s'], '.2f')} | {_fmt(s['staging_vs_state'], '.3f', '×')} | "
            f"{s['peak_rss_mib']:.0f} / {s['worker_peak_rss_mib']:.0f} |"
        )
    lines += [
        "",
        "| restore | median s | GB/s | vs dcp.load | vs raw read | into a fresh job s "
        "(vs fastest other library) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| raw read | {r:.3f} | {gb / r:.2f} | – | 1.00× | – |",
    ]
    for method, s in sh["methods"].items():
        if s.get("restore_median_s"):
            lines.append(
                f"| {method} | {s['restore_median_s']:.3f} | {_fmt(s['restore_gbps'])} | "
                f"{_fmt(s['restore_speedup_vs_dcp_load'], '.2f', '× faster')} | "
                f"{_fmt(s['restore_vs_raw_read'], '.1f', '× slower')} | "
                f"{_fmt(s.get('fresh_restore_median_s'), '.3f')} "
                f"({_fmt(s.get('fresh_restore_vs_others'), '.2f', '×')}) |"
            )
    lines += _disk_rows(sh["methods"])
    lines += _baseline_rows(sh["methods"])
    diverged = [n for n, s in sh["methods"].items() if s.get("same_loss_as_baseline") is False]
    if diverged:
        lines += [
            "",
            f"WARNING: final loss differs from every baseline run's: {', '.join(diverged)}",
        ]
    return lines


def _baseline_rows(methods: dict[str, dict[str, Any]]) -> list[str]:
    """This version against the ``--baseline`` package, method by method (empty without
    one): each figure as this / baseline, with both runs' spreads."""
    pairs = [
        (name, s, methods[name + "@baseline"])
        for name, s in methods.items()
        if name + "@baseline" in methods
        and "loop_median_s" in s
        and "loop_median_s" in methods[name + "@baseline"]
    ]
    if not pairs:
        return []
    lines = [
        "",
        "| against the baseline | extra s / ckpt: this (spread) / baseline (spread) | ratio "
        "| save→durable s: this / baseline | ratio | restore into a fresh job s: this / "
        "baseline | trainer CPU s / ckpt: this / baseline |",
        "|---|---|---:|---|---:|---|---|",
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return _fmt(a / b, ".2f", "×") if a is not None and b else "–"

    for name, s, b in pairs:
        lines.append(
            f"| {name} | {_fmt(s['overhead_per_checkpoint_s'])} "
            f"({_spread(s['overhead_per_checkpoint_runs_s'])}) / "
            f"{_fmt(b['overhead_per_checkpoint_s'])} "
            f"({_spread(b['overhead_per_checkpoint_runs_s'])}) | "
            f"{ratio(s['overhead_per_checkpoint_s'], b['overhead_per_checkpoint_s'])} | "
            f"{_fmt(s['later_durable_median_s'])} / {_fmt(b['later_durable_median_s'])} | "
            f"{ratio(s['later_durable_median_s'], b['later_durable_median_s'])} | "
            f"{_fmt(s.get('fresh_restore_median_s'), '.3f')} / "
            f"{_fmt(b.get('fresh_restore_median_s'), '.3f')} | "
            f"{_fmt(s['trainer_cpu_per_checkpoint_s'])} / "
            f"{_fmt(b['trainer_cpu_per_checkpoint_s'])} |"
        )
    return lines


def plot_training_report(report: dict[str, Any], path: str) -> None:
    """Draw each method's step times (first run) with its checkpoint events into ``path``.

    One panel per method: a bar per step (its wall time, checkpoint blocking included),
    a red mark where a save blocked the loop and a green mark where it became durable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(report["shapes"]))
    report = {**report["shapes"][first], "config": report["config"]}  # the first shape
    rows = [(n, s) for n, s in report["methods"].items() if s.get("runs")]
    fig, axes = plt.subplots(
        len(rows) + 1,
        1,
        figsize=(10, 1.8 * (len(rows) + 1)),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    base = report["baseline"]["loop_median_s"] / report["config"]["steps"]
    steps = report["baseline"]["step_s"]
    starts = [sum(steps[:i]) for i in range(len(steps))]
    axes[0, 0].bar(starts, steps, width=steps, align="edge", color="#8aa")
    for ax, (name, s) in zip(axes[1:, 0], rows, strict=True):
        run = s["runs"][0]
        starts = [sum(run["step_s"][:i]) for i in range(len(run["step_s"]))]
        ax.bar(starts, run["step_s"], width=run["step_s"], align="edge", color="#8aa")
        for ev in run["events"]:
            ax.axvspan(ev["start_s"], ev["start_s"] + ev["blocking_s"], color="r", alpha=0.3)
            if ev.get("durable_s"):
                ax.plot([ev["start_s"] + ev["durable_s"]], [base], "g^")
        ax.axhline(base, color="k", lw=0.6, ls="--")
        ax.set_ylabel("step s")
        ax.set_title(f"{name}: loop {s['loop_median_s']:.1f} s", fontsize=9, loc="left")
    axes[0, 0].axhline(base, color="k", lw=0.6, ls="--")
    axes[0, 0].set_title(
        f"no checkpoints: {report['baseline']['loop_median_s']:.1f} s (dashed: its mean "
        "step; red: a save blocks; green ▲: durable)",
        fontsize=9,
        loc="left",
    )
    axes[-1, 0].set_xlabel("seconds since the loop started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
