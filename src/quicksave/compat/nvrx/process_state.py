"""The process-wide state that NVRx's API defines, kept in one object.

quicksave keeps no module-level mutable state (STYLE.md point 8): the engine, its worker
and its plan cache belong to objects the user holds. NVRx's ``async_ckpt`` API, which
``quicksave.compat.nvrx`` reproduces so that switching is a change of imports, defines three
things per process instead, and its users call them without holding anything:

* ``abort_nvrx_checkpoint()`` stops the workers of *every* ``AsyncCallsQueue`` alive in
  the process (an in-process restart's clean-up), found through NVRx's ``ObjectTracker``
  metaclass, whose instances are tracked (weakly) here;
* ``AsyncCallsQueue.warmup_persistent_caller(rank)`` starts a worker before any queue
  exists; the next persistent queue adopts it;
* ``save_state_dict_async_plan(..., enable_cache=True)`` without ``metadata_cache`` uses
  a default plan cache, which ``init_checkpoint_metadata_cache(md)`` fills after a restart
  and ``get_metadata_caching_status()`` reports on.

(With them, NVRx's ``ObjectTracker.get_instances`` and
``PersistentAsyncCaller.register_worker_restart_callback``, which serve the first two, and
the staging pool ``FileSystemWriterAsync`` reuses from one save to the next, as NVRx's
writer keeps its shared-memory tensors in a class-level cache.)
Those live here, in :data:`PROCESS`, and nowhere else. Code that wants no shared
state passes its own ``metadata_cache`` and holds its queues (``queue.close(abort=True)``
is the per-queue abort).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quicksave.stage.pool import SparePool

if TYPE_CHECKING:
    from quicksave.worker.config import WorkerConfig
    from quicksave.worker.persisters import ProcessPersister


class NvrxProcessState:
    """What NVRx's API shares across a process (see the module docstring).

    Attributes:
        metadata_cache: the default ``CheckpointMetadataCache`` (None until first used).
        spare_pool: the staging pool ``FileSystemWriterAsync`` reuses (the last
            finalized save's).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warm: tuple[ProcessPersister, WorkerConfig, int] | None = None
        self._tracked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._restart_callbacks: list[Any] = []
        self.spare_pool = SparePool()
        self.metadata_cache: Any = None

    def track(self, obj: Any) -> None:
        """Remember ``obj`` (weakly) for ``ObjectTracker.get_instances``."""
        with self._lock:
            self._tracked.add(obj)

    def instances(self, cls: type) -> list[Any]:
        """The live tracked objects that are instances of ``cls``."""
        with self._lock:
            return [o for o in self._tracked if isinstance(o, cls)]

    def add_restart_callback(self, fn: Any) -> None:
        """``PersistentAsyncCaller.register_worker_restart_callback``."""
        with self._lock:
            self._restart_callbacks.append(fn)

    def restart_callbacks(self) -> list[Any]:
        with self._lock:
            return list(self._restart_callbacks)

    def put_warm_worker(self, persister: ProcessPersister, config: WorkerConfig, rank: int) -> bool:
        """Keep a pre-started worker for the next persistent queue; False (and nothing
        kept) if one is already waiting."""
        with self._lock:
            if self._warm is not None:
                return False
            self._warm = (persister, config, rank)
            return True

    def take_warm_worker(self) -> tuple[ProcessPersister, WorkerConfig, int] | None:
        """The pre-started worker, once (None if there is none)."""
        with self._lock:
            warm, self._warm = self._warm, None
            return warm

    def default_metadata_cache(self, create: Callable[[], Any]) -> Any:
        """The default plan cache, made by ``create()`` at first use (the caller passes
        ``CheckpointMetadataCache``, which lives above this module)."""
        with self._lock:
            if self.metadata_cache is None:
                self.metadata_cache = create()
            return self.metadata_cache


PROCESS = NvrxProcessState()
"""This process's NVRx state (the only instance)."""


class ObjectTracker(type):
    """NVRx's metaclass that tracks the live instances of a class (``abort_nvrx_checkpoint``
    reaches every ``AsyncCallsQueue`` through it). The instances are held weakly in
    ``process_state.PROCESS``, not on the class."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        PROCESS.track(instance)
        return instance

    def get_instances(cls) -> list[Any]:
        """The live instances of this class (and its subclasses) in this process."""
        return PROCESS.instances(cls)
