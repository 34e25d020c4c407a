"""The overlap copy's CPU priority (``saving/copy_priority.py``) on real threads: idle
while it runs alone, normal once the training thread waits for it, never lowered when
it cannot be raised back."""

from __future__ import annotations

import os
import threading

import pytest

from quicksave.errors import CheckpointError
from quicksave.saving.config import EngineConfig
from quicksave.saving.copy_priority import IdleUntilWaited, can_leave_idle

needs_idle = pytest.mark.skipif(
    not can_leave_idle(), reason="this process may not raise a thread back from SCHED_IDLE"
)


def _copy_thread(priority: IdleUntilWaited, seen: list[int], go: threading.Event) -> None:
    priority.enter()
    seen.append(os.sched_getscheduler(0))
    go.wait(30)  # the "copy" runs until the trainer has waited
    seen.append(os.sched_getscheduler(0))
    priority.leave()
    seen.append(os.sched_getscheduler(0))


def _run(priority: IdleUntilWaited, wait_first: bool = False) -> list[int]:
    seen: list[int] = []
    go = threading.Event()
    if wait_first:
        priority.waited()
    t = threading.Thread(target=_copy_thread, args=(priority, seen, go))
    t.start()
    while not seen and t.is_alive():
        t.join(0.01)
    priority.waited()  # the training thread blocks on the copy from here
    go.set()
    t.join()
    return seen


@needs_idle
def test_the_copy_is_idle_until_waited_for_then_normal() -> None:
    seen = _run(IdleUntilWaited(True))
    assert seen == [os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_OTHER]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the waiting thread is untouched


@needs_idle
def test_a_copy_waited_for_before_it_starts_is_never_lowered() -> None:
    assert _run(IdleUntilWaited(True), wait_first=True) == [os.SCHED_OTHER] * 3


def test_disabled_keeps_normal_priority() -> None:
    assert _run(IdleUntilWaited(False)) == [os.SCHED_OTHER] * 3


def test_the_probe_matches_what_the_kernel_allows() -> None:
    # Going idle is always allowed; coming back only where the probe says so.
    out: list[object] = []

    def probe() -> None:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            out.append(True)
        except PermissionError:
            out.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    assert out == [can_leave_idle()]


def test_the_config_names_the_choices() -> None:
    assert EngineConfig().copy_priority == "idle"
    with pytest.raises(CheckpointError, match="copy_priority must be one of"):
        EngineConfig(copy_priority="low")  # type: ignore[arg-type]
