"""``TorchAsyncCheckpoint``: ``torch.save`` in the background, written atomically.

``async_save`` copies every tensor of the state dict into host buffers (shared memory when
the calls run in the worker process, so they reach it without a copy through the pipe)
and returns; the worker ``torch.save``s the copies into a temporary file next to the
target, fsyncs it, renames it over the target and fsyncs the directory. So the values
saved are those at the ``async_save`` call, training may mutate its tensors at once, and
the target path holds either the previous file or the complete new one, never half.

The staging buffers are reused by the next save with the same tensor shapes once the call
that used them is finalized (a fresh allocation costs page faults on every byte).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from typing import Any

import torch

from quicksave.commit import new_token
from quicksave.commit.files import fsync_path, temp_path_for
from quicksave.compat.nvrx.calls_queue import AsyncCallsQueue
from quicksave.compat.nvrx.request import AsyncRequest
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.storage import local_path
from quicksave.worker.config import WorkerConfig

logger = logging.getLogger("quicksave")

_Signature = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


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
        self._shared = self._queue.persistent
        self._free: tuple[_Signature, list[torch.Tensor]] | None = None

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
        staged, signature, buffers = self._stage(state_dict, path)
        request = AsyncRequest(
            self.async_fn,
            (staged, path, *rest),
            [lambda: self._release(signature, buffers)],
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
        self._free = None
        if self._owns_queue:
            self._queue.close(abort=abort)

    def __del__(self) -> None:
        queue = getattr(self, "_queue", None)
        if queue is not None and getattr(self, "_owns_queue", False):
            queue.__del__()  # calls in flight finish; nothing collective runs

    def __enter__(self) -> TorchAsyncCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(abort=exc[0] is not None)

    # ------------------------------------------------------------------ staging
    def _stage(self, obj: Any, path: str) -> tuple[Any, _Signature, list[torch.Tensor]]:
        sources: dict[int, torch.Tensor] = {}
        _find_tensors(obj, "", sources, path)
        signature = tuple((t.dtype, tuple(t.shape)) for t in sources.values())
        free, self._free = self._free, None
        if free is not None and free[0] == signature:
            buffers = free[1]
        else:
            buffers = [self._empty(s, d) for d, s in signature]
        copies: dict[int, torch.Tensor] = {}
        for (key, src), buf in zip(sources.items(), buffers, strict=True):
            buf.copy_(src.detach())
            if isinstance(src, torch.nn.Parameter):
                copies[key] = torch.nn.Parameter(buf, requires_grad=src.requires_grad)
            else:
                copies[key] = buf
        return _rebuild(obj, copies, deep=not self._shared), signature, buffers

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not self._shared:
            return torch.empty(shape, dtype=dtype)
        # Allocated in shared memory directly: ``share_memory_()`` would copy it there.
        nbytes = math.prod(shape) * dtype.itemsize
        storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
        strides = torch.empty(shape, dtype=dtype, device="meta").stride()
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)

    def _release(self, signature: _Signature, buffers: list[torch.Tensor]) -> None:
        self._free = (signature, buffers)  # the call is done: its buffers may be reused


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


def _rebuild(obj: Any, copies: dict[int, torch.Tensor], deep: bool) -> Any:
    """``obj`` with its tensors replaced by their staged copies; container types (and
    attributes such as ``OrderedDict._metadata`` of ``Module.state_dict()``) kept."""
    if isinstance(obj, torch.Tensor):
        return copies[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _rebuild(v, copies, deep)
        return out
    if isinstance(obj, list):
        return [_rebuild(v, copies, deep) for v in obj]
    if isinstance(obj, tuple):
        items = [_rebuild(v, copies, deep) for v in obj]
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
