"""Checks shared by the campaigns that run trainer children: start-up, resume,
accounting of saves and errors, the folder's committed checkpoints."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import faultkit
from faultkit import Result
from forkserver import Child, ForkServer

SEED = 11

# ====================================================================== shared parsing


def account(res: Result, child: Child, label: str) -> dict[str, Any]:
    """Check the lines of a trainer that ended by itself (closed its manager): every
    save it started finished, every failure was raised to it, nothing raw."""
    lines = child.lines()
    keys = [ln[0] for ln in lines]
    records = [ln for ln in lines if ln[0] == "record"]
    failed = [r for r in records if r[2] == "failed"]
    committed = [int(r[1]) for r in records if r[2] == "committed"]
    in_flight = [r for r in records if r[2] == "in_flight"]
    reported = keys.count("error") + keys.count("closeerror")
    res.count("saves_started", keys.count("saved"))
    res.count("saves_committed", len(committed))
    res.count("saves_failed", len(failed))
    res.count("errors_reported", reported)
    if "done" not in keys:
        res.violate("trainer_incomplete", f"{label}: no 'done'\n{child.tail()}")
    messages = [" ".join(ln) for ln in lines if ln[0] in ("error", "closeerror")]
    missed = faultkit.unreported([int(r[1]) for r in failed], messages)
    if missed:
        res.violate(
            "unreported_failures",
            f"{label}: {len(failed)} saves failed, {reported} errors raised; no raised error "
            f"names the failed saves of steps {missed[:10]}",
        )
    if in_flight:
        res.violate("lost_saves", f"{label}: still in flight after close: {in_flight}")
    for ln in lines:
        if ln[0] == "raw":
            res.violate("raw_exception", f"{label}: {' '.join(ln)}")
    return {"committed": committed, "failed": len(failed), "reported": reported, "lines": lines}


def check_start(
    res: Result,
    child: Child,
    label: str,
    expect: int | None,
    newest_now: Callable[[], int | None] | None = None,
) -> None:
    """The trainer's start-up: no temporaries left after its manager was built, and the
    resume loaded the newest committed step (``expect``), bit-exactly. With
    ``newest_now``, a dying writer may still have committed a newer step meanwhile: any
    step from ``expect`` to ``newest_now()`` (asked after the resume) is right."""
    start = child.wait_line("start", 60)
    if start[1] != "tmp=0":
        res.violate("leftover_tmp_after_startup", f"{label}: {start}")
    resumed = child.wait_line("resumed", 60)
    if resumed[2] != "ok":
        res.violate("resume_wrong_values", f"{label}: {resumed}")
    got = None if resumed[1] == "none" else int(resumed[1])
    hi = newest_now() if newest_now is not None else expect
    if got != expect and (got is None or hi is None or not (expect or 0) <= got <= hi):
        res.violate("resume_not_newest", f"{label}: resumed {got}, newest committed {expect}..{hi}")


def newest(folder: Path) -> int | None:
    from quicksave.manager.folder import committed_steps

    steps = committed_steps(str(folder))
    return steps[-1] if steps else None


def check_folder(res: Result, folder: Path, label: str) -> None:
    """Every committed checkpoint of ``folder`` passes verify (a writer may be deleting
    some meanwhile: those are skipped; a raw exception from verify is a violation)."""
    for path in faultkit.committed_dirs(folder):
        try:
            problems = faultkit.verify_problems(path)
        except Exception as e:  # noqa: BLE001 - verify raises only CheckpointError
            res.violate("raw_exception", f"{label}: verify of {path}: {faultkit.describe(e)}")
            continue
        if problems:
            res.violate("torn_commits", f"{label}: {Path(path).name}: {problems[:3]}")


def final_trainer(
    res: Result, server: ForkServer, folder: Path, work: Path, kib: int, label: str, **kw: Any
) -> None:
    """A fresh writer after the campaign: start-up leaves no temporaries, resumes the
    newest checkpoint bit-exactly, and its one save commits (the lease is free)."""
    expect = newest(folder)
    child = server.start(
        "trainer", work / f"final-{label}.out", folder=str(folder), seed=SEED, kib=kib,
        extra_steps=1, **kw,
    )  # fmt: skip
    check_start(res, child, f"final {label}", expect)
    status = child.wait_exit(120)
    info = account(res, child, f"final {label}")
    if status != 0 or not info["committed"]:
        res.violate("final_save_failed", f"{label}: status {status}\n{child.tail()}")
    check_folder(res, folder, f"final {label}")


@contextlib.contextmanager
def captured_logs() -> Iterator[list[logging.LogRecord]]:
    """The ``quicksave`` logger's records (WARNING and above) while inside."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("quicksave")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
