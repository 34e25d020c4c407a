"""The async engine: ``AsyncSaver`` — plan, stage, hand off, finalize — one per rank.

One ``save()``, in the training thread::

    finalize finished saves (FIFO; a failed one raises here)
    → backpressure: a free staging pool (wait, or skip by policy)
    → collect: flatten, snapshot plain values as JSON (now, not later)
    → plan: layout of the rank's files (cached while the state's shapes are unchanged)
    → stage: copy tensors into the pool (blocking mode: all now; overlap mode: the small
      and forward-mutable ones now, the deferred ones — parameters, optimizer states — in a
      background thread while the next forward/backward runs)
    → submit: a small PersistJob to the persister (worker process or thread)
    → return a SaveHandle

The persister writes the files from the pool, checksums them, fsyncs and commits (single
rank). ``finalize()`` collects outcomes; a worker that died or hung becomes a
``WorkerFailedError`` there (or in ``save()``), and the next save starts a new worker.

A pool the worker still reads is never written: each pool is "busy" from its submit to
its result (``max_in_flight`` pools allow that many saves in flight).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from quicksave import commit
from quicksave.adapters.dcp_writer import dcp_metadata_bytes
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.format import objects as objcodec
from quicksave.format.dtypes import dtype_name, element_size
from quicksave.format.keys import names_itself
from quicksave.format.manifest import (
    ChunkEntry,
    FileEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    check_user_metadata,
)
from quicksave.ranks.saving import DistContext, DistSave, DistSaving
from quicksave.save.collect import check_tensor, flatten_with_paths, to_state_dict
from quicksave.save.guard import Snapshot, torn_copy_error
from quicksave.save.plan import ItemSpec, RankLayout, layout_rank
from quicksave.stage.pool import StagingPool
from quicksave.storage import Location, StorageOptions, parse_location
from quicksave.storage.backend import Backend
from quicksave.worker.calls import CallResult
from quicksave.worker.config import WorkerConfig
from quicksave.worker.job import FileJob, JobResult, PersistJob
from quicksave.worker.persisters import ProcessPersister, ThreadPersister

logger = logging.getLogger("quicksave")

Deferred = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True)
class EngineConfig:
    """How an AsyncSaver works.

    Attributes:
        mode: ``"process"`` (a persistent worker process per rank writes the files) or
            ``"thread"`` (a background thread of this process does).
        staging: ``"blocking"`` (``save()`` returns once every tensor is copied) or
            ``"overlap"`` (tensors selected by ``save(deferred=...)`` are copied in the
            background; call ``maybe_wait_for_staging()`` before mutating them).
        thread_count: data files (and writer threads) per rank.
        backpressure: ``"wait"`` for a free pool, or ``"skip"`` the save (logged).
        max_in_flight: staging pools, i.e. saves that may be in flight at once.
        o_direct: write files with O_DIRECT where the filesystem allows.
        fsync: fsync files and directories (off only for throwaway tests).
        worker: heartbeat and timeouts of the worker process.
        close_timeout_s: how long ``close()`` waits for saves in flight.
        pin_memory: page-lock pools for CUDA copies (default: when CUDA is available).
        storage: how to reach object stores (``s3://``, ``msc://`` paths).
        write_rate_mbps: MB/s (10^6 bytes) each writer thread writes to local files at
            most: spreads a save's disk traffic over more time, for machines where it
            slows training (the time to durable grows accordingly). None: no limit.
    """

    mode: Literal["process", "thread"] = "process"
    staging: Literal["overlap", "blocking"] = "blocking"
    thread_count: int = 2
    backpressure: Literal["wait", "skip"] = "wait"
    max_in_flight: int = 1
    o_direct: bool = True
    fsync: bool = True
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    close_timeout_s: float = 300.0
    pin_memory: bool | None = None
    storage: StorageOptions = field(default_factory=StorageOptions)
    write_rate_mbps: float | None = None

    def __post_init__(self) -> None:
        rate = self.write_rate_mbps
        if rate is not None and not rate > 0:
            raise CheckpointError(f"EngineConfig.write_rate_mbps must be > 0 or None: {rate!r}")
        for name, value, allowed in (
            ("mode", self.mode, ("process", "thread")),
            ("staging", self.staging, ("overlap", "blocking")),
            ("backpressure", self.backpressure, ("wait", "skip")),
        ):
            if value not in allowed:
                raise CheckpointError(
                    f"EngineConfig.{name} must be one of {allowed}, got {value!r}"
                )
        if self.thread_count < 1 or self.max_in_flight < 1:
            raise CheckpointError("EngineConfig.thread_count and max_in_flight must be >= 1")


@dataclass(frozen=True)
class SaveResult:
    """What one save cost. Times in seconds from the ``save()`` call."""

    step: int | None
    path: str
    bytes: int
    blocking_s: float  # save() held the caller
    staging_s: float  # every tensor copied into the pool
    durable_s: float  # committed: files, manifest and rename fsynced
    write_s: float  # the persister's writing (files + fsync)
    commit_s: float  # .metadata + manifest + rename
    # CPU seconds spent on this save by the trainer (save() on the calling thread plus
    # the background staging thread) and by the persister (its job and writer threads)
    trainer_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0
    bytes_copied: int = 0  # tensor bytes copied into the staging pool
    bytes_hashed: int = 0  # bytes checksummed, by the trainer's staging and the writer


class SaveHandle:
    """A save in flight: ``done()``, ``wait(timeout)`` → SaveResult (or raises)."""

    def __init__(self, step: int | None, path: str, started: float) -> None:
        self.step = step
        self.path = path
        self.started = started
        self.blocking_s = 0.0
        self.staging_s: float | None = None
        self.trainer_cpu_s = 0.0  # save() on its thread + the background staging thread
        self.bytes_copied = 0
        self.bytes_hashed = 0  # by the staging thread (hashed while copying)
        self._done = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._saver: AsyncSaver | None = None

    def done(self) -> bool:
        if not self._done.is_set() and self._saver is not None:
            if self._confirmable():
                with contextlib.suppress(CheckpointError):  # this handle holds it
                    self._saver._confirm_if_staged()
            self._saver._collect(0.0)
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until durable. Raises CheckpointError if the save failed, TimeoutError if
        not done within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._confirmable():
            assert self._saver is not None
            with contextlib.suppress(CheckpointError):  # this handle holds it
                self._saver.maybe_wait_for_staging()
        while not self._done.is_set():
            if self._saver is None:
                self._done.wait(0.05)
            else:
                self._saver._collect(0.05)
            if deadline is not None and time.monotonic() > deadline and not self._done.is_set():
                raise TimeoutError(
                    f"save of step {self.step} to {self.path} not done after {timeout} s"
                )
        if self._error is not None:
            if self._saver is not None:
                self._saver._reported(self._error)  # raised here: not again by save/finalize
            raise self._error
        assert self._result is not None
        return self._result

    def _confirmable(self) -> bool:
        """Whether this save's background copy awaits the training thread's check."""
        overlap = None if self._saver is None else self._saver._overlap
        return overlap is not None and overlap.handle is self

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def _finish(self, result: SaveResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()


@dataclass(frozen=True)
class _Plan:
    key: tuple
    layout: RankLayout
    chunk_keys: dict[str, tuple[str, int]]
    dcp_metadata: bytes
    tensors: dict[str, TensorEntry]  # checksums empty
    files: dict[str, FileEntry]
    places: dict[str, tuple[str, int, int]]  # staged name -> (file, offset, length)
    keys: dict[str, str] = field(default_factory=dict)  # staged name -> chunk key, if not same


@dataclass
class _Slot:
    pool: StagingPool | None = None
    plan_key: tuple | None = None
    pool_id: int = -1
    busy: int | None = None  # job id using the pool


@dataclass
class _InFlight:
    handle: SaveHandle
    slot: _Slot
    bytes: int
    tmp_dir: str = ""  # removed by the trainer when the persister died mid-save (local)
    token: str = ""  # multi-rank: the save's commit records (see dist/records.py)
    location: Location | None = None  # where it commits
    replace: bool = False  # overwrite: a committed checkpoint was there before the save


@dataclass
class _Overlap:
    """A save whose deferred tensors are copied in the background: submitted to the
    persister only once the training thread has seen their version counters unchanged
    (``guard.py``)."""

    job: PersistJob
    handle: SaveHandle
    snapshot: Snapshot
    tensors: dict[str, torch.Tensor]  # staged name -> the tensor copied
    fqn_of: dict[str, str]  # staged name -> fqn, where they differ (several ranks)


def _lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux: threads have their own),
    so that background preparation mostly takes CPU time that training leaves idle."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError):
        pass


class AsyncSaver:
    """Saves checkpoints of one rank in the background.

    Call order (training thread): ``save()`` per checkpoint (returns after staging, or at
    once in overlap mode) → optionally ``maybe_wait_for_staging()`` before mutating
    deferred tensors → ``finalize()`` now and then (surfaces errors) → ``close()``.

    Args:
        config: :class:`EngineConfig`.
        rank: this process's rank (named in errors).

    Example::

        saver = AsyncSaver(EngineConfig(mode="process"))
        handle = saver.save(model.state_dict(), "ckpt/step-10", step=10)
        ...  # training goes on
        handle.wait()
        saver.close()
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        rank: int = 0,
        dist_context: DistContext | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.rank = dist_context.rank if dist_context is not None else rank
        # Multi-rank: plans through the plan cache, commits through parts and records.
        self._dist = DistSaving(dist_context) if dist_context is not None else None
        self._lock = threading.RLock()
        self._slots = [_Slot() for _ in range(self.config.max_in_flight)]
        self._plans: dict[tuple, _Plan] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._backends: dict[tuple, Backend] = {}  # object stores (trainer-side checks)
        self._unreported: list[BaseException] = []
        self._next_id = 0
        self._staging: threading.Thread | None = None
        self._staging_error: BaseException | None = None
        self._overlap: _Overlap | None = None  # the background copy's save, unconfirmed
        # Staged tensors (by address) seen written during a background copy: copied
        # inside save() from then on (see guard.py).
        self._unguarded: set[int] = set()
        self._closed = False
        self._mapped: set[int] = set()
        self._persister: ProcessPersister | ThreadPersister | None = None
        self._replaced_worker = False  # this save's vote started a new worker (see _ready)
        # Several ranks: saves whose job this rank lost with its worker: token -> when
        # every rank has their outcome at the latest (see _ready).
        self._lost: dict[str, float] = {}
        self._prepare_thread: threading.Thread | None = None  # see prepare()
        self._span_cache: tuple[tuple, StagingPool, dict[str, tuple[int, int]]] | None = None
        self._entries: tuple[_Plan, dict, dict[str, TensorEntry]] | None = None
        self._persister = self._new_persister()  # started now: the first save pays no start-up
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ persister
    def _new_persister(self) -> ProcessPersister | ThreadPersister:
        self._mapped = set()
        if self.config.mode == "process":
            if self._dist is None:
                return ProcessPersister(self.config.worker, self.rank)
            # Several ranks: the worker connects to the ranks' store (imports torch) at
            # start-up, in the background, not at the first save (issue 20).
            return ProcessPersister(
                self.config.worker,
                self.rank,
                store=self._dist.address,
                store_timeout_s=self._dist.ctx.commit_timeout_s,
            )
        return ThreadPersister()

    def _persister_for_submit(
        self, job_id: int | None = None
    ) -> ProcessPersister | ThreadPersister:
        """The persister to hand work to (``job_id``: the job about to be sent, already
        registered in flight). A worker that died while idle is replaced first."""
        mine = set() if job_id is None else {job_id}
        idle = set(self._in_flight) <= mine  # no job was in its hands
        if idle:  # died while idle (SIGTERM, OOM killer...): no save was lost
            self._drop_idle_dead_worker()
        if self._persister is None:
            logger.warning("quicksave: starting a new checkpoint worker (rank %d)", self.rank)
            self._persister = self._new_persister()
        return self._persister

    def _worker_failed(self, err: BaseException) -> None:
        """The persister is gone: fail every save in flight, free the pools."""
        if self._persister is not None:
            self._persister.close(0.0)  # kills it, and frees its socket and heartbeat page
        self._persister = None
        for job_id in list(self._in_flight):
            self._fail_job(job_id, err)
        self._unreported.append(err)

    def _fail_job(self, job_id: int, err: BaseException) -> None:
        """Fail one save in flight that no writer will finish: free its pool, tell the
        other ranks (they stop waiting for this rank, and nothing commits), remove its
        partial files."""
        fl = self._in_flight.pop(job_id)
        fl.slot.busy = None
        fl.handle._finish(None, err)
        if self._dist is not None and fl.token:
            why = err.message if isinstance(err, CheckpointError) else str(err)
            self._dist.worker_failed(fl.token, why)  # the others stop waiting for us
            self._lost[fl.token] = fl.handle.started + self._dist.outcome_wait_s
        elif fl.tmp_dir:  # the dead writer's partial files: nobody else will remove them
            shutil.rmtree(fl.tmp_dir, ignore_errors=True)

    def _reported(self, err: BaseException) -> None:
        self._unreported = [e for e in self._unreported if e is not err]

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory held by this saver's staging pools now."""
        return sum(s.pool.nbytes for s in self._slots if s.pool is not None)

    @property
    def distributed(self) -> bool:
        """True if this saver's saves are multi-rank (each ``save()`` is collective)."""
        return self._dist is not None

    @property
    def worker_pid(self) -> int | None:
        """PID of the worker process (process mode), for monitoring and tests."""
        p = self._persister
        return p.pid if isinstance(p, ProcessPersister) else None

    # --------------------------------------------------------------------- save
    def save(
        self,
        state_dict: Mapping[str, Any],
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        deferred: Deferred | None = None,
        user_metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
    ) -> SaveHandle | None:
        """Start saving ``state_dict`` to the checkpoint directory ``path``.

        Args:
            state_dict: names to tensors, ``Stateful`` objects, nested dicts/lists, values.
            path: the checkpoint directory to create (must not hold a committed one,
                unless ``overwrite``).
            step: recorded in the manifest.
            deferred: in overlap mode, ``deferred(fqn, tensor)`` says which tensors may be
                copied after ``save()`` returns (their values are still those at the call,
                as long as nothing mutates them before ``maybe_wait_for_staging()``).
            user_metadata: JSON-serializable dict stored in the manifest.
            overwrite: a committed checkpoint at ``path`` is replaced atomically at the
                commit (the two directories are exchanged, ``commit.publish``): until
                then, and if the save fails, the old one stays whole. Single-rank saves
                to local paths only.

        Returns:
            a SaveHandle, or None if skipped by ``backpressure="skip"``.

        Raises:
            CheckpointError: a previous save failed (reported once), bad input (checked
                before any I/O), the target exists, ``overwrite`` on an object store or
                in a multi-rank saver, or the worker failed.
        """
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        # Outside the lock: the staging and prepare threads take it.
        try:
            self.maybe_wait_for_staging()
        except CheckpointError as e:
            if self._dist is None:
                raise
            # Several ranks: the last save's copy failed (or its tensors moved) on this
            # rank. Raised after this save's vote (see _plan_dist), which it turns into a
            # skip on every rank: raising now would leave the others waiting in the vote.
            self._unreported.append(e)
        self.wait_prepared()
        with self._lock:
            if self._closed:
                raise CheckpointError("the saver is closed", path=os.fspath(path), rank=self.rank)
            loc = parse_location(path, options=self.config.storage)
            final = loc.url
            store = None if loc.is_local else loc
            check_user_metadata(dict(user_metadata or {}), final, self.rank)
            if overwrite and self._dist is not None:
                raise CheckpointError(
                    "overwrite=True is supported for single-rank saves only",
                    path=final,
                    rank=self.rank,
                )
            if self._dist is not None:
                ds = self._plan_dist(state_dict, loc, step, user_metadata)
                if ds is None:
                    return None
                tensors, sources = ds.tensors, ds.sources
                plan = _Plan(ds.key, ds.layout, ds.chunk_keys, ds.dcp_metadata, {}, {}, ds.places)
                manifest, token = ds.manifest, ds.dist.token
            else:
                self.finalize(blocking=False)  # raises an earlier failure, once
                commit.check_target(loc, self.rank, self._backend_for(store), replace=overwrite)
                tensors, sources, objects, paths, empty = self._collect_state(state_dict, final)
                plan = self._plan(tensors, objects)
                manifest = Manifest(
                    step=step,
                    world_size=1,
                    tensors=self._tensor_entries(plan, paths),
                    objects={fqn: ObjectEntry(v, paths.get(fqn)) for fqn, v in objects.items()},
                    files=plan.files,
                    user_metadata=dict(user_metadata or {}),
                    empty_dicts=empty,
                )
                token = commit.new_token()
            slot = self._free_slot()
            if slot is None:
                logger.warning(
                    "quicksave: skipped the save of step %s: the previous save is still in flight",
                    step,
                )
                return None
            pool = self._pool_for(slot, plan)
            handle = SaveHandle(step, final, t0)
            handle._saver = self
            job_id = self._next_id
            self._next_id += 1
            slot.busy = job_id
            job = PersistJob(
                job_id=job_id,
                pool_id=slot.pool_id,
                step=step,
                rank=self.rank,
                final_path=final,
                tmp_dir=commit.temp_path_for(final, token) if store is None else loc.key,
                files=tuple(
                    FileJob(
                        f.name,
                        pf.base,
                        f.size,
                        tuple((e.item.key, e.offset, e.length) for e in f.entries),
                    )
                    for f, pf in zip(plan.layout.files, pool.pool.files, strict=True)
                ),
                manifest=manifest,
                chunk_keys=plan.chunk_keys,
                dcp_metadata=plan.dcp_metadata,
                fsync=self.config.fsync,
                o_direct=self.config.o_direct,
                thread_count=self.config.thread_count,
                dist=ds.dist if self._dist is not None else None,
                location=store,
                replace=overwrite,
                write_rate=None if (mbps := self.config.write_rate_mbps) is None else mbps * 1e6,
            )
            self._in_flight[job_id] = _InFlight(
                handle,
                slot,
                sum(f.size for f in plan.layout.files),
                job.tmp_dir if store is None else "",  # never a store's key: not a path
                token if self._dist is not None else "",
                loc,
                overwrite,
            )
            now, later = self._split(plan, tensors, deferred)
            ready = _cuda_ready(tensors)
            try:
                handle.bytes_copied = self._stage(pool, plan, tensors, now, ready=ready)
            except BaseException:
                slot.busy = None
                del self._in_flight[job_id]
                raise
            if later:
                fqn_of = {} if self._dist is None else _fqns_of(plan.layout)
                self._overlap = _Overlap(
                    job, handle, Snapshot.take(sources, later), tensors, fqn_of
                )
                self._staging_error = None
                self._staging = threading.Thread(
                    target=self._stage_in_background,
                    args=(pool, plan, tensors, later, handle, ready),
                    name="quicksave-stage",
                    daemon=True,
                )
                self._staging.start()
            else:
                handle.staging_s = time.monotonic() - t0
                self._submit(job, handle)
            handle.blocking_s = time.monotonic() - t0
            handle.trainer_cpu_s += time.thread_time() - cpu0
            return handle

    def _backend_for(self, loc: Location | None) -> Backend | None:
        """The trainer side's backend for an object store (checks before a save), kept
        until :meth:`close`; None for the local filesystem."""
        if loc is None or loc.is_local:
            return None
        key = loc.backend_id()
        if key not in self._backends:  # its calls run on the training thread: bounded
            bounded = loc.bounded(self.config.worker.save_timeout_s)
            self._backends[key] = bounded.open(rank=self.rank)
        return self._backends[key]

    def _plan_dist(
        self,
        state_dict: Mapping[str, Any],
        loc: Location,
        step: int | None,
        user_metadata: dict[str, Any] | None,
    ) -> DistSave | None:
        """Several ranks: plan (a collective every rank runs for every save, whatever
        happens on this rank), then raise this rank's reason not to save, if any. A save
        that any rank cannot make now is skipped by every rank together.

        Waiting (for a free pool, for a new worker) happens before each vote (see
        ``_ready``): in step with the other ranks while the save that holds this rank up
        has no outcome yet, then in bounded rounds of votes. No rank sits in the
        collective for longer than its timeout while another is busy: a gloo collective
        that times out closes its pairs, and every later save's planning would fail.

        A failure already collected and not reported is this rank's reason not to save
        (raised here, the save skipped on every rank); one found while waiting here is
        reported by the next ``save()`` or ``finalize()``, and this save goes on, so
        that whether a save is made does not depend on when a failure is noticed."""
        problem: CheckpointError | None = self._unreported[0] if self._unreported else None
        if problem is None:
            try:
                commit.check_target(loc, self.rank, self._backend_for(loc))
            except CheckpointError as e:
                # taken, or the store cannot be reached: raised after the vote, so that
                # every rank skips this save together instead of waiting for this one
                problem = e
        assert self._dist is not None
        wait = self.config.backpressure == "wait"
        self._collect(0.0)
        free = wait or any(s.busy is None for s in self._slots)
        self._replaced_worker = False
        round_s = self._dist.ctx.commit_timeout_s / 4

        def ready() -> bool:
            return self._ready(round_s, need_pool=wait)

        ds = self._dist.plan(
            state_dict,
            loc.url,
            step=step,
            user_metadata=user_metadata,
            thread_count=self.config.thread_count,
            go=problem is None and free,
            ready=ready,
        )
        if ds is not None:
            return ds
        if problem is not None:
            self._reported(problem)
            raise problem
        logger.warning(
            "quicksave: skipped the save of step %s: %s",
            step,
            "the previous save is still in flight" if not free else "another rank cannot save now",
        )
        return None

    def _ready(self, timeout: float, need_pool: bool) -> bool:
        """Several ranks, before a save's vote: whether this rank can take the save now —
        a free staging pool (``need_pool``) and a worker that can start on the job at
        once. Never raises; False if not ready yet (every rank then votes again).

        It waits in two stages. First, in step with the other ranks, for the outcome of
        the save it is held up by (its oldest in flight when no pool is free, and any
        whose job it lost with its worker): every rank waits for the same commit record,
        so all of them leave this wait together, however long the save took. Then for at
        most ``timeout`` seconds (well under the collective's timeout) for what only
        this rank still needs: its own writer finishing a save whose outcome is known
        already (a slow rank), or a new worker. A worker found dead is replaced here, and
        the new one warmed up (torch imported, the store connected, the pools mapped)
        before this rank is ready: its first job must not spend the coordinator's
        ``commit_timeout_s`` starting up."""
        while True:
            with self._lock:
                self._collect(0.0)
                self._replace_dead_worker()
                if self._local_ready(need_pool) or not self._awaiting_outcome(need_pool):
                    break
                self._pause(0.02)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._local_ready(need_pool):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pause(min(0.05, left))
                self._collect(0.0)
                self._replace_dead_worker()

    def _local_ready(self, need_pool: bool) -> bool:
        free = not need_pool or any(s.busy is None for s in self._slots)
        return free and self._worker_warm() and not self._lost

    def _awaiting_outcome(self, need_pool: bool) -> bool:
        """Whether the outcome of a save this rank is held up by is still to be posted
        (and its time is not up): a lost one, or its oldest in flight if no pool is free."""
        assert self._dist is not None
        now = time.monotonic()
        for token, until in list(self._lost.items()):
            if now >= until or self._dist.settled(token):
                del self._lost[token]
        if self._lost:
            return True
        if not need_pool or any(s.busy is None for s in self._slots) or not self._in_flight:
            return False
        oldest = self._in_flight[min(self._in_flight)]
        until = oldest.handle.started + self._dist.outcome_wait_s
        return now < until and not self._dist.settled(oldest.token)

    def _pause(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for news from the worker (a result, a warm-up answer)."""
        if self._in_flight:
            self._collect(timeout)
        else:
            self._poll_warm(timeout)

    def _drop_idle_dead_worker(self) -> None:
        """Forget a worker process that exited while it held no job (the caller checked
        that none is in flight): no save was lost; the next use starts another."""
        p = self._persister
        if isinstance(p, ProcessPersister) and p.process.poll() is not None:
            logger.warning(
                "quicksave: the checkpoint worker (pid %d) exited while idle (code %s)",
                p.pid,
                p.process.returncode,
            )
            p.close(0.0)
            self._persister = None

    def _replace_dead_worker(self) -> None:
        """Process mode, several ranks: start a new worker now (once per save) if the
        last one died — after failing its jobs (``_worker_failed``) or while idle — and
        send it the pools and a warm-up (see ``ProcessPersister.warm_up``)."""
        if self.config.mode != "process" or self._replaced_worker or self._closed:
            return
        if self._persister is not None:
            if self._in_flight:
                return  # a death with jobs in hand is _collect's to find (it fails them)
            self._drop_idle_dead_worker()
            if self._persister is not None:  # alive (or a thread persister)
                return
        self._replaced_worker = True
        logger.warning("quicksave: starting a new checkpoint worker (rank %d)", self.rank)
        assert self._dist is not None
        try:
            p = self._new_persister()
        except CheckpointError as e:  # save() tries again, and raises
            logger.warning("quicksave: %s", e)
            return
        self._persister = p
        try:
            for slot in self._slots:
                if slot.pool is not None and slot.pool_id not in self._mapped:
                    p.map_pool(
                        slot.pool_id, slot.pool.fd, slot.pool.nbytes, memoryview(slot.pool._mm)
                    )
                    self._mapped.add(slot.pool_id)
            if isinstance(p, ProcessPersister):
                p.warm_up(self._dist.address, self._dist.ctx.commit_timeout_s)
        except CheckpointError as e:
            self._drop_new_worker(e)

    def _worker_warm(self) -> bool:
        """No warm-up of a new worker is awaited (answered, gone, or past its start-up
        timeout: then its first job shows what is wrong)."""
        p = self._persister
        if not isinstance(p, ProcessPersister) or not p.warming:
            return True
        return p.age > self.config.worker.start_timeout_s

    def _poll_warm(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a new worker's warm-up answer (no job in flight)."""
        p = self._persister
        if not isinstance(p, ProcessPersister) or not p.warming:
            time.sleep(timeout)
            return
        try:
            p.poll(timeout)  # no job in flight: no result to lose
        except CheckpointError as e:
            self._drop_new_worker(e)

    def _drop_new_worker(self, err: CheckpointError) -> None:
        """A worker started by ``_replace_dead_worker`` failed before any job: no save
        is lost; the next submit starts another (and reports what goes wrong then)."""
        logger.warning("quicksave: the new checkpoint worker failed at start-up: %s", err)
        if self._persister is not None:
            self._persister.close(0.0)
        self._persister = None

    def _collect_state(
        self, state_dict: Mapping[str, Any], final: str
    ) -> tuple[
        dict[str, torch.Tensor],
        dict[str, torch.Tensor],
        dict[str, Any],
        dict[str, tuple],
        tuple[tuple, ...],
    ]:
        """Flatten ``state_dict``: (tensors to stage, the tensors whose version counters
        track their writes, encoded values, key paths, empty dicts)."""
        try:
            nested = to_state_dict(state_dict)
            flat, all_paths, empty = flatten_with_paths(nested)
            tensors: dict[str, torch.Tensor] = {}
            sources: dict[str, torch.Tensor] = {}
            objects: dict[str, Any] = {}
            for fqn, v in flat.items():
                if isinstance(v, torch.Tensor):
                    check_tensor(fqn, v, self.rank)
                    tensors[fqn] = _whole_local(fqn, v)
                    sources[fqn] = v
                else:
                    # Encoding is also the check; done once, with the value of this moment.
                    objects[fqn] = objcodec.encode(v, fqn)
        except IncompatibleStateError as e:
            raise IncompatibleStateError(e.message, path=final, fqn=e.fqn, rank=self.rank) from None
        paths = {fqn: p for fqn, p in all_paths.items() if not names_itself(p, fqn)}
        return tensors, sources, objects, paths, tuple(empty)

    def _tensor_entries(self, plan: _Plan, paths: dict[str, tuple]) -> dict[str, TensorEntry]:
        """The manifest's tensor entries of ``plan`` with their key paths (made once
        per plan and paths: ~1,500 entries cost a save ~10 ms to make)."""
        cached = self._entries
        if cached is not None and cached[0] is plan and cached[1] == paths:
            return cached[2]
        entries = {
            fqn: dataclasses.replace(t, path=paths.get(fqn)) for fqn, t in plan.tensors.items()
        }
        self._entries = (plan, paths, entries)
        return entries

    # ---------------------------------------------------------------------- plan
    def _plan(self, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> _Plan:
        key = (
            tuple((fqn, t.dtype, tuple(t.shape)) for fqn, t in tensors.items()),
            tuple(objects),
            self.config.thread_count,
        )
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        items = []
        for fqn, t in tensors.items():
            shape = tuple(t.shape)
            items.append(
                ItemSpec(
                    fqn,
                    (0,) * len(shape),
                    shape,
                    shape,
                    dtype_name(t.dtype),
                    t.numel() * element_size(t.dtype),
                )
            )
        layout = layout_rank(self.rank, items, self.config.thread_count)
        entries: dict[str, TensorEntry] = {}
        chunk_keys: dict[str, tuple[str, int]] = {}
        files: dict[str, FileEntry] = {}
        places: dict[str, tuple[str, int, int]] = {}
        for f in layout.files:
            files[f.name] = FileEntry(f.size, f.header_xxh3_64, self.rank, f.data_start)
            for e in f.entries:
                it = e.item
                entries[it.fqn] = TensorEntry(
                    it.dtype,
                    it.global_shape,
                    (ChunkEntry(it.offsets, it.sizes, f.name, e.offset, e.length, ""),),
                )
                chunk_keys[it.key] = (it.fqn, 0)
                places[it.fqn] = (f.name, e.offset, e.length)
        skeleton = Manifest(None, 1, entries, {fqn: ObjectEntry(None) for fqn in objects}, files)
        keys = {fqn: key for key, (fqn, _) in chunk_keys.items()}
        plan = _Plan(
            key, layout, chunk_keys, dcp_metadata_bytes(skeleton), entries, files, places, keys
        )
        self._plans = {key: plan}  # keep the latest only: plans change rarely
        return plan

    # -------------------------------------------------------------------- pools
    def _free_slot(self) -> _Slot | None:
        while True:
            for slot in self._slots:
                if slot.busy is None:
                    return slot
            if self.config.backpressure == "skip":
                return None
            self._collect(0.1)  # wait: a buffer the worker still reads is never overwritten

    def _pool_for(self, slot: _Slot, plan: _Plan) -> StagingPool:
        persister = self._persister_for_submit()
        self._adopt(plan)
        if slot.pool is None or slot.plan_key != plan.key:
            if slot.pool is not None:
                persister.unmap_pool(slot.pool_id)
                slot.pool.close()
            slot.pool = StagingPool(plan.layout, pin=self.config.pin_memory)
            slot.plan_key = plan.key
            slot.pool_id = self._next_id
            self._next_id += 1
        if slot.pool_id not in self._mapped:
            persister.map_pool(
                slot.pool_id, slot.pool.fd, slot.pool.nbytes, memoryview(slot.pool._mm)
            )
            self._mapped.add(slot.pool_id)
        return slot.pool

    def _adopt(self, plan: _Plan) -> None:
        """Free pools of another plan whose file images match ``plan``'s are kept for it
        (``StagingPool.adopt``): a plan changes with the order of the state dict (e.g.
        an optimizer state loaded from a checkpoint lists its keys in another order) or
        with its non-tensor names, while the layout, sorted by name, stays the same."""
        for slot in self._slots:
            if (
                slot.busy is None
                and slot.pool is not None
                and slot.plan_key != plan.key
                and slot.pool.adopt(plan.layout)
            ):
                slot.plan_key = plan.key

    # ------------------------------------------------------------------ staging
    def _split(self, plan: _Plan, tensors: dict[str, torch.Tensor], deferred: Deferred | None):
        """(copied in save(), copied in the background): ``deferred`` picks the second,
        less those a background copy has already seen written (see guard.py)."""
        if self.config.staging == "blocking" or deferred is None:
            return list(tensors), []
        now, later = [], []
        for fqn, t in tensors.items():
            late = deferred(fqn, t) and t.data_ptr() not in self._unguarded and not t.is_inference()
            (later if late else now).append(fqn)
        return now, later

    def _stage(
        self,
        pool: StagingPool,
        plan: _Plan,
        tensors: dict[str, torch.Tensor],
        fqns: list[str],
        digests: dict[str, str] | None = None,
        *,
        ready: torch.cuda.Event | None = None,
    ) -> int:
        """Copy ``fqns`` into the pool; return the bytes copied. With ``digests``, also
        hash every copied chunk into it (chunk key -> xxh3-64 hex): CPU tensors right as
        they are copied, CUDA ones from the pool once their copies are done
        (``StagingPool.stage_many``: small tensors in batches, one torch call each).
        CUDA copies run on a side stream that first waits for ``ready`` (recorded on the
        training thread's stream at ``save()``: the kernels that wrote the state, e.g.
        the optimizer step, may still be queued there)."""
        spans = self._spans(plan, pool)
        keys = plan.keys
        items = [(keys.get(n, n), *spans[n], tensors[n]) for n in fqns]
        cuda = any(it[3].is_cuda for it in items)
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None and ready is not None:
            stream.wait_event(ready)
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            after = pool.stage_many(items, digests, non_blocking=pool.pinned)
        if stream is not None:
            stream.synchronize()
        for key, offset, length in after:
            assert digests is not None
            digests[key] = pool.digest(offset, length)
        return sum(it[2] for it in items)

    def _spans(self, plan: _Plan, pool: StagingPool) -> dict[str, tuple[int, int]]:
        """Staged name -> (pool offset, length) of ``plan`` (kept for the latest plan)."""
        cached = self._span_cache
        if cached is not None and cached[0] == plan.key and cached[1] is pool:
            return cached[2]
        spans = {
            name: (pool.pool.base_of(file) + offset, length)
            for name, (file, offset, length) in plan.places.items()
        }
        self._span_cache = (plan.key, pool, spans)
        return spans

    def _stage_in_background(
        self, pool, plan, tensors, fqns, handle: SaveHandle, ready: torch.cuda.Event | None
    ) -> None:
        # Runs beside training: copies on one thread, hashing each block while it is in
        # the cache, so that the writer only writes (see ARCHITECTURE.md). The save is
        # handed to the writer by the training thread, once it has checked that nothing
        # wrote these tensors meanwhile (maybe_wait_for_staging).
        cpu0 = time.thread_time()
        digests: dict[str, str] = {}
        try:
            copied = self._stage(pool, plan, tensors, fqns, digests, ready=ready)
        except BaseException as e:  # noqa: BLE001 - reported at the next wait/save
            self._staging_error = e
            return
        overlap = self._overlap
        if overlap is not None and overlap.handle is handle:
            overlap.job = dataclasses.replace(overlap.job, digests=digests)
        handle.bytes_copied += copied
        handle.bytes_hashed += copied
        handle.staging_s = time.monotonic() - handle.started
        handle.trainer_cpu_s += time.thread_time() - cpu0

    def maybe_wait_for_staging(self) -> None:
        """Block until background staging is done, then hand that save to the writer —
        or fail it, if a deferred tensor was written since ``save()`` (``guard.py``).

        Call from the training thread before writing deferred tensors, between training
        operations (the manager's optimizer pre-hooks do, and so do ``save()``,
        ``finalize()``, ``close()`` and ``SaveHandle.wait()``).

        Raises:
            CheckpointError: the background copy failed, or a deferred tensor was
                written during it (the save is not committed; on every rank).
        """
        t = self._staging
        if t is None:
            return
        t.join()
        self._staging = None
        overlap, self._overlap = self._overlap, None
        if self._staging_error is not None:
            err, self._staging_error = self._staging_error, None
            self._release_unsubmitted()
            raise CheckpointError(
                f"staging failed: {type(err).__name__}: {err}", rank=self.rank
            ) from err
        if overlap is not None:
            self._confirm(overlap)

    def _confirm_if_staged(self) -> None:
        """``maybe_wait_for_staging`` if the background copy is already done (no wait)."""
        t = self._staging
        if t is not None and not t.is_alive():
            self.maybe_wait_for_staging()

    def _confirm(self, overlap: _Overlap) -> None:
        """Submit a save staged in the background, or fail it if its tensors moved."""
        changed = overlap.snapshot.changed()
        with self._lock:
            fl = self._in_flight.get(overlap.job.job_id)
            if fl is None or fl.handle is not overlap.handle:
                return  # failed meanwhile (its worker died): nothing to submit
            if not changed:
                self._submit(overlap.job, overlap.handle)
                return
            self._unguarded.update(overlap.tensors[n].data_ptr() for n in changed)
            err = torn_copy_error(
                changed, overlap.fqn_of, overlap.handle.step, overlap.handle.path, self.rank
            )
            logger.error("quicksave: %s", err)
            self._fail_job(overlap.job.job_id, err)
        raise err

    def _release_unsubmitted(self) -> None:
        with self._lock:
            for job_id, fl in list(self._in_flight.items()):
                if fl.handle.staging_s is None:
                    err = CheckpointError("staging failed", path=fl.handle.path, rank=self.rank)
                    self._fail_job(job_id, err)

    def _submit(self, job: PersistJob, handle: SaveHandle) -> None:
        try:
            self._persister_for_submit(job.job_id).submit(job)
        except CheckpointError as e:
            self._worker_failed(e)

    # ----------------------------------------------------------------- finalize
    def _collect(self, timeout: float) -> None:
        """Take results from the persister and complete their handles (never raises)."""
        with self._lock:
            if self._persister is None or not self._in_flight:
                if timeout:
                    time.sleep(min(timeout, 0.01))
                return
            try:
                results = self._persister.poll(timeout)
            except CheckpointError as e:
                self._worker_failed(e)
                return
            for r in results:
                self._complete(r)

    def _complete(self, r: JobResult | CallResult) -> None:
        fl = self._in_flight.pop(r.job_id, None)
        if fl is None or not isinstance(r, JobResult):
            return
        fl.slot.busy = None
        h = fl.handle
        if r.ok:
            h._finish(
                SaveResult(
                    step=h.step,
                    path=h.path,
                    bytes=r.bytes_written,
                    blocking_s=h.blocking_s,
                    staging_s=h.staging_s or 0.0,
                    durable_s=r.finished_at - h.started,
                    write_s=r.write_s,
                    commit_s=r.commit_s,
                    trainer_cpu_s=h.trainer_cpu_s,
                    worker_cpu_s=r.cpu_s,
                    bytes_copied=h.bytes_copied,
                    bytes_hashed=h.bytes_hashed + r.bytes_hashed,
                ),
                None,
            )
        else:
            err = r.error()
            if r.detail:
                logger.error("quicksave: save of step %s failed:\n%s", h.step, r.detail)
            h._finish(None, err)
            self._unreported.append(err)

    def finalize(self, blocking: bool = False) -> list[SaveResult]:
        """Collect finished saves (all in flight if ``blocking``), oldest first.

        Raises:
            CheckpointError: the first failed save not reported before (each failure is
                raised once, here or by ``save()``).
        """
        done: list[SaveHandle] = [fl.handle for fl in self._in_flight.values()]
        if blocking:
            self.maybe_wait_for_staging()
            while self._in_flight:
                self._collect(0.1)
        else:
            self._confirm_if_staged()
            self._collect(0.0)
        if self._unreported:
            err = self._unreported.pop(0)
            raise err
        return [h._result for h in done if h._done.is_set() and h._result is not None]

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------- close
    def close(self, abort: bool = False) -> None:
        """Wait for saves in flight (unless ``abort``), stop the worker, free the pools."""
        if self._closed:
            return
        try:
            if not abort:
                deadline = time.monotonic() + self.config.close_timeout_s
                try:
                    self.maybe_wait_for_staging()
                except CheckpointError:
                    pass
                while self._in_flight and time.monotonic() < deadline:
                    self._collect(0.1)
        finally:
            self._closed = True
            self.wait_prepared()  # it sees _closed and frees what it built
            if self._staging is not None:  # abort: a copy still writing into a pool
                self._staging.join()
                self._staging = None
            if self._persister is not None:
                # saves still in flight here timed out (or abort): stop the writer now, so
                # that no save is reported failed and then committed behind our back
                if abort or self._in_flight:
                    self._persister.close(0.0)
                elif isinstance(self._persister, ProcessPersister):
                    # Idle: our own mappings go first (cheap while the worker still maps
                    # the pages), then the worker is told to stop; its exit, and the
                    # freeing of the pages it maps last, need not delay close() nor run
                    # beside our unmapping.
                    self._close_pools()
                    self._persister.close(5.0, wait=False)
                else:
                    self._persister.close(5.0)
                self._persister = None
            self._abandon_in_flight()
            self._close_pools()
            atexit.unregister(self._atexit)
            for b in self._backends.values():
                b.close()
            self._backends.clear()

    def _close_pools(self) -> None:
        for slot in self._slots:
            if slot.pool is not None:
                slot.pool.close()
                slot.pool = None

    def _abandon_in_flight(self) -> None:
        for job_id, fl in list(self._in_flight.items()):
            del self._in_flight[job_id]
            fl.slot.busy = None
            where = fl.location if fl.location is not None else fl.handle.path
            # With overwrite a checkpoint was there before: its presence proves nothing.
            if not fl.replace and commit.classify(where) is commit.CheckpointKind.QUICKSAVE:
                h = fl.handle  # committed just before the writer stopped
                durable = time.monotonic() - h.started
                h._finish(
                    SaveResult(
                        h.step, h.path, fl.bytes, h.blocking_s, h.staging_s or 0.0, durable, 0, 0
                    ),
                    None,
                )
                continue
            if fl.tmp_dir:
                shutil.rmtree(fl.tmp_dir, ignore_errors=True)
            fl.handle._finish(
                None,
                CheckpointError(
                    "the saver was closed before this save was durable (close_timeout_s="
                    f"{self.config.close_timeout_s:g} s or abort); "
                    + (
                        "the checkpoint at this path is the old one or this one (each "
                        "whole): the writer stopped around its atomic replace"
                        if fl.replace
                        else "it was not committed"
                    ),
                    path=fl.handle.path,
                    rank=self.rank,
                ),
            )

    def _atexit(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter exit: best effort
            logger.exception("quicksave: closing the saver at exit failed")

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prepare
    def prepare(
        self, state_dict: Mapping[str, Any], *, background: bool = True
    ) -> threading.Thread | None:
        """Plan ``state_dict`` and build, populate and hand to the worker its staging
        pools now, so that the first ``save()`` of the same shapes pays no allocation
        (~1 s/GiB) and no first-touch page faults.

        Call from the training thread once the state is complete (optimizer states
        exist only after the first optimizer step, or after a checkpoint was loaded into
        them); values are not read, only names, dtypes and shapes. ``save()`` waits for a
        build still running. Never raises: a state that cannot be saved is reported by
        ``save()``, a pool that cannot be allocated is logged and built by ``save()``.

        Args:
            state_dict: the state that later saves will pass (same shapes).
            background: build in a low-priority thread while training goes on (the page
                clearing then happens in the worker process). False: build here, before
                returning — for start-up, when nothing else competes for the CPU.

        Returns:
            the thread building the pools, or None if there was nothing to build or it
            was built before returning.

        Example::

            saver.prepare(state_dict)  # after step 1; save(state_dict, ...) at step 100
        """
        self.wait_prepared()
        if self._dist is not None:
            return None  # planning is collective: the first save builds the pool
        with self._lock:
            if self._closed:
                return None
            try:
                tensors, _, objects, _, _ = self._collect_state(state_dict, "")
                plan = self._plan(tensors, objects)
            except CheckpointError as e:
                logger.debug("quicksave: nothing prepared: %s", e)
                return None
            self._adopt(plan)
            n = sum(s.plan_key != plan.key for s in self._slots)
            if n == 0:
                return None
            if background:
                thread = threading.Thread(
                    target=self._build_pools,
                    args=(plan, n, True),
                    name="quicksave-prepare",
                    daemon=True,
                )
                self._prepare_thread = thread
                thread.start()
                return thread
        self._build_pools(plan, n, False)
        return None

    def wait_prepared(self) -> None:
        """Block until a :meth:`prepare` build is finished (call outside the lock)."""
        t = self._prepare_thread
        if t is not None:
            t.join()
            self._prepare_thread = None

    def _build_pools(self, plan: _Plan, n: int, background: bool) -> None:
        # In the background (beside training) this thread runs at the worker's lower CPU
        # priority, and the page clearing (the bulk of the cost: ~0.4 s/GiB) goes to the
        # worker process, whose map_pool faults the pages in (see stage.py); only an
        # in-process persister has them touched here. In the foreground: populate here.
        if background:
            _lower_thread_priority(self.config.worker.nice)
        in_worker = background and isinstance(self._persister, ProcessPersister)
        try:
            pools = [
                StagingPool(plan.layout, pin=self.config.pin_memory, populate=not background)
                for _ in range(n)
            ]
            if background and not in_worker:
                for pool in pools:
                    pool.touch()
        except CheckpointError as e:
            logger.warning("quicksave: staging pool not prepared ahead: %s", e)
            return
        with self._lock:
            for pool in pools:
                slot = next(
                    (s for s in self._slots if s.busy is None and s.plan_key != plan.key), None
                )
                if slot is None or self._closed:
                    pool.close()
                    continue
                if slot.pool is not None:
                    if self._persister is not None:
                        self._persister.unmap_pool(slot.pool_id)
                    slot.pool.close()
                slot.pool, slot.plan_key, slot.pool_id = pool, plan.key, self._next_id
                self._next_id += 1
                if self._persister is None:
                    continue  # save() maps it into the next worker
                # Mapped now, while the worker is idle: its populate of the mapping (which
                # clears the pages) then runs neither beside the first save's copies nor
                # before its write.
                try:
                    self._persister.map_pool(
                        slot.pool_id, pool.fd, pool.nbytes, memoryview(pool._mm)
                    )
                    self._mapped.add(slot.pool_id)
                    if not background and isinstance(self._persister, ProcessPersister):
                        # At start-up: the worker's own start and its populate of this
                        # mapping (~0.1 CPU s per 1.6 GB) finish here, not beside the
                        # first training step.
                        self._persister.sync(self.config.worker.start_timeout_s)
                except CheckpointError as e:
                    self._worker_failed(e)


def _whole_local(fqn: str, v: torch.Tensor) -> torch.Tensor:
    """The plain tensor a single-rank save stages for ``v``: ``v`` itself, or the local
    tensor of a DTensor on a one-rank mesh (FSDP2 or TP code run on one rank), which holds
    every element.

    Raises:
        IncompatibleStateError: a tensor split over several ranks (a multi-rank saver
            saves it), or another tensor subclass.
    """
    if type(v) is torch.Tensor or isinstance(v, torch.nn.Parameter):
        return v.detach()
    if type(v).__name__ == "DTensor":
        local = v.to_local()
        if v.device_mesh.size() == 1 and tuple(local.shape) == tuple(v.shape):
            return local.detach()
        raise IncompatibleStateError(
            f"this DTensor is split over {v.device_mesh.size()} ranks, and this saver saves "
            "one rank; build the saver with a dist_context (CheckpointManager does when the "
            "process group has several ranks) or save with quicksave.save",
            fqn=fqn,
        )
    raise IncompatibleStateError(
        f"{type(v).__name__} values are not saved by the single-rank engine; save them "
        "with quicksave.save, or pass plain tensors",
        fqn=fqn,
    )


def _fqns_of(layout: RankLayout) -> dict[str, str]:
    """Chunk key -> fqn of every chunk in ``layout`` (several ranks stage by chunk key)."""
    return {e.item.key: e.item.fqn for f in layout.files for e in f.entries}


def _cuda_ready(tensors: Mapping[str, torch.Tensor]) -> torch.cuda.Event | None:
    """An event on the calling thread's current CUDA stream, if any tensor is on a GPU:
    the staging stream waits for it, so it copies what the queued kernels leave."""
    device = next((t.device for t in tensors.values() if t.is_cuda), None)
    if device is None:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
