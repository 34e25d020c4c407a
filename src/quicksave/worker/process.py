"""Persist in the background: the job format, its execution, and the worker process.

``execute_job`` writes one rank's staged file images from the pool and commits them; it
runs either in a thread of the training process (``ThreadPersister``) or in one
persistent worker process per rank (``ProcessPersister``), which:

- is started with ``spawn`` when the saver is built, so the first save pays no start-up;
- maps each staging pool once, through a file descriptor passed over a Unix socket (the
  pool is a ``memfd``: no path, nothing to leak); tensor bytes never cross the pipe;
- runs at a lower CPU priority, so that on a small machine training keeps its cores;
- beats a heartbeat, and exits by itself within a second when its parent dies (even by
  SIGKILL) or closes the pipe; on SIGTERM it finishes the job in hand, then exits;
- reports every job's outcome ("done" with checksums and timings, or the error).

Control messages are small pickled tuples of this module's dataclasses.

Trainer-side failure detection (``ProcessPersister.poll``): a dead process, a hung one
(a heartbeat older than ``worker_timeout_s`` and no progress: see ``WorkerConfig``), or a
job running longer than ``save_timeout_s`` each raise ``WorkerFailedError`` naming the
step and the cause; the worker is then killed and a new one is started for the next save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import mmap
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler, recv_handle, send_handle
from typing import Any

from quicksave import commit, errors
from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, WorkerFailedError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.manifest import FileEntry, Manifest, to_json_bytes
from quicksave.parts import (
    RankPart,
    manifest_from_parts,
    part_name,
    read_part,
    write_part,
    write_part_object,
)
from quicksave.ranks import records
from quicksave.ranks.records import StoreAddress
from quicksave.storage.backend import Backend, join
from quicksave.storage.local import LocalBackend
from quicksave.storage.location import Location
from quicksave.worker import fnpickle
from quicksave.worker.liveness import Liveness


@dataclass(frozen=True)
class FileJob:
    name: str
    base: int  # pool offset of the file image
    size: int
    entries: tuple[tuple[str, int, int], ...]  # (safetensors key, file offset, length)


@dataclass(frozen=True)
class PersistJob:
    """Everything the worker needs for one save of one rank (no tensor bytes)."""

    job_id: int
    pool_id: int
    step: int | None
    rank: int
    final_path: str
    tmp_dir: str
    files: tuple[FileJob, ...]
    manifest: Manifest | None  # checksums still empty; multi-rank: the coordinator's only
    chunk_keys: dict[str, tuple[str, int]]  # safetensors key -> (fqn, chunk index)
    dcp_metadata: bytes  # the pickled .metadata (built by the trainer at plan time)
    fsync: bool = True
    o_direct: bool = True
    thread_count: int = 2
    dist: DistCommit | None = None  # multi-rank: commit through parts and store records
    # An object store's checkpoint location (None: the local filesystem). Its objects are
    # written straight under ``final_path``'s prefix (``tmp_dir`` is that prefix too),
    # and the manifest, written last, commits them.
    location: Location | None = None
    # Replace a committed checkpoint at ``final_path`` atomically (local, single rank).
    replace: bool = False
    # Chunk digests the trainer computed while staging (chunk key -> xxh3-64 hex): the
    # writer hashes only the chunks missing here.
    digests: dict[str, str] = field(default_factory=dict)
    # Bytes per second each writer thread writes at most (local files; None: no limit).
    write_rate: float | None = None


@dataclass(frozen=True)
class DistCommit:
    """The multi-rank half of a PersistJob (protocol: ``quicksave.ranks.records``).

    Every rank writes its files and its part, then posts its rank record; the
    coordinator's writer waits for all records and commits (its job's ``manifest`` is the
    skeleton and ``chunk_keys`` cover every rank); the others wait for the commit record.
    """

    token: str  # names this save's records; agreed by all ranks at plan time
    world_size: int
    coordinator: int
    store: StoreAddress
    objects: dict[str, Any]  # typed JSON values of the objects this rank owns
    timeout_s: float  # the coordinator's wait for every rank; others wait a bit longer


@dataclass(frozen=True)
class JobResult:
    job_id: int
    step: int | None
    ok: bool
    bytes_written: int = 0
    write_s: float = 0.0
    commit_s: float = 0.0
    finished_at: float = 0.0  # time.monotonic() when durable (comparable across processes)
    cpu_s: float = 0.0  # CPU seconds of the job's thread and its writer threads
    bytes_hashed: int = 0  # chunk bytes the writer hashed (not given by the trainer)
    error_type: str = ""
    error_message: str = ""
    error_path: str | None = None
    error_fqn: str | None = None
    error_rank: int | None = None
    detail: str = ""

    def error(self) -> CheckpointError:
        cls = getattr(errors, self.error_type, None)
        if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
            cls = CheckpointError
        return cls(
            self.error_message, path=self.error_path, fqn=self.error_fqn, rank=self.error_rank
        )


def _fill_checksums(
    m: Manifest, digests: dict[str, str], keys: dict[str, tuple[str, int]]
) -> Manifest:
    tensors = dict(m.tensors)
    chunks: dict[str, list] = {fqn: list(t.chunks) for fqn, t in m.tensors.items()}
    for key, digest in digests.items():
        fqn, i = keys[key]
        chunks[fqn][i] = dataclasses.replace(chunks[fqn][i], xxh3_64=digest)
    for fqn, t in m.tensors.items():
        tensors[fqn] = dataclasses.replace(t, chunks=tuple(chunks[fqn]))
    return dataclasses.replace(m, tensors=tensors)


def execute_job(
    job: PersistJob,
    pool: memoryview,
    store: Any = None,
    backends: dict[tuple, Backend] | None = None,
) -> JobResult:
    """Write the job's files from ``pool`` (the staged images), then commit. Never raises:
    failures come back in the JobResult, and what was written is removed.

    A multi-rank job (``job.dist``) needs ``store``, a client of the ranks' store; its
    result is the outcome of the whole checkpoint, not only of this rank's files.
    ``backends`` keeps object-store backends (their clients) from job to job.
    """
    try:
        backend = _backend_for(job, backends if backends is not None else {})
    except BaseException as e:  # noqa: BLE001 - e.g. the extra is not installed
        return _failure(job, e)
    if job.dist is not None:
        return _execute_dist_job(job, pool, store, backend)
    t0 = time.monotonic()
    usage = _Usage(time.thread_time())
    try:
        digests = _write_files(job, pool, backend, usage)
        t1 = time.monotonic()
        commit_files(
            job.tmp_dir,
            job.final_path,
            _fill_checksums(job.manifest, digests, job.chunk_keys),
            job.dcp_metadata,
            backend,
            replace=job.replace,
        )
        t2 = time.monotonic()
        return _done(job, t0, t1, t2, usage)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the trainer
        _discard(job, backend)
        return _failure(job, e)


@dataclass
class _Usage:
    """What one job cost the persister: CPU seconds of its thread (from ``cpu0``, its
    ``time.thread_time()`` at the start) and of its writer threads, chunk bytes hashed."""

    cpu0: float
    helpers_cpu_s: float = 0.0
    bytes_hashed: int = 0

    def cpu_s(self) -> float:
        return time.thread_time() - self.cpu0 + self.helpers_cpu_s


def _backend_for(job: PersistJob, backends: dict[tuple, Backend]) -> Backend:
    """The backend a job writes through: a fresh local one (it holds only settings), or
    the object store's, kept in ``backends`` from job to job."""
    if job.location is None:
        return LocalBackend(
            fsync=job.fsync, o_direct=job.o_direct, rank=job.rank, write_rate=job.write_rate
        )
    key = job.location.backend_id()
    if key not in backends:
        backends[key] = job.location.open(rank=job.rank)
    return backends[key]


