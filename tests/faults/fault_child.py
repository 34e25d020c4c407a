"""Child processes of the fault-injection suite.

``python fault_child.py serve`` is a fork server: it imports torch and quicksave once,
prints ``ready``, then for each line ``go <role> <out> <json args>`` on stdin forks a
child running ``<role>`` and prints ``pid <pid>``; when a child ends it prints
``exited <pid> <wait status>``. A child writes its protocol lines to ``<out>`` (each line
in one ``write``, so a SIGKILL never leaves half a line) and its stderr (the library's
log messages, tracebacks) to ``<out>.err``.

Roles:

- ``trainer``: the deterministic job of ``faultkit`` under a ``CheckpointManager``
  saving every step; resumes from the folder first and checks the restored state
  bit-exactly against a replay. Lines::

      begin <pid>
      start tmp=<n> worker=<pid>|none      after the manager's construction
      starterror <message>                 the construction raised CheckpointError
      resumed <step>|none ok|bad           after manager.load()
      loaderror <type> <message>           manager.load() raised CheckpointError
      ready
      saved <step> | skipped <step>        save() returned True | False
      error <step> <time> <type> <message> save() raised CheckpointError (at
                                           time.monotonic(), comparable across
                                           processes: CLOCK_MONOTONIC)
      raw <where> <type> <message>         any other exception (a bug)
      committed <step> | failed <step>     the manager saw the save finish
      closed ok | closeerror <message>
      record <step> <status> <kind>        manager.metrics at the end
      done

- ``eval``: an evaluation script racing a writer: builds managers on the folder again
  and again (read-only, default and synchronous configs), ``committed_steps()``,
  ``load()`` (checked bit-exactly), ``quicksave.loading.catalog.list_checkpoints`` and, now and
  then, the ``quicksave ls`` command. Lines: ``load <step> ok|wrong``, ``load none``,
  ``loaderror <type> <message>``, ``ls ok|fail``, ``raw ...``, ``iterations <n>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import faultkit  # noqa: E402
import torch  # noqa: E402

from quicksave.errors import CheckpointError  # noqa: E402
from quicksave.loading.catalog import list_checkpoints  # noqa: E402
from quicksave.manager import CheckpointConfig, CheckpointManager  # noqa: E402


def emit(*words: object) -> None:
    """One protocol line, in one write."""
    text = " ".join(str(w) for w in words).replace("\n", " | ")
    os.write(1, (text + "\n").encode())


def oneline(e: BaseException) -> str:
    return " ".join(str(e).split())[:400]


def worker_pid(manager: CheckpointManager) -> int | None:
    """The worker's pid (None: the manager writes synchronously, or has no writer yet)."""
    writer = manager.session.writer
    return None if writer is None else writer.saver.worker_pid


def trainer(
    folder: str,
    seed: int,
    kib: int,
    keep: int = 3,
    stop_file: str | None = None,
    extra_steps: int | None = None,
    step_sleep: float = 0.0,
    drop_caps: bool = False,
    config: dict[str, Any] | None = None,
) -> int:
    if drop_caps:
        faultkit.drop_dac_capabilities()
    emit("begin", os.getpid())
    job = faultkit.Job(seed, kib)
    cfg = {"interval": 1, "keep_latest_k": keep, **(config or {})}
    try:
        manager = CheckpointManager(CheckpointConfig(folder=folder, **cfg), job.states())
    except CheckpointError as e:
        emit("starterror", oneline(e))
        return 5
    emit("start", f"tmp={len(faultkit.temporaries(folder))}", f"worker={worker_pid(manager)}")
    try:
        resumed = manager.load()
    except CheckpointError as e:
        emit("loaderror", type(e).__name__, oneline(e))
        return 6
    if resumed is None:
        emit("resumed", "none", "ok")
    else:
        good = job.fingerprint() == faultkit.Replay(seed, kib).fingerprint(resumed)
        emit("resumed", resumed, "ok" if good else "bad")
    emit("ready")
    step = resumed or 0
    last = None if extra_steps is None else step + extra_steps
    reported = 0
    while (last is None or step < last) and not (stop_file and os.path.exists(stop_file)):
        step += 1
        job.step(step)
        try:
            emit("saved" if manager.save(step) else "skipped", step)
        except CheckpointError as e:
            emit("error", step, f"{time.monotonic():.4f}", type(e).__name__, oneline(e))
        except Exception as e:  # noqa: BLE001 - reported as a bug by the test
            emit("raw", "save", type(e).__name__, oneline(e))
            traceback.print_exc()
        reported = _report_finished(manager, reported)
        if step_sleep:
            time.sleep(step_sleep)
    try:
        manager.close()
        emit("closed", "ok")
    except CheckpointError as e:
        emit("closeerror", type(e).__name__, oneline(e))
    except Exception as e:  # noqa: BLE001
        emit("raw", "close", type(e).__name__, oneline(e))
        traceback.print_exc()
    _report_finished(manager, reported)
    for record in manager.metrics:
        emit("record", record.step, record.status, record.kind)
    emit("done")
    return 0


