"""``quicksave bench --coordination``: what one multi-rank save costs the job in
coordination (planning collectives + commit), over real gloo ranks on this host,
quicksave's ``CheckpointManager`` vs stock ``torch.distributed.checkpoint.async_save``.

Every rank holds the same small replicated state (``tensors`` fp32 tensors of
``tensor_kib`` KiB each), so the bytes written are negligible and what is left is
coordination. For each world size the job runs, on every rank::

    quicksave: CheckpointManager(async_mode="thread", staging="blocking", thread_count=1)
               for step in 1..saves: barrier; save(step) [block]; poll for
               step-<N>/manifest.json [save → committed]
    DCP:       for i in 1..saves: barrier; async_save(..., FileSystemWriter, own gloo
               group) [block]; future.result() [save → committed: .metadata written]

The barrier before each save is not timed; it lines the ranks up so that no rank's
block time includes waiting for a slower peer's previous save. The first save (cold:
quicksave plans globally, DCP builds its planner) is reported apart from the steady
saves 2..N (median). Each number is the slowest rank's (the job waits for it).
quicksave's ``write_s`` (one rank writing its own data files, from ``manager.metrics``)
is reported beside it, so ``committed - write`` estimates the coordination alone.

Processes: one zygote interpreter imports torch once and forks the ranks, which meet
through a ``FileStore`` in a temporary directory (no port to race for); the whole group
is killed after ``timeout_s``.

Example::

    quicksave bench --coordination --ranks 2,4,8 --saves 5 --tensors 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

POLL_S = 0.001  # manifest polling period; bounds the error of "save → committed"
METHODS = ("quicksave", "dcp")


@dataclass(frozen=True)
class CoordinationBenchConfig:
    """Args: ranks: world sizes to run; saves: saves per method and world size (>= 2);
    tensors / tensor_kib: the replicated state of every rank; dir: where checkpoints and
    the rendezvous go (default: a temporary directory, removed after); timeout_s: hard
    limit per world size (everything is killed after it)."""

    ranks: tuple[int, ...] = (2, 4, 8)
    saves: int = 5
    tensors: int = 200
    tensor_kib: int = 4
    dir: str | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.ranks or any(r < 2 for r in self.ranks):
            raise ValueError(f"--ranks must list world sizes >= 2, got {self.ranks}")
        if self.saves < 2:
            raise ValueError(f"--saves must be >= 2 (first save + steady ones), got {self.saves}")
        if self.tensors < 1 or self.tensor_kib < 1:
            raise ValueError("--tensors and --tensor-kib must be >= 1")


# ---------------------------------------------------------------------- rank side
class _Tensors:
    """The benchmark's state: a plain dict of tensors behind ``state_dict()``."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors.update(state)


def _make_state(tensors: int, tensor_kib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)  # same values on every rank: replicated
    n = tensor_kib * 1024 // 4
    return {f"t{i:04d}": torch.randn(n, generator=g) for i in range(tensors)}


def _run_quicksave(root: str, state: dict[str, Any], saves: int) -> dict[str, Any]:
    import torch.distributed as dist

    from quicksave.manager import CheckpointConfig, CheckpointManager

    config = CheckpointConfig(
        folder=os.path.join(root, "quicksave"),
        interval=1,
        async_mode="thread",
        staging="blocking",  # like DCP's default stager: copy before returning
        thread_count=1,  # like FileSystemWriter's default: one data file per rank
    )
    manager = CheckpointManager(config, {"bench": _Tensors(state)})
    block, committed = [], []
    try:
        for step in range(1, saves + 1):
            dist.barrier()
            manifest = os.path.join(manager.step_path(step), "manifest.json")
            t0 = time.perf_counter()
            manager.save(step)
            t1 = time.perf_counter()
            while not os.path.exists(manifest):
                time.sleep(POLL_S)
            t2 = time.perf_counter()
            block.append(t1 - t0)
            committed.append(t2 - t0)
    finally:
        manager.close()
    records = [r for r in manager.metrics if r.kind == "full"]
    return {
        "block_s": block,
        "committed_s": committed,
        "write_s": [r.write_s for r in records],
        "commit_s": [r.commit_s for r in records],
        "all_committed": len(records) == saves
        and all(r.status == "committed" for r in records)
        and manager.committed_steps() == list(range(1, saves + 1)),
    }


