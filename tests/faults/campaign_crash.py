"""Campaigns that kill or stop processes: 2. SIGKILL of trainer, worker or both, and
8. a hung (SIGSTOPped) worker."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import faultkit
from campaign_checks import (
    SEED,
    account,
    check_folder,
    check_start,
    final_trainer,
    newest,
)
from faultkit import Job, Result
from forkserver import Child, ForkServer

# ====================================================================== 2. SIGKILL


def kills(per_mode: int, rng: random.Random, server: ForkServer, work: Path) -> Result:
    """Campaign 2: SIGKILL at random moments of a job that saves every step (8 MiB
    payload, async process mode, keep_latest_k=3), resuming in the same folder after
    each kill. Four targets, ``per_mode`` kills each:

    - ``trainer``: the trainer; the next one starts once its worker is gone;
    - ``worker``: the trainer's worker; the trainer goes on, then stops by itself;
    - ``both``: worker and trainer at once;
    - ``restart_now``: the trainer, and the next one starts at once, racing the dying
      worker (a scheduler restarting a job).

    A few kills land during the trainer's start-up (clean-up, resume), some before its
    first commit, most while it saves. Checked after every kill: every committed
    checkpoint passes verify; a killed trainer's worker is gone within 5 s; the next
    trainer's start-up leaves no temporaries and resumes the newest step bit-exactly; a
    trainer whose worker was killed got a CheckpointError for each failed save and
    committed again afterwards. At the end a fresh writer resumes and commits."""
    res = Result(
        "sigkill",
        must_be_zero=(
            "torn_commits", "orphan_workers", "leftover_tmp_after_startup",
            "resume_wrong_values", "resume_not_newest", "unreported_failures", "lost_saves",
            "raw_exception", "hangs", "no_recovery", "lost_commit", "final_save_failed",
            "trainer_incomplete",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 8192
    folder = work / "ckpt"
    stop = work / "stop"
    modes = ["trainer", "worker", "both", "restart_now"]
    dying: list[tuple[int, float, str]] = []  # (worker pid, its trainer's kill time, label)
    for i in range(per_mode * len(modes)):
        mode = modes[i % len(modes)]
        label = f"kill {i} ({mode})"
        lowest = newest(folder)
        child = server.start(
            "trainer", work / f"kill-{i}.out", folder=str(folder), seed=SEED, kib=kib,
            keep=3, stop_file=str(stop),
        )  # fmt: skip
        res.grow(f"kills[{mode}]")
        _check_dying(res, dying)
        startup = mode != "worker" and rng.random() < 0.15
        if startup:
            res.grow("kills_during_startup")
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            check_start(res, child, label, lowest, lambda: newest(folder))
            child.wait_line("ready", 60)
            if mode != "worker" and rng.random() < 0.2:
                res.grow("kills_before_first_commit")
                time.sleep(rng.uniform(0.0, 0.2))
            else:
                child.wait_line("committed", 60)
                time.sleep(rng.uniform(0.0, 1.0))
        workers = faultkit.children_of(child.pid)
        res.require(startup or bool(workers), f"{label}: the trainer had no worker to kill")
        committed_before = [int(ln[1]) for ln in child.find("committed")]
        killed = time.monotonic()
        if mode in ("worker", "both"):
            for w in workers:
                faultkit.kill_quietly(w)
        if mode == "worker":
            _worker_killed(res, child, workers, committed_before, killed, stop, rng, label)
        else:
            child.kill()
            killed = time.monotonic()
            if server.exit_status(child.pid, 30) is None:
                res.violate("hangs", f"{label}: trainer not reaped 30 s after SIGKILL")
            dying += [(w, killed, label) for w in workers]
            if workers:
                res.grow("trainer_kills_with_a_worker")
            if mode != "restart_now":
                _check_dying(res, dying)
            if committed_before:  # what the trainer saw committed is still there
                last = committed_before[-1]
                problems = faultkit.verify_problems(str(folder / f"step-{last}"))
                retained_away = problems is None and (newest(folder) or 0) > last
                if problems != [] and not retained_away:
                    res.violate("lost_commit", f"{label}: step {last} reported committed")
        check_folder(res, folder, label)
        res.count("temporaries_left_by_kill", len(faultkit.temporaries(folder)))
    _check_dying(res, dying)
    final_trainer(res, server, folder, work, kib, "sigkill", keep=3)
    res.seconds = time.monotonic() - t0
    return res


def _check_dying(res: Result, dying: list[tuple[int, float, str]]) -> None:
    """Every worker of a killed trainer is gone within 5 s of the kill."""
    for pid, killed, label in dying:
        left = max(0.0, killed + 5.0 - time.monotonic())
        if faultkit.wait_dead(pid, left) is None:
            res.violate("orphan_workers", f"{label}: worker {pid} alive 5 s after its trainer")
            faultkit.kill_quietly(pid)
        else:
            res.time("worker_exit_after_trainer_s", time.monotonic() - killed)
    dying.clear()


def _worker_killed(
    res: Result,
    child: Child,
    workers: list[int],
    committed_before: list[int],
    killed: float,
    stop: Path,
    rng: random.Random,
    label: str,
) -> None:
    """After a worker kill: the trainer goes on for a while, then stops by itself; its
    failed save was raised to it, and it committed again."""
    time.sleep(rng.uniform(0.5, 1.5))
    stop.touch()
    try:
        status = child.wait_exit(60)
    except AssertionError as e:
        res.violate("hangs", f"{label}: {e}")
        status = None
    stop.unlink()
    info = account(res, child, label)
    if status is not None and status != 0:
        res.violate("raw_exception", f"{label}: exit status {status}\n{child.tail()}")
    after = [s for s in info["committed"] if not committed_before or s > committed_before[-1]]
    errors = [float(ln[2]) for ln in info["lines"] if ln[0] == "error"]
    if errors:
        res.count("worker_kills_reported")
        res.time("time_to_error_after_worker_kill_s", errors[0] - killed)
    if not after:
        res.violate("no_recovery", f"{label}: nothing committed after the worker kill")
    for w in workers:
        if faultkit.wait_dead(w, 30.0) is None:
            res.violate("orphan_workers", f"{label}: killed worker {w} still alive")


# ====================================================================== 8. hung worker


def hung_worker(trials: int, rng: random.Random, work: Path) -> Result:
    """Campaign 8: SIGSTOP the worker at a random moment of a job that saves every step
    (default config: worker_timeout_s is the library default). Checked: a
    CheckpointError reaches the trainer within 10 s of the stop; the stopped worker is
    not left behind; the next saves commit; nothing torn is committed."""
    from quicksave.errors import CheckpointError
    from quicksave.manager import CheckpointConfig, CheckpointManager

    res = Result(
        "hung_worker",
        must_be_zero=(
            "hangs", "slow_detection", "stopped_worker_left", "no_recovery", "torn_commits",
            "raw_exception", "unexpected_error", "unreported_failures",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 16384
    for t in range(trials):
        folder = work / f"hung-{t}"
        label = f"trial {t}"
        res.grow("trials")
        job = Job(SEED, kib)
        m = CheckpointManager(
            CheckpointConfig(folder=str(folder), interval=1, keep_latest_k=2), job.states()
        )
        step = 0
        stopped: dict[str, Any] = {}

        def stop_worker(stopped: dict[str, Any] = stopped, m: CheckpointManager = m) -> None:
            pid = m.session.writer.saver.worker_pid if m.session.writer else None  # noqa: SLF001
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                stopped["pid"], stopped["at"] = pid, time.monotonic()

        # A watchdog, so that a save that never returns fails the test instead of
        # hanging it: 60 s after the stop it kills the stopped worker.
        watchdog = threading.Timer(
            60.0, lambda stopped=stopped: faultkit.kill_quietly(stopped.get("pid"))
        )
        try:
            while not any(r.status == "committed" for r in m.metrics):
                step += 1
                job.step(step)
                m.save(step)
                time.sleep(0.02)
            timer = threading.Timer(rng.uniform(0.0, 0.4), stop_worker)
            timer.start()
            watchdog.start()
            error_at = None
            messages: list[str] = []
            while "at" not in stopped or time.monotonic() - stopped["at"] < 30:
                step += 1
                job.step(step)
                try:
                    m.save(step)
                except CheckpointError as e:
                    messages.append(str(e))
                    if "at" not in stopped:
                        res.violate("unexpected_error", f"{label}: before the stop: {e}")
                        continue
                    error_at = time.monotonic()
                    res.notes.append(f"{label}: {type(e).__name__}: {e}"[:200])
                    break
            timer.join()
            watchdog.cancel()
            if error_at is None:
                res.violate("hangs", f"{label}: no CheckpointError 30 s after SIGSTOP")
            else:
                took = error_at - stopped["at"]
                res.time("time_to_error_s", took)
                if took > 10:
                    res.violate("slow_detection", f"{label}: {took:.1f} s")
            if faultkit.wait_dead(stopped["pid"], 30) is None:
                res.violate("stopped_worker_left", f"{label}: pid {stopped['pid']}")
                faultkit.kill_quietly(stopped["pid"])
            fail_step = step
            for _ in range(3):
                step += 1
                job.step(step)
                try:
                    m.save(step)
                except CheckpointError as e:
                    messages.append(str(e))
                    res.count("errors_after_the_first")
            try:
                m.close()
            except CheckpointError as e:
                messages.append(str(e))
                res.count("errors_after_the_first")
            later = [r for r in m.metrics if r.step > fail_step and r.status == "committed"]
            if not later:
                res.violate("no_recovery", label)
            failed = [r.step for r in m.metrics if r.status == "failed"]
            res.count("saves_failed", len(failed))
            missed = faultkit.unreported(failed, messages)
            if missed:
                res.violate("unreported_failures", f"{label}: steps {missed}: {messages}")
        except Exception as e:  # noqa: BLE001
            watchdog.cancel()
            res.violate("raw_exception", f"{label}: {faultkit.describe(e)}")
            if "pid" in stopped:
                faultkit.kill_quietly(stopped["pid"])
            with contextlib.suppress(Exception):
                m.close()
        check_folder(res, folder, label)
    res.seconds = time.monotonic() - t0
    return res