def _discard(job: PersistJob, backend: Backend, parts: bool = False) -> None:
    """Remove what a failed job of this rank wrote (best effort; on object stores
    objects without a manifest are invisible anyway, and start-up clean-up takes them)."""
    if backend.atomic_rename:
        shutil.rmtree(job.tmp_dir, ignore_errors=True)
        return
    keys = [join(job.tmp_dir, f.name) for f in job.files]
    if parts and job.dist is not None:
        keys += [join(job.tmp_dir, part_name(r)) for r in range(job.dist.world_size)]
    elif job.dist is not None:
        keys.append(join(job.tmp_dir, part_name(job.rank)))
    with contextlib.suppress(Exception):
        backend.delete(keys)


def _write_files(
    job: PersistJob, pool: memoryview, backend: Backend, usage: _Usage
) -> dict[str, str]:
    """Write every file image of the job into its temporary directory (an object store:
    under the checkpoint's prefix); return the xxh3-64 of every chunk (safetensors key ->
    hex): those the trainer hashed while staging (``job.digests``), the others computed
    while writing. Adds the writer threads' CPU and the bytes hashed to ``usage``."""
    local = isinstance(backend, LocalBackend)
    if local:
        os.makedirs(job.tmp_dir, exist_ok=True)

    def one(f: FileJob) -> tuple[dict[str, str], float]:
        cpu0 = time.thread_time()
        key = join(job.tmp_dir, f.name)
        todo = tuple(e for e in f.entries if e[0] not in job.digests)
        if local:  # whole pages past the end, for O_DIRECT
            image = pool[f.base : f.base + f.size + (-f.size % 4096)]
            digests = backend.put_padded(key, image, f.size, todo)
        else:
            digests = backend.put(key, pool[f.base : f.base + f.size], ranges=todo)
        return digests, time.thread_time() - cpu0

    digests: dict[str, str] = dict(job.digests)
    usage.bytes_hashed += sum(e[2] for f in job.files for e in f.entries if e[0] not in digests)
    if len(job.files) <= 1 or job.thread_count <= 1:
        for f in job.files:
            digests.update(one(f)[0])  # on the job's thread: counted by its usage.cpu0
    else:
        with ThreadPoolExecutor(min(job.thread_count, len(job.files))) as ex:
            for d, cpu in ex.map(one, job.files):
                digests.update(d)
                usage.helpers_cpu_s += cpu
    return digests


