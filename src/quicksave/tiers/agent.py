"""The node agent: the process that gives a job's node memory its lifetime.

One agent per job folder of node memory (``quicksave.tiers.node_memory``), started by the
first trainer of the node that attaches, as ``python -m quicksave.tiers.agent DIR
--idle-s N`` in a session of its own (``start_new_session``): a SIGKILL of the trainer,
or of the trainer's process group, does not reach it. It forks once at start and the
first process exits (after writing ``agent.json``, the agent's pid and start time), so
the agent is no trainer's child and never waits as a zombie on one.

It holds an exclusive ``flock`` on ``DIR/agent.lock`` for its whole life: "an agent is
alive" is "that lock is taken", whatever became of its pid. Every ``PERIOD_S`` it looks
at the trainers registered under ``DIR/trainers/`` (``<pid>-<start>-<token>``: a
registration counts only while a process with that pid *and* that start time runs, so a
reused pid is no trainer; the dead ones are removed) and frees the job's memory (deletes
``DIR``) and exits:

- when ``DIR/ended`` exists (a trainer detached with ``job_done=True``) and no trainer is
  attached: the job is over;
- when no trainer has been attached for ``--idle-s`` seconds: the job is gone or will not
  come back in time (a restarted trainer that attaches sooner finds the snapshot);
- on SIGTERM (whoever ends the node's processes wants its memory back);
- without deleting anything, when ``DIR`` is gone or is another folder of that name.

The deletion holds the job folder's attach lock (an ``flock`` on ``DIR`` itself, which
``NodeMemory.attach`` holds while it registers a trainer): a trainer that attaches at that
moment waits, finds the folder gone, and starts afresh.

Standard library only, and nothing above the package's ``__init__``: the agent starts in
a fraction of a second and never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

AGENT_LOCK = "agent.lock"  # held by the agent for its whole life
AGENT_FILE = "agent.json"  # {"pid", "start"} of the agent
AGENT_LOG = "agent.log"  # the agent's stderr
ENDED = "ended"  # the job is over: free the memory once no trainer is attached
TRAINERS = "trainers"  # one empty file per attached trainer: <pid>-<start>-<token>
PERIOD_S = 0.25


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field
    22); None if no such process runs (gone, or a zombie that only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def is_running(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a process that
    reuses the pid has another start time)."""
    return start_time(pid) == start


def registration_name(pid: int, start: int, token: str) -> str:
    """The file name under ``trainers/`` that registers one attached trainer."""
    return f"{pid}-{start}-{token}"


def live_trainers(path: Path) -> list[str]:
    """The registrations under ``path/trainers`` whose process runs; removes the others
    (and names that are no registration)."""
    try:
        names = os.listdir(path / TRAINERS)
    except FileNotFoundError:
        return []
    live = []
    for name in names:
        try:
            pid, start, _ = name.split("-", 2)
            alive = is_running(int(pid), int(start))
        except ValueError:
            alive = False
        if alive:
            live.append(name)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path / TRAINERS / name)
    return sorted(live)


def agent_command(path: Path, idle_s: float) -> list[str]:
    """The agent's command line, for ``subprocess.Popen`` with the package on
    ``PYTHONPATH``."""
    return [sys.executable, "-m", "quicksave.tiers.agent", str(path), "--idle-s", repr(idle_s)]


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _free(path: Path, force: bool) -> bool:
    """Delete the job folder under its attach lock if no trainer is attached (``force``:
    even so); False if a trainer holds the lock (attaching) or is attached."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if not force and live_trainers(path):
            return False
        # a straggler (a dead trainer's writer finishing a file) may add a file meanwhile
        for _ in range(3):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                return True
        print(f"quicksave agent: cannot delete {path}; retrying", file=sys.stderr)
        return False
    finally:
        os.close(fd)


def serve(path: Path, lock_fd: int, idle_s: float, stop: threading.Event) -> None:
    """The agent's loop (see the module docstring), until the job's memory is freed or
    the folder is gone."""
    idle_since = time.monotonic()
    while True:
        if not _same_file(path / AGENT_LOCK, lock_fd):
            return  # deleted by someone else (and maybe made again, with its own agent)
        now = time.monotonic()
        if live_trainers(path) and not stop.is_set():
            idle_since = now
        elif stop.is_set() or (path / ENDED).exists() or now - idle_since >= idle_s:
            if _free(path, force=stop.is_set()):
                return
        stop.wait(PERIOD_S)


def main(argv: list[str]) -> int:
    """Entry point: ``DIR --idle-s N``. Returns (in the first process) once the agent runs:
    0, with ``DIR/agent.json`` written; 3 if another agent holds the folder."""
    parser = argparse.ArgumentParser(prog="python -m quicksave.tiers.agent")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--idle-s", type=float, required=True)
    args = parser.parse_args(argv)
    path: Path = args.dir
    lock_fd = os.open(path / AGENT_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"quicksave agent: another agent holds {path / AGENT_LOCK}", file=sys.stderr)
        return 3
    # the handlers before the fork, so the agent has them from its first instruction: its
    # pid is published by the first process, and a SIGTERM may follow at once (the
    # default action would kill it without freeing the memory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pid = os.fork()
    if pid:  # the first process: say who the agent is, and leave it to run alone
        tmp = path / f"{AGENT_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({"pid": pid, "start": start_time(pid)}))
        os.replace(tmp, path / AGENT_FILE)
        os._exit(0)
    serve(path, lock_fd, args.idle_s, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
