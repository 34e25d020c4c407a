"""``AsyncCallsQueue``: background calls (``AsyncRequest``), finalized in FIFO order.

One request's life (training thread unless said otherwise)::

    schedule_async_request(req) → id
        ├─ preload_fn (worker; schedule returns once it is done) → replaces async_fn_args[1]
        └─ async_fn(*args, **kwargs)   (worker process, or a thread if persistent=False)
    maybe_finalize_async_calls(blocking, no_dist) → [ids]
        for the oldest unfinalized call, FIFO:
            done here? ── no_dist=False: ONE MIN all-reduce so every rank agrees ──
            failed on any rank → CheckpointError on every rank (its finalize fns never run)
            done everywhere → run its finalize_fns here, in order

Where ``async_fn`` runs:

- ``persistent=True`` (default): in the queue's persistent worker process
  (``ProcessPersister``), started when the queue is built. ``async_fn``, its arguments and
  ``preload_fn`` are pickled with multiprocessing's ``ForkingPickler`` and torch's
  reductions: CPU tensors travel as shared memory (their storage moves to shared memory in
  the trainer, and the worker maps the same pages), never through the pipe. So the worker
  reads the trainer's live tensors: copy them first (``preload_fn``, or staging as
  ``TorchAsyncCheckpoint`` does) if training mutates them. Functions must be importable
  (module level, or ``functools.partial`` of such); the worker adopts the trainer's
  ``sys.path``. Calls run one at a time, in order. A worker that dies or hangs fails every
  call in flight with ``WorkerFailedError`` (bounded by ``WorkerConfig`` timeouts); the
  next request starts a new worker.
- ``persistent=False``: in a background thread of the trainer, one per call (the seeds
  fork a process per call instead; forking a threaded CUDA process is unsafe, and a thread
  needs no pickling). ``preload_fn`` runs in the trainer, in ``schedule_async_request``.
  Calls may overlap; finalization is still FIFO. Threads cannot be killed: ``close(abort=
  True)`` leaves them to finish.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, WorkerFailedError
from ..worker import CallResult, ProcessPersister, ThreadPersister, WorkerConfig
from .request import (
    AsyncRequest,
    check_request,
    drop_preloaded,
    preload_in_worker,
    preloaded_args,
    run_preloaded,
)

logger = logging.getLogger("quicksave")

__all__ = ["AsyncCallsQueue", "AsyncRequest"]


@dataclass
class _Call:
    call_id: int
    request: AsyncRequest
    path: str | None = None  # named in errors, when known
    done: bool = False
    error: CheckpointError | None = None
    preloading: bool = False


@dataclass(frozen=True)
class _Agreement:
    all_done: bool
    failed_rank: int | None  # lowest rank whose call failed


_NO_FAILURE = 2**62


def _all_ranks_agree_on_call(
    call_id: int, done: bool, failed: bool, process_group: Any = None
) -> _Agreement:
    """The queue's only collective: every rank says whether its oldest call is done (or
    failed); one MIN all-reduce of four small integers gives every rank the same answer.

    Raises:
        CheckpointError: ranks are at different calls (they scheduled different requests,
            or not all of them are finalizing).
    """
    import torch.distributed as dist

    backend = str(dist.get_backend(process_group))
    device = torch.device("cpu") if "gloo" in backend else torch.device("cuda")
    me = dist.get_rank()
    t = torch.tensor(
        [int(done), me if failed else _NO_FAILURE, call_id, -call_id],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=process_group)
    all_done, failed_rank, lo, hi = (int(v) for v in t.tolist())
    if lo != -hi:
        raise CheckpointError(
            f"ranks are finalizing different async calls (ids {lo}..{-hi}): every rank must "
            "schedule the same requests and call maybe_finalize_async_calls together",
            rank=me,
        )
    return _Agreement(bool(all_done), None if failed_rank == _NO_FAILURE else failed_rank)


class AsyncCallsQueue:
    """Runs ``AsyncRequest``s in the background and finalizes them in FIFO order.

    Call order (every rank, training thread): ``schedule_async_request`` per request →
    ``maybe_finalize_async_calls`` now and then (with ``no_dist=False`` every rank must call
    it, the same number of times) → ``close``. See the module docstring for where calls run.

    Args:
        persistent: run calls in a persistent worker process (started now, so the first
            call pays no start-up); ``False``: in background threads.
        worker: heartbeat and timeouts of the worker process.
        process_group: group of the ``no_dist=False`` agreement (default group if None).
        close_timeout_s: how long ``close()`` waits for calls in flight.

    Example::

        queue = AsyncCallsQueue()
        queue.schedule_async_request(AsyncRequest(save_fn, (rank, state, path), [commit_fn]))
        ...  # training goes on
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)  # → [0]
        queue.close()
    """

    def __init__(
        self,
        persistent: bool = True,
        *,
        worker: WorkerConfig | None = None,
        process_group: Any = None,
        close_timeout_s: float = 300.0,
    ) -> None:
        self.persistent = persistent
        self.worker_config = worker or WorkerConfig()
        self.process_group = process_group
        self.close_timeout_s = close_timeout_s
        self.rank = _dist_rank()
        self._calls: deque[_Call] = deque()
        self._jobs: dict[int, tuple[_Call | None, str]] = {}  # persister job -> call, role
        self._next_call = 0
        self._next_job = 0
        self._token = uuid.uuid4().hex[:12]
        self._closed = False
        self._persister: ProcessPersister | ThreadPersister | None = self._new_persister()
        atexit.register(self._atexit)

    # ---------------------------------------------------------------- persister
    def _new_persister(self) -> ProcessPersister | ThreadPersister:
        if not self.persistent:
            return ThreadPersister()
        p = ProcessPersister(self.worker_config, self.rank or 0)
        # Warm-up: the worker imports torch now, in the background, not at the first call.
        self._submit(p, None, "warmup", os.getpid, (), {})
        return p

    @property
    def worker_pid(self) -> int | None:
        """PID of the worker process (``persistent=True``), for monitoring and tests."""
        p = self._persister
        return p.pid if isinstance(p, ProcessPersister) else None

    def _submit(self, p, call: _Call | None, role: str, fn, args: tuple, kwargs: dict) -> None:
        job = self._next_job
        self._next_job += 1
        p.submit_call(job, fn, args, kwargs)
        self._jobs[job] = (call, role)

    def _worker_failed(self, err: CheckpointError) -> None:
        for call in self._calls:
            if not call.done:
                call.done, call.preloading = True, False
                call.error = WorkerFailedError(
                    f"async call {call.call_id}: {err.message}", path=call.path, rank=self.rank
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
            call.error = CheckpointError(
                f"async call {call.call_id} ({_name(call.request.async_fn)}): {what}: {r.error}",
                path=call.path,
                rank=self.rank,
            )

    # ------------------------------------------------------------------ schedule
    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` in the background; every rank must schedule the same
        requests in the same order.

        Args:
            async_request: the call; it is frozen (copied) here.

        Returns:
            The call's id: 0, 1, 2, ... in scheduling order.

        Raises:
            CheckpointError: the queue is closed, or the request is malformed or does not
                pickle (``persistent=True``). Failures of the call itself (and of the
                worker) surface in ``maybe_finalize_async_calls``.
        """
        return self._schedule(async_request)

    def _schedule(self, async_request: AsyncRequest, path: str | None = None) -> int:
        if self._closed:
            raise CheckpointError("the AsyncCallsQueue is closed", path=path, rank=self.rank)
        req = async_request.freeze()
        check_request(req, path, self.rank)
        call = _Call(self._next_call, req, path)
        if req.async_fn is None:
            call.done = True
        elif self.persistent:
            self._start_in_worker(call)
        else:
            self._start_in_thread(call)
        self._next_call += 1
        self._calls.append(call)
        return call.call_id

    def _start_in_thread(self, call: _Call) -> None:
        req = call.request
        if self._persister is None:
            self._persister = self._new_persister()
        try:
            args = preloaded_args(req)  # in the trainer, like the seeds' forking caller
        except Exception as e:  # noqa: BLE001 - surfaces at finalization, on every rank
            call.done = True
            call.error = CheckpointError(
                f"async call {call.call_id}: its preload_fn failed: {type(e).__name__}: {e}",
                path=call.path,
                rank=self.rank,
            )
            return
        self._submit(self._persister, call, "call", req.async_fn, args, req.async_fn_kwargs)

    def _start_in_worker(self, call: _Call) -> None:
        req = call.request
        if self._persister is None:
            logger.warning("quicksave: starting a new checkpoint worker (rank %s)", self.rank)
            self._persister = self._new_persister()
        p = self._persister
        fn, args = req.async_fn, tuple(req.async_fn_args)
        try:
            if req.preload_fn is not None:
                key = f"{self._token}-{call.call_id}"
                self._submit(p, call, "preload", preload_in_worker, (key, req.preload_fn), {})
                call.preloading = True
                fn, args = run_preloaded, (key, req.async_fn, args, req.async_fn_kwargs)
                try:
                    self._submit(p, call, "call", fn, args, {})
                except CheckpointError as e:
                    if isinstance(e, WorkerFailedError):
                        raise
                    self._submit(p, None, "drop", drop_preloaded, (key,), {})
                    raise
            else:
                self._submit(p, call, "call", fn, args, req.async_fn_kwargs)
        except WorkerFailedError as e:
            self._worker_failed(e)  # fails the calls in flight; this one too, below
            call.done, call.preloading = True, False
            call.error = WorkerFailedError(
                f"async call {call.call_id}: {e.message}", path=call.path, rank=self.rank
            )
            return
        # The trainer may mutate what preload_fn reads as soon as we return: wait for it.
        while call.preloading:
            self._pump(0.1)

    # ------------------------------------------------------------------ finalize
    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = True) -> list[int]:
        """Finalize the calls that are done, oldest first, running their finalize functions.

        Args:
            blocking: wait until every scheduled call is done and finalized.
            no_dist: decide from this rank alone. ``False`` (with ``torch.distributed``
                initialized): a call counts as done only when it is done on every rank
                (one small all-reduce per call considered), so all ranks finalize the same
                calls together; every rank must then call this, the same number of times.

        Returns:
            Ids of the calls finalized by this call, in order. A later call is never
            finalized before an earlier one.

        Raises:
            CheckpointError: the oldest done call failed (on this rank, or on another rank
                with ``no_dist=False``: then every rank raises); its finalize functions do
                not run and it is removed, so each failure is raised once. Calls finalized
                before it in the same invocation stay finalized. ``WorkerFailedError`` if
                the worker process died or hung.
        """
        use_dist = not no_dist and _dist_rank() is not None
        finalized: list[int] = []
        while self._calls:
            head = self._calls[0]
            self._pump(0.0)
            while blocking and not head.done:
                self._pump(0.1)
            if use_dist:
                agreed = _all_ranks_agree_on_call(
                    head.call_id, head.done, head.error is not None, self.process_group
                )
                done, failed_rank = agreed.all_done, agreed.failed_rank
                failed = failed_rank is not None
            else:
                done, failed_rank, failed = head.done, self.rank, head.error is not None
            if not done:
                break
            self._calls.popleft()
            if failed:
                raise head.error or CheckpointError(
                    f"async call {head.call_id} ({_name(head.request.async_fn)}) failed on "
                    f"rank {failed_rank}; it was not finalized on any rank",
                    path=head.path,
                    rank=self.rank,
                )
            for fn in head.request.finalize_fns:
                try:
                    fn()
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(
                        f"async call {head.call_id}: finalize function {_name(fn)} failed: "
                        f"{type(e).__name__}: {e}",
                        path=head.path,
                        rank=self.rank,
                    ) from e
            finalized.append(head.call_id)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Calls scheduled and not yet finalized (running, done, or failed)."""
        return len(self._calls)

    # --------------------------------------------------------------------- close
    def close(self, abort: bool = False) -> None:
        """Finalize every call (this rank alone: ``no_dist=True``), then stop the worker.

        With ``torch.distributed``, call ``maybe_finalize_async_calls(blocking=True,
        no_dist=False)`` on every rank first, so that finalization stays collective.

        Args:
            abort: drop unfinalized calls without waiting or finalizing, and kill the
                worker at once (threads of ``persistent=False`` finish on their own).

        Raises:
            CheckpointError: the first call that failed (after everything was shut down).
        """
        if self._closed:
            return
        first: CheckpointError | None = None
        try:
            if not abort:
                deadline = time.monotonic() + self.close_timeout_s
                while self._calls and time.monotonic() < deadline:
                    try:
                        self.maybe_finalize_async_calls(blocking=False, no_dist=True)
                    except CheckpointError as e:
                        first = first or e
                    if self._calls:
                        self._pump(0.1)
                if self._calls:
                    first = first or CheckpointError(
                        f"{len(self._calls)} async call(s) not done after close_timeout_s="
                        f"{self.close_timeout_s:.0f} s; they were abandoned",
                        rank=self.rank,
                    )
        finally:
            self._shutdown(0.0 if abort else 5.0)
        if first is not None:
            raise first

    def _shutdown(self, timeout: float) -> None:
        self._closed = True
        self._calls.clear()
        self._jobs.clear()
        if self._persister is not None:
            self._persister.close(timeout)
            self._persister = None
        atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        # Interpreter exit: let calls in flight finish (files complete), but run no
        # finalize functions: they may need peers that are already gone.
        deadline = time.monotonic() + self.close_timeout_s
        while any(not c.done for c in self._calls) and time.monotonic() < deadline:
            self._pump(0.1)
        self._shutdown(5.0)


def _name(fn: Any) -> str:
    if fn is None:
        return "no-op"
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _dist_rank() -> int | None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return None
