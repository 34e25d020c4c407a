"""``TorchAsyncCheckpoint``: ``torch.save`` in the background, written atomically.

``async_save`` copies every tensor of the state dict into one staging pool (a
``StagingPool`` of tensor slots, ``quicksave.stage``: shared memory that reaches the
worker process as one handle, never through the pipe) and returns; the background call
puts the pool's tensors back into the object (:class:`_SaveStaged`) and the worker
``torch.save``s it into a temporary file next to the target, fsyncs it, renames it over
the target and fsyncs the directory. So the values saved are those at the ``async_save``
call, training may mutate its tensors at once, and the target path holds either the
previous file or the complete new one, never half.

The pool is reused by the next save that fits in it once the call that used it is
finalized (a fresh allocation costs page faults on every byte).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from quicksave.commit import new_token
from quicksave.commit.files import fsync_path, temp_path_for
from quicksave.compat.nvrx.calls_queue import AsyncCallsQueue
from quicksave.compat.nvrx.request import AsyncRequest
from quicksave.compat.nvrx.staging import stage_to_pool
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.stage.pool import SparePool, StagingPool
from quicksave.storage import local_path
from quicksave.worker.config import WorkerConfig

logger = logging.getLogger("quicksave")

_NOT_A_LEAF = object()  # what a ``_rebuild`` swap returns for containers and values


@dataclass(frozen=True)
class _Staged:
    """Stands in the staged object for one tensor: its slot in the pool."""

    key: str
    parameter: bool  # a ``torch.nn.Parameter``: rebuilt as one
    requires_grad: bool


class TorchAsyncCheckpoint:
    """An asynchronous ``torch.save``.

    Call order: ``async_save`` per checkpoint → ``finalize_async_save`` now and then
    (non-blocking in the training loop, blocking before exit) → ``close``.

    NVRx 0.7's ``TorchAsyncCheckpoint`` (same arguments and methods), saving atomically.

    Args:
        persistent_queue: run the saves in a persistent worker process (default) or in
            threads; see :class:`AsyncCallsQueue`.
        worker: heartbeat and timeouts of the worker process.
        queue: schedule on this queue (shared with other requests) instead of a new one;
            it is then not closed by ``close()``.

    Attributes:
        save: ``torch.save`` itself (NVRx's synchronous save).
        async_fn: what runs in the background: an atomic ``torch.save``.

    Example::

        ckpt = TorchAsyncCheckpoint()
        for step in range(steps):
            ckpt.finalize_async_save(blocking=False)
            train_step()
            if step % 100 == 0:
                ckpt.async_save(model.state_dict(), f"ckpt/model-{step}.pt")
        ckpt.finalize_async_save(blocking=True, terminate=True)
    """

    async_fn: Any = None

    def __init__(
        self,
        persistent_queue: bool = True,
        *,
        worker: WorkerConfig | None = None,
        queue: AsyncCallsQueue | None = None,
    ) -> None:
        self.save = torch.save
        self.async_fn = _save_atomically
        self._owns_queue = queue is None
        self._queue = (
            queue if queue is not None else AsyncCallsQueue(persistent_queue, worker=worker)
        )
        self._deep = not self._queue.persistent  # a thread saves later: freeze values
        self._spare = SparePool()  # the pool of the last finalized save

    def _get_async_calls_queue(self) -> AsyncCallsQueue:
        """The queue the saves run on (NVRx's accessor, for tests and monitoring)."""
        return self._queue

    def async_save(self, state_dict: Any, *args: Any, **kwargs: Any) -> int:
        """Start ``torch.save(state_dict, *args, **kwargs)`` in the background.

        Args:
            state_dict: any object ``torch.save`` takes; tensors inside dicts, lists and
                tuples are copied to host now (GPU tensors come back on CPU when loaded;
                a tensor that appears twice is saved once).
            *args: ``torch.save``'s arguments after the object: the target path first
                (a ``str`` or ``os.PathLike``: file objects cannot reach another process),
                then e.g. ``pickle_protocol``.
            **kwargs: ``torch.save``'s keyword arguments (``f=`` may name the path).

        Returns:
            The id of the call in the queue (what ``finalize_async_save`` returns).

        Raises:
            CheckpointError: no path, the path's directory does not exist, or the path is
                a directory (checked now, before anything is written).
            IncompatibleStateError: a tensor that cannot be staged (sparse, meta,
                tensor subclasses), naming its key.
        """
        if args:
            f, rest = args[0], args[1:]
        elif "f" in kwargs:
            kwargs = dict(kwargs)
            f, rest = kwargs.pop("f"), ()
        else:
            raise CheckpointError("async_save needs the target path, like torch.save")
        if not isinstance(f, (str, os.PathLike)):
            raise CheckpointError(
                f"async_save writes to a path (str or os.PathLike), not a {type(f).__name__}: "
                "file objects cannot be handed to the background writer"
            )
        path = local_path(f, what="torch.save target")
        if not os.path.isdir(os.path.dirname(path)):
            raise CheckpointError("the directory to save into does not exist", path=path)
        if os.path.isdir(path):
            raise CheckpointError("the target is a directory; give a file path", path=path)
        skeleton, pool = self._stage(state_dict, path)
        request = AsyncRequest(
            _SaveStaged(self.async_fn),
            (pool, skeleton, path, *rest),
            [lambda: self._spare.give(pool)],
            kwargs,
        )
        return self._queue._schedule(request, path=path)

    def finalize_async_save(
        self, blocking: bool = False, no_dist: bool = True, terminate: bool = False
    ) -> list[int]:
        """Finalize saves that are done (all of them if ``blocking``).

        Args:
            blocking: wait until every save is durable.
            no_dist: decide from this rank alone; ``False``: all ranks agree (see
                ``AsyncCallsQueue.maybe_finalize_async_calls``).
            terminate: then close (the worker process exits).

        Returns:
            Ids of the saves finalized now, oldest first.

        Raises:
            AsyncCheckpointError: a save failed (named with its path and cause).
        """
        if blocking and self._queue.get_num_unfinalized_calls():
            logger.info("quicksave: waiting for unfinalized async torch.save calls")
        try:
            return self._queue.maybe_finalize_async_calls(blocking, no_dist=no_dist)
        finally:
            if terminate:
                self.close()

    def close(self, abort: bool = False) -> None:
        """Finalize what is left (unless ``abort``) and stop the worker of an owned queue
        (a later ``async_save`` starts a new one)."""
        if self._owns_queue:
            self._queue.close(abort=abort)  # finalizing hands the pools back: then close
        self._spare.close()

    def __del__(self) -> None:
        queue = getattr(self, "_queue", None)
        if queue is not None and getattr(self, "_owns_queue", False):
            queue.__del__()  # calls in flight finish; nothing collective runs

    def __enter__(self) -> TorchAsyncCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(abort=exc[0] is not None)

    # ------------------------------------------------------------------ staging
    def _stage(self, obj: Any, path: str) -> tuple[Any, StagingPool]:
        """Copy every tensor of ``obj`` into a pool; ``obj`` with each tensor replaced
        by its slot (``_Staged``), and the pool."""
        sources: dict[int, torch.Tensor] = {}
        _find_tensors(obj, "", sources, path)
        slots = {f"t{i}": t.detach() for i, t in enumerate(sources.values())}
        pool = stage_to_pool(slots, self._spare.take)
        staged = {
            key: _Staged(f"t{i}", isinstance(t, torch.nn.Parameter), t.requires_grad)
            for i, (key, t) in enumerate(sources.items())
        }

        def swap(value: Any) -> Any:
            return staged[id(value)] if isinstance(value, torch.Tensor) else _NOT_A_LEAF

        return _rebuild(obj, swap, deep=self._deep), pool


@dataclass(frozen=True)
class _SaveStaged:
    """The background call of one save (the worker process, or a thread): the object
    with the pool's tensors in their places, then ``func(obj, *args, **kwargs)``.
    ``func`` is named ``func`` as in a ``functools.partial``, so that errors name it."""

    func: Any

    def __call__(self, pool: StagingPool, skeleton: Any, *args: Any, **kwargs: Any) -> None:
        tensors = pool.tensors()
        built: dict[str, torch.Tensor] = {}  # a tensor met twice is one object, saved once

        def swap(value: Any) -> Any:
            if not isinstance(value, _Staged):
                return _NOT_A_LEAF
            if value.key not in built:
                t = tensors[value.key]
                if value.parameter:
                    t = torch.nn.Parameter(t, requires_grad=value.requires_grad)
                built[value.key] = t
            return built[value.key]

        self.func(_rebuild(skeleton, swap, deep=False), *args, **kwargs)


def _find_tensors(obj: Any, key: str, out: dict[int, torch.Tensor], path: str) -> None:
    if isinstance(obj, torch.Tensor):
        if (
            type(obj) not in (torch.Tensor, torch.nn.Parameter)
            or obj.layout != torch.strided
            or obj.is_meta
        ):
            raise IncompatibleStateError(
                f"cannot stage a {type(obj).__name__} ({obj.layout}, device {obj.device}) for "
                "an async torch.save; save a dense tensor (e.g. .to_dense() / .full_tensor())",
                path=path,
                fqn=key or "<root>",
            )
        out.setdefault(id(obj), obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _find_tensors(v, f"{key}.{k}" if key else str(k), out, path)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _find_tensors(v, f"{key}.{i}" if key else str(i), out, path)


def _rebuild(obj: Any, swap: Any, deep: bool) -> Any:
    """``obj`` with each leaf that ``swap`` replaces replaced (``swap`` returns
    ``_NOT_A_LEAF`` for the others); container types (and attributes such as
    ``OrderedDict._metadata`` of ``Module.state_dict()``) kept."""
    got = swap(obj)
    if got is not _NOT_A_LEAF:
        return got
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _rebuild(v, swap, deep)
        return out
    if isinstance(obj, list):
        return [_rebuild(v, swap, deep) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, swap, deep) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if deep:  # a thread saves later: freeze mutable values now (a process pickles now)
        with contextlib.suppress(Exception):
            return copy.deepcopy(obj)
    return obj


def _save_atomically(obj: Any, path: str, *args: Any, **kwargs: Any) -> None:
    """Runs in the background: ``torch.save`` into a sibling temporary file, fsync, rename
    over ``path``, fsync the directory."""
    tmp = temp_path_for(path, new_token())
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f, *args, **kwargs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(path))
