"""``quicksave bench --recovery``: how fast a fresh job resumes a checkpointed state from
each tier, beside the raw floor of each tier, in one run.

Per shape (default: the training benchmark's ``mlp``, 1.6 GB with AdamW's state; see
:mod:`.shapes`), every measurement in a fresh process (:mod:`.recovery_child`):

1. one trainer trains a step and saves it with every method: quicksave to a local
   folder, to an ``s3://`` folder on a SeaweedFS the bench starts on loopback, and with
   the memory tier (then dies unclosed, as a crashed trainer); DCP and
   torch_checkpointing to local folders. Every state tensor's xxh3 digest is recorded.
2. the floors (:mod:`.recovery_floors`), ``repeats`` times each: memory (copy into a
   fresh job's destinations + one xxh3 pass), disk (4-thread ``pread`` from a cold page
   cache, and ``O_DIRECT``), peer (gloo send/recv between two processes on loopback),
   object store (8 parallel boto3 ranged GETs).
3. the restores, each method twice in fresh jobs: time to fully restored (checked
   bit-exact against the digests) and time to the first training step (the restore plus
   the first step's extra over a steady step, so that lazily read bytes count). Local
   folders are evicted from the page cache first (how: :data:`.recovery_state.COLD_CACHE`).
   The peer restore (``quicksave-peer``, :mod:`.recovery_peer`) runs two ranks as two
   nodes: they save with one peer replica each, node 1's memory is lost, and rank 1's
   restore (fetched from rank 0's replica) is the one measured, beside the peer floor.
4. the loop overhead, on each of ``--loop-shapes`` (default all three of
   :mod:`.shapes`): steps with the memory tier every step and every ``--every`` steps,
   against none and against the floor copy (memcpy + xxh3 of the state); in
   ``--loop-repeats`` rounds, each round one fresh process that runs every loop once
   (the order rotated round to round), the figures medians over the rounds.

A method or floor this installation cannot run (no memory tier yet, no ``weed`` binary,
no torch_checkpointing) is reported unavailable, not failed. The report is JSON
(``--json``) with a short table on stderr; the exit code is 1 if a restore failed or
was not bit-exact.

Example::

    quicksave bench --recovery --json > recovery.json
    quicksave bench --recovery --quick
    quicksave bench --recovery --shapes mlp,transformer --no-object-store
    quicksave bench --recovery --methods quicksave-peer --loop-shapes mlp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from quicksave_tools.bench.child import run_in_fresh_process
from quicksave_tools.bench.recovery_child import (
    CHILD,
    LOCAL,
    METHODS,
    QUICKSAVE_DISK,
    QUICKSAVE_DISK_WHOLE,
    QUICKSAVE_MEMORY,
    QUICKSAVE_OBJECT_STORE,
    QUICKSAVE_PEER,
)
from quicksave_tools.bench.recovery_peer import PEER_CHILD
from quicksave_tools.bench.recovery_report import format_table, summarize, summarize_loops
from quicksave_tools.bench.recovery_state import COLD_CACHE
from quicksave_tools.bench.shapes import DEFAULT_SHAPES, SHAPES


@dataclass(frozen=True)
class RecoveryBenchConfig:
    """What ``quicksave bench --recovery`` measures.

    Args:
        shapes: model shapes of :mod:`.shapes`.
        quick: their tiny sizes (a smoke run).
        methods: the restore methods (see :data:`~.recovery_child.METHODS`).
        repeats: fresh jobs per restore pass and method.
        loop_steps: timed steps per loop of the overhead part (0: no loops).
        every: the memory tier's sparser interval in the loop part.
        loop_shapes: the shapes the loop part runs on (each at its ``quick`` size).
        loop_repeats: rounds of the loop part per shape (each round runs every loop
            once, in a rotated order; the figures are medians over the rounds).
        object_store: start SeaweedFS and measure the object store (unavailable if no
            ``weed`` binary).
        directory: where the folders go (default: the temp dir; a disk, not tmpfs).
        threads: ``torch.set_num_threads`` of every process.
        seed: seed of the saved model.
        timeout_s: a fresh process that runs longer is stopped, reported failed.
    """

    shapes: tuple[str, ...] = ("mlp",)
    quick: bool = False
    methods: tuple[str, ...] = METHODS
    repeats: int = 1
    loop_steps: int = 10
    every: int = 5
    loop_shapes: tuple[str, ...] = DEFAULT_SHAPES
    loop_repeats: int = 3
    object_store: bool = True
    directory: str | None = None
    threads: int = 2
    seed: int = 0
    timeout_s: float = 600.0


def check_config(config: RecoveryBenchConfig) -> None:
    unknown = [s for s in (*config.shapes, *config.loop_shapes) if s not in SHAPES]
    if unknown or not config.shapes:
        raise ValueError(f"unknown shape {unknown}; known: {', '.join(SHAPES)}")
    own = [s for s in (*config.shapes, *config.loop_shapes) if SHAPES[s].optimizer is not None]
    if own:  # (its trainer is AdamW's, whose state the first step creates)
        raise ValueError(f"shape(s) {', '.join(own)} train with an optimizer other than AdamW")
    if not config.methods or any(m not in METHODS for m in config.methods):
        raise ValueError(f"methods must be some of {', '.join(METHODS)}")
    if min(config.repeats, config.loop_repeats, config.threads) < 1 or config.every < 2:
        raise ValueError("repeats, loop repeats and threads must be at least 1, every at least 2")
    if config.loop_steps < 0:
        raise ValueError("loop steps must be at least 0")


@dataclass(frozen=True)
class _Store:
    """The object store of a run: the S3 target and its bucket, or why there is none."""

    target: Any = None
    bucket: str | None = None
    why: str | None = None


@contextlib.contextmanager
def _object_store(enabled: bool) -> Iterator[_Store]:
    """A fresh bucket on a SeaweedFS started here and stopped when the block ends, or
    why there is none."""
    if not enabled:
        yield _Store(why="not asked for (--no-object-store)")
        return
    try:
        from quicksave_tools.testing.seaweed import SeaweedServer
        from quicksave_tools.testing.seaweed_process import find_weed

        find_weed()
    except Exception as e:  # noqa: BLE001 - no weed binary, no boto3: unavailable
        yield _Store(why=f"no S3 test server: {type(e).__name__}: {e}")
        return
    from quicksave_tools.bench.storage.target import Target, sigterm_as_interrupt

    server = SeaweedServer(nice=19)  # a stand-in for a remote store: not the trainer's CPUs
    try:
        with sigterm_as_interrupt():
            try:
                server.start()
            except Exception as e:  # noqa: BLE001
                yield _Store(why=f"the S3 test server did not start: {e}")
                return
            target = Target.from_server(server, kind="SeaweedFS on loopback")
            yield _Store(target, server.create_bucket(f"qs-recovery-{uuid.uuid4().hex[:12]}"))
    finally:
        server.stop()


class _Run:
    """One shape's processes: specs in ``work``, the children's environment."""

    def __init__(self, config: RecoveryBenchConfig, shape: str, work: str, store: _Store) -> None:
        self.config, self.shape, self.work, self.store = config, shape, work, store
        target = self.target = store.target
        self.count = 0
        self.env = {**os.environ, **(target.env() if target is not None else {})}
        self.locations = {m: os.path.join(work, m) for m in METHODS}
        self.locations[QUICKSAVE_DISK_WHOLE] = self.locations[QUICKSAVE_DISK]
        if target is not None:
            self.locations[QUICKSAVE_OBJECT_STORE] = f"s3://{store.bucket}/{shape}"

    def spec(self, kind: str, **more: Any) -> dict[str, Any]:
        spec = {
            "kind": kind,
            "shape": self.shape,
            "quick": self.config.quick,
            "seed": self.config.seed,
            "threads": self.config.threads,
            "work": self.work,
            "locations": self.locations,
            **more,
        }
        if self.target is not None:
            spec.update(endpoint_url=self.target.endpoint_url, region=self.target.region)
        return spec

    def child(self, spec: dict[str, Any], entry: str = CHILD, **env: str) -> dict[str, Any]:
        """Run ``spec`` in a fresh process (``entry``: its ``python -c`` code; ``env``:
        more environment variables)."""
        self.count += 1
        spec["result"] = os.path.join(self.work, f"{self.count:03d}-result.json")
        path = os.path.join(self.work, f"{self.count:03d}-spec.json")
        t0 = time.perf_counter()
        env = {**self.env, **env}
        result = run_in_fresh_process(entry, spec, path, self.config.timeout_s, env)
        result["process_s"] = time.perf_counter() - t0  # the whole process, start to end
        return result

    def pair(self, specs: list[dict[str, Any]], entry: str = CHILD) -> list[dict[str, Any]]:
        """Two ranks' specs run side by side in fresh processes (gloo on loopback); their
        results, by rank."""
        loopback = {"GLOO_SOCKET_IFNAME": "lo"} if os.path.isdir("/sys/class/net/lo") else {}
        results: list[dict[str, Any]] = [{}, {}]

        def go(rank: int) -> None:
            results[rank] = self.child(specs[rank], entry, **loopback)

        threads = [threading.Thread(target=go, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def _floors(run: _Run) -> dict[str, Any]:
    """Every floor ``repeats`` times; each figure the median of its runs (``runs``: all)."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else run.work
    disk = run.locations[QUICKSAVE_DISK]
    if not os.path.isdir(disk):
        disk = None  # not saved: no files to read
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "disk": [], "peer": []}
    runs["object_store"] = []
    for _ in range(run.config.repeats):
        runs["memory"].append(run.child(run.spec("floor", floor="memory", shm=shm)))
        if disk is not None:
            runs["disk"].append(run.child(run.spec("floor", floor="disk", folder=disk)))
        runs["peer"].append(_peer_floor(run))
        if run.target is not None:
            prefix = f"{run.shape}/step-"
            spec = run.spec("floor", floor="object_store", bucket=run.store.bucket, prefix=prefix)
            runs["object_store"].append(run.child(spec))
    out = {name: _medians(rows) for name, rows in runs.items() if rows}
    if disk is None:
        out["disk"] = {"unavailable": f"no {QUICKSAVE_DISK} checkpoint to read"}
    if run.target is None:
        out["object_store"] = {"unavailable": run.store.why}
    return out


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One floor's runs as one row: a failure if any, else each number's median."""
    for row in rows:
        if "failed" in row or "unavailable" in row:
            return row
    out: dict[str, Any] = {**rows[0], "runs": rows}
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows if key in r)
    return out


def _peer_floor(run: _Run) -> dict[str, Any]:
    """The two ranks of the peer floor, side by side; the receiver's result."""
    store = os.path.join(run.work, f"peer-{uuid.uuid4().hex[:8]}.store")
    results = run.pair([run.spec("floor", floor="peer", rank=r, store=store) for r in (0, 1)])
    if "failed" in results[0] and "failed" not in results[1]:
        return {"failed": f"sender: {results[0]['failed']}"}
    return {**results[1], "backend": "gloo", "transport": "loopback TCP"}


