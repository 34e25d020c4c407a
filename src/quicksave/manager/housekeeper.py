"""The folder's housekeeping in a thread of its own: the store calls a front end needs
after a commit (removing failed saves' leftovers, retention, a previous lease holder's
leftovers) never run on the training thread, so that a store that is down or slow stalls
no training step (docs/RELIABILITY.md, "The training thread never waits on the store").

Call order (the session, on the lease holder): :meth:`Housekeeper.request` from the
training thread after a commit was seen (returns at once) → the thread runs the session's
work (``CheckpointSession._housekeep_now``) with the steps to protect, one request at a
time; requests that arrive meanwhile are merged into one → :meth:`Housekeeper.stop` at
``release()`` (runs what was requested, waits up to a bound, then gives up).

Paths a save is about to write are *claimed* by the training thread (:meth:`claim`, no
I/O) before the save is handed over; the thread removes a failed save's leftover only
if it is not claimed, and a claim of a path the thread is removing now is refused (the
save then fails, named, instead of racing with the deletion).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("quicksave")


class Housekeeper:
    """One daemon thread that runs ``work(protect)`` when asked.

    Args:
        work: the housekeeping itself, ``work(housekeeper, protect)`` (``protect``:
            steps it must not delete); it never raises (the session's logs its failures).
        name: the thread's name (seen in a profiler or ``py-spy``).
    """

    def __init__(self, work: Callable[[Housekeeper, set[int]], None], name: str) -> None:
        self._work = work
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._protect: set[int] | None = None  # the pending request (None: none)
        self._running = False
        self._stopping = False
        self._claimed: set[str] = set()
        self._removing: str | None = None
        self._thread: threading.Thread | None = None

    def request(self, protect: set[int]) -> None:
        """Ask for one round of housekeeping (merged with a pending one). No I/O."""
        with self._lock:
            if self._stopping:
                return
            self._protect = (self._protect or set()) | protect
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._wake.notify()

    def claim(self, path: str) -> bool:
        """The training thread is about to save to ``path``: leftovers there are not
        removed from now on. False if the thread is removing one there right now."""
        with self._lock:
            if self._removing == path:
                return False
            self._claimed.add(path)
            return True

    def unclaim(self, path: str) -> None:
        """The save to ``path`` ended (committed or failed)."""
        with self._lock:
            self._claimed.discard(path)

    def start_removing(self, path: str) -> bool:
        """The thread is about to remove the leftover at ``path``: False if a save has
        claimed it (then it is left alone)."""
        with self._lock:
            if path in self._claimed:
                return False
            self._removing = path
            return True

    def done_removing(self) -> None:
        with self._lock:
            self._removing = None

    def stop(self, timeout: float) -> bool:
        """Run what was requested, then end the thread; wait for it up to ``timeout``
        seconds. True if it ended (False: it is still in a store call; it is a daemon
        thread and ends with the process)."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._protect is None and not self._stopping:
                    self._wake.wait()
                protect = self._protect
                if protect is None:  # stopping, nothing left to do
                    return
                self._protect = None
                self._running = True
            try:
                self._work(self, protect)
            except BaseException as e:  # noqa: BLE001 - a thread must not die silently
                logger.warning("quicksave: housekeeping failed: %s", e)
            finally:
                with self._lock:
                    self._running = False
                    self._wake.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no round is running or pending (tests, ``close()``); True if so."""
        with self._lock:
            return self._wake.wait_for(lambda: not self._running and self._protect is None, timeout)
