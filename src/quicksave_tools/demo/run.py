"""``quicksave demo``: kill a training run with SIGKILL, resume it, prove nothing was lost.

Three child processes train the same tiny language model (:mod:`quicksave_tools.demo.train`):

1. **reference** — all ``--steps`` without checkpoints, never interrupted;
2. **interrupted** — checkpoints every ``--interval`` steps through the
   ``CheckpointManager``; at ``--kill-at`` it reports in and the parent kills it with
   SIGKILL (no clean-up of any kind runs). If a checkpoint is due at that very step, the
   kill lands while it is being written;
3. **resumed** — a fresh process on the same folder: ``manager.load()`` restores the newest
   *committed* checkpoint (anything half-written is invisible) and training runs to the end.

The resumed run must end bit-identical to the reference: same loss at every step (``==``),
same parameter and optimizer-state hashes. Exit status 0 iff it does.

Folder layout: ``checkpoints/`` (the manager's folder), ``<run>.json`` (each child's
results and checkpoint metrics), ``<run>.log`` (each child's stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

from quicksave.commit import CheckpointKind, classify, is_temp_name
from quicksave.storage import local_path
from quicksave_tools.demo.config import DemoConfig
from quicksave_tools.demo.report import list_checkpoints, summarize
from quicksave_tools.demo.train import DEFAULT_ASYNC_MODE


def default_kill_at(steps: int, interval: int) -> int:
    """Half an interval after the checkpoint nearest the middle of the run.

    Example:
        >>> default_kill_at(120, 20)
        70
    """
    k = max(1, (steps // 2) // interval) * interval + max(1, interval // 2)
    return min(k, steps - 1)


def parse_args(argv: list[str] | None = None) -> DemoConfig:
    """Command line of ``quicksave demo`` → :class:`DemoConfig` (exits 2 on bad values)."""
    p = argparse.ArgumentParser(
        prog="quicksave demo",
        description="Train a tiny language model, kill it with SIGKILL mid-run, resume it "
        "from its last committed checkpoint and check that it ends bit-identical to an "
        "uninterrupted run.",
    )
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--interval", type=int, default=20, help="checkpoint every N steps (20)")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="step at which the run is killed (default: mid-run, between two checkpoints; "
        "a multiple of --interval kills it while that step's checkpoint is being written)",
    )
    p.add_argument(
        "--folder",
        default=None,
        help="work folder (default: a fresh temp folder, deleted afterwards)",
    )
    p.add_argument("--keep", type=int, default=0, help="keep the newest K checkpoints (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per training process")
    p.add_argument("--async-mode", default=DEFAULT_ASYNC_MODE, help="the manager's async_mode")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    if not 1 <= a.interval < a.steps:
        p.error("--interval must be at least 1 and smaller than --steps")
    kill_at = default_kill_at(a.steps, a.interval) if a.kill_at is None else a.kill_at
    if not a.interval < kill_at < a.steps:
        p.error(
            f"--kill-at must be after the first checkpoint and before the end "
            f"({a.interval} < kill-at < {a.steps}), got {kill_at}"
        )
    if a.keep < 0 or a.threads < 1:
        p.error("--keep must be >= 0 and --threads >= 1")
    folder = a.folder or tempfile.mkdtemp(prefix="quicksave-demo-")
    return DemoConfig(
        steps=a.steps,
        interval=a.interval,
        kill_at=kill_at,
        folder=local_path(folder, what="demo folder"),  # 's3:/x' is no local folder
        keep=a.keep,
        seed=a.seed,
        threads=a.threads,
        async_mode=a.async_mode,
        timeout_s=a.timeout,
        keep_folder=a.folder is not None,
    )


class DemoError(Exception):
    """A step of the demo could not run (a child failed, timed out, or wrote no result)."""


# ------------------------------------------------------------------ children


def _child_env() -> dict[str, str]:
    # The child must import this very quicksave, even when it is not installed.
    import quicksave

    src = os.path.dirname(os.path.dirname(os.path.abspath(quicksave.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _child_args(cfg: DemoConfig, run: str) -> list[str]:
    args = [
        sys.executable, "-m", "quicksave_tools.demo.train",
        "--steps", str(cfg.steps),
        "--seed", str(cfg.seed),
        "--threads", str(cfg.threads),
        "--json", os.path.join(cfg.folder, f"{run}.json"),
    ]  # fmt: skip
    if run != "reference":
        args += [
            "--folder", os.path.join(cfg.folder, "checkpoints"),
            "--interval", str(cfg.interval),
            "--keep", str(cfg.keep),
            "--async-mode", cfg.async_mode,
        ]  # fmt: skip
    if run == "interrupted":
        args += ["--hold-at", str(cfg.kill_at)]
    if run == "resumed":
        args += ["--resume"]
    return args


def _start(
    cfg: DemoConfig, run: str, log: TextIO, live: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    # A session (process group) of its own, so that the kill takes the trainer together
    # with any worker process it started, as a machine crash would.
    proc = subprocess.Popen(
        _child_args(cfg, run),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=_child_env(),
        start_new_session=True,
    )
    live.append(proc)
    return proc


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's process group (the child and anything it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group has already exited


def _log_tail(cfg: DemoConfig, run: str, lines: int = 15) -> str:
    try:
        with open(os.path.join(cfg.folder, f"{run}.log"), encoding="utf-8") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _watch(
    cfg: DemoConfig, run: str, proc: subprocess.Popen[str], out: TextIO, stop_tag: str | None
) -> int | None:
    """Relay the child's progress; return the step of ``stop_tag`` once seen (the child is
    still alive then), or None when the child's output ended."""
    assert proc.stdout is not None
    for line in proc.stdout:
        tag, _, value = line.strip().partition(" ")
        if tag == "@@step" and int(value) % cfg.interval == 0:
            print(f"  [{run:>11}] step {int(value):>5}/{cfg.steps}", file=out, flush=True)
        elif stop_tag is not None and tag == f"@@{stop_tag}":
            return int(value)
    return None