def _restores(run: _Run, methods: list[str], expected: dict[str, str]) -> dict[str, list]:
    out: dict[str, list] = {m: [] for m in methods}
    passes = _passes(run.config)
    memory_jobs = len(passes)
    for i, p in enumerate(passes):
        for method in methods:
            crash = method == QUICKSAVE_MEMORY and i < memory_jobs - 1
            spec = run.spec("restore", method=method, expected=expected, crash=crash)
            spec["pass"] = p
            out[method].append(run.child(spec))
    return out


def _passes(config: RecoveryBenchConfig) -> list[str]:
    return [p for _ in range(config.repeats) for p in ("full", "first_step")]


def _kill_agents(base: str) -> None:
    """SIGKILL the node-memory agents the bench's trainers started under ``base`` (each
    named by its ``agent.json``; a pid no longer running quicksave's agent is left)."""
    for root, _, names in os.walk(base):
        if "agent.json" not in names:
            continue
        try:
            with open(os.path.join(root, "agent.json")) as f:
                pid = int(json.load(f)["pid"])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"quicksave.tiers.agent" not in f.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError, TypeError):
            continue


def _lose_node(base: str, node: int) -> str:
    """Node ``node`` is lost: its agent killed, its memory removed; the replacement comes
    with an empty memory root (returned)."""
    root = os.path.join(base, f"node-{node}")
    _kill_agents(root)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    return root


