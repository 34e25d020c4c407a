"""The fork server's client: fork fresh children that already imported torch.

``fault_child.py serve`` imports torch and quicksave once and forks one child per role
(a trainer, an eval loop); each child writes protocol lines to its own file. See
``fault_child.py`` for the roles and their lines.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from faultkit import REPO, children_of, kill_quietly

CHILD = Path(__file__).resolve().parent / "fault_child.py"


class ForkServer:
    """Client of ``fault_child.py serve``: one interpreter that imported torch and
    quicksave once, and forks a fresh child for each role (a trainer, an eval loop, a
    checker). A forked child shares no state with any other child: it is as fresh as a
    new interpreter, without the seconds of imports.

    Each child writes its protocol lines (``key value ...``, one ``write`` each) to its
    own file; the server reports each child's exit status."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            bufsize=1,
        )
        self._pids: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._started: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start ({CHILD} serve)")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "ready":
                self._ready.set()
            elif parts[0] == "pid":
                self._pids.put(int(parts[1]))
            elif parts[0] == "exited":
                with self._cond:
                    self._exits[int(parts[1])] = int(parts[2])
                    self._cond.notify_all()

    def start(self, role: str, out: Path, **args: Any) -> Child:
        """Fork a child running ``role`` with ``args``; its lines go to ``out``."""
        assert self.proc.stdin is not None
        out.parent.mkdir(parents=True, exist_ok=True)
        self.proc.stdin.write(f"go {role} {out} {json.dumps(args)}\n")
        self.proc.stdin.flush()
        pid = self._pids.get(timeout=60)
        self._started.append(pid)
        return Child(self, pid, out)

    def kill_all(self) -> list[int]:
        """SIGKILL every child still running (and its children: workers), e.g. after a
        campaign failed half-way; returns their pids."""
        running = [pid for pid in self._started if self.exit_status(pid, 0) is None]
        for pid in running:
            for kid in children_of(pid):
                kill_quietly(kid)
            kill_quietly(pid)
        for pid in running:
            self.exit_status(pid, 10)
        self._started = [pid for pid in self._started if pid not in running]
        return running

    def exit_status(self, pid: int, timeout: float) -> int | None:
        """The raw wait status of child ``pid``, or None if it is still running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._exits[pid]

    def close(self) -> None:
        """Kill the children still running, then stop the server."""
        if self.proc.poll() is None:
            self.kill_all()
            assert self.proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Child:
    """A forked child of the fork server, and its protocol lines."""

    server: ForkServer
    pid: int
    out: Path
    killed_at: float | None = None

    def lines(self) -> list[list[str]]:
        try:
            text = self.out.read_text()
        except FileNotFoundError:
            return []
        return [ln.split(" ") for ln in text.splitlines() if ln]

    def find(self, key: str) -> list[list[str]]:
        return [ln for ln in self.lines() if ln[0] == key]

    def wait_line(self, key: str, timeout: float = 60.0) -> list[str]:
        """The first line starting with ``key``, waiting for it (and failing with the
        child's output if it exits first or the wait times out)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(key)
            if found:
                return found[0]
            if self.server.exit_status(self.pid, 0) is not None:
                found = self.find(key)
                if found:
                    return found[0]
                raise AssertionError(f"child exited without '{key}':\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no '{key}' from the child in {timeout} s:\n{self.tail()}")
            time.sleep(0.01)

    def wait_exit(self, timeout: float = 120.0) -> int:
        status = self.server.exit_status(self.pid, timeout)
        if status is None:
            kill_quietly(self.pid)
            for w in children_of(self.pid):
                kill_quietly(w)
            raise AssertionError(f"child {self.pid} still running after {timeout} s")
        return status

    def tail(self, n: int = 40) -> str:
        texts = []
        for path in (self.out, Path(f"{self.out}.err")):
            with contextlib.suppress(FileNotFoundError):
                texts.append("\n".join(path.read_text().splitlines()[-n:]))
        return "\n---\n".join(texts)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        kill_quietly(self.pid, sig)
        self.killed_at = time.monotonic()
