"""The trainer's handles on its writer: the :class:`Persister` protocol, and its two
built-in implementations, a thread and a persistent worker process.

A persister runs the ``PersistJob``s the saver (``quicksave.saving.engine``) submits and the
generic calls of the NVRx-compatible queue (``quicksave.compat.nvrx``), one persister per
rank, used from the training thread only. The saver starts one from :data:`PERSISTERS`
(by ``EngineConfig.mode``) or with ``EngineConfig.persister``, a user's (e.g. one that
attaches to a writer process that outlives the trainer):

- ``ThreadPersister`` (``async_mode="thread"``): each job in a thread of the training
  process (``quicksave.worker.execute.execute_job``);
- ``ProcessPersister`` (``async_mode="process"``): one persistent worker process per rank
  (``quicksave.worker.main``), started when the persister is built, so the first save
  pays no start-up. What crosses to it is small control messages, one way (trainer →
  worker; results come back): a staging pool is handed over once as a file descriptor
  and mapped there, so tensor bytes never go through the socket.

Call order: ``map_pool`` once per staging pool → ``submit`` (or ``submit_call``) → ``poll``
until each result arrives → ``unmap_pool`` → ``close`` (see :class:`Persister`).

Trainer-side failure detection (``ProcessPersister.poll``): a dead process, a hung one
(a heartbeat older than ``worker_timeout_s`` and no progress: see ``WorkerConfig`` and
``quicksave.worker.liveness``), or a job running longer than ``save_timeout_s`` each
raise ``WorkerFailedError`` naming the step and the cause; the worker is then killed and
a new one is started for the next save.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Protocol, runtime_checkable

from quicksave.commit import rank_records as records
from quicksave.commit.rank_records import StoreAddress
from quicksave.errors import CheckpointError, WorkerFailedError
from quicksave.storage.backend import Backend
from quicksave.storage.registry import Registry
from quicksave.storage.retry import StoreHealth
from quicksave.worker.calls import CallResult, pickle_call, run_call
from quicksave.worker.config import WorkerConfig
from quicksave.worker.execute import execute_job, store_for
from quicksave.worker.job import JobResult, PersistJob, Phase, failure, untraced
from quicksave.worker.liveness import Liveness
from quicksave.worker.main import HEALTH_OFFSET, command, environment


@runtime_checkable
class Persister(Protocol):
    """The trainer's handle on the writer of its saves (one per rank; training thread
    only). The staging pool itself is the data: a job names byte ranges of a pool the
    persister was given (``PersistJob.files``: offsets and sizes), and the writer reads
    them there; tensor bytes are never copied to hand a save over.

    Call order::

        map_pool(pool_id, fd, nbytes, buffer)  attach a staging pool (once per pool)
        submit(job)                            a save of this rank: ranges of a pool
        poll(timeout)                          results, until each job's has come (wait:
                                               a timeout; raises WorkerFailedError when
                                               the writer is gone: build a new one)
        unmap_pool(pool_id)                    detach a pool (no job of it in flight)
        close(timeout)                         detach from the writer

    Attach and detach: a persister either starts its writer (:class:`ProcessPersister`:
    a child process; :class:`ThreadPersister`: threads of the trainer) or attaches to
    one that outlives the trainer. ``close`` stops what it started, and only detaches
    from what it attached to: a long-lived writer keeps running, with no pool of this
    trainer left mapped. ``kill`` stops at once whatever of the writer this persister
    may stop (a thread cannot be: it finishes its job).

    Attributes:
        health: where the writer's store retries say whether the store answers (the
            trainer reads it while it waits for a pool).
    """

    health: StoreHealth

    def map_pool(self, pool_id: int, fd: int, nbytes: int, buffer: memoryview) -> None:
        """Give the writer the pool ``pool_id``: ``fd`` (a memfd of ``nbytes``, for a
        writer in another process to map) and ``buffer`` (the trainer's own mapping,
        for one in this process)."""
        ...

    def unmap_pool(self, pool_id: int) -> None:
        """Take the pool back from the writer; never raises."""
        ...

    def submit(self, job: PersistJob) -> None:
        """Hand one save of this rank to the writer (its result comes from :meth:`poll`).

        Raises:
            WorkerFailedError: the writer is gone.
        """
        ...

    def poll(self, timeout: float = 0.0) -> list[JobResult | CallResult]:
        """The results that arrived within ``timeout`` seconds (each job's once).

        Raises:
            WorkerFailedError: the writer is gone, hung, or past a job's timeout.
        """
        ...

    def close(self, timeout: float) -> None:
        """Detach (see the class docstring), waiting up to ``timeout`` s for jobs in
        hand; idempotent."""
        ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class PersisterStart:
    """What a persister is started (or attached) with.

    Attributes:
        worker: heartbeat and timeouts of a writer process.
        rank: the rank whose saves it writes.
        store: several ranks: their store, which the writer connects to for the commit
            records (None: one rank).
        store_timeout_s: how long connecting to it may take.
        phase: wraps a job's phases in the trainer's process (profiler ranges).
    """

    worker: WorkerConfig
    rank: int = 0
    store: StoreAddress | None = None
    store_timeout_s: float = 120.0
    phase: Phase = untraced


def start_process(start: PersisterStart) -> ProcessPersister:
    """``EngineConfig.mode="process"``: a persistent worker process of its own."""
    return ProcessPersister(
        start.worker, start.rank, store=start.store, store_timeout_s=start.store_timeout_s
    )


def start_thread(start: PersisterStart) -> ThreadPersister:
    """``EngineConfig.mode="thread"``: threads of the trainer's process."""
    return ThreadPersister(phase=start.phase)


# The built-in persisters, by ``EngineConfig.mode``.
PERSISTERS: Registry[Callable[[PersisterStart], Persister]] = Registry(
    {"process": start_process, "thread": start_thread}
)


@dataclass
class _Pending:
    job_id: int
    step: int | None
    final_path: str | None
    submitted_at: float


class ThreadPersister:
    """Runs jobs in one background thread of the training process (``async_mode="thread"``).

    Args:
        phase: wraps each job's phases (``execute_job``): the engine passes
            ``quicksave.trace.phase``, so that they are profiler ranges of the thread.
    """

    def __init__(self, phase: Phase = untraced) -> None:
        self._phase = phase
        self._pools: dict[int, memoryview] = {}
        self._results: list[JobResult | CallResult] = []
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._stores = records.StoreClients()  # multi-rank jobs' store clients
        self._backends: dict[tuple, Backend] = {}  # object stores' clients, job to job
        self._held: dict[str, Any] = {}  # what a call keeps for a later one (calls.uses_held)
        self.health = StoreHealth()  # whether the store answers this persister's jobs
        self.pid = os.getpid()

    def map_pool(self, pool_id: int, fd: int, nbytes: int, buffer: memoryview) -> None:
        self._pools[pool_id] = buffer

    def unmap_pool(self, pool_id: int) -> None:
        self._pools.pop(pool_id, None)

    def submit(self, job: PersistJob) -> None:
        def run() -> None:
            try:
                r = execute_job(
                    job,
                    self._pools[job.pool_id],
                    store_for(job, self._stores),
                    self._backends,
                    self.health,
                    self._phase,
                )
            except BaseException as e:  # noqa: BLE001 - a lost result would hang the trainer
                r = failure(job, e)
            with self._lock:
                self._results.append(r)

        t = _Joinable(run, f"quicksave-persist-{job.job_id}")
        self._threads[job.job_id] = t
        t.start()

    def submit_call(self, job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        def run() -> None:
            r = run_call(job_id, fn, args, kwargs, self._held)
            with self._lock:
                self._results.append(r)

        t = _Joinable(run, f"quicksave-call-{job_id}")
        self._threads[job_id] = t
        t.start()

    def poll(self, timeout: float = 0.0) -> list[JobResult | CallResult]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                out, self._results = self._results, []
            if out or time.monotonic() >= deadline:
                for r in out:
                    self._threads.pop(r.job_id, None)
                return out
            time.sleep(0.002)

    def close(self, timeout: float) -> None:
        for t in list(self._threads.values()):
            t.join(timeout)

    def kill(self) -> None:  # threads cannot be killed; they finish on their own
        pass


class ProcessPersister:
    """One persistent worker process (``async_mode="process"``).

    The worker is a fresh interpreter started with ``subprocess.Popen`` when this is
    built, running ``quicksave.worker.main.main`` (see there: not ``multiprocessing``, so
    the trainer's ``__main__`` is not imported again). It talks over a Unix socket pair;
    its heartbeat is a double in a shared page.

    Call order (training thread only): ``map_pool`` once per pool → ``submit`` per save →
    ``poll`` until each job's result arrives → ``close``. Any method may raise
    ``WorkerFailedError``; after that, build a new one.
    """

    def __init__(
        self,
        config: WorkerConfig = WorkerConfig(),  # noqa: B008 - frozen: never shared mutably
        rank: int = 0,
        *,
        store: StoreAddress | None = None,
        store_timeout_s: float = 120.0,
    ) -> None:
        """Start the worker. ``store``: the ranks' store of a multi-rank saver, which the
        worker connects to as soon as it runs, in the background (importing torch takes
        seconds of CPU), so that it is ready for the first multi-rank job."""
        self.config = config
        self.rank = rank
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._beat_fd = os.memfd_create("quicksave-heartbeat", os.MFD_CLOEXEC)
        os.ftruncate(self._beat_fd, mmap.PAGESIZE)
        self._beat = mmap.mmap(self._beat_fd, mmap.PAGESIZE)
        # whether the store answers the worker's jobs (written by its retry loop)
        self.health = StoreHealth(self._beat, HEALTH_OFFSET)
        cmd = command(child_sock.fileno(), self._beat_fd, config, store, store_timeout_s)
        try:
            self.process = subprocess.Popen(
                cmd,
                pass_fds=(child_sock.fileno(), self._beat_fd),
                env=environment(),
                stdin=subprocess.DEVNULL,
            )
        except OSError as e:  # e.g. the interpreter is not executable here, out of pids
            parent_sock.close()
            child_sock.close()
            self._beat.close()
            os.close(self._beat_fd)
            raise WorkerFailedError(
                f"cannot start the checkpoint worker process ({sys.executable}): "
                f"{e.strerror or e}; use async_mode='thread' if processes cannot be started here",
                path=os.fspath(e.filename) if e.filename else None,
                rank=rank,
            ) from e
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self.pid = self.process.pid
        self._started = time.monotonic()
        self._liveness = Liveness(self.pid, config.worker_timeout_s)
        self._in_flight: dict[int, _Pending] = {}
        self._failed: WorkerFailedError | None = None
        self.warming = False  # a warm_up() not answered yet (see poll)
        # A private socket pair: safe to hand over the key (see "auth" in quicksave.worker.main).
        self._conn.send(("auth", bytes(multiprocessing.current_process().authkey)))
        self._status: dict[str, Any] | None = None  # the answer to status()

    def _heartbeat(self) -> float:
        return struct.unpack_from("d", self._beat, 0)[0]

    # messages ----------------------------------------------------------------
    def _send(self, msg: tuple, what: str) -> None:
        self._check()
        try:
            self._conn.send(msg)
        except (OSError, EOFError, BrokenPipeError) as e:
            raise self._fail(f"cannot reach the worker process ({what}): {e}") from e

    def map_pool(
        self, pool_id: int, fd: int, nbytes: int, buffer: memoryview | None = None
    ) -> None:
        self._send(("map", pool_id, nbytes), "map pool")
        try:
            send_handle(self._conn, fd, self.pid)
        except OSError as e:
            raise self._fail(f"cannot pass the staging pool to the worker: {e}") from e

    def unmap_pool(self, pool_id: int) -> None:
        if self._failed is None and self.process.poll() is None:
            try:
                self._conn.send(("unmap", pool_id))
            except OSError:
                pass

    def warm_up(self, store: StoreAddress, timeout_s: float) -> None:
        """Have the worker connect to the ranks' store now, which imports torch (seconds
        of CPU), instead of at its first multi-rank job; ``warming`` stays True until it
        answers (``poll`` reads the answer). Sent after ``map_pool``: the answer also
        means that the pools mapped before are populated.

        Raises:
            WorkerFailedError: the worker is gone.
        """
        self._send(("warm", store, timeout_s), "warm up")
        self.warming = True

    def sync(self, timeout_s: float) -> None:
        """Wait until the worker has handled every message sent so far (its start-up
        and the populate of the pools mapped before), at most ``timeout_s`` seconds.

        Raises:
            WorkerFailedError: the worker is gone.
        """
        self.warm_up(None, timeout_s)  # type: ignore[arg-type]  # None: answer only
        deadline = time.monotonic() + timeout_s
        while self.warming and time.monotonic() < deadline:
            self.poll(0.05)  # no job in flight: no result to lose

    def status(self, timeout_s: float) -> dict[str, Any]:
        """What the worker has ready (``records.StoreClients.status``: the ranks' store
        clients connected, connecting, and connections made so far), asked while no job
        is in flight (its results would be lost here); for tests and monitoring.

        Raises:
            WorkerFailedError: the worker is gone.
            CheckpointError: it did not answer within ``timeout_s``.
        """
        assert not self._in_flight, "status() while a job is in flight"
        self._status = None
        self._send(("status",), "status")
        deadline = time.monotonic() + timeout_s
        while self._status is None:
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"the checkpoint worker (pid {self.pid}) did not answer a status query "
                    f"within {timeout_s:g} s",
                    rank=self.rank,
                )
            self.poll(0.05)  # no job in flight: no result to lose
        return self._status

    @property
    def age(self) -> float:
        """Seconds since this worker was started."""
        return time.monotonic() - self._started

    def submit(self, job: PersistJob) -> None:
        # Pending first: a worker found dead while sending fails naming this job's
        # step and path (it died while idle; this save is the one it costs).
        self._in_flight[job.job_id] = _Pending(
            job.job_id, job.step, job.final_path, time.monotonic()
        )
        self._send(("job", job), f"step {job.step}")

    def submit_call(self, job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Run ``fn(*args, **kwargs)`` in the worker (pickled: fn must be importable from
        this process's ``sys.path``, which the worker adopts). CPU tensors in args travel
        through shared memory, not the pipe (see ``pickle_call``).

        Raises:
            CheckpointError: fn or args do not pickle (nothing was sent).
            WorkerFailedError: the worker is gone.
        """
        payload = pickle_call(job_id, fn, args, kwargs)
        self._send(("call", job_id, payload, list(sys.path)), f"call {job_id}")
        self._in_flight[job_id] = _Pending(job_id, None, None, time.monotonic())

    # health ------------------------------------------------------------------
    def _steps(self) -> str:
        steps = [str(p.step) for p in self._in_flight.values() if p.step is not None]
        return f" while writing step {', '.join(steps)}" if steps else ""

    def _fail(self, cause: str) -> WorkerFailedError:
        if self._failed is None:
            self._failed = WorkerFailedError(
                f"checkpoint worker process (pid {self.pid}) failed{self._steps()}: "
                f"{cause}; the checkpoint was not committed and the previous one is intact",
                path=next((p.final_path for p in self._in_flight.values() if p.final_path), None),
                rank=self.rank,
            )
            self.kill()
        return self._failed

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed
        now = time.monotonic()
        code = self.process.poll()
        if code is not None:
            how = (
                f"killed by signal {-code}"
                if code is not None and code < 0
                else f"exit code {code}"
            )
            raise self._fail(f"it died ({how})")
        beat = self._heartbeat()
        if beat == 0.0:
            if now - self._started > self.config.start_timeout_s:
                raise self._fail(f"it did not start within {self.config.start_timeout_s:.0f} s")
        else:
            hung = self._liveness.check(now, beat)  # a stale heartbeat: is it progressing?
            if hung is not None:
                raise self._fail(hung)
        for p in self._in_flight.values():
            if now - p.submitted_at > self.config.save_timeout_s:
                raise self._fail(
                    f"job {p.job_id} took longer than save_timeout_s="
                    f"{self.config.save_timeout_s:.0f} s"
                )

    def poll(self, timeout: float = 0.0) -> list[JobResult | CallResult]:
        """Results that arrived within ``timeout`` seconds (checks health while waiting)."""
        deadline = time.monotonic() + timeout
        out: list[JobResult | CallResult] = []
        while True:
            if self._failed is not None:
                raise self._failed
            wait = min(0.1, max(0.0, deadline - time.monotonic()))
            closed = False
            try:
                while self._conn.poll(wait if not out else 0):
                    kind, payload = self._conn.recv()
                    if kind == "result":
                        self._in_flight.pop(payload.job_id, None)
                        out.append(payload)
                    elif kind == "warm":
                        self.warming = False
                    elif kind == "status":
                        self._status = payload
                    wait = 0
            except (EOFError, OSError):
                closed = True
            # Results already sent count even if the worker exited right after (SIGTERM
            # finishes the job in hand, then exits): drain first, judge health after.
            if out:
                return out
            if closed:  # it is exiting: give the kernel a moment to report how
                try:
                    self.process.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
            self._check()
            if closed:
                raise self._fail("its pipe closed")
            if time.monotonic() >= deadline:
                return out

    def close(self, timeout: float, wait: bool = True) -> None:
        """Ask the worker to finish and exit; kill it after ``timeout`` seconds. Idempotent.

        ``wait=False`` (the worker is idle: every job is done) returns once the request is
        sent; a daemon thread waits for the exit (and kills after ``timeout``). The
        worker's exit, and the freeing of the pool pages it maps last, then cost the
        caller nothing.
        """
        if self._beat_fd < 0:
            return
        if self.process.poll() is None and self._failed is None:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            if not wait:
                _Reaper(self, timeout).start()
            else:
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
                self.kill()
        else:
            self.kill()
        self._conn.close()
        self._beat.close()
        os.close(self._beat_fd)
        self._beat_fd = -1

    def reap(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the worker to exit, then kill it."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass


class _Joinable(threading.Thread):
    """A daemon thread of quicksave's that runs ``fn`` to its end, with a ``stop()``
    that waits for that end: test harnesses that police threads left behind
    (Lightning's) call ``stop()`` on daemon threads."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        super().__init__(target=fn, name=name, daemon=True)

    def stop(self) -> None:
        """Wait until it has run to its end (a job, a call, a worker's exit: each is
        bounded by its own timeout)."""
        self.join()


class _Reaper(_Joinable):
    """Waits for a stopped worker's exit (killing it after ``timeout`` s), so that
    ``close()`` need not."""

    def __init__(self, persister: ProcessPersister, timeout: float) -> None:
        super().__init__(lambda: persister.reap(timeout), "quicksave-reap")
