"""``AsyncCallsQueue``: background calls (``AsyncRequest``), finalized in FIFO order.

The API of NVRx 0.7's ``nvidia_resiliency_ext.checkpointing.async_ckpt.core``: the same
names, signatures and defaults (``AsyncCallsQueue``, ``AsyncRequest``,
``abort_nvrx_checkpoint``), so that switching is a change of imports.

One request's life (training thread unless said otherwise)::

    schedule_async_request(req) → id
        ├─ preload_fn (worker; schedule returns once it is done) → replaces async_fn_args[1]
        └─ async_fn(*args, **kwargs)   (worker process, or a thread if persistent=False)
    maybe_finalize_async_calls(blocking, no_dist=False) → [ids]
        for the oldest unfinalized call, FIFO:
            done here? ── no_dist=False: ONE MIN all-reduce so every rank agrees ──
            failed on any rank → AsyncCheckpointError on every rank, naming each failed
                rank and its cause (its finalize fns never run)
            done everywhere → run its finalize_fns here, in order

Failures are ``compat.nvrx.errors.AsyncCheckpointError``: a ``quicksave.CheckpointError``
and torch's ``CheckpointException`` (what NVRx documents) at once.

Where ``async_fn`` runs:

- ``persistent=True`` (default): in the queue's persistent worker process
  (``ProcessPersister``), started when the queue is built (or adopted from
  ``warmup_persistent_caller``), so the first save pays no start-up. ``async_fn``, its
  arguments and ``preload_fn`` are pickled in ``schedule_async_request`` (a failure is
  raised there, never at finalize): CPU tensors travel as shared memory (their storage
  moves to shared memory in the trainer, and the worker maps the same pages), never
  through the pipe, so the worker reads the trainer's live tensors: copy them first
  (``preload_fn``, or staging as ``TorchAsyncCheckpoint`` does) if training mutates them.
  Importable functions go by reference (the worker adopts the trainer's ``sys.path``);
  functions of the training script (``__main__``), closures and lambdas go by value
  (``quicksave.worker.fnpickle``). Calls run one at a time, in order. A worker that dies or
  hangs fails every call in flight (bounded by ``WorkerConfig`` timeouts).
  ``close()`` (or ``close(abort=True)``, ``abort_nvrx_checkpoint()``) stops the worker;
  the queue stays usable and its next request starts a new one.
- ``persistent=False``: in a background thread of the trainer, one per call (NVRx forks a
  process per call instead; forking a threaded CUDA process is unsafe, and a thread
  needs no pickling). ``preload_fn`` runs in the trainer, in ``schedule_async_request``.
  Calls may overlap; finalization is still FIFO. Threads cannot be killed: ``close(abort=
  True)`` leaves them to finish.

NVRx's keyword arguments: ``cpu_priority`` is the worker's nice increment;
``io_priority`` its Linux I/O scheduling class (``ionice -c``); ``sigterm_timeout`` how
long ``close()`` lets the worker finish before killing it; ``is_daemon`` makes the worker
refuse to start processes of its own, as a daemonic process does (so NVRx's "Invalid
Setup!" error for ``is_multiproc_io=True`` writers is reproduced); ``cpu_shm_mode`` is
accepted and changes nothing (tensors are always staged in host shared memory here).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import uuid
import weakref
from collections import deque
from typing import Any

from quicksave.compat.nvrx.call_agreement import (
    Call,
    agree_on_call,
    call_name,
    dist_rank,
    failures_everywhere,
)
from quicksave.compat.nvrx.errors import (
    AsyncCheckpointError,
    AsyncWorkerFailedError,
    as_async_error,
)
from quicksave.compat.nvrx.process_state import PROCESS, ObjectTracker
from quicksave.compat.nvrx.request import (
    AsyncRequest,
    check_request,
    drop_preloaded,
    preload_in_worker,
    preloaded_args,
    run_preloaded,
)
from quicksave.errors import CheckpointError, WorkerFailedError
from quicksave.worker.calls import CallResult
from quicksave.worker.config import WorkerConfig
from quicksave.worker.persisters import ProcessPersister, ThreadPersister

logger = logging.getLogger("quicksave")


class WorkerHandle:
    """What ``AsyncCallsQueue._get_async_caller()`` returns: a view of the queue's worker
    (NVRx's ``AsyncCaller``), for monitoring and NVRx's tests."""

    def __init__(self, persister: ProcessPersister | ThreadPersister) -> None:
        self._persister = persister

    @property
    def pid(self) -> int | None:
        p = self._persister
        return p.pid if isinstance(p, ProcessPersister) else None

    def _debug_is_async_process_running(self) -> bool:
        """True while the worker process runs (a thread-based queue: always True)."""
        p = self._persister
        if isinstance(p, ProcessPersister):
            return p.process.poll() is None and p._beat_fd >= 0
        return True

    def is_alive(self) -> bool:
        return self._debug_is_async_process_running()


class AsyncCallsQueue(metaclass=ObjectTracker):
    """Runs ``AsyncRequest``s in the background and finalizes them in FIFO order.

    Call order (every rank, training thread): ``schedule_async_request`` per request →
    ``maybe_finalize_async_calls`` now and then (with ``no_dist=False``, the default, every
    rank must call it, the same number of times) → ``close``. See the module docstring
    for where calls run and what NVRx's arguments do.

    Args:
        persistent: run calls in a persistent worker process (started now, so the first
            call pays no start-up); ``False``: in background threads.
        is_daemon: the worker may not start processes of its own (NVRx's daemon worker).
        cpu_priority: the worker's nice increment (0-19; higher is lower priority).
        io_priority: the worker's Linux I/O scheduling class (0-3 as ``ionice -c``;
            3 is idle); None: the trainer's.
        sigterm_timeout: seconds ``close()`` lets the worker finish before killing it.
        cpu_shm_mode: accepted, no effect (see the module docstring).
        worker: heartbeat and timeouts of the worker process (its ``nice``,
            ``io_priority`` and ``daemon`` are then taken from it, not from the arguments
            above).
        process_group: group of the ``no_dist=False`` agreement (default group if None).
        close_timeout_s: how long interpreter exit waits for calls in flight.

    Example::

        queue = AsyncCallsQueue()
        queue.schedule_async_request(AsyncRequest(save_fn, (rank, state, path), [commit_fn]))
        ...  # training goes on
        queue.maybe_finalize_async_calls(blocking=True)  # → [0]
        queue.close()
    """

    def __init__(
        self,
        persistent: bool = True,
        is_daemon: bool = True,
        cpu_priority: int = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
        *,
        worker: WorkerConfig | None = None,
        process_group: Any = None,
        close_timeout_s: float = 300.0,
    ) -> None:
        self.persistent = persistent
        self.is_daemon = is_daemon
        self.cpu_priority = cpu_priority
        self.io_priority = io_priority
        self.sigterm_timeout = sigterm_timeout
        self.cpu_shm_mode = cpu_shm_mode
        self.worker_config = worker or WorkerConfig(
            nice=cpu_priority, io_priority=io_priority, daemon=is_daemon
        )
        self.process_group = process_group
        self.close_timeout_s = close_timeout_s
        self.rank = dist_rank()
        self._calls: deque[Call] = deque()
        self._jobs: dict[int, tuple[Call | None, str]] = {}  # persister job -> call, role
        self._next_call = 0
        self._next_job = 0
        self._token = uuid.uuid4().hex[:12]
        self._persister: ProcessPersister | ThreadPersister | None = self._new_persister()
        self._exit_hook = functools.partial(_queue_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    # ---------------------------------------------------------------- persister
    def _new_persister(self) -> ProcessPersister | ThreadPersister:
        if not self.persistent:
            return ThreadPersister()
        warm = PROCESS.take_warm_worker()
        if warm is not None:
            p, config, _ = warm
            if p.process.poll() is None:
                if config != self.worker_config:
                    logger.info("quicksave: adopting the pre-started worker (its own settings)")
                return p
            p.close(0.0)  # died while waiting: reap it, start ours
        p = ProcessPersister(self.worker_config, self.rank or 0)
        # Warm-up: the worker imports torch now, in the background, not at the first call.
        self._submit(p, None, "warmup", os.getpid, (), {})
        return p

    @classmethod
    def warmup_persistent_caller(
        cls,
        rank: int,
        is_daemon: bool = True,
        cpu_priority: int = 10,
        io_priority: int | None = None,
        sigterm_timeout: float = 30.0,
        cpu_shm_mode: bool = False,
    ) -> None:
        """Start a worker process now, before any queue exists; the next persistent
        ``AsyncCallsQueue`` built in this process adopts it (NVRx's pre-warming). A queue
        starts its own worker when built anyway, so this only helps code that builds its
        queue late. No-op if a pre-started worker is already waiting.

        Args:
            rank: this rank (names the worker in errors).
            is_daemon, cpu_priority, io_priority, sigterm_timeout, cpu_shm_mode: as for
                ``AsyncCallsQueue``.
        """
        config = WorkerConfig(nice=cpu_priority, io_priority=io_priority, daemon=is_daemon)
        p = ProcessPersister(config, rank)
        p.submit_call(-1, os.getpid, (), {})  # import torch in the background now
        if not PROCESS.put_warm_worker(p, config, rank):
            p.close(0.0)

    def _get_async_caller(self) -> WorkerHandle | None:
        """The queue's current worker (None after ``close()`` until the next request)."""
        return WorkerHandle(self._persister) if self._persister is not None else None

    @property
    def worker_pid(self) -> int | None:
        """PID of the worker process (``persistent=True``), for monitoring and tests."""
        p = self._persister
        return p.pid if isinstance(p, ProcessPersister) else None

    def _submit(self, p, call: Call | None, role: str, fn, args: tuple, kwargs: dict) -> None:
        job = self._next_job
        self._next_job += 1
        p.submit_call(job, fn, args, kwargs)
        self._jobs[job] = (call, role)

    def _worker_failed(self, err: CheckpointError) -> None:
        for call in self._calls:
            if not call.done:
                call.done, call.preloading = True, False
                call.error = AsyncWorkerFailedError(
                    f"async call {call.call_id}: {err.message}",
                    path=call.path,
                    rank=self.rank,
                    failures={self.rank or 0: (err, None)},
                )
        self._jobs.clear()
        if self._persister is not None:
            self._persister.kill()
        self._persister = None

    def _pump(self, timeout: float) -> None:
        """Take finished calls from the persister (never raises: failures go to calls)."""
        if self._persister is None:
            return
        try:
            results = self._persister.poll(timeout)
        except CheckpointError as e:
            self._worker_failed(e)
            return
        for r in results:
            self._record(r)

    def _record(self, r: CallResult) -> None:
        call, role = self._jobs.pop(r.job_id, (None, ""))
        if call is None:
            if not r.ok:
                logger.warning("quicksave: checkpoint worker warm-up failed: %s", r.error)
            return
        if role == "preload":
            call.preloading = False
            if r.ok:
                return
            what = "its preload_fn failed"
        else:
            what = "its async_fn failed"
        if call.done and call.error is not None:
            return  # the first failure (the preload's) is the cause
        call.done = True
        if not r.ok:
            if r.detail:
                logger.error("quicksave: async call %d failed:\n%s", call.call_id, r.detail)
            fn_name = call_name(call.request.async_fn)
            call.error = AsyncCheckpointError(
                f"async call {call.call_id} ({fn_name}): {what}: {r.error}",
                path=call.path,
                rank=self.rank,
                failures={self.rank or 0: (RuntimeError(r.error), None)},
            )

    # ------------------------------------------------------------------ schedule
    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; every rank must schedule the same
        requests in the same order. Starts a new worker if the queue was closed.

        Args:
            async_request: the call; it is frozen (copied) here.

        Returns:
            The call's id: 0, 1, 2, ... in scheduling order (from 0 again after close).

        Raises:
            AsyncCheckpointError: the request is malformed or does not pickle
                (``persistent=True``; e.g. a class defined in ``__main__``), raised here,
                before anything runs. Failures of the call itself (and of the worker)
                surface in ``maybe_finalize_async_calls``.
        """
        return self._schedule(async_request)

    def _schedule(self, async_request: AsyncRequest, path: str | None = None) -> int:
        if len(async_request) != len(AsyncRequest._fields):  # a request type of another API
            async_request = AsyncRequest(*async_request)
        try:
            req = async_request.freeze()._replace(call_idx=self._next_call)
            check_request(req, path, self.rank)
        except CheckpointError as e:
            raise as_async_error(e, path=path, rank=self.rank) from e
        call = Call(self._next_call, req, path)
        if req.async_fn is None:
            call.done = True
        elif self.persistent:
            self._start_in_worker(call)
        else:
            self._start_in_thread(call)
        self._next_call += 1
        self._calls.append(call)
        return call.call_id

    def _start_in_thread(self, call: Call) -> None:
        req = call.request
        if self._persister is None:
            self._persister = self._new_persister()
        try:
            args = preloaded_args(req)  # in the trainer, like NVRx's forking caller
        except Exception as e:  # noqa: BLE001 - surfaces at finalization, on every rank
            call.done = True
            call.error = AsyncCheckpointError(
                f"async call {call.call_id}: its preload_fn failed: {type(e).__name__}: {e}",
                path=call.path,
                rank=self.rank,
                failures={self.rank or 0: (e, None)},
            )
            return
        self._submit(self._persister, call, "call", req.async_fn, args, req.async_fn_kwargs or {})

    def _start_in_worker(self, call: Call) -> None:
        req = call.request
        if self._persister is None:
            logger.info("quicksave: starting a new checkpoint worker (rank %s)", self.rank)
            self._persister = self._new_persister()
            for fn in PROCESS.restart_callbacks():
                fn()
        p = self._persister
        fn, args, kwargs = req.async_fn, tuple(req.async_fn_args), req.async_fn_kwargs or {}
        try:
            if req.preload_fn is not None:
                key = f"{self._token}-{call.call_id}"
                self._submit(p, call, "preload", preload_in_worker, (key, req.preload_fn), {})
                call.preloading = True
                try:
                    self._submit(p, call, "call", run_preloaded, (key, fn, args, kwargs), {})
                except CheckpointError as e:
                    if isinstance(e, WorkerFailedError):
                        raise
                    self._submit(p, None, "drop", drop_preloaded, (key,), {})
                    raise
            else:
                self._submit(p, call, "call", fn, args, kwargs)
        except WorkerFailedError as e:
            self._worker_failed(e)  # fails the calls in flight; this one too, below
            call.done, call.preloading = True, False
            call.error = AsyncWorkerFailedError(
                f"async call {call.call_id}: {e.message}",
                path=call.path,
                rank=self.rank,
                failures={self.rank or 0: (e, None)},
            )
            return
        except CheckpointError as e:  # does not pickle: nothing was sent
            raise as_async_error(e, path=call.path, rank=self.rank) from e
        # The trainer may mutate what preload_fn reads as soon as we return: wait for it.
        while call.preloading:
            self._pump(0.1)

    # ------------------------------------------------------------------ finalize
    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        """Finalize the calls that are done, oldest first, running their finalize functions.

        Args:
            blocking: wait until every scheduled call is done and finalized.
            no_dist: decide from this rank alone. ``False`` (default, with
                ``torch.distributed`` initialized): a call counts as done only when it is
                done on every rank (one small all-reduce per call considered), so all
                ranks finalize the same calls together; every rank must then call this,
                the same number of times.

        Returns:
            Ids of the calls finalized by this call, in order. A later call is never
            finalized before an earlier one.

        Raises:
            AsyncCheckpointError: (torch's ``CheckpointException`` too) the oldest done
                call failed: on this rank, or (``no_dist=False``) on any rank, and then
                every rank raises, naming each failed rank and its cause. Its finalize
                functions do not run and it is removed, so each failure is raised once.
                Calls finalized before it in the same invocation stay finalized. A
                finalize function's own failure is raised as one too (torch's
                ``CheckpointException`` from it unchanged).
        """
        use_dist = not no_dist and dist_rank() is not None
        finalized: list[int] = []
        while self._calls:
            head = self._calls[0]
            self._pump(0.0)
            while blocking and not head.done:
                self._pump(0.1)
            if use_dist:
                agreed = agree_on_call(
                    head.call_id, head.done, head.error is not None, self.process_group
                )
                done, failed = agreed.all_done, agreed.failed_rank is not None
            else:
                done, failed = head.done, head.error is not None
            if not done:
                break
            self._calls.popleft()
            if failed:
                if use_dist:
                    raise self._failure_everywhere(head)
                assert head.error is not None
                raise as_async_error(head.error, path=head.path, rank=self.rank)
            for fn in head.request.finalize_fns:
                self._run_finalize(head, fn)
            finalized.append(head.call_id)
        return finalized

    def _failure_everywhere(self, head: Call) -> AsyncCheckpointError:
        causes = failures_everywhere(head, self.process_group)
        named = "; ".join(f"rank {r}: {msg}" for r, (msg, _) in sorted(causes.items()))
        path = head.path or next((p for _, p in causes.values() if p), None)
        return AsyncCheckpointError(
            f"async call {head.call_id} ({call_name(head.request.async_fn)}) failed on "
            f"{len(causes)} rank(s), so it was not finalized on any rank: {named}",
            path=path,
            rank=self.rank,
            failures={
                r: (CheckpointError(msg, path=p, rank=r), None) for r, (msg, p) in causes.items()
            },
        )

    def _run_finalize(self, head: Call, fn: Any) -> None:
        try:
            fn()
        except CheckpointError as e:
            raise as_async_error(e, path=head.path, rank=self.rank) from e
        except Exception as e:
            raise AsyncCheckpointError(
                f"async call {head.call_id}: finalize function {call_name(fn)} failed: "
                f"{type(e).__name__}: {e}",
                path=head.path,
                rank=self.rank,
                failures={self.rank or 0: (e, None)},
            ) from e

    def get_num_unfinalized_calls(self) -> int:
        """Calls scheduled and not yet finalized (running, done, or failed)."""
        return len(self._calls)

    # --------------------------------------------------------------------- close
    def close(self, abort: bool = False) -> None:
        """Finalize every call (``maybe_finalize_async_calls(blocking=True)``: with
        ``torch.distributed``, every rank must close), then stop the worker, letting it
        finish for up to ``sigterm_timeout`` seconds. The queue stays usable: the next
        request starts a new worker.

        Args:
            abort: drop unfinalized calls without waiting or finalizing, and kill the
                worker at once (threads of ``persistent=False`` finish on their own).

        Raises:
            AsyncCheckpointError: a call failed (after the worker was stopped).
        """
        try:
            if not abort and self._calls:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._stop_worker(0.0 if abort else self.sigterm_timeout)

    def _stop_worker(self, timeout: float) -> None:
        self._calls.clear()
        self._jobs.clear()
        self._next_call = 0
        if self._persister is not None:
            self._persister.close(timeout)
            self._persister = None

    def _drain(self) -> None:
        # Interpreter exit, or the queue is collected: let calls in flight finish (files
        # complete), but run no finalize functions: they may need peers already gone.
        deadline = time.monotonic() + self.close_timeout_s
        while any(not c.done for c in self._calls) and time.monotonic() < deadline:
            self._pump(0.1)
        self._stop_worker(5.0)

    def __del__(self) -> None:
        try:
            atexit.unregister(self._exit_hook)
            self._drain()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


def _queue_at_exit(ref: weakref.ref[AsyncCallsQueue]) -> None:
    queue = ref()
    if queue is not None:
        queue._drain()


def abort_nvrx_checkpoint() -> None:
    """Abort every ``AsyncCallsQueue`` of this process (NVRx's clean-up before an
    in-process restart): calls in flight are dropped unfinalized and the workers killed.
    Each queue starts a new worker at its next request."""
    for queue in AsyncCallsQueue.get_instances():
        try:
            queue.close(abort=True)
        except Exception as e:  # noqa: BLE001 - abort every queue whatever one does
            logger.warning("quicksave: aborting a checkpoint queue: %s", e)
