"""The worker process: its command line, its entry point and its loop.

The trainer's ``ProcessPersister`` (``quicksave.worker.persisters``), one per rank,
starts it when it is built, with ``subprocess.Popen`` (``command``, ``environment``): a
fresh interpreter of the trainer's Python running ``main``. It is not a
``multiprocessing`` child: the training script's ``__main__`` is not imported again, and
training scripts need no ``if __name__ == "__main__"`` guard. Then the worker:

- reads small pickled control messages from a Unix socket pair, only ever sent by the
  trainer, and answers jobs and calls with their results (``_serve`` lists them). Tensor
  bytes never cross the socket: each staging pool is mapped once, through its file
  descriptor passed over the socket (the pool is a ``memfd``: no path, nothing to leak),
  and a job only names offsets in it;
- runs at a lower CPU priority (``nice``), so that on a small machine training keeps its
  cores; optionally on given CPUs and in a given I/O class;
- beats a heartbeat (a double in a page shared with the trainer) from a thread of its own;
- exits by itself within a second when its parent dies (even by SIGKILL: a thread watches
  its parent pid) or closes the socket; on SIGTERM it finishes the job in hand, then
  exits; SIGINT is ignored (Ctrl-C goes to the trainer, which closes it);
- runs each job (``quicksave.worker.execute``) or call (``quicksave.worker.calls``) and
  reports its outcome ("done" with checksums and timings, or the error).

Imports no torch at start (importing it costs seconds of CPU): torch comes in with the
ranks' store client of a multi-rank saver (connected at start-up, in the background) or
with the first generic call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import mmap
import multiprocessing
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

from quicksave.commit import rank_records as records
from quicksave.commit.rank_records import StoreAddress
from quicksave.storage.backend import Backend
from quicksave.storage.retry import StoreHealth
from quicksave.worker.calls import run_pickled_call
from quicksave.worker.config import WorkerConfig
from quicksave.worker.execute import Templates, execute_job, store_for
from quicksave.worker.job import Arrivals, PersistJob

# The page shared with the trainer: the heartbeat (a double at 0), and where the
# store stands for the jobs (a double at HEALTH_OFFSET: storage.retry.StoreHealth).
HEALTH_OFFSET = 8


def command(
    sock_fd: int,
    beat_fd: int,
    config: WorkerConfig,
    store: StoreAddress | None = None,
    store_timeout_s: float = 120.0,
) -> list[str]:
    """The worker's command line (its arguments: see ``main``), run by the trainer with
    ``environment()``; ``sock_fd`` and ``beat_fd`` must be passed to it (``pass_fds``)."""
    return [
        sys.executable,
        "-c",
        "import sys; from quicksave.worker.main import main; main(sys.argv[1:])",
        str(sock_fd),
        str(beat_fd),
        str(os.getpid()),
        str(config.nice),
        str(config.heartbeat_s),
        ",".join(str(c) for c in config.cpus or ()),
        "" if config.io_priority is None else str(config.io_priority),
        "1" if config.daemon else "0",
        "" if store is None else _store_spec(store, store_timeout_s),
    ]


def environment() -> dict[str, str]:
    """The worker's environment: the trainer's, with this package's root first on
    ``PYTHONPATH`` (the worker imports the same ``quicksave`` as the trainer)."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def _store_spec(store: StoreAddress, timeout_s: float) -> str:
    """The worker's STORE argument (see ``main``)."""
    return json.dumps({**dataclasses.asdict(store), "timeout_s": timeout_s})