def _execute_dist_job(job: PersistJob, pool: memoryview, store: Any, backend: Backend) -> JobResult:
    """One rank's share of a multi-rank save: files, part, rank record; then commit (the
    coordinator) or wait for the commit record (the others)."""
    d = job.dist
    assert d is not None
    t0 = time.monotonic()
    usage = _Usage(time.thread_time())
    coordinator = job.rank == d.coordinator
    try:
        if store is None:
            raise CheckpointError("a multi-rank save needs the ranks' store", rank=job.rank)
        try:
            digests = _write_files(job, pool, backend, usage)
            part = RankPart(job.rank, digests, d.objects)
            if backend.atomic_rename:
                write_part(job.tmp_dir, part, job.fsync)
            else:
                write_part_object(backend, job.tmp_dir, part)
        except BaseException as e:  # noqa: BLE001 - told to the others, then reported here
            result = _failure(job, e)
            records.post_rank(store, d.token, job.rank, result.error_message)
            if coordinator:
                problem = f"rank {job.rank}: {result.error_message}"
                records.post_commit(store, d.token, problem)
                _discard(job, backend, parts=True)
            return result
        records.post_rank(store, d.token, job.rank)
        t1 = time.monotonic()
        if coordinator:
            problems = records.wait_ranks(store, d.token, d.world_size, d.timeout_s)
            if not problems:
                try:
                    via = None if backend.atomic_rename else backend
                    parts = [read_part(job.tmp_dir, r, via) for r in range(d.world_size)]
                    assert job.manifest is not None
                    manifest = manifest_from_parts(job.manifest, job.chunk_keys, parts, job.tmp_dir)
                    # merged: the checkpoint holds no parts
                    if backend.atomic_rename:
                        for r in range(d.world_size):
                            os.unlink(os.path.join(job.tmp_dir, part_name(r)))
                    else:
                        backend.delete(join(job.tmp_dir, part_name(r)) for r in range(d.world_size))
                    commit_files(job.tmp_dir, job.final_path, manifest, job.dcp_metadata, backend)
                except BaseException as e:  # noqa: BLE001 - an abort like any other
                    problems = {job.rank: f"{type(e).__name__}: {e}"}
            if problems:
                r, why = min(problems.items())
                reason = f"rank {r}: {why}"
                records.post_commit(store, d.token, reason)
                _discard(job, backend, parts=True)
                return _not_committed(job, reason, r)
            records.post_commit(store, d.token)
        else:
            reason = records.wait_commit(
                store, d.token, records.commit_wait_s(d.timeout_s), coordinator=d.coordinator
            )
            if reason is not None:
                return _not_committed(job, reason, None)
        t2 = time.monotonic()
        return _done(job, t0, t1, t2, usage)
    except BaseException as e:  # noqa: BLE001 - e.g. the store went away
        return _failure(job, e)


