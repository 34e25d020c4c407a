"""Campaigns that take the folder away from a writer: 3. a full disk, and
4. permission flips."""

from __future__ import annotations

import contextlib
import random
import shutil
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
)
from faultkit import Result
from forkserver import ForkServer

# ====================================================================== 3. full disk


class SmallState:
    """A payload-only state (the full-disk campaign sizes it per cycle)."""

    def __init__(self, kib: int) -> None:
        self.payload = faultkit.Payload(SEED, kib)

    def states(self) -> dict[str, Any]:
        return {"payload": self.payload}

    def expected(self, step: int, kib: int) -> dict[str, Any]:
        p = faultkit.Payload(SEED, kib)
        p.set_step(step)
        return p.state_dict()


def full_disk(cycles: int, rng: random.Random, work: Path) -> Result:
    """Campaign 3: a tmpfs of a few MiB as the folder; save every step until saves
    fail for lack of space (process, thread and synchronous modes in turn); then the
    operator deletes old checkpoints, and the same manager saves again; then a new
    manager starts on the folder and saves.

    Checked: every failed save raised a CheckpointError to the trainer; every committed
    checkpoint passes verify and loads bit-exactly (the older ones too); once space is
    freed, the same manager's next save commits; a new manager's start-up leaves no
    temporaries and its save commits."""
    res = Result(
        "full_disk",
        must_be_zero=(
            "unreported_failures", "lost_saves", "torn_commits", "old_checkpoint_unloadable",
            "raw_exception", "leftover_tmp_after_startup", "save_after_freeing_failed",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    modes = ["process", "thread", "disabled"]
    for c in range(cycles):
        mode = modes[c % len(modes)]
        size_kib = rng.randint(3 * 1024, 8 * 1024)
        kib = rng.randint(150, size_kib // 3)  # a kept one and a new one fit once freed
        label = f"cycle {c} ({mode}, {kib} KiB state, {size_kib} KiB tmpfs)"
        res.grow(f"cycles[{mode}]")
        with faultkit.tmpfs(f"{size_kib}k") as mnt:
            _disk_cycle(res, mnt, mode, kib, label)
    res.seconds = time.monotonic() - t0
    return res


def _disk_cycle(res: Result, mnt: Path, mode: str, kib: int, label: str) -> None:
    """One cycle of :func:`full_disk` on the tmpfs ``mnt``."""
    from quicksave.errors import CheckpointError
    from quicksave.manager import CheckpointConfig, CheckpointManager

    folder = mnt / "ckpt"
    state = SmallState(kib)
    cfg = CheckpointConfig(folder=str(folder), interval=1, async_mode=mode)
    manager = CheckpointManager(cfg, state.states())
    raised, step = 0, 0
    messages: list[str] = []

    def save(step: int) -> bool:
        nonlocal raised
        state.payload.set_step(step)
        try:
            return manager.save(step)
        except CheckpointError as e:
            raised += 1
            messages.append(str(e))
            res.count("enospc_errors" if "No space" in str(e) else "other_errors")
            if "No space" not in str(e) and len(res.notes) < 6:
                res.notes.append(f"{label}: {e}"[:200])
        except Exception as e:  # noqa: BLE001
            res.violate("raw_exception", f"{label} save {step}: {faultkit.describe(e)}")
        return False

    while raised < 2 and step < 300:  # fill the disk
        step += 1
        save(step)
    res.grow("saves", step)
    res.require(raised > 0, f"{label}: the disk never filled in {step} saves")
    check_folder(res, folder, f"{label}, full")
    committed = [int(p.rsplit("-", 1)[1]) for p in faultkit.committed_dirs(folder)]
    res.count("committed_before_full", len(committed))
    for s in committed:
        _check_loads(res, state, folder, s, kib, label)
    for s in committed[:-1]:  # free space: the operator deletes old checkpoints
        shutil.rmtree(folder / f"step-{s}")
    next_save = None
    for _ in range(5):  # the same manager goes on (it may first raise an old error)
        step += 1
        if save(step):
            next_save = step
            break
    try:
        manager.close()
    except CheckpointError as e:
        raised += 1
        messages.append(str(e))
    failed = [r.step for r in manager.metrics if r.status == "failed"]
    res.count("saves_failed", len(failed))
    res.count("errors_raised", raised)
    missed = faultkit.unreported(failed, messages)
    if missed:
        res.violate(
            "unreported_failures",
            f"{label}: {len(failed)} saves failed, {raised} errors raised, none naming "
            f"steps {missed}",
        )
    if any(r.status == "in_flight" for r in manager.metrics):
        res.violate("lost_saves", f"{label}: {manager.metrics}")
    if next_save is None or faultkit.verify_problems(str(folder / f"step-{next_save}")) != []:
        res.violate("save_after_freeing_failed", f"{label}: same manager")
    res.count("temporaries_after_failures", len(faultkit.temporaries(folder)))
    manager = CheckpointManager(cfg, state.states())  # a restarted job
    if faultkit.temporaries(folder):
        res.violate("leftover_tmp_after_startup", f"{label}: {faultkit.temporaries(folder)}")
    step += 1
    state.payload.set_step(step)
    try:
        manager.save(step)
        manager.close()
        ok = faultkit.verify_problems(str(folder / f"step-{step}")) == []
    except CheckpointError as e:
        ok = False
        res.notes.append(f"{label}: after a restart: {e}")
    if not ok:
        res.violate("save_after_freeing_failed", f"{label}: new manager")
    if committed:
        _check_loads(res, state, folder, committed[-1], kib, f"{label}, kept")
    check_folder(res, folder, label)


def _check_loads(
    res: Result, state: SmallState, folder: Path, step: int, kib: int, label: str
) -> None:
    import quicksave
    from quicksave.errors import CheckpointError

    want = state.expected(step, kib)
    out = faultkit.zeros_like(want)
    try:
        quicksave.load({"payload": out}, folder / f"step-{step}")
        good = faultkit.same_bits(out, want)
    except CheckpointError as e:
        good = False
        res.notes.append(f"{label}: step {step}: {e}")
    if not good:
        res.violate("old_checkpoint_unloadable", f"{label}: step {step}")


# ====================================================================== 4. permissions


def permission_flips(
    flips: int, rng: random.Random, server: ForkServer, work: Path, *, how: str = "chmod"
) -> Result:
    """Campaign 4: the folder becomes read-only while a job saves every step, then
    writable again, ``flips`` times.

    ``how="chmod"``: the folder and every directory in it go 0555, then 0755; the job
    runs as root without CAP_DAC_OVERRIDE, so the bits apply to it (EACCES).
    ``how="chattr"``: ``chattr +i`` on the same directories, which stops root too
    (EPERM). (A read-only remount cannot be used: the kernel refuses it, EBUSY, while
    a file is open for writing, and the writer lease's lock file always is.)

    Checked: every failed save raised a CheckpointError; every committed checkpoint
    passes verify; after each restore the job commits again; a fresh writer then leaves
    no temporaries and resumes the newest step."""
    res = Result(
        f"permission_flips_{how}",
        must_be_zero=(
            "unreported_failures", "lost_saves", "torn_commits", "raw_exception",
            "no_recovery", "leftover_tmp_after_startup", "resume_wrong_values",
            "resume_not_newest", "final_save_failed", "hangs", "trainer_incomplete",
        ),
    )  # fmt: skip
    t0 = time.monotonic()
    kib = 2048
    stop = work / f"stop-{how}"

    def flip(read_only: bool) -> None:
        if how == "chattr":
            faultkit.set_immutable(folder, read_only)
        else:
            faultkit.set_writable(folder, not read_only)

    with contextlib.ExitStack() as stack:
        base = work / f"perm-{how}"
        base.mkdir()
        folder = base / "ckpt"
        child = server.start(
            "trainer", work / f"perm-{how}.out", folder=str(folder), seed=SEED, kib=kib,
            keep=2, stop_file=str(stop), drop_caps=how == "chmod",
        )  # fmt: skip
        stack.callback(lambda: flip(False))  # never leave an immutable directory behind
        check_start(res, child, "perm trainer", None)
        child.wait_line("committed", 60)
        for i in range(flips):
            time.sleep(rng.uniform(0.05, 0.6))
            errors_before = len(child.find("error"))
            flip(True)
            res.grow("flips")
            time.sleep(rng.uniform(0.2, 0.8))
            flip(False)
            check_folder(res, folder, f"flip {i}")
            commits = len(child.find("committed"))
            deadline = time.monotonic() + 20
            while len(child.find("committed")) <= commits and time.monotonic() < deadline:
                time.sleep(0.02)
            if len(child.find("committed")) <= commits:
                res.violate("no_recovery", f"flip {i}: no commit within 20 s of the restore")
            res.count("flips_with_an_error", int(len(child.find("error")) > errors_before))
        time.sleep(0.5)
        stop.touch()
        try:
            status = child.wait_exit(60)
        except AssertionError as e:
            res.violate("hangs", str(e))
            status = None
        info = account(res, child, "perm trainer")
        if status not in (0, None):
            res.violate("raw_exception", f"trainer exit status {status}\n{child.tail()}")
        records = [ln for ln in info["lines"] if ln[0] == "record"]
        if records and records[-1][2] != "committed":
            res.violate("no_recovery", f"the last save after the last flip failed: {records[-1]}")
        check_folder(res, folder, "after flips")
        res.require(res.outcomes.get("flips_with_an_error", 0) > 0, "no flip made a save fail")
        res.count("temporaries_left", len(faultkit.temporaries(folder)))
        stop.unlink()
        final_trainer(res, server, folder, work, kib, res.name, keep=2)
    res.seconds = time.monotonic() - t0
    return res