def _run_dcp(root: str, state: dict[str, Any], saves: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.new_group(backend="gloo")  # DCP's advice for async_save: its own group
    block, committed, ok = [], [], True
    for i in range(1, saves + 1):
        dist.barrier()
        path = os.path.join(root, "dcp", f"step-{i}")
        t0 = time.perf_counter()
        response = dcp.async_save(state, checkpoint_id=path, process_group=group)
        t1 = time.perf_counter()
        future = getattr(response, "upload_completion", response)
        future.result()
        t2 = time.perf_counter()
        block.append(t1 - t0)
        committed.append(t2 - t0)
        ok = ok and os.path.exists(os.path.join(path, ".metadata"))
    return {"block_s": block, "committed_s": committed, "all_committed": ok}


def _rank_main(spec: dict[str, Any], rank: int) -> None:
    """Body of one forked rank: join the group, run both methods, write the result."""
    import datetime

    import torch.distributed as dist

    result_path = os.path.join(spec["work"], f"result-{rank}.json")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(spec['work'], 'store')}",
            rank=rank,
            world_size=spec["world_size"],
            timeout=datetime.timedelta(seconds=spec["timeout_s"]),
        )
        state = _make_state(spec["tensors"], spec["tensor_kib"])
        result: dict[str, Any] = {"ok": True}
        result["quicksave"] = _run_quicksave(spec["root"], state, spec["saves"])
        result["dcp"] = _run_dcp(spec["root"], state, spec["saves"])
        dist.barrier()
    except BaseException:
        result = {"ok": False, "traceback": traceback.format_exc()}
    with open(result_path + ".part", "w") as f:
        json.dump(result, f)
    os.rename(result_path + ".part", result_path)
    if result["ok"]:
        dist.destroy_process_group()


def _zygote_main(spec_file: str) -> int:
    """Import torch once, then fork one process per rank and wait for them."""
    with open(spec_file) as f:
        spec = json.load(f)
    import torch.distributed.checkpoint  # noqa: F401  (paid once, before the fork)

    from quicksave import manager  # noqa: F401

    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(spec["world_size"]):
        pid = os.fork()
        if pid == 0:
            log = os.open(
                os.path.join(spec["work"], f"log-{rank}.txt"),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                0o644,
            )
            os.dup2(log, 1)
            os.dup2(log, 2)
            try:
                _rank_main(spec, rank)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return 0


# ---------------------------------------------------------------------- driver side
def _run_world(config: CoordinationBenchConfig, world_size: int, base: str) -> list[dict]:
    """Run one world size; returns every rank's raw result. Raises RuntimeError if a
    rank failed or the group ran past ``timeout_s``."""
    work = os.path.join(base, f"world-{world_size}")
    os.makedirs(work)
    spec = {
        "world_size": world_size,
        "work": work,
        "root": os.path.join(work, "ckpt"),
        "saves": config.saves,
        "tensors": config.tensors,
        "tensor_kib": config.tensor_kib,
        "timeout_s": config.timeout_s,
    }
    spec_file = os.path.join(work, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on a few cores: no oversubscription
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "quicksave_tools.bench.coordination", spec_file],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # the zygote and its ranks: one process group to kill
    )
    timed_out = False
    try:
        proc.wait(timeout=config.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # no rank outlives the run
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    results, problems = [], []
    for rank in range(world_size):
        try:
            with open(os.path.join(work, f"result-{rank}.json")) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"ok": False, "traceback": "no result" + (" (timed out)" if timed_out else "")}
        if not res["ok"]:
            problems.append(f"rank {rank}: {res['traceback']}")
        results.append(res)
    if problems:
        raise RuntimeError(f"{world_size} ranks: " + "\n".join(problems))
    return results


def _summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Slowest rank's first save and median of saves 2..N, per measured quantity."""

    def worst(key: str, first: bool) -> float | None:
        values = []
        for r in per_rank:
            series = [v for v in r.get(key, []) if v is not None]
            if len(series) < 2:
                return None
            values.append(series[0] if first else statistics.median(series[1:]))
        return max(values)

    out: dict[str, Any] = {
        "first_block_s": worst("block_s", True),
        "steady_block_s": worst("block_s", False),
        "first_committed_s": worst("committed_s", True),
        "steady_committed_s": worst("committed_s", False),
        "all_committed": all(r["all_committed"] for r in per_rank),
    }
    if "write_s" in per_rank[0]:
        out["steady_write_s"] = worst("write_s", False)
        out["steady_commit_s"] = worst("commit_s", False)
        if out["steady_write_s"] is not None:
            out["steady_coordination_est_s"] = out["steady_committed_s"] - out["steady_write_s"]
    return out