def _not_committed(job: PersistJob, reason: str, failed_rank: int | None) -> JobResult:
    return JobResult(
        job.job_id,
        job.step,
        False,
        error_type="CheckpointError",
        error_message=f"the checkpoint was not committed: {reason}",
        error_path=job.final_path,
        error_rank=failed_rank if failed_rank is not None else job.rank,
    )


def _done(
    job: PersistJob, began: float, written: float, committed: float, usage: _Usage
) -> JobResult:
    """A job's success: its files written at ``written``, committed at ``committed``."""
    return JobResult(
        job.job_id,
        job.step,
        True,
        bytes_written=sum(f.size for f in job.files),
        write_s=written - began,
        commit_s=committed - written,
        finished_at=committed,
        cpu_s=usage.cpu_s(),
        bytes_hashed=usage.bytes_hashed,
    )


def _failure(job: PersistJob, e: BaseException) -> JobResult:
    if isinstance(e, CheckpointError):
        return JobResult(
            job.job_id,
            job.step,
            False,
            error_type=type(e).__name__,
            error_message=e.message,
            error_path=e.path or job.final_path,
            error_fqn=e.fqn,
            error_rank=job.rank,
        )
    if isinstance(e, OSError):  # e.g. creating the temporary directory
        name = errno.errorcode.get(e.errno or 0, type(e).__name__)
        return JobResult(
            job.job_id,
            job.step,
            False,
            error_type="CheckpointError",
            error_message=f"writing the checkpoint failed: {name} ({e.strerror})",
            error_path=os.fspath(e.filename) if e.filename else job.final_path,
            error_rank=job.rank,
        )
    return JobResult(
        job.job_id,
        job.step,
        False,
        error_type="CheckpointError",
        error_message=f"{type(e).__name__}: {e}",
        error_path=job.final_path,
        error_rank=job.rank,
        detail=traceback.format_exc(),
    )


def _store_for(job: PersistJob, stores: records.StoreClients) -> Any:
    """The store client for a multi-rank job (one connection per address, kept by the
    persister that runs the jobs); None for a single-rank job or if it cannot connect
    (the job then fails: execute_job reports "needs the ranks' store")."""
    if job.dist is None:
        return None
    try:
        return stores.get(job.dist.store, job.dist.timeout_s)
    except Exception:  # noqa: BLE001 - never out of the worker's loop: the job fails
        return None


def commit_files(
    tmp_dir: str,
    final_path: str,
    manifest: Manifest,
    dcp_metadata: bytes,
    backend: Backend | None = None,
    *,
    replace: bool = False,
) -> None:
    """Write ``.metadata`` then the manifest, and make the checkpoint visible: locally
    into ``tmp_dir``, fsynced, then published by renaming it (``replace``: exchanged
    with a committed checkpoint at ``final_path``, :func:`.commit.publish`); on an
    object store under the checkpoint's prefix (``tmp_dir``), the manifest last, its
    presence the commit."""
    import xxhash

    files = dict(manifest.files)
    files[DCP_METADATA_NAME] = FileEntry(
        len(dcp_metadata), hexdigest(xxhash.xxh3_64_intdigest(dcp_metadata))
    )
    manifest = dataclasses.replace(manifest, files=files)
    manifest_bytes = to_json_bytes(manifest)
    expected = {name: entry.size for name, entry in files.items()}
    if backend is not None and not backend.atomic_rename:
        if replace:
            raise CheckpointError(
                "cannot replace a checkpoint on an object store (no atomic replace)",
                path=final_path,
            )
        backend.put(join(tmp_dir, DCP_METADATA_NAME), memoryview(dcp_metadata))
        commit.commit_on_store(backend, tmp_dir, final_path, expected, manifest_bytes)
        return
    commit.write_durable(os.path.join(tmp_dir, DCP_METADATA_NAME), dcp_metadata)
    commit.write_durable(os.path.join(tmp_dir, MANIFEST_NAME), manifest_bytes)
    expected[MANIFEST_NAME] = len(manifest_bytes)
    if replace:
        commit.publish(tmp_dir, final_path, expected, replace=True)
    else:
        commit.publish(tmp_dir, final_path, expected)


# --------------------------------------------------------------------- persisters


@dataclass
class _Pending:
    job_id: int
    step: int | None
    final_path: str | None
    submitted_at: float


