"""``quicksave bench``: benchmarks kept with the code; the numbers they gave are in
``docs/benchmarks.md``.

``quicksave bench`` measures save/load throughput (:mod:`.throughput`);
``quicksave bench --training ...`` measures what checkpointing costs a training loop
(:mod:`.training`); ``quicksave bench --planning ...`` the coordinator's planning cost at
scale, cached and uncached (:mod:`.planning`); ``quicksave bench --coordination ...`` the
per-save coordination cost over real gloo ranks, vs stock DCP (:mod:`.coordination`);
``quicksave bench --hold`` how long a steady ``save()`` of thousands of small tensors
holds the training thread (:mod:`.hold`); ``quicksave bench --recovery`` how fast a
fresh job resumes from each tier (memory, local disk, object store) beside each tier's
raw floor (:mod:`.recovery`); ``quicksave bench --storage ...`` save/load
throughput to S3 and what checkpointing to S3 costs a training loop (the package
:mod:`.storage`, whose ``main`` the command line calls directly).

Example::

    python -c "import quicksave_tools.bench as b; b.main(['--size-mib', '64', '--repeats', '1'])"
    python -c "import quicksave_tools.bench as b; b.main(['--training', '--quick'])"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["BenchConfig", "build_parser", "format_report", "main", "run_benchmark"]

# The throughput benchmark's names, imported when first asked for: a training run's child
# process imports this package too, and with ``--baseline`` its quicksave is another
# version, which the throughput benchmark's imports need not fit.
_THROUGHPUT = ("BenchConfig", "format_report", "run_benchmark")


def __getattr__(name: str) -> Any:
    if name in _THROUGHPUT:
        from quicksave_tools.bench import throughput

        return getattr(throughput, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicksave bench",
        description="Save/load throughput of quicksave vs a raw write, torch.save and DCP, "
        "measured side by side in one run.",
    )
    p.add_argument("--size-mib", type=int, default=1024, help="state dict size (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every method (default 3)")
    p.add_argument(
        "--dir",
        default=None,
        help="folder to write in (default: the current directory; never /dev/shm unless asked)",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before every load (root only; slows the whole machine)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the tensor values")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--out",
        metavar="FILE.json",
        help="also write the report as JSON to FILE.json and its plot beside it (FILE.png; "
        "needs matplotlib: pip install 'quicksave[bench]')",
    )
    p.add_argument(
        "--training",
        action="store_true",
        help="run the training-loop benchmark instead (its options: --training --help)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench``.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on bad arguments or an unusable folder, 1 if a method loaded
        wrong values.

    Example::

        quicksave bench --size-mib 1024 --repeats 3
        quicksave bench --size-mib 1024 --out results/bench.json  # + results/bench.png
        quicksave bench --training --plot steps.png
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--coordination" in argv:
        from quicksave_tools.bench.coordination import (
            main as coordination_main,  # imported only when asked for
        )

        argv.remove("--coordination")
        return coordination_main(argv)
    if "--planning" in argv:
        from quicksave_tools.bench.planning import (
            main as planning_main,  # imported only when asked for
        )

        argv.remove("--planning")
        return planning_main(argv)
    if "--recovery" in argv:
        from quicksave_tools.bench.recovery import (
            main as recovery_main,  # imported only when asked for
        )

        argv.remove("--recovery")
        return recovery_main(argv)
    if "--hold" in argv:
        from quicksave_tools.bench.hold import main as hold_main  # imported only when asked for

        argv.remove("--hold")
        return hold_main(argv)
    if "--training" in argv:
        from quicksave_tools.bench.training import (
            main as training_main,  # imported only when asked for
        )

        argv.remove("--training")
        return training_main(argv)
    from quicksave_tools.bench.throughput import BenchConfig, format_report, run_benchmark

    args = build_parser().parse_args(argv)
    config = BenchConfig(args.size_mib, args.repeats, args.dir, args.cold, args.seed)
    try:
        report = run_benchmark(config)
    except ValueError as e:
        print(f"quicksave bench: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"quicksave bench: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if args.out:
        return _write_out(report, args.out)
    return 0


def _write_out(report: dict[str, Any], path: str) -> int:
    """The report as JSON at ``path`` and its plot beside it; 0, or 2 if ``path`` cannot
    be written. Without matplotlib the JSON is written and the missing plot is said."""
    from quicksave_tools.bench.throughput_plot import plot_path, plot_throughput_report

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    except OSError as e:
        print(f"quicksave bench: cannot write {path}: {e}", file=sys.stderr)
        return 2
    png = plot_path(path)
    try:
        plot_throughput_report(report, png)
    except ImportError:
        print(
            f"quicksave bench: wrote {path}; no plot: matplotlib is not installed "
            "(pip install 'quicksave[bench]')",
            file=sys.stderr,
        )
        return 0
    print(f"quicksave bench: wrote {path} and {png}", file=sys.stderr)
    return 0