def main(argv: list[str]) -> None:
    """Entry point of the worker process: ``SOCK_FD BEAT_FD PARENT_PID NICE PERIOD CPUS
    IO_CLASS DAEMON STORE`` (CPUS: comma-separated, empty for the trainer's; IO_CLASS empty
    for the trainer's; DAEMON ``1`` or ``0``; STORE empty, or the JSON of the ranks'
    ``StoreAddress`` plus ``timeout_s`` to connect to at start-up)."""
    sock_fd, beat_fd, parent_pid = int(argv[0]), int(argv[1]), int(argv[2])
    nice, period = int(argv[3]), float(argv[4])
    cpus = tuple(int(c) for c in argv[5].split(",") if c) if len(argv) > 5 else ()
    io_class = int(argv[6]) if len(argv) > 6 and argv[6] else None
    daemon = len(argv) > 7 and argv[7] == "1"
    connect = None
    if len(argv) > 8 and argv[8]:
        spec = json.loads(argv[8])
        timeout_s = float(spec.pop("timeout_s"))
        connect = (StoreAddress(**spec), timeout_s)
    heartbeat = mmap.mmap(beat_fd, mmap.PAGESIZE)
    os.close(beat_fd)
    _serve(
        Connection(sock_fd), heartbeat, parent_pid, nice, period, cpus, io_class, daemon, connect
    )


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # orphaned: the trainer is gone, nothing can be committed for it
        time.sleep(0.25)


def _beat(heartbeat: mmap.mmap, period: float) -> None:
    while True:
        struct.pack_into("d", heartbeat, 0, time.monotonic())
        time.sleep(period)


def _serve(
    conn: Connection,
    heartbeat: mmap.mmap,
    parent_pid: int,
    nice: int,
    period: float,
    cpus: tuple[int, ...] = (),
    io_class: int | None = None,
    daemon: bool = False,
    connect: tuple[StoreAddress, float] | None = None,
) -> None:
    """The worker's loop, until "stop", the socket closes, or SIGTERM. Messages (pickled
    tuples; answers only where a line says so):

    - ``("auth", key)``: the trainer's ``multiprocessing`` authkey (sent first);
    - ``("map", pool_id, nbytes)``, then the pool's file descriptor: map it (populated);
    - ``("unmap", pool_id)``;
    - ``("job", PersistJob)`` → ``("result", JobResult)``;
    - ``("call", job_id, payload, sys_path)`` → ``("result", CallResult)``;
    - ``("warm", address, timeout_s)`` → ``("warm", None)`` once connected to the ranks'
      store (``address`` None: answer only);
    - ``("status",)`` → ``("status", StoreClients.status())``;
    - ``("stop",)``: unmap the pools and return.
    """
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if daemon:  # as a daemonic multiprocessing process: no children of its own
        multiprocessing.current_process().daemon = True
    if io_class is not None:
        _set_io_class(io_class)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # finish the job in hand
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    if cpus:  # every thread started from here on inherits it
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:  # e.g. outside this container's cpuset: run where allowed
            print(
                f"quicksave worker: cannot run on CPUs {list(cpus)} ({e.strerror}); "
                f"running on {sorted(os.sched_getaffinity(0))}",
                file=sys.stderr,
            )
    stores = records.StoreClients()  # connected at start-up (``connect``) or by a job
    if connect is None:
        _lower_priority(nice)
    else:
        # A multi-rank saver's worker connects to the ranks' store now, in the background,
        # and the whole worker runs at the trainer's priority until it is connected: the
        # import of torch (seconds of CPU, once) is then done by the first save even
        # beside a training loop that keeps every core busy (at nice 10 such a loop
        # starves it past the first save; and a nice-10 thread holding the GIL stalls it
        # too).
        def connect_then_lower(address: StoreAddress, timeout_s: float) -> None:
            try:
                stores.get(address, timeout_s)  # a failure: the first job reports it
            finally:
                _lower_priority(nice)

        threading.Thread(
            target=connect_then_lower, args=connect, name="quicksave-start", daemon=True
        ).start()
    threading.Thread(target=_beat, args=(heartbeat, period), daemon=True).start()
    pools: dict[int, tuple[mmap.mmap, memoryview]] = {}
    backends: dict[tuple, Backend] = {}  # object stores' clients, kept from job to job
    health = StoreHealth(heartbeat, HEALTH_OFFSET)  # the trainer reads it (persisters.py)
    held: dict[str, Any] = {}  # what a call keeps for a later one (calls.uses_held)
    lock = threading.Lock()  # in-place jobs answer from their own threads
    paused = _PausedCollector()
    templates = Templates()  # of the manifests' skeletons, kept from job to job
    arrivals = Arrivals()  # the skeletons themselves, unpickled once

    def send(msg: tuple) -> bool:
        try:
            with lock:
                conn.send(msg)
            return True
        except OSError:
            return False

    while not stopping.is_set():
        try:
            if not conn.poll(0.2):
                continue
            with paused:  # (a job's unpickling builds its manifest's skeleton)
                msg = arrivals.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "map":
            _, pool_id, nbytes = msg
            fd = recv_handle(conn)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.close(fd)
            pools[pool_id] = (mm, memoryview(mm))
        elif kind == "unmap":
            entry = pools.pop(msg[1], None)
            if entry is not None:
                _unmap(*entry)
        elif kind == "job":
            job: PersistJob = msg[1]
            run = _job_runner(
                job, pools[job.pool_id][1], stores, backends, health, send, paused, templates
            )
            if job.linked is not None:  # in place: a link and a commit, beside a long write
                threading.Thread(target=run, name="quicksave-in-place", daemon=True).start()
            elif not run():
                break
        elif kind == "warm":  # connected before answering: its first job pays no import
            _, address, timeout_s = msg
            if address is not None:  # None: only answer
                stores.get(address, timeout_s)  # a failure: the first job reports it
            if not send(("warm", None)):
                break
        elif kind == "status":
            if not send(("status", stores.status())):
                break
        elif kind == "call":
            _, job_id, payload, sys_path = msg
            with paused:
                result = run_pickled_call(job_id, payload, sys_path, held)
            if not send(("result", result)):
                break
        elif kind == "auth":
            # The trainer's key, so that torch's shared-memory tensors (whose file
            # descriptors the worker fetches from the trainer's resource sharer) unpickle.
            multiprocessing.current_process().authkey = msg[1]
        elif kind == "stop":
            break
    for mm, view in pools.values():
        _unmap(mm, view)


