#!/usr/bin/env python3
"""Time until finalized: NVRx's async_ckpt vs quicksave.compat.nvrx, side by side.

A measuring tool, not a test (pytest does not collect ``nvrx_compat``). The same user
script (``ttf_user_script.py``: NVRx's documented ``FileSystemWriterAsync`` +
``save_state_dict_async_plan`` + ``AsyncRequest`` + persistent ``AsyncCallsQueue`` flow) runs
twice with only its import switched: as it is against NVRx's source tree
(``nvidia_resiliency_ext.checkpointing.async_ckpt``; on a machine without CUDA with the CPU
shim, ``cpu_shim/sitecustomize.py``), and rewritten to ``quicksave.compat.nvrx``. For each
world size and state-dict shape it starts the ranks (torchrun's environment, gloo) once per
implementation and round, alternating (NVRx, quicksave, NVRx, quicksave, ...) so that both
see the same machine; each start makes a first save (which starts the worker) and then
``--saves`` timed saves into fresh directories of one temp dir, each loaded back with stock
DCP and deleted before the next.

Reported per implementation: the medians over all timed saves of the blocking time (plan +
schedule) and of the time until finalized (start of the save to the return of the blocking
``maybe_finalize_async_calls``), each the max over ranks, the first save's time until
finalized, and the ratio NVRx / quicksave. An implementation that fails (an error, a
timeout, a checkpoint that does not load back as saved) is reported with its error line
instead of a time.

Usage (see README.md next to this file)::

    python tests/nvrx_compat/time_to_finalize.py \\
        --from-mirror /work/.mirror/NVIDIA+nvidia-resiliency-ext/repo --json ttf.json
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from run_nvrx_tests import (
    NVRX_ASYNC,
    PKG_SRC,
    QS_ASYNC,
    REPO_ROOT,
    SetupError,
    _p_imports,
    _read,
    check_cpu_shim,
    cuda_available,
    extract_from_git,
    first_failure,
    install_cpu_shim,
    last_exception_line,
    launch,
)

USER_SCRIPT = Path(__file__).resolve().parent / "ttf_user_script.py"
IMPLS = ("nvrx", "quicksave")
LABEL = {"nvrx": "NVRx", "quicksave": "quicksave"}


@dataclass(frozen=True)
class Shape:
    """A per-rank state dict: ``count`` float32 tensors of ``tensor_mib`` MiB each."""

    name: str
    count: int
    tensor_mib: float

    @property
    def label(self) -> str:
        total = self.count * self.tensor_mib
        size = f"{total / 1024:g} GiB" if total >= 1024 else f"{total:g} MiB"
        each = (
            f"{self.tensor_mib:g} MiB"
            if self.tensor_mib >= 1
            else f"{self.tensor_mib * 1024:g} KiB"
        )
        return f"{self.count} x {each} ({size})"


SHAPES = {
    "large": Shape("large", 64, 16),  # the case: 1 GiB per rank in 16 MiB tensors
    "small": Shape("small", 1024, 0.25),  # 256 MiB per rank in 256 KiB tensors
}


@dataclass
class Run:
    """One start of the ranks for one implementation (a first save + the timed saves)."""

    impl: str
    round: int
    status: str  # "ok" or "fail"
    error: str = ""
    seconds: float = 0.0
    first: dict | None = None  # per-rank lists: blocking_s, finalized_s, verify_s
    saves: list[dict] = field(default_factory=list)
    module_file: str = ""


# --------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    script_dir: Path  # cwd of the ranks; holds ttf_user_script.py for this implementation
    env: dict
    info: dict
    setup_error: str = ""


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True)
    return out.stdout.strip()


def _working_tree_state() -> dict:
    """HEAD and whether src/ has uncommitted changes (quicksave from the working tree)."""
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--", "src")),
    }


def prepare(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Impl], dict]:
    base = dict(os.environ)
    base.pop("PYTHONPATH", None)
    base["PYTHONUNBUFFERED"] = "1"
    script = USER_SCRIPT.read_text(encoding="utf-8")
    qs_script, n = _p_imports(script)
    if n == 0 or "nvidia_resiliency_ext" in qs_script:
        raise SetupError(f"{USER_SCRIPT}: the import rewriting to {QS_ASYNC} failed")
    diff = "".join(
        difflib.unified_diff(
            script.splitlines(True),
            qs_script.splitlines(True),
            "nvrx/" + USER_SCRIPT.name,
            "quicksave/" + USER_SCRIPT.name,
        )
    )
    impls: dict[str, Impl] = {}
    settings: dict = {"script_diff": diff}

    if "nvrx" in args.impls:
        if args.from_mirror:
            root = tmp / "nvrx"
            commit = extract_from_git(Path(args.from_mirror), args.ref, root, [PKG_SRC])
            info = {"mirror": str(args.from_mirror), "ref": args.ref, "commit": commit}
        else:
            root = Path(args.nvrx_root).resolve()
            info = {"path": str(root)}
        if not (root / PKG_SRC).is_dir():
            raise SetupError(f"{root / PKG_SRC}: not found (NVRx's source package)")
        pythonpath = [str(root / "src")]
        shim = args.nvrx_cpu_shim
        if shim is None:
            shim = not cuda_available(args.python, base)
        if shim:
            pythonpath.insert(0, str(install_cpu_shim(tmp / "cpu_shim")))
        env = dict(base, PYTHONPATH=os.pathsep.join(pythonpath))
        info["cpu_shim"] = shim
        d = tmp / "scripts" / "nvrx"
        d.mkdir(parents=True)
        (d / USER_SCRIPT.name).write_text(script, encoding="utf-8")
        impls["nvrx"] = Impl("nvrx", d, env, info)
        if shim:
            check_cpu_shim(args.python, env, d)

    if "quicksave" in args.impls:
        env = dict(base)
        if args.quicksave_ref:
            src = tmp / "quicksave"
            commit = extract_from_git(REPO_ROOT, args.quicksave_ref, src, ["src"])
            env["PYTHONPATH"] = str(src / "src")
            info = {"ref": args.quicksave_ref, "commit": commit}
        else:
            info = {"ref": "working tree", **_working_tree_state()}
        d = tmp / "scripts" / "quicksave"
        d.mkdir(parents=True)
        (d / USER_SCRIPT.name).write_text(qs_script, encoding="utf-8")
        impls["quicksave"] = Impl("quicksave", d, env, info)

    for impl in impls.values():
        mod = (NVRX_ASYNC if impl.name == "nvrx" else QS_ASYNC) + ".core"
        probe = subprocess.run(
            [args.python, "-c", f"import {mod} as m; print(m.__file__)"],
            cwd=impl.script_dir,
            env=impl.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if probe.returncode != 0:
            impl.setup_error = f"cannot import {mod}: {last_exception_line(probe.stderr)}"
        impl.info["module_file"] = probe.stdout.strip()
    return impls, settings


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_once(
    args: argparse.Namespace, impl: Impl, ws: int, shape: Shape, rnd: int, tmp: Path
) -> Run:
    tag = f"ws{ws}-{shape.name}-r{rnd}-{impl.name}"
    ckpt_root = tmp / "ckpt" / tag
    result = tmp / "results" / f"{tag}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        args.python,
        USER_SCRIPT.name,
        "--ckpt-root",
        str(ckpt_root),
        "--result",
        str(result),
        "--count",
        str(shape.count),
        "--tensor-mib",
        str(shape.tensor_mib),
        "--saves",
        str(args.saves),
    ] + (["--no-fsync"] if args.no_fsync else [])
    logdir = tmp / "logs" / tag
    try:
        runs, secs = launch(argv, ws, impl.script_dir, impl.env, logdir, args.timeout, args.grace)
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)  # whatever a failed run left
    data = json.loads(_read(result) or "{}")
    run = Run(impl.name, rnd, "ok", seconds=secs, module_file=data.get("module_file", ""))
    run.first, run.saves = data.get("first"), data.get("saves", [])
    if any(r.returncode != 0 for r in runs):
        run.status, run.error = "fail", first_failure(runs).replace(str(tmp), "$TMP")
    elif len(run.saves) != args.saves or run.first is None:
        run.status, run.error = "fail", f"exit 0 but {len(run.saves)}/{args.saves} saves reported"
    return run


def measure(args: argparse.Namespace, impls: dict[str, Impl], tmp: Path) -> list[dict]:
    configs = []
    for ws in args.world_sizes:
        for shape in (SHAPES[s] for s in args.shapes):
            runs: list[Run] = []
            failed: dict[str, str] = {
                name: impl.setup_error for name, impl in impls.items() if impl.setup_error
            }
            for rnd in range(args.rounds):
                for name in args.impls:
                    if name in failed:
                        continue  # once failed in this configuration, not started again
                    run = run_once(args, impls[name], ws, shape, rnd, tmp)
                    runs.append(run)
                    if run.status != "ok":
                        failed[name] = run.error
                    _log(f"[{ws} rank(s), {shape.name}, round {rnd}] {_run_line(run)}")
            configs.append(summarize(ws, shape, runs, failed, args.impls))
    return configs


def _run_line(run: Run) -> str:
    label = f"{LABEL[run.impl]:9} ({run.seconds:.0f}s)"
    if run.status != "ok":
        return f"{label} FAILED: {run.error}"
    fin = [max(s["finalized_s"]) for s in run.saves]
    first = max(run.first["finalized_s"]) if run.first else float("nan")
    return f"{label} first {first:.2f}s, finalized " + " ".join(f"{x:.2f}" for x in fin)


# --------------------------------------------------------------------------------------
# Summary and output
# --------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(
    ws: int, shape: Shape, runs: list[Run], failed: dict[str, str], impls: list[str]
) -> dict:
    out: dict = {"world_size": ws, "shape": asdict(shape), "label": shape.label, "impls": {}}
    total_bytes = shape.count * int(shape.tensor_mib * (1 << 20)) * ws
    for name in impls:
        mine = [r for r in runs if r.impl == name]
        saves = [s for r in mine if r.status == "ok" for s in r.saves]
        firsts = [r.first for r in mine if r.status == "ok" and r.first]
        fin = [max(s["finalized_s"]) for s in saves]
        block = [max(s["blocking_s"]) for s in saves]
        first = [max(f["finalized_s"]) for f in firsts]
        med = _median(fin)
        out["impls"][name] = {
            "status": "fail" if name in failed else "ok",
            "error": failed.get(name, ""),
            "n_saves": len(fin),
            "finalized_median_s": med,
            "finalized_min_s": min(fin) if fin else None,
            "finalized_max_s": max(fin) if fin else None,
            "blocking_median_s": _median(block),
            "first_finalized_median_s": _median(first),
            "gib_per_s": total_bytes / med / (1 << 30) if med else None,
            "runs": [asdict(r) for r in mine],
        }
    a, b = out["impls"].get("nvrx"), out["impls"].get("quicksave")
    if a and b and a["status"] == b["status"] == "ok":
        out["ratio_nvrx_over_quicksave"] = {
            k: a[k] / b[k] if a[k] and b[k] else None
            for k in ("finalized_median_s", "blocking_median_s", "first_finalized_median_s")
        }
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(report: dict) -> str:
    rows = [
        "| ranks | state dict per rank | implementation | first save: finalized (s) | "
        "blocking, median (s) | finalized, median (min-max) (s) | GiB/s, all ranks | saves |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = [
        "| ranks | state dict per rank | finalized NVRx/quicksave | blocking NVRx/quicksave "
        "| first save NVRx/quicksave |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in report["configs"]:
        for name, s in c["impls"].items():
            head = f"| {c['world_size']} | {c['label']} | {LABEL[name]} |"
            if s["status"] != "ok":
                err = s["error"].replace("|", "\\|")
                done = f" (after {s['n_saves']} timed saves)" if s["n_saves"] else ""
                rows.append(f"{head} failed{done}: {err} | | | | |")
                continue
            rows.append(
                f"{head} {_f(s['first_finalized_median_s'])} | {_f(s['blocking_median_s'], '.3f')} "
                f"| {_f(s['finalized_median_s'])} ({_f(s['finalized_min_s'])}-"
                f"{_f(s['finalized_max_s'])}) | {_f(s['gib_per_s'])} | {s['n_saves']} |"
            )
        r = c.get("ratio_nvrx_over_quicksave")
        if r:
            ratios.append(
                f"| {c['world_size']} | {c['label']} | {_f(r['finalized_median_s'])} "
                f"| {_f(r['blocking_median_s'])} | {_f(r['first_finalized_median_s'])} |"
            )
    out = rows
    if len(ratios) > 2:
        out += ["", *ratios]
    return "\n".join(out) + "\n"


def render_header(report: dict) -> str:
    lines = [f"date: {report['date']}", f"machine: {report['machine']}"]
    for name, info in report["implementations"].items():
        where = info.get("ref", info.get("path", ""))
        commit = info.get("commit", "")[:12]
        extra = " (uncommitted changes in src/)" if info.get("dirty") else ""
        if info.get("at_end"):
            end = info["at_end"]
            extra += (
                f"; WARNING: src/ changed during the run (at the end: {end['commit'][:12]}"
                + (", uncommitted changes" if end["dirty"] else "")
                + "); use --quicksave-ref to pin it"
            )
        shim = ", CPU shim" if info.get("cpu_shim") else ""
        lines.append(f"{LABEL[name]}: {where} {commit}{extra}{shim}; {info.get('module_file')}")
    s = report["settings"]
    lines.append(
        f"saves: 1 first + {s['saves']} timed per start, {s['rounds']} round(s) per "
        f"implementation, alternating; fsync {'off' if s['no_fsync'] else 'on'}; "
        f"thread_count=2; temp dir {s['tmpdir']}"
    )
    return "\n".join(lines)


def machine() -> str:
    mem = ""
    try:
        kib = int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemTotal")).split()[1])
        mem = f", {kib / (1 << 20):.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{platform.node()}: {os.cpu_count()} cores{mem}, {platform.platform()}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="ttf_", dir=args.tmpdir))
    _log(f"work directory: {tmp}")
    try:
        impls, settings = prepare(args, tmp)
        for impl in impls.values():
            _log(f"{LABEL[impl.name]}: {impl.info}")
            if impl.setup_error:
                _log(f"  {impl.setup_error}")
        torch_version = subprocess.run(
            [args.python, "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        configs = measure(args, impls, tmp)
        qs = impls.get("quicksave")
        if qs and qs.info["ref"] == "working tree":
            # Others may commit or edit while this runs: say so if src/ moved under us.
            end = _working_tree_state()
            if end != {k: qs.info[k] for k in end} or end["dirty"]:
                qs.info["at_end"] = end
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine() + f", torch {torch_version}, Python {platform.python_version()}",
        "implementations": {n: i.info for n, i in impls.items()},
        "settings": {
            **settings,
            "saves": args.saves,
            "rounds": args.rounds,
            "no_fsync": args.no_fsync,
            "world_sizes": args.world_sizes,
            "shapes": args.shapes,
            "tmpdir": str(tmp.parent),
        },
        "configs": configs,
        "work_dir": str(tmp) if args.keep else None,
    }
    print(render_header(report))
    print()
    print(render_markdown(report), end="")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(report), encoding="utf-8")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so that launch() kills the ranks it started


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time until finalized, NVRx's async_ckpt vs quicksave.compat.nvrx: the same "
        "user script with only the import switched, alternating, on 1 and 2 gloo ranks.",
    )
    p.add_argument("nvrx_root", nargs="?", help="an NVRx checkout or extract (not modified)")
    p.add_argument("--from-mirror", metavar="PATH", help="a git repository of NVRx")
    p.add_argument("--ref", default="v0.7.0-main", help="with --from-mirror (default %(default)s)")
    p.add_argument(
        "--quicksave-ref",
        metavar="REF",
        help="time quicksave's src/ at this git ref (default: the installed working tree)",
    )
    p.add_argument(
        "--impls",
        default="nvrx,quicksave",
        type=lambda s: [x for x in s.split(",") if x],
        help="which implementations, in the order they alternate (default %(default)s)",
    )
    p.add_argument(
        "--nvrx-cpu-shim",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run NVRx's CUDA calls on the CPU (default: on when torch.cuda.is_available() "
        "is False)",
    )
    p.add_argument(
        "--world-sizes",
        default="1,2",
        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        help="comma-separated (default %(default)s)",
    )
    p.add_argument(
        "--shapes",
        default="large,small",
        type=lambda s: [x for x in s.split(",") if x],
        help="per-rank state dicts: "
        + ", ".join(f"{k} = {v.label}" for k, v in SHAPES.items())
        + " (default %(default)s)",
    )
    p.add_argument("--saves", type=int, default=3, help="timed saves per start (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="starts per implementation (default 2)")
    p.add_argument("--no-fsync", action="store_true", help="sync_files=False for both")
    p.add_argument("--timeout", type=float, default=300, help="seconds per start (all ranks)")
    p.add_argument("--grace", type=float, default=30, help="seconds after a rank failed")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the tables as Markdown")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, results)")
    p.add_argument("--tmpdir", help="where the temp dir (and the checkpoints) go")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    args = p.parse_args(argv)
    if "nvrx" in args.impls and bool(args.nvrx_root) == bool(args.from_mirror):
        p.error("give exactly one of NVRX_ROOT or --from-mirror PATH")
    bad = [x for x in args.impls if x not in IMPLS] + [x for x in args.shapes if x not in SHAPES]
    if bad or not args.impls or not args.shapes:
        p.error(f"unknown --impls/--shapes: {bad}")
    if args.saves < 1 or args.rounds < 1 or not args.world_sizes or min(args.world_sizes) < 1:
        p.error("--saves, --rounds and --world-sizes need positive integers")
    return args


if __name__ == "__main__":
    sys.exit(main())
