"""NVRx's ``async_ckpt.core`` module: the names it defines, where NVRx's users and tests
import them from (``quicksave.async_api.core`` is this module too).

- ``AsyncCallsQueue``, ``abort_nvrx_checkpoint``: ``calls_queue`` (the queue, and the
  call order of a request's life);
- ``ObjectTracker``: ``process_state`` (it tracks the queues there);
- ``AsyncRequest``: ``request``;
- ``AsyncCaller``, ``PersistentAsyncCaller``, ``TemporalAsyncCaller``: ``callers``.
"""

from quicksave.compat.nvrx.callers import (
    AsyncCaller,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from quicksave.compat.nvrx.calls_queue import AsyncCallsQueue, abort_nvrx_checkpoint
from quicksave.compat.nvrx.process_state import ObjectTracker
from quicksave.compat.nvrx.request import AsyncRequest

__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "ObjectTracker",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "abort_nvrx_checkpoint",
]
