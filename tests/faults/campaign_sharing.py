"""Campaigns with several processes on one folder: 5. two jobs (an eval script beside
a writer; a second writer) and 6. readers racing writers and retention."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faultkit
from campaign_checks import (
    SEED,
    account,
    captured_logs,
    check_folder,
    check_start,
    final_trainer,
)
from faultkit import Job, Replay, Result
from forkserver import Child, ForkServer

# ====================================================================== 5. two jobs


def two_jobs(seconds: float, rng: random.Random, server: ForkServer, work: Path) -> Result:
    """Campaign 5a: job A saves every step (process mode, keep_latest_k=3) while an
    eval process builds managers on the same folder again and again (read-only,
    default and synchronous configs), loads, lists and runs ``quicksave ls``; the test
    process verifies every committed checkpoint it sees meanwhile.

    Checked: no committed checkpoint fails verify (ever); every eval load is bit-exact
    or a CheckpointError; every failure of A would be raised to A, and there is none
    (an eval script never harms the job: it takes no lease and deletes nothing)."""
    res = Result(
        "two_jobs",
        must_be_zero=(
            "torn_commits", "silent_wrong_load", "raw_exception", "unreported_failures",
            "lost_saves", "ls_failed", "hangs", "trainer_incomplete", "job_a_harmed",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 4096
    folder = work / "shared"
    stop = work / "stop-a"
    a = server.start(
        "trainer", work / "job-a.out", folder=str(folder), seed=SEED, kib=kib, keep=3,
        stop_file=str(stop),
    )  # fmt: skip
    check_start(res, a, "job A", None)
    a.wait_line("committed", 60)
    b = server.start("eval", work / "eval.out", folder=str(folder), seed=SEED, kib=kib,
                     duration=seconds)  # fmt: skip
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for path in faultkit.committed_dirs(folder):
            res.grow("verifications")
            try:
                problems = faultkit.verify_problems(path)
            except Exception as e:  # noqa: BLE001 - verify raises only CheckpointError
                res.violate("raw_exception", f"verify of {path}: {faultkit.describe(e)}")
                continue
            if problems:
                res.violate("torn_commits", f"{path}: {problems[:3]}")
        time.sleep(rng.uniform(0.0, 0.1))
    try:
        b.wait_exit(120)
    except AssertionError as e:
        res.violate("hangs", f"eval: {e}")
    stop.touch()
    try:
        a.wait_exit(120)
    except AssertionError as e:
        res.violate("hangs", f"job A: {e}")
    info = account(res, a, "job A")
    res.grow("a_saves", len([ln for ln in info["lines"] if ln[0] == "saved"]))
    if info["failed"] or info["reported"]:  # an eval script must never harm the job
        res.violate("job_a_harmed", f"{info['failed']} failed, {info['reported']} errors")
    _eval_outcomes(res, b)
    res.require(res.outcomes.get("eval_load_ok", 0) > 0, "the eval never loaded")
    res.require(len(info["committed"]) > 3, "job A committed too little to race anything")
    check_folder(res, folder, "end")
    final_trainer(res, server, folder, work, kib, "two_jobs", keep=3)
    res.seconds = time.monotonic() - t0
    return res


def _eval_outcomes(res: Result, b: Child) -> None:
    for ln in b.lines():
        key = ln[0]
        if key == "load":
            if ln[1] == "none":
                res.count("eval_load_none")
            elif ln[2] == "ok":
                res.count("eval_load_ok")
            else:
                res.violate("silent_wrong_load", f"eval: {' '.join(ln)}")
        elif key == "loaderror":
            res.count("eval_load_refused")
            res.notes.append(" ".join(ln)[:300])
        elif key == "ls":
            res.grow("quicksave_ls_runs")
            if ln[1] != "ok":
                res.violate("ls_failed", " ".join(ln))
        elif key == "raw":
            res.violate("raw_exception", f"eval: {' '.join(ln)}")
        elif key in ("ctorerror", "closeerror", "lserror"):
            res.count(f"eval_{key}")
            res.notes.append(" ".join(ln)[:300])
        elif key == "iterations":
            res.grow("eval_iterations", int(ln[1]))
    if "iterations" not in [ln[0] for ln in b.lines()]:
        res.violate("raw_exception", f"eval did not finish:\n{b.tail()}")


def second_writer(attempts: int, rng: random.Random, server: ForkServer, work: Path) -> Result:
    """Campaign 5b: while job A writes a folder, this process builds ordinary (writing)
    managers on it, ``attempts`` times. Each must come up read-only with a warning, load
    the newest checkpoint bit-exactly, and refuse ``save()`` with a CheckpointError
    naming the folder and A's pid; A must be unharmed (every save commits). Then, with
    A gone: a ``read_only=True`` manager leaves a stale temporary alone, and a writing
    manager removes it."""
    from quicksave.errors import CheckpointError
    from quicksave.manager import CheckpointConfig, CheckpointManager

    res = Result(
        "second_writer",
        must_be_zero=(
            "second_writer_not_refused", "refusal_unclear", "no_warning",
            "second_load_wrong", "job_a_harmed", "torn_commits", "raw_exception",
            "unreported_failures", "lost_saves", "read_only_deleted", "stale_tmp_kept",
            "hangs", "trainer_incomplete", "two_writers", "no_writer",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 4096
    folder = work / "owned"
    stop = work / "stop-owner"
    a = server.start(
        "trainer", work / "owner.out", folder=str(folder), seed=SEED, kib=kib, keep=3,
        stop_file=str(stop),
    )  # fmt: skip
    check_start(res, a, "job A", None)
    a.wait_line("committed", 60)
    replay = Replay(SEED, kib)
    for i in range(attempts):
        time.sleep(rng.uniform(0.0, 0.3))
        res.grow("attempts")
        job = Job(SEED, kib)
        try:
            with captured_logs() as logs:
                manager = CheckpointManager(
                    CheckpointConfig(folder=str(folder), interval=1), job.states()
                )
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"attempt {i}: construction: {faultkit.describe(e)}")
            continue
        try:
            if not any("read-only" in r.getMessage() for r in logs):
                res.violate("no_warning", f"attempt {i}: {[r.getMessage() for r in logs]}")
            step = manager.load()
            if step is None or job.fingerprint() != replay.fingerprint(step):
                res.violate("second_load_wrong", f"attempt {i}: step {step}")
            job.step((step or 0) + 1)
            try:
                manager.save((step or 0) + 1, force=True)
            except CheckpointError as e:
                res.count("refused")
                msg = str(e)
                if str(folder) not in msg or f"pid {a.pid}" not in msg:
                    res.violate("refusal_unclear", f"attempt {i}: {msg}")
            else:
                res.violate("second_writer_not_refused", f"attempt {i}: save() returned")
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"attempt {i}: {faultkit.describe(e)}")
        finally:
            manager.close()
    stop.touch()
    try:
        a.wait_exit(120)
    except AssertionError as e:
        res.violate("hangs", f"job A: {e}")
    info = account(res, a, "job A")
    if info["failed"] or info["reported"]:
        res.violate("job_a_harmed", f"{info['failed']} failed, {info['reported']} errors")
    check_folder(res, folder, "end")
    # A is gone: a read-only manager must not clean up; a writer must.
    stale = folder / "step-999999.tmp-deadbeef0000"
    stale.mkdir()
    (stale / "rank-00000-00.safetensors").write_bytes(b"partial")
    job = Job(SEED, kib)
    with CheckpointManager(
        CheckpointConfig(folder=str(folder), read_only=True), job.states()
    ) as ro:
        ro.load()
        try:
            ro.save(10**6, force=True)
            res.violate("second_writer_not_refused", "a read_only manager saved")
        except CheckpointError:
            res.count("refused")
    if not stale.exists():
        res.violate("read_only_deleted", "a read_only manager removed a temporary")
    with CheckpointManager(CheckpointConfig(folder=str(folder)), job.states()):
        pass
    res.require(res.outcomes.get("refused", 0) == attempts + 1, "not every refusal was seen")
    for i in range(attempts):
        _simultaneous_start(res, server, work / f"race-{i}", rng, f"race {i}")

    if stale.exists():
        res.violate("stale_tmp_kept", "a writer with the lease did not remove a dead temporary")
    res.seconds = time.monotonic() - t0
    return res


def _simultaneous_start(
    res: Result, server: ForkServer, folder: Path, rng: random.Random, label: str
) -> None:
    """Two jobs started on one fresh folder at the same moment, both saving every step
    for a second: exactly one writes; the other's saves are refused, each with a
    CheckpointError naming the lease; nothing committed is torn."""
    stop = folder.parent / f"{folder.name}.stop"
    jobs = [
        server.start(
            "trainer",
            folder.parent / f"{folder.name}-{k}.out",
            folder=str(folder),
            seed=SEED,
            kib=512,
            keep=2,
            stop_file=str(stop),
        )  # fmt: skip
        for k in range(2)
    ]
    res.grow("simultaneous_starts")
    for job in jobs:
        job.wait_line("ready", 60)
    time.sleep(rng.uniform(0.5, 1.0))
    stop.touch()
    writers = 0
    for k, job in enumerate(jobs):
        try:
            job.wait_exit(60)
        except AssertionError as e:
            res.violate("hangs", f"{label} job {k}: {e}")
        scratch = Result("race")  # the loser's thousands of refusals are not save errors
        info = account(scratch, job, f"{label} job {k}")
        for v in scratch.violations:
            key, _, detail = v.partition(": ")
            res.violate(key, detail)
        errors = [ln for ln in info["lines"] if ln[0] == "error"]
        if info["committed"]:
            writers += 1
        elif errors and all("writer lease" in " ".join(ln) for ln in errors):
            res.count("refused")
        else:
            res.violate("no_writer", f"{label} job {k}: neither wrote nor was refused")
    if writers != 1:
        res.violate("two_writers" if writers > 1 else "no_writer", f"{label}: {writers} wrote")
    check_folder(res, folder, label)


# ====================================================================== 6. readers


def readers_vs_retention(
    seconds: float, rng: random.Random, server: ForkServer, work: Path, keep: int = 1
) -> Result:
    """Campaign 6: a writer saves every step with ``keep_latest_k`` 1 or 2 (so every
    commit deletes one) while this process lists (``committed_steps``,
    ``list_checkpoints``), verifies and loads (``quicksave.load``, and a read-only
    manager's ``load()``) in a tight loop.

    Checked: only CheckpointError or a bit-exact load; a listed checkpoint that still
    exists never fails verify (no torn checkpoint listed)."""
    import quicksave
    from quicksave.errors import CheckpointError
    from quicksave.loading.catalog import list_checkpoints
    from quicksave.manager import CheckpointConfig, CheckpointManager
    from quicksave.manager.folder import committed_steps

    res = Result(
        f"readers_keep{keep}",
        must_be_zero=(
            "torn_listed", "silent_wrong_load", "raw_exception", "unreported_failures",
            "lost_saves", "hangs", "trainer_incomplete",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 1024
    folder = work / f"churn{keep}"
    stop = work / f"stop-churn{keep}"
    w = server.start(
        "trainer", work / f"churn{keep}.out", folder=str(folder), seed=SEED, kib=kib,
        keep=keep, stop_file=str(stop),
    )  # fmt: skip
    check_start(res, w, "writer", None)
    w.wait_line("committed", 60)
    replay = Replay(SEED, kib)

    def guarded(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointError as e:
            res.count(f"{what}_checkpoint_error")
            if len(res.notes) < 8:
                res.notes.append(f"{what}: {type(e).__name__}: {e}"[:300])
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"{what}: {faultkit.describe(e)}")
        return None

    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        i += 1
        res.grow("iterations")
        steps = guarded("committed_steps", lambda: committed_steps(str(folder))) or []
        infos = guarded("list_checkpoints", lambda: list_checkpoints(folder)) or []
        listed = [x.step for x in infos if x.committed]
        candidates = steps[-2:] + listed[-2:]
        if not candidates:
            continue
        step = rng.choice(candidates)
        path = folder / f"step-{step}"
        if i % 4 == 0:
            problems = guarded("verify", lambda p=path: faultkit.verify_problems(str(p)))
            res.grow("verifications")
            if problems:
                res.violate("torn_listed", f"step {step}: {problems[:3]}")
        job = Job(SEED + 1, kib)
        if i % 3 == 0:

            def by_manager(job: Job = job) -> int | None:
                with CheckpointManager(
                    CheckpointConfig(folder=str(folder), read_only=True), job.states()
                ) as m:
                    return m.load()

            loaded = guarded("manager_load", by_manager)
        else:
            loaded = guarded(
                "load", lambda p=path, s=step, job=job: quicksave.load(job.states(), p) or s
            )
        res.grow("loads")
        if loaded is not None:
            if job.fingerprint() == replay.fingerprint(loaded):
                res.count("load_ok")
            else:
                res.violate("silent_wrong_load", f"step {loaded}")
    stop.touch()
    try:
        w.wait_exit(120)
    except AssertionError as e:
        res.violate("hangs", f"writer: {e}")
    info = account(res, w, "writer")
    res.grow("writer_commits", len(info["committed"]))
    res.require(res.outcomes.get("load_ok", 0) > 0, "no load succeeded")
    res.require(len(info["committed"]) > keep + 2, "retention deleted too little to race")
    check_folder(res, folder, "end")
    res.seconds = time.monotonic() - t0
    return res
