"""The throughput benchmark's figures as a plot: one panel for saves, one for loads, a bar
per method (GB/s, median run) with every run marked, written beside the JSON report by
``quicksave bench --out FILE.json`` (matplotlib: ``pip install 'quicksave[bench]'``).

Example::

    quicksave bench --size-mib 1024 --out results/bench.json   # + results/bench.png
"""

from __future__ import annotations

import os
from typing import Any


def plot_path(json_path: str) -> str:
    """Where the plot of the report at ``json_path`` goes: the same name, ``.png``.

    Example:
        >>> plot_path("results/bench.json")
        'results/bench.png'
    """
    return os.path.splitext(json_path)[0] + ".png"


def throughput_figure(report: dict[str, Any]) -> Any:
    """The matplotlib figure of ``report`` (``run_benchmark``'s): for each of ``save`` and
    ``load``, a horizontal bar per measured method at its median GB/s, a dot per run,
    the raw method's median as a dashed line; methods not measured are left out.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, m = report["config"], report["machine"]
    nbytes = c["bytes"]
    kinds = ("save", "load")
    rows = {k: [(n, s) for n, s in report[k].items() if "unavailable" not in s] for k in kinds}
    fig, axes = plt.subplots(
        2,
        1,
        figsize=(9, 1.2 + 0.45 * sum(len(r) for r in rows.values())),
        height_ratios=[max(1, len(rows[k])) for k in kinds],
        squeeze=False,
    )
    for ax, kind in zip(axes[:, 0], kinds, strict=True):
        names = [n for n, _ in rows[kind]][::-1]  # the first method on top
        stats = dict(rows[kind])
        y = range(len(names))
        ax.barh(list(y), [stats[n]["gbps_median"] for n in names], color="#8aa")
        for i, n in enumerate(names):
            runs = [nbytes / 1e9 / s for s in stats[n]["seconds"]]
            ax.plot(runs, [i] * len(runs), "k.", ms=4)
        raw = next((s for n, s in rows[kind] if n.startswith("raw ")), None)
        if raw is not None:
            ax.axvline(raw["gbps_median"], color="k", lw=0.6, ls="--")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.set_title(f"{kind}: GB/s (bar: median, dots: each run, dashed: raw)", fontsize=9,
                     loc="left")  # fmt: skip
    axes[-1, 0].set_xlabel("GB/s")
    fig.suptitle(
        f"{nbytes / 2**20:.0f} MiB in {c['tensors']} tensors, {c['repeats']} repeats, "
        f"{c['cache']} cache, {m['filesystem']}, {m['cpus']} CPUs",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def plot_throughput_report(report: dict[str, Any], path: str) -> None:
    """Draw ``report`` into ``path`` (PNG, or any format matplotlib writes by suffix).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib.pyplot as plt

    fig = throughput_figure(report)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
