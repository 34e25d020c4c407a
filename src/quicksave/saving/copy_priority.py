"""The background copy's CPU priority: it takes only CPU time that training leaves idle
(``SCHED_IDLE``) until the training thread waits for it; from then on it runs at normal
priority (``SCHED_OTHER``), so the wait lasts no longer than the copy itself.

On a machine whose cores training keeps busy, a copy at normal priority takes its fair
share from the training threads while they compute; at idle priority it fills the gaps
they leave (data loading, Python between kernels, synchronisation) and is raised the
moment the training thread blocks on it (``AsyncSaver.maybe_wait_for_staging``).

Linux schedules threads, each with its own policy. Leaving ``SCHED_IDLE`` needs
``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows the nice value 0 (at least 20):
without either (:func:`can_leave_idle`), the copy stays at normal priority throughout —
a copy that could not be raised again would wait behind a busy machine while training
waits for it.

Call order, per copy: ``IdleUntilWaited(enabled)`` (training thread, before the copy
thread starts) → :meth:`IdleUntilWaited.enter` (first thing on the copy thread) → maybe
:meth:`IdleUntilWaited.waited` (training thread, before it joins the copy) →
:meth:`IdleUntilWaited.leave` (last thing on the copy thread). No collective.
"""

from __future__ import annotations

import logging
import os
import resource
import threading

logger = logging.getLogger("quicksave")

_NICE_ZERO_RLIMIT = 20  # RLIMIT_NICE a thread needs to take nice 0 (20 - nice)


def can_leave_idle() -> bool:
    """Whether a thread of this process may go back from ``SCHED_IDLE`` to normal
    priority at nice 0 (the kernel's rule: ``CAP_SYS_NICE``, or ``RLIMIT_NICE`` ≥ 20)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    except (AttributeError, ValueError, OSError):
        soft = 0
    if soft == resource.RLIM_INFINITY or soft >= _NICE_ZERO_RLIMIT:
        return True
    return _has_cap_sys_nice()


def _has_cap_sys_nice() -> bool:
    cap_sys_nice = 23
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> cap_sys_nice & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


class IdleUntilWaited:
    """One copy's priority: idle until the training thread waits for it.

    Args:
        enabled: lower the copy at all (``EngineConfig.copy_priority == "idle"`` and
            :func:`can_leave_idle`).
    """

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._lock = threading.Lock()
        self._waited = False
        self._tid: int | None = None  # the copy thread's, while it is idle

    def enter(self) -> None:
        """Copy thread, first: take idle priority (unless already waited for)."""
        with self._lock:
            if not self._enabled or self._waited:
                return
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except OSError as e:
                logger.debug("quicksave: the copy stays at normal priority: %s", e)
                return
            self._tid = threading.get_native_id()

    def waited(self) -> None:
        """Training thread, before it blocks on the copy: normal priority from now on."""
        with self._lock:
            self._waited = True
            tid, self._tid = self._tid, None
            if tid is not None:
                # Under the lock: the copy thread is alive until it has left() (below), so
                # the id is still its own.
                _normal(tid)

    def leave(self) -> None:
        """Copy thread, last: back to normal priority (its id may be reused once it
        ends)."""
        with self._lock:
            if self._tid is not None:
                self._tid = None
                _normal(0)


def _normal(tid: int) -> None:
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError as e:  # not permitted after all: the copy finishes at idle priority
        logger.debug("quicksave: cannot raise the copy's priority: %s", e)