def _peer_restores(run: _Run) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``quicksave-peer`` method (:mod:`.recovery_peer`): its save's row and rank 1's
    restores, each after node 1's memory was lost. The nodes' memory roots lie in a
    folder of ``/dev/shm`` removed at the end, their agents killed."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else run.work
    base = tempfile.mkdtemp(prefix="qs-recovery-peer-", dir=shm)
    common = {
        "node_roots": [_lose_node(base, n) for n in (0, 1)],
        "job_id": f"bench-peer-{uuid.uuid4().hex[:12]}",
        "folder": os.path.join(run.work, QUICKSAVE_PEER),
        "idle_timeout_s": run.config.timeout_s * 2,
        "timeout_s": run.config.timeout_s,
    }

    def both(kind: str, **more: Any) -> list[dict[str, Any]]:
        store = os.path.join(run.work, f"peer-{uuid.uuid4().hex[:8]}.store")
        specs = [run.spec(kind, rank=r, store=store, **common, **more) for r in (0, 1)]
        return run.pair(specs, PEER_CHILD)

    try:
        saves = both("peer_save")
        why = next((r for r in saves if "failed" in r or "unavailable" in r), None)
        if why is not None:
            return why, [why]
        sender, receiver = saves
        row = {
            "seconds": max(r["seconds"] for r in saves),
            "state_bytes": receiver["bytes"],
            "snapshot_bytes": receiver["snapshot_bytes"],
            "replica_sent_bytes": sum(e["sent"] for e in receiver["replicated"]),
            "held_by_rank_0": sender["held"],
            "holder_state_bytes": sender["bytes"],
        }
        rows = []
        for p in _passes(run.config):
            _lose_node(base, 1)
            spec = {"method": QUICKSAVE_PEER, "expected": receiver["digests"], "pass": p}
            rank0, rank1 = both("peer_restore", **spec)
            if "failed" in rank0 and "failed" not in rank1:
                rank1 = {"failed": f"rank 0: {rank0['failed']}"}
            rows.append({**rank1, "rank_0_tier": rank0.get("tier")})
        return row, rows
    finally:
        _kill_agents(base)
        shutil.rmtree(base, ignore_errors=True)