def _job_runner(
    job: PersistJob,
    pool: memoryview,
    stores: Any,
    backends: dict,
    health: StoreHealth,
    send: Callable[[tuple], bool],
    paused: contextlib.AbstractContextManager,
    templates: Templates,
) -> Callable[[], bool]:
    """``job`` run (the collector paused) and its result sent (False: the pipe is gone)."""

    def run() -> bool:
        with paused:
            store = store_for(job, stores)
            result = execute_job(job, pool, store, backends, health, templates=templates)
        return send(("result", result))

    return run


class _PausedCollector:
    """The cyclic garbage collector paused while any job or call runs (they may overlap:
    in-place jobs run on threads of their own), as ``api._engine_call`` pauses it around
    a save in the trainer. A job builds its manifest (thousands of dicts and entries,
    alive until it is written): collections during it walk them again and again, a few
    milliseconds of the worker's CPU per save, taken from training on a small machine.
    What a job allocates is freed by reference counting; a cycle (an error's traceback)
    waits for the next collection, after the job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._running += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0 and self._was_enabled:
                gc.enable()


def _lower_priority(nice: int) -> None:
    """Add ``nice`` to the nice value of every thread of this process. On Linux the nice
    value is per thread, and a new thread inherits its creator's: threads started later
    by any of these run lowered too."""
    if not nice:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        except OSError:
            pass  # a thread that just ended


def _unmap(mm: mmap.mmap, view: memoryview) -> None:
    try:
        view.release()
        mm.close()
    except BufferError:
        pass  # a slice is still referenced (a failed job's traceback): freed with it


def _set_io_class(io_class: int) -> None:
    """``ionice -c io_class`` for this process (Linux ``ioprio_set``); a warning on
    stderr where the kernel or the platform refuses."""
    import ctypes
    import platform

    numbers = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
    nr = numbers.get(platform.machine())
    ok = False
    if nr is not None and 0 <= io_class <= 3:
        libc = ctypes.CDLL(None, use_errno=True)
        # IOPRIO_WHO_PROCESS = 1, this process; class in bits 13+, level 4 (the middle)
        level = 0 if io_class in (0, 3) else 4
        ok = libc.syscall(nr, 1, 0, (io_class << 13) | level) == 0
    if not ok:
        print(f"quicksave worker: cannot set I/O class {io_class}", file=sys.stderr)
