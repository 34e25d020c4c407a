"""The engine's background copy (``staging="overlap"``) and its confirmation: the deferred
tensors of a save are copied into its pool by a thread while training goes on; the save
is handed to the worker only once the training thread has seen their version counters
unchanged (``guard.py``), and fails — never committed — if they moved.

Call order: ``start()`` at the end of ``save()`` (training thread) → the copy runs on
the ``quicksave-stage`` thread, hashing what it copies → ``wait()`` on the training
thread at its next sync point (``AsyncSaver.maybe_wait_for_staging``: the manager's
optimizer pre-hooks, ``save()``, ``finalize()``, ``close()``, ``SaveHandle.wait()``):
joins the copy and checks the guard; the saver then submits the save or fails it. One
copy at a time per saver.

Its own state is the copy (its thread, its error, its save) and the tensors seen written;
it takes no lock of the saver's and touches none of its saves: ``wait()`` returns a
:class:`CopyDone`, on which the saver acts under its own lock (``InFlightSaves.confirm``:
submit the save, or fail it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quicksave.errors import CheckpointError
from quicksave.saving.engine_plan import EnginePlan
from quicksave.saving.guard import Snapshot, torn_copy_error
from quicksave.saving.handle import SaveHandle
from quicksave.saving.staging import PoolCopier
from quicksave.stage.pool import StagingPool
from quicksave.trace import phase
from quicksave.worker.job import PersistJob


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
    # incremental saves: drops the deferred blocks that did not change, before the copy
    # (``incremental._Sift``: (names, digests, bases found) -> (names left, bytes hashed))
    sift: Callable[[list[str], dict[str, str], dict[str, int]], tuple[list[str], int]] | None = None


@dataclass(frozen=True)
class CopyDone:
    """A finished background copy, for the saver to act on.

    Attributes:
        job: the save's job (with the digests of what the copy hashed), or None if no
            save awaited the copy.
        handle: that save's handle (None with ``job``).
        error: None: the save may be handed to the writer. Else why it fails.
        torn: ``error`` is the guard's (a deferred tensor was written during the copy)
            or an incremental save's check (a block referred to on its version
            counter's word changed, ``incremental._Sift``): only this save fails.
            Otherwise the copy itself failed: every save not yet handed to the writer
            fails.
    """

    job: PersistJob | None
    handle: SaveHandle | None
    error: CheckpointError | None = None
    torn: bool = False


class BackgroundCopy:
    """One saver's background copy, and the tensors it has seen written.

    Args:
        copier: copies into the pools.
        rank: named in errors.

    Attributes:
        thread: the copy running or finished but not yet waited for, else None.
        unguarded: addresses of staged tensors seen written during a copy: copied inside
            ``save()`` from then on (see guard.py).
    """

    def __init__(self, copier: PoolCopier, rank: int) -> None:
        self.copier = copier
        self.rank = rank
        self.thread: threading.Thread | None = None
        self.unguarded: set[int] = set()
        self._error: BaseException | None = None
        self._refused: CheckpointError | None = None  # the sift's: this save only fails
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
        self._refused = None
        self.thread = threading.Thread(
            target=self._run,
            args=(pool, plan, overlap.tensors, fqns, overlap.handle, ready, overlap.sift),
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
        sift: Callable[[list[str], dict[str, str], dict[str, int]], tuple[list[str], int]]
        | None = None,
    ) -> None:
        # Runs beside training: copies on one thread, hashing each block while it is in
        # the cache, so that the writer only writes (see ARCHITECTURE.md). The save is
        # handed to the writer by the training thread, once it has checked that nothing
        # wrote these tensors meanwhile (wait).
        cpu0 = time.thread_time()
        digests: dict[str, str] = {}
        found: dict[str, int] = {}  # chunks referred to (incremental: ``sift``)
        hashed = 0
        try:
            with phase("save.stage"):
                if sift is not None:
                    try:
                        fqns, hashed = sift(fqns, digests, found)
                    except CheckpointError as e:  # (a block changed behind its counter)
                        self._refused = e
                        return
                copied = self.copier.stage(pool, plan, tensors, fqns, digests, ready=ready)
        except BaseException as e:  # noqa: BLE001 - reported at the next wait/save
            self._error = e
            return
        overlap = self._overlap
        if overlap is not None and overlap.handle is handle:
            # (the digests save() took are kept: chunks referred to, and copied then)
            job = overlap.job
            job = dataclasses.replace(job, digests={**job.digests, **digests})
            if found:  # (incremental: the blocks the sift found unchanged are referred to)
                job = dataclasses.replace(job, bases={**job.bases, **found})
            overlap.job = job
        handle.bytes_copied += copied
        handle.bytes_hashed += copied + hashed
        handle.staging_s = time.monotonic() - handle.started
        handle.trainer_cpu_s += time.thread_time() - cpu0

    def wait(self) -> CopyDone | None:
        """Block until the copy is done, then check that no deferred tensor was written
        since ``save()``. Training thread. None: no copy was running.

        Returns:
            what the saver does with the copy's save (see :class:`CopyDone`).
        """
        t = self.thread
        if t is None:
            return None
        with phase("save.wait_staging"):
            t.join()
            self.thread = None
            overlap, self._overlap = self._overlap, None
            job = None if overlap is None else overlap.job
            handle = None if overlap is None else overlap.handle
            if self._error is not None:
                err, self._error = self._error, None
                failed = CheckpointError(
                    f"staging failed: {type(err).__name__}: {err}", rank=self.rank
                )
                failed.__cause__ = err
                return CopyDone(job, handle, failed)
            if overlap is None:
                return None
            if self._refused is not None:
                refused, self._refused = self._refused, None
                return CopyDone(job, handle, refused, torn=True)
            changed = overlap.snapshot.changed()
            if not changed:
                return CopyDone(job, handle)
            self.unguarded.update(overlap.tensors[n].data_ptr() for n in changed)
            torn = torn_copy_error(
                changed, overlap.fqn_of, overlap.handle.step, overlap.handle.path, self.rank
            )
            return CopyDone(job, handle, torn, torn=True)

    def join(self) -> None:
        """Wait for a copy still writing into a pool (``close()``), without confirming."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