def _report_finished(manager: CheckpointManager, reported: int) -> int:
    """Emit ``committed``/``failed`` for records finished since the last call, in
    order; returns how many leading records are finished and reported."""
    records = manager.metrics
    while reported < len(records) and records[reported].status != "in_flight":
        r = records[reported]
        emit("committed" if r.status == "committed" else "failed", r.step)
        reported += 1
    return reported


def eval_loop(folder: str, seed: int, kib: int, duration: float, ls_every: int = 8) -> int:
    replay = faultkit.Replay(seed, kib)
    end = time.monotonic() + duration
    variants = ("read_only", "default", "disabled")
    i = 0
    while time.monotonic() < end:
        variant = variants[i % len(variants)]
        i += 1
        cfg: dict[str, Any] = {"folder": folder, "interval": 1}
        if variant == "read_only":
            cfg["read_only"] = True
        elif variant == "disabled":
            cfg["async_mode"] = "disabled"
        job = faultkit.Job(seed, kib)
        try:
            manager = CheckpointManager(CheckpointConfig(**cfg), job.states())
        except CheckpointError as e:
            emit("ctorerror", variant, type(e).__name__, oneline(e))
            continue
        except Exception as e:  # noqa: BLE001
            emit("raw", f"ctor-{variant}", type(e).__name__, oneline(e))
            continue
        try:
            manager.committed_steps()
            step = manager.load()
            if step is None:
                emit("load", "none")
            else:
                good = job.fingerprint() == replay.fingerprint(step)
                emit("load", step, "ok" if good else "wrong", variant)
        except CheckpointError as e:
            emit("loaderror", type(e).__name__, oneline(e))
        except Exception as e:  # noqa: BLE001
            emit("raw", f"load-{variant}", type(e).__name__, oneline(e))
            traceback.print_exc()
        try:
            manager.close()
        except CheckpointError as e:
            emit("closeerror", type(e).__name__, oneline(e))
        except Exception as e:  # noqa: BLE001
            emit("raw", "close", type(e).__name__, oneline(e))
        try:
            list_checkpoints(folder)
        except CheckpointError as e:
            emit("lserror", type(e).__name__, oneline(e))
        except Exception as e:  # noqa: BLE001
            emit("raw", "list_checkpoints", type(e).__name__, oneline(e))
        if i % ls_every == 0:
            p = subprocess.run(
                [sys.executable, "-m", "quicksave", "ls", folder], capture_output=True, text=True
            )
            emit("ls", "ok" if p.returncode == 0 else "fail", oneline(Exception(p.stderr)))
    emit("iterations", i)
    return 0


ROLES = {"trainer": trainer, "eval": eval_loop}


_RUNNING: set[int] = set()  # the server's children not reaped yet


def _reap(_signum: int, _frame: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _RUNNING.discard(pid)
        os.write(1, f"exited {pid} {status}\n".encode())


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``): a test run
    that is killed must not leave trainers saving forever."""
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def serve() -> None:
    _die_with_parent()
    signal.signal(signal.SIGCHLD, _reap)
    os.write(1, b"ready\n")
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        _, role, out, args = line.rstrip("\n").split(" ", 3)
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent()  # the server's death (only: the worker is not affected)
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                efd = os.open(out + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(efd, 2)
                os.close(fd)
                os.close(efd)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                torch.set_num_threads(1)
                code = ROLES[role](**json.loads(args))
            except BaseException:  # noqa: BLE001 - the test reads it from <out>.err
                traceback.print_exc()
            finally:
                os._exit(code)
        _RUNNING.add(pid)
        os.write(1, f"pid {pid}\n".encode())
    for pid in list(_RUNNING):  # the test is gone: no child outlives the server
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit(f"usage: {sys.argv[0]} serve")