def run_coordination_benchmark(config: CoordinationBenchConfig) -> dict[str, Any]:
    """Run every world size of ``config`` and return the report (JSON-ready).

    Returns:
        ``{"config", "runs": [{"world_size", "quicksave": summary, "dcp": summary,
        "per_rank": {method: [raw per-rank series]}}], "notes"}``.

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or timed out.

    Example::

        report = run_coordination_benchmark(CoordinationBenchConfig(ranks=(2,), saves=3))
    """
    base = tempfile.mkdtemp(prefix="quicksave-coord-", dir=config.dir)
    runs = []
    try:
        for world_size in config.ranks:
            results = _run_world(config, world_size, base)
            run: dict[str, Any] = {"world_size": world_size, "per_rank": {}}
            for method in METHODS:
                per_rank = [r[method] for r in results]
                run[method] = _summary(per_rank)
                run["per_rank"][method] = per_rank
            runs.append(run)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cfg = asdict(config)
    cfg["ranks"] = list(config.ranks)
    return {
        "config": cfg,
        "state_bytes": config.tensors * config.tensor_kib * 1024,
        "runs": runs,
        "notes": [
            "times are the slowest rank's; steady = median of saves 2..N",
            "block: time save()/async_save() held the caller (quicksave: planning "
            "collective + staging copy; DCP: staging copy only, its collectives run in "
            "the background thread)",
            "committed: from the call until the checkpoint is committed (quicksave: "
            f"manifest.json seen, polled every {POLL_S * 1000:g} ms; DCP: future done)",
            "quicksave write_s: the worker writing this rank's data files; commit_s: from its "
            "files written to the commit (rank 0: waits for every rank's record, merges the "
            "parts, writes the manifest, renames; the others: wait for rank 0's record); "
            "coordination_est = committed - write",
            f"{os.cpu_count()} CPU cores shared by every rank and its writer thread: with "
            "more ranks than cores they compete for CPU, which inflates every number",
        ],
    }


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def format_coordination_report(report: dict[str, Any]) -> str:
    """The report as a Markdown table (one row per world size and method)."""
    c = report["config"]
    lines = [
        f"{c['tensors']} replicated tensors of {c['tensor_kib']} KiB per rank, "
        f"{c['saves']} saves per method",
        "",
        "| ranks | method | first block | steady block | first committed "
        "| steady committed | steady write | committed - write | all committed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        for method in METHODS:
            s = run[method]
            lines.append(
                f"| {run['world_size']} | {method} | {_ms(s['first_block_s'])} "
                f"| {_ms(s['steady_block_s'])} | {_ms(s['first_committed_s'])} "
                f"| {_ms(s['steady_committed_s'])} | {_ms(s.get('steady_write_s'))} "
                f"| {_ms(s.get('steady_coordination_est_s'))} | {s['all_committed']} |"
            )
    lines += ["", *(f"- {n}" for n in report["notes"])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quicksave bench --coordination",
        description="Per-save coordination cost over real gloo ranks: quicksave vs "
        "torch.distributed.checkpoint.async_save.",
    )
    p.add_argument("--ranks", default="2,4,8", help="world sizes, comma-separated (2,4,8)")
    p.add_argument("--saves", type=int, default=5, help="saves per method (default 5)")
    p.add_argument("--tensors", type=int, default=200, help="tensors per rank (default 200)")
    p.add_argument("--tensor-kib", type=int, default=4, help="KiB per tensor (default 4)")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per world size")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --coordination``.

    Returns:
        0 on success, 2 on bad arguments, 1 if a rank failed or a save did not commit.

    Example::

        quicksave bench --coordination --ranks 2,4,8 --saves 5 --tensors 200 --json
    """
    args = build_parser().parse_args(argv)
    try:
        ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
        config = CoordinationBenchConfig(
            ranks, args.saves, args.tensors, args.tensor_kib, args.dir, args.timeout
        )
    except ValueError as e:
        print(f"quicksave bench --coordination: {e}", file=sys.stderr)
        return 2
    try:
        report = run_coordination_benchmark(config)
    except RuntimeError as e:
        print(f"quicksave bench --coordination: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_coordination_report(report))
    committed = all(run[m]["all_committed"] for run in report["runs"] for m in METHODS)
    return 0 if committed else 1


if __name__ == "__main__":
    sys.exit(_zygote_main(sys.argv[1]))
