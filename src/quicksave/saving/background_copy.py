"""The engine's background copy (``staging="overlap"``) and its confirmation: the deferred
tensors of a save are copied into its pool by a thread while training goes on; the save
is handed to the worker only once the training thread has seen their version counters
unchanged (``guard.py``), and fails — never committed — if they moved.

Call order: ``start()`` at the end of ``save()`` (training thread) → the copy runs on
the ``quicksave-stage`` thread, hashing what it copies → ``wait_and_confirm()`` on the
training thread at its next sync point (``AsyncSaver.maybe_wait_for_staging``: the
manager's optimizer pre-hooks, ``save()``, ``finalize()``, ``close()``,
``SaveHandle.wait()``): joins the copy, then submits the save or fails it. One copy at
a time per saver.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quicksave.errors import CheckpointError
from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.guard import Snapshot, torn_copy_error
from quicksave.saving.handle import SaveHandle
from quicksave.saving.in_flight import InFlightSaves
from quicksave.saving.staging import PoolCopier
from quicksave.stage.pool import StagingPool
from quicksave.trace import phase
from quicksave.worker.job import PersistJob

logger = logging.getLogger("quicksave")


@dataclass
class Overlap:
    """A save whose deferred tensors are copied in the background: submitted to the
    persister only once the training thread has seen their version counters unchanged
    (``guard.py``)."""

    job: PersistJob
    handle: SaveHandle
    snapshot: Snapshot
    tensors: dict[str, torch.Tensor]  # staged name -> the tensor copied
    fqn_of: dict[str, str]  # staged name -> fqn, where they differ (several ranks)


class BackgroundCopy:
    """One saver's background copy, and the tensors it has seen written.

    Args:
        copier: copies into the pools.
        flights: the saver's saves in flight (a torn or failed copy fails its save).
        lock: the saver's lock (held while submitting or failing).
        submit: hands a confirmed save to the worker.
        rank: named in errors.

    Attributes:
        thread: the copy running or finished but not yet confirmed, else None.
        unguarded: addresses of staged tensors seen written during a copy: copied inside
            ``save()`` from then on (see guard.py).
    """

    def __init__(
        self,
        copier: PoolCopier,
        flights: InFlightSaves,
        lock: threading.RLock,
        submit: Callable[[PersistJob, SaveHandle], None],
        rank: int,
    ) -> None:
        self.copier = copier
        self.flights = flights
        self.lock = lock
        self.submit = submit
        self.rank = rank
        self.thread: threading.Thread | None = None
        self.unguarded: set[int] = set()
        self._error: BaseException | None = None
        self._overlap: Overlap | None = None  # the copy's save, unconfirmed

    def start(
        self,
        overlap: Overlap,
        pool: StagingPool,
        plan: EnginePlan,
        fqns: list[str],
        ready: torch.cuda.Event | None,
    ) -> None:
        """Copy ``fqns`` of ``overlap``'s save into ``pool`` in a new thread."""
        self._overlap = overlap
        self._error = None
        self.thread = threading.Thread(
            target=self._run,
            args=(pool, plan, overlap.tensors, fqns, overlap.handle, ready),
            name="quicksave-stage",
            daemon=True,
        )
        self.thread.start()

    def awaits(self, handle: SaveHandle) -> bool:
        """Whether ``handle``'s save is the one whose copy awaits confirmation."""
        overlap = self._overlap
        return overlap is not None and overlap.handle is handle

    def finished(self) -> bool:
        """Whether a copy is done and awaits confirmation (no wait)."""
        t = self.thread
        return t is not None and not t.is_alive()

    def _run(
        self,
        pool: StagingPool,
        plan: EnginePlan,
        tensors: dict[str, torch.Tensor],
        fqns: list[str],
        handle: SaveHandle,
        ready: torch.cuda.Event | None,
    ) -> None:
        # Runs beside training: copies on one thread, hashing each block while it is in
        # the cache, so that the writer only writes (see ARCHITECTURE.md). The save is
        # handed to the writer by the training thread, once it has checked that nothing
        # wrote these tensors meanwhile (wait_and_confirm).
        cpu0 = time.thread_time()
        digests: dict[str, str] = {}
        try:
            with phase("save.stage"):
                copied = self.copier.stage(pool, plan, tensors, fqns, digests, ready=ready)
        except BaseException as e:  # noqa: BLE001 - reported at the next wait/save
            self._error = e
            return
        overlap = self._overlap
        if overlap is not None and overlap.handle is handle:
            overlap.job = dataclasses.replace(overlap.job, digests=digests)
        handle.bytes_copied += copied
        handle.bytes_hashed += copied
        handle.staging_s = time.monotonic() - handle.started
        handle.trainer_cpu_s += time.thread_time() - cpu0

    def wait_and_confirm(self) -> None:
        """Block until the copy is done, then hand its save to the writer — or fail it,
        if a deferred tensor was written since ``save()``. Training thread.

        Raises:
            CheckpointError: the copy failed, or a deferred tensor was written during it
                (the save is not committed).
        """
        t = self.thread
        if t is None:
            return
        with phase("save.wait_staging"):
            t.join()
            self.thread = None
            overlap, self._overlap = self._overlap, None
            if self._error is not None:
                err, self._error = self._error, None
                with self.lock:
                    self.flights.release_unsubmitted()
                raise CheckpointError(
                    f"staging failed: {type(err).__name__}: {err}", rank=self.rank
                ) from err
            if overlap is not None:
                self._confirm(overlap)

    def _confirm(self, overlap: Overlap) -> None:
        """Submit a save staged in the background, or fail it if its tensors moved."""
        changed = overlap.snapshot.changed()
        with self.lock:
            fl = self.flights.jobs.get(overlap.job.job_id)
            if fl is None or fl.handle is not overlap.handle:
                return  # failed meanwhile (its worker died): nothing to submit
            if not changed:
                self.submit(overlap.job, overlap.handle)
                return
            self.unguarded.update(overlap.tensors[n].data_ptr() for n in changed)
            err = torn_copy_error(
                changed, overlap.fqn_of, overlap.handle.step, overlap.handle.path, self.rank
            )
            logger.error("quicksave: %s", err)
            self.flights.fail(overlap.job.job_id, err)
        raise err

    def join(self) -> None:
        """Wait for a copy still writing into a pool (``close()``), without confirming."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