def _loop_variants(every: int) -> list[tuple[str, str, int]]:
    """The loops of one round: (name, variant, interval)."""
    out = [("none", "none", 1)]
    for n in (1, every):
        out += [(f"{v}-every-{n}", v, n) for v in ("floor", "memory")]
    return out


def _shape_loops(run: _Run) -> dict[str, Any]:
    """One shape's loops: ``loop_repeats`` rounds, each every loop once in one fresh
    process, the order rotated by one each round (no loop always runs after another)."""
    variants = _loop_variants(run.config.every)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    rounds: list[dict[str, Any]] = []
    for i in range(run.config.loop_repeats):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        spec = run.spec("loops", variants=order, steps=run.config.loop_steps, round=i)
        result = run.child(spec)
        if "unavailable" in result:  # no memory tier: nothing to hold the floor against
            return {"runs": runs, "unavailable": result["unavailable"]}
        rounds.append({"order": [name for name, _, _ in order], "process_s": result["process_s"]})
        for name, _, _ in variants:
            runs[name].append(result.get("runs", {}).get(name, {"failed": result.get("failed")}))
    return {"runs": runs, "rounds": rounds}


def _loops(config: RecoveryBenchConfig, store: _Store) -> dict[str, Any]:
    """The loop part (module doc) on each of ``config.loop_shapes``; {} if no steps."""
    if config.loop_steps == 0:
        return {}
    out: dict[str, Any] = {"steps": config.loop_steps, "every": config.every,
                           "repeats": config.loop_repeats, "shapes": {}}  # fmt: skip
    for shape in config.loop_shapes:
        work = tempfile.mkdtemp(prefix=f"qs-recovery-loop-{shape}-", dir=config.directory)
        try:
            out["shapes"][shape] = _shape_loops(_Run(config, shape, work, store))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _one_shape(config: RecoveryBenchConfig, shape: str, store: _Store) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix=f"qs-recovery-{shape}-", dir=config.directory)
    try:
        run = _Run(config, shape, work, store)
        methods = [m for m in config.methods if store.target or m != QUICKSAVE_OBJECT_STORE]
        methods = [m for m in methods if m != QUICKSAVE_PEER]  # two ranks: its own part
        save_order = sorted(methods, key=lambda m: m == QUICKSAVE_MEMORY)  # memory last
        saved = run.child(run.spec("save", methods=save_order))
        if "failed" in saved:
            return {"shape": shape, "failed": f"save: {saved['failed']}"}
        expected = saved.pop("digests")
        runnable = [m for m in methods if "seconds" in saved["saves"].get(m, {})]
        restores = _restores(run, runnable, expected)
        for m in methods:
            if m not in runnable:
                restores[m] = [saved["saves"].get(m, {"unavailable": "not saved"})]
        if store.target is None and QUICKSAVE_OBJECT_STORE in config.methods:
            restores[QUICKSAVE_OBJECT_STORE] = [{"unavailable": store.why}]
        if QUICKSAVE_PEER in config.methods:
            saved["saves"][QUICKSAVE_PEER], restores[QUICKSAVE_PEER] = _peer_restores(run)
        return summarize(shape, saved, _floors(run), restores)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_recovery_benchmark(config: RecoveryBenchConfig) -> dict[str, Any]:
    """Every shape of ``config``; the report (see the module doc)."""
    check_config(config)
    import torch

    with _object_store(config.object_store) as store:
        shapes = [_one_shape(config, s, store) for s in config.shapes]
    loops = summarize_loops(_loops(config, _Store(why="the loop part saves to memory")))
    return {
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "torch": torch.__version__,
        "quick": config.quick,
        "local_methods": list(LOCAL),
        "object_store": store.target.kind if store.target else f"unavailable: {store.why}",
        "cold_cache": COLD_CACHE,
        "shapes": shapes,
        "loop": loops,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicksave bench --recovery``; 0, 2 on bad arguments, 1 if a
    restore failed or was not bit-exact."""
    p = argparse.ArgumentParser(
        prog="quicksave bench --recovery", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shapes", default="mlp", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated restores")
    p.add_argument("--repeats", type=int, default=1, help="fresh jobs per restore and pass")
    p.add_argument("--loop-steps", type=int, default=10, help="timed steps per loop (0: none)")
    p.add_argument("--every", type=int, default=5, help="the memory tier's sparser interval")
    p.add_argument("--loop-shapes", default=",".join(DEFAULT_SHAPES), help="the loop part's shapes")
    p.add_argument("--loop-repeats", type=int, default=None,
                   help="rounds of the loop part (default 3; 1 with --quick)")  # fmt: skip
    p.add_argument("--no-object-store", action="store_true", help="skip SeaweedFS")
    p.add_argument("--dir", default=None, help="folder to write in (default: the temp dir)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    config = RecoveryBenchConfig(
        shapes=tuple(s for s in args.shapes.split(",") if s),
        quick=args.quick,
        methods=tuple(m for m in args.methods.split(",") if m),
        repeats=args.repeats,
        loop_steps=args.loop_steps,
        every=args.every,
        loop_shapes=tuple(s for s in args.loop_shapes.split(",") if s),
        loop_repeats=(1 if args.quick else 3) if args.loop_repeats is None else args.loop_repeats,
        object_store=not args.no_object_store,
        directory=args.dir,
        threads=args.threads,
    )
    try:
        report = run_recovery_benchmark(config)
    except ValueError as e:
        print(f"quicksave bench --recovery: {e}", file=sys.stderr)
        return 2
    print(format_table(report), file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    failed = any(s.get("failed") or s.get("problems") for s in report["shapes"])
    return 1 if failed or report["loop"].get("problems") else 0
