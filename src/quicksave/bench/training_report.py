"""Text and picture of a training-loop benchmark report (see :mod:`.training`)."""

from __future__ import annotations

from typing import Any

from .training_loop import median


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def format_training_report(report: dict[str, Any]) -> str:
    """The report as Markdown: one line about the run, the loop table, the restore table."""
    c, m, raw, st = report["config"], report["machine"], report["raw"], report["state"]
    gb = st["bytes"] / 1e9
    w, r = median(raw["write_s"]), median(raw["read_s"])
    lines = [
        f"{st['params'] / 1e6:.1f}M-parameter MLP + AdamW, {gb:.2f} GB state, {c['steps']} "
        f"steps, checkpoint every {c['interval']}, {c['repeats']} repeat(s), "
        f"{c['threads']} torch threads; {m['cpus']} CPUs, torch {m['torch']}, load average "
        f"{m['loadavg_before'][0]} → {m['loadavg_after'][0]}",
        f"baseline loop (no checkpoints): median {report['baseline']['loop_median_s']:.2f} s "
        f"of {', '.join(f'{x:.2f}' for x in report['baseline']['loop_s'])}; paired estimate "
        "without checkpoints (should be 0): "
        + ", ".join(_fmt(x, "+.2f") for x in report["baseline"].get("paired_extra_s", []))
        + " s",
        f"raw write+fsync {w:.3f} s ({gb / w:.2f} GB/s)"
        + (f", O_DIRECT write {median(raw['direct_s']):.3f} s" if raw.get("direct_s") else "")
        + f", raw read {r:.3f} s, memcpy into warm memory {median(raw['copy_warm_s']):.3f} s, "
        f"into fresh memory {median(raw['copy_fresh_s']):.3f} s",
        "",
        "| method | loop s | extra s / ckpt | vs dcp process | extra s / ckpt (paired) | "
        "vs dcp process (paired) | 1st save blocks s | later saves block s | "
        "save→durable s | write GB/s | durable vs raw write | end wait s | setup s | "
        "peak RSS MiB (trainer / workers) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in report["methods"].items():
        if "loop_median_s" not in s:
            why = s.get("unavailable") or s.get("failed")
            lines.append(
                f"| {name} | {'unavailable' if 'unavailable' in s else 'failed'}: "
                f"{why.splitlines()[0][:150]} |" + " |" * 12
            )
            continue
        lines.append(
            f"| {name} | {s['loop_median_s']:.2f} | {_fmt(s['overhead_per_checkpoint_s'])} | "
            f"{_fmt(s['overhead_vs_reference'], '.2f', '×')} | "
            f"{_fmt(s['paired_overhead_per_checkpoint_s'])} | "
            f"{_fmt(s['paired_overhead_vs_reference'], '.2f', '×')} | "
            f"{_fmt(s['first_blocking_s'], '.3f')} | {_fmt(s['later_blocking_median_s'], '.3f')} | "
            f"{_fmt(s['later_durable_median_s'], '.2f')} | {_fmt(s['write_gbps'])} | "
            f"{_fmt(s['durable_vs_raw_write'], '.2f', '×')} | {_fmt(s['drain_median_s'])} | "
            f"{_fmt(s['setup_median_s'], '.3f')} | "
            f"{s['peak_rss_mib']:.0f} / {s['worker_peak_rss_mib']:.0f} |"
        )
    lines += [
        "",
        "| restore | median s | GB/s | vs dcp.load | vs raw read |",
        "|---|---:|---:|---:|---:|",
        f"| raw read | {r:.3f} | {gb / r:.2f} | – | 1.00× |",
    ]
    for name, s in report["methods"].items():
        if s.get("restore_median_s"):
            lines.append(
                f"| {name} | {s['restore_median_s']:.3f} | {_fmt(s['restore_gbps'])} | "
                f"{_fmt(s['restore_speedup_vs_dcp_load'], '.2f', '× faster')} | "
                f"{_fmt(s['restore_vs_raw_read'], '.1f', '× slower')} |"
            )
    diverged = [n for n, s in report["methods"].items() if s.get("same_loss_as_baseline") is False]
    if diverged:
        lines += ["", f"WARNING: final loss differs from the baseline's: {', '.join(diverged)}"]
    return "\n".join(lines)


def plot_training_report(report: dict[str, Any], path: str) -> None:
    """Draw each method's step times (first run) with its checkpoint events into ``path``.

    One panel per method: a bar per step (its wall time, checkpoint blocking included),
    a red mark where a save blocked the loop and a green mark where it became durable.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
