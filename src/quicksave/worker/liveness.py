"""Is the checkpoint worker hung, or only slow? Judged from its progress in ``/proc``.

A heartbeat alone cannot tell a hung worker from a starved one: on a busy node a
runnable worker may not be scheduled for seconds (its heartbeat thread is waiting for a
CPU), which is slowness, not a failure. So a stale heartbeat is only the start of the
question; the answer comes from what the process did meanwhile:

- stopped (every thread in state ``T`` or ``t``: SIGSTOP, a debugger) → hung, as soon as
  the heartbeat is older than the timeout;
- a thread runnable (``R``: waiting for a CPU) → starved, not hung, however long;
- CPU time used (``utime + stime`` of all its threads) or bytes read or written
  (``rchar``, ``wchar``, ``write_bytes``) since the last look → progressing, not hung;
- otherwise (sleeping, or in ``D`` without any I/O finishing) it is not progressing →
  hung once the heartbeat is older than the timeout *and* it has been seen still for
  half the timeout (watching starts when the heartbeat is half the timeout old, so a
  deadlock is reported after about the timeout, as a heartbeat-only rule would).

The trainer side reads ``/proc/<pid>`` of its own child; nothing here runs in the worker.
Standard library only; imported by ``quicksave.worker.persisters`` (the trainer side), and
torch-free like every module of ``quicksave.worker``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """One look at a process in ``/proc``."""

    cpu_ticks: int  # utime + stime of all its threads, in clock ticks
    io_bytes: int  # rchar + wchar + write_bytes (0 where /proc/<pid>/io is unreadable)
    states: str  # one state letter per thread, e.g. "SSR"

    @property
    def stopped(self) -> bool:
        return bool(self.states) and all(s in "Tt" for s in self.states)

    @property
    def runnable(self) -> bool:
        return "R" in self.states

    def moved_since(self, before: Progress) -> bool:
        return self.cpu_ticks != before.cpu_ticks or self.io_bytes != before.io_bytes


def _stat_fields(path: str) -> list[str]:
    """The fields of a ``stat`` file after the command name (which may hold spaces):
    ``[0]`` is the state letter, ``[11]`` utime, ``[12]`` stime."""
    with open(path, "rb") as f:
        stat = f.read(4096)
    return stat[stat.rindex(b")") + 2 :].decode("ascii", "replace").split()


def read_progress(pid: int) -> Progress | None:
    """What ``/proc`` says about ``pid`` now; None if it cannot be read (no such process,
    no ``/proc``)."""
    try:
        fields = _stat_fields(f"/proc/{pid}/stat")  # CPU of the whole thread group
        cpu = int(fields[11]) + int(fields[12])
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                states.append(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[0])
            except (OSError, ValueError):
                pass  # a thread that just ended
    except (OSError, ValueError, IndexError):
        return None
    io = 0
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f.read(4096).splitlines():
                name, _, value = line.partition(b":")
                if name in (b"rchar", b"wchar", b"write_bytes"):
                    io += int(value)
    except (OSError, ValueError):
        pass  # e.g. not permitted in this container: CPU and states still count
    return Progress(cpu, io, "".join(states))


class Liveness:
    """Judges one worker process from its heartbeat and its progress (see the module
    docstring for the rule). Trainer side; one per worker; call :meth:`check` whenever
    its health matters (each call may read ``/proc`` once)."""

    def __init__(
        self,
        pid: int,
        timeout_s: float,
        read: Callable[[int], Progress | None] = read_progress,
    ) -> None:
        self.pid = pid
        self.timeout_s = timeout_s
        self._read = read
        self._last: Progress | None = None  # the previous look, while the beat is stale
        self._moved_at = 0.0  # when it was last seen progressing (or first watched)

    def check(self, now: float, beat: float) -> str | None:
        """None while the worker is alive (beating, or progressing without beating);
        else why it is hung, for the error message. ``now`` and ``beat`` (its last
        heartbeat) are ``time.monotonic()`` values."""
        age = now - beat
        if age <= self.timeout_s / 2:
            self._last = None
            return None
        p = self._read(self.pid)
        if p is None:  # nothing to judge by but the heartbeat
            return f"no heartbeat for {age:.1f} s (hung?)" if age > self.timeout_s else None
        if self._last is None or p.runnable or p.moved_since(self._last):
            self._moved_at = now
        self._last = p
        if age <= self.timeout_s:
            return None
        if p.stopped:
            return (
                f"no heartbeat for {age:.1f} s: it is stopped (state {p.states[0]}: SIGSTOP, "
                "or a debugger holds it)"
            )
        still = now - self._moved_at
        if still <= self.timeout_s / 2:
            return None
        return (
            f"no heartbeat for {age:.1f} s and not progressing for {still:.1f} s (no CPU "
            f"time, no bytes read or written, no thread runnable; thread states "
            f"{p.states or '?'}): deadlocked?"
        )