def _finish(cfg: DemoConfig, run: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    rc = proc.wait()
    if rc != 0:
        raise DemoError(
            f"the {run} run failed (exit status {rc}; -9 after --timeout "
            f"{cfg.timeout_s:g} s):\n{_log_tail(cfg, run)}"
        )
    return _read_result(cfg, run)


def _read_result(cfg: DemoConfig, run: str) -> dict[str, Any]:
    path = os.path.join(cfg.folder, f"{run}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DemoError(f"the {run} run left no readable result at {path}: {e}") from e


def _with_timeout(cfg: DemoConfig, proc: subprocess.Popen[str]) -> threading.Timer:
    timer = threading.Timer(cfg.timeout_s, _kill_group, args=(proc,))
    timer.daemon = True
    timer.start()
    return timer


def _run_to_end(
    cfg: DemoConfig, run: str, out: TextIO, live: list[subprocess.Popen[str]]
) -> dict[str, Any]:
    with open(os.path.join(cfg.folder, f"{run}.log"), "w", encoding="utf-8") as log:
        proc = _start(cfg, run, log, live)
        timer = _with_timeout(cfg, proc)
        try:
            _watch(cfg, run, proc, out, None)
            return _finish(cfg, run, proc)
        finally:
            timer.cancel()
            _kill_group(proc)


def _committed(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(
        n
        for n in os.listdir(folder)
        if n.startswith("step-") and classify(os.path.join(folder, n)) is CheckpointKind.QUICKSAVE
    )


def _leftovers(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if is_temp_name(n))


def _run_and_kill(
    cfg: DemoConfig, out: TextIO, live: list[subprocess.Popen[str]]
) -> dict[str, Any]:
    """Run the interrupted child, SIGKILL it at ``kill_at``; return its last result plus
    what the kill left on disk."""
    ckpt = os.path.join(cfg.folder, "checkpoints")
    with open(os.path.join(cfg.folder, "interrupted.log"), "w", encoding="utf-8") as log:
        proc = _start(cfg, "interrupted", log, live)
        timer = _with_timeout(cfg, proc)
        try:
            held = _watch(cfg, "interrupted", proc, out, "hold")
            if held is None:
                proc.wait()
                raise DemoError(
                    f"the interrupted run ended (exit status {proc.returncode}) before step "
                    f"{cfg.kill_at}:\n{_log_tail(cfg, 'interrupted')}"
                )
            # The child is now in (or past) this step's checkpoint call. Kill only once
            # there is something to resume from, or the demo would prove nothing.
            deadline = time.monotonic() + cfg.timeout_s
            while not _committed(ckpt) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
            if held % cfg.interval == 0:
                # A checkpoint is due at this step: aim the kill at its write, once its
                # temporary directory exists (briefly; the save may also be done already).
                aim = time.monotonic() + 5.0
                while not _leftovers(ckpt) and time.monotonic() < aim and proc.poll() is None:
                    time.sleep(0.001)
            _kill_group(proc)
            rc = proc.wait()
            if rc != -signal.SIGKILL:
                raise DemoError(
                    f"the interrupted run exited on its own (status {rc}) before the kill:\n"
                    f"{_log_tail(cfg, 'interrupted')}"
                )
        finally:
            timer.cancel()
            _kill_group(proc)
    print(f"  [{'interrupted':>11}] SIGKILL at step {held} (exit status {rc})", file=out)
    result = _read_result(cfg, "interrupted")
    result["killed_at"] = held
    result["exit_status"] = rc
    result["committed_at_kill"] = _committed(ckpt)
    result["leftovers_at_kill"] = _leftovers(ckpt)
    return result


# ------------------------------------------------------------------ main


def run_demo(cfg: DemoConfig, out: TextIO | None = None) -> int:
    """Run the three trainings of ``cfg``, print the summary; 0 iff bit-exact.

    Args:
        cfg: the demo settings (see :func:`parse_args`).
        out: where to print (default: ``sys.stdout`` at call time).

    Returns:
        0 if the resumed run matches the reference bit for bit, else 1 (also when a
        child failed; the reason and the child's log tail are printed).

    Example::

        run_demo(DemoConfig(steps=30, interval=10, kill_at=15, folder="qs-demo"))
    """
    out = out if out is not None else sys.stdout
    ckpt = os.path.join(cfg.folder, "checkpoints")
    os.makedirs(cfg.folder, exist_ok=True)
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        print(
            f"quicksave demo: {ckpt} already holds checkpoints, and the interrupted run must "
            "start from scratch; use a fresh --folder (or delete it)",
            file=out,
        )
        return 1
    print(
        f"quicksave demo: {cfg.steps} steps, checkpoint every {cfg.interval}, SIGKILL at "
        f"step {cfg.kill_at}; work folder {cfg.folder}",
        file=out,
    )
    results: dict[str, dict[str, Any]] = {}
    wall: dict[str, float] = {}
    errors: list[DemoError] = []
    live: list[subprocess.Popen[str]] = []

    def timed(run: str) -> None:
        t0 = time.perf_counter()
        try:
            if run == "interrupted":
                results[run] = _run_and_kill(cfg, out, live)
            else:
                results[run] = _run_to_end(cfg, run, out, live)
        except DemoError as e:
            errors.append(e)
        finally:
            wall[run] = time.perf_counter() - t0

    # The reference never touches the checkpoint folder, so it runs beside the
    # interrupted-then-resumed pair (one torch thread each).
    print("\ntraining: reference (uninterrupted) beside interrupted -> resumed", file=out)
    reference = threading.Thread(target=timed, args=("reference",), daemon=True)
    reference.start()
    try:
        try:
            timed("interrupted")
            if not errors:
                timed("resumed")
        except BaseException:  # e.g. Ctrl-C: leave no training process behind
            for proc in live:
                _kill_group(proc)
            raise
        finally:
            reference.join()
        if errors:
            raise errors[0]
        if results["resumed"]["resumed_from"] is None:
            raise DemoError("the resumed run found no committed checkpoint to resume from")
        ok = summarize(cfg, results, wall, out)
        list_checkpoints(ckpt, out)
    except DemoError as e:
        print(f"\nquicksave demo failed: {e}", file=out)
        ok = False
    finally:
        if not cfg.keep_folder:
            shutil.rmtree(cfg.folder, ignore_errors=True)
            print(f"(temporary folder {cfg.folder} removed; pass --folder to keep it)", file=out)
    print(f"\nbit-exact: {'yes' if ok else 'no'}", file=out, flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``quicksave demo [--steps N --interval N --kill-at N --folder DIR --keep K --seed S]``.

    Returns:
        0 iff the killed-and-resumed run ends bit-identical to the uninterrupted one.

    Example::

        sys.exit(main(["--steps", "30", "--interval", "10"]))
    """
    return run_demo(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