class ThreadPersister:
    """Runs jobs in one background thread of the training process (``async_mode="thread"``)."""

    def __init__(self) -> None:
        self._pools: dict[int, memoryview] = {}
        self._results: list[JobResult | CallResult] = []
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}
        self._stores = records.StoreClients()  # multi-rank jobs' store clients
        self._backends: dict[tuple, Backend] = {}  # object stores' clients, job to job
        self.pid = os.getpid()

    def map_pool(self, pool_id: int, fd: int, nbytes: int, buffer: memoryview) -> None:
        self._pools[pool_id] = buffer

    def unmap_pool(self, pool_id: int) -> None:
        self._pools.pop(pool_id, None)

    def submit(self, job: PersistJob) -> None:
        def run() -> None:
            try:
                r = execute_job(
                    job, self._pools[job.pool_id], _store_for(job, self._stores), self._backends
                )
            except BaseException as e:  # noqa: BLE001 - a lost result would hang the trainer
                r = _failure(job, e)
            with self._lock:
                self._results.append(r)

        t = threading.Thread(target=run, name=f"quicksave-persist-{job.job_id}", daemon=True)
        self._threads[job.job_id] = t
        t.start()

    def submit_call(self, job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        def run() -> None:
            r = run_call(job_id, fn, args, kwargs)
            with self._lock:
                self._results.append(r)

        t = threading.Thread(target=run, name=f"quicksave-call-{job_id}", daemon=True)
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


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker process runs and when the trainer gives up on it.

    Hung means not progressing, not unscheduled. The worker beats a heartbeat from a
    thread of its own every ``heartbeat_s`` (so a slow write keeps beating). A heartbeat
    older than ``worker_timeout_s`` alone is not a failure: the trainer then reads the
    worker's progress in /proc (``quicksave.worker.liveness``) and fails its saves
    (``WorkerFailedError``) only if it is stopped (SIGSTOP, a debugger), or if it has
    also been seen making no progress — no thread runnable, no CPU time, no bytes read
    or written — for half of ``worker_timeout_s`` (a deadlock). A starved worker (runnable
    but not scheduled on a busy node, or progressing slowly) is never failed for it,
    however long: ``save_timeout_s`` is the absolute bound on each save.
    """

    worker_timeout_s: float = 5.0
    save_timeout_s: float = 900.0  # a job running longer than this: failed
    start_timeout_s: float = 120.0  # spawn + imports on a busy machine
    nice: int = 10  # CPU priority increment of the worker
    # CPUs the worker process runs on (None: the trainer's); e.g. keep it and the
    # uploads off the cores that feed the training loop
    cpus: tuple[int, ...] | None = None
    heartbeat_s: float = 0.2
    # Linux I/O scheduling class of the worker (ionice -c: 1 realtime, 2 best-effort,
    # 3 idle; None: the trainer's)
    io_priority: int | None = None
    # The worker behaves as a daemonic process: it may not start processes of its own
    # (NVRx's is_daemon; multiprocessing refuses children there)
    daemon: bool = False


class ProcessPersister:
    """One persistent worker process (``async_mode="process"``).

    The worker is a fresh interpreter running ``quicksave.worker.process.main``, like
    multiprocessing's ``spawn`` but without re-importing the trainer's ``__main__`` (no
    ``if __name__ == "__main__"`` guard needed in training scripts). It talks over a Unix
    socket pair; its heartbeat is a double in a shared page.

    Call order (training thread only): ``map_pool`` once per pool → ``submit`` per save →
    ``poll`` until each job's result arrives → ``close``. Any method may raise
    ``WorkerFailedError``; after that, build a new one.
    """

    def __init__(
        self,
        config: WorkerConfig = WorkerConfig(),
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
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        cmd = [
            sys.executable,
            "-c",
            "import sys; from quicksave.worker.process import main; main(sys.argv[1:])",
            str(child_sock.fileno()),
            str(self._beat_fd),
            str(os.getpid()),
            str(config.nice),
            str(config.heartbeat_s),
            ",".join(str(c) for c in config.cpus or ()),
            "" if config.io_priority is None else str(config.io_priority),
            "1" if config.daemon else "0",
            "" if store is None else _store_spec(store, store_timeout_s),
        ]
        try:
            self.process = subprocess.Popen(
                cmd,
                pass_fds=(child_sock.fileno(), self._beat_fd),
                env=env,
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
        # A private socket pair: safe to hand over the key (see "auth" in _worker_main).
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
        caller nothing (~0.1 s per 1.6 GB pool, most of it the pages).
        """
        if self._beat_fd < 0:
            return
        if self.process.poll() is None and self._failed is None:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            if not wait:
                threading.Thread(
                    target=self._reap, args=(timeout,), name="quicksave-reap", daemon=True
                ).start()
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

    def _reap(self, timeout: float) -> None:
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


def _store_spec(store: StoreAddress, timeout_s: float) -> str:
    """The worker's STORE argument (see ``main``)."""
    return json.dumps({**dataclasses.asdict(store), "timeout_s": timeout_s})


# ------------------------------------------------------------------ worker process


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)  # orphaned: the trainer is gone, nothing can be committed for it
        time.sleep(0.25)


def _beat(heartbeat: mmap.mmap, period: float) -> None:
    while True:
        struct.pack_into("d", heartbeat, 0, time.monotonic())
        time.sleep(period)


def _worker_main(
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
        # import of torch (~1.5 CPU s, once) is then done by the first save even beside a
        # training loop that keeps every core busy (at nice 10 it took longer than the
        # loop's first 3 s; and a nice-10 thread holding the GIL stalls it too).
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
    while not stopping.is_set():
        try:
            if not conn.poll(0.2):
                continue
            msg = conn.recv()
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
            result = execute_job(job, pools[job.pool_id][1], _store_for(job, stores), backends)
            try:
                conn.send(("result", result))
            except OSError:
                break
        elif kind == "warm":  # connected before answering: its first job pays no import
            _, address, timeout_s = msg
            if address is not None:  # None: only answer
                stores.get(address, timeout_s)  # a failure: the first job reports it
            try:
                conn.send(("warm", None))
            except OSError:
                break
        elif kind == "status":
            try:
                conn.send(("status", stores.status()))
            except OSError:
                break
        elif kind == "call":
            _, job_id, payload, sys_path = msg
            try:
                conn.send(("result", run_pickled_call(job_id, payload, sys_path)))
            except OSError:
                break
        elif kind == "auth":
            # The trainer's key, so that torch's shared-memory tensors (whose file
            # descriptors the worker fetches from the trainer's resource sharer) unpickle.
            multiprocessing.current_process().authkey = msg[1]
        elif kind == "stop":
            break
    for mm, view in pools.values():
        _unmap(mm, view)


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


@dataclass(frozen=True)
class CallResult:
    """Outcome of a generic call (the seeds' ``AsyncRequest.async_fn``) run by the worker."""

    job_id: int
    ok: bool
    error: str = ""
    detail: str = ""
    value: Any = None


def run_call(job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> CallResult:
    try:
        fn(*args, **kwargs)
        return CallResult(job_id, True)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        return CallResult(job_id, False, f"{type(e).__name__}: {e}", traceback.format_exc())


def pickle_call(job_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Pickle a generic call for the worker with ``fnpickle`` (a ``ForkingPickler``).

    With torch's reductions registered (``torch.multiprocessing``), a CPU tensor pickles as
    a handle to shared memory: its storage is moved to shared memory once (``is_shared()``
    is then true in the trainer too) and the worker maps the same pages; no tensor bytes
    are copied into the message. Functions the worker cannot import (those of the
    training script's ``__main__``, closures, lambdas) go by value; classes must be
    importable. Failures surface here, when the call is scheduled, not in the worker.
    """
    if "torch" in sys.modules:
        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions
    try:
        return fnpickle.dumps((fn, args, kwargs))
    except CheckpointError as e:
        raise CheckpointError(
            f"call {job_id}: its function or arguments cannot be sent to the worker process "
            f"({e.message}); the arguments must pickle and classes must be importable (the "
            "worker does not run the training script)"
        ) from e


def run_pickled_call(job_id: int, payload: bytes, sys_path: list[str]) -> CallResult:
    """Worker side of ``pickle_call``: adopt the trainer's import path, unpickle, run."""
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    try:
        import torch.multiprocessing  # noqa: F401 - tensors arrive as shared-memory handles

        fn, args, kwargs = ForkingPickler.loads(payload)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer
        return CallResult(
            job_id,
            False,
            f"the worker cannot unpickle the call ({type(e).__name__}: {e})",
            traceback.format_exc(),
        )
    return run_call(job_id, fn, args, kwargs)


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
    _worker_main(
        Connection(sock_fd), heartbeat, parent_pid, nice, period, cpus, io_class, daemon, connect
    )


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
