"""The manager's asynchronous write path: one :class:`~quicksave.saving.engine.AsyncSaver` per
manager, and the hooks that keep overlapped staging correct.

Which tensors are staged in the background (``staging="overlap"``): those that only the
optimizers of the manager's ``OptimizerState`` states write — their parameters and state
tensors (exp_avg, step, ...) — once the step hooks have seen them through an interval
between steps with no other writer (``overlap.py``). Every such optimizer gets a step
pre-hook that waits until the background copy is done and lets the engine check, by
version counters, that nothing else wrote the tensors meanwhile (``saving/guard.py``).
Everything else (buffers such as BatchNorm statistics, which the forward pass updates,
parameters no registered optimizer holds or that something else writes, scalars, RNG,
train state, data loader, schedulers) is copied before ``save()`` returns. Writes the
counters cannot see (through ``tensor.data``, fused optimizers the manager was not given)
need ``manager.maybe_wait_for_staging()`` first (docs/RELIABILITY.md).

No cold start: as soon as the state is known — when the manager is built or a
checkpoint is loaded if every optimizer already holds state, or if the state of every
optimizer's first step is known (Adam, AdamW, SGD: ``optimizer_layout.py``), else after
every optimizer's first step (a step post-hook) — the engine plans the full state and
builds its staging pool (at start-up before returning, later in a background thread), so
the first checkpoint finds warm memory. A pool planned from the first step's predicted
state is checked once that step has run, and planned again in the background if the
guess was wrong (the engine also rebuilds any pool whose plan is not the save's).

Life of one save here: ``submit`` (engine ``save()``) → ``track`` (pending, by step) →
``poll`` (completed → committed or failed record) → retention by the manager.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from quicksave.errors import AlreadyCommittedError, CheckpointError
from quicksave.manager.optimizer_layout import Predicted, matches, stand_ins
from quicksave.manager.overlap import WriterWatch
from quicksave.manager.records import SaveRecord
from quicksave.manager.states import OptimizerState
from quicksave.saving.config import EngineConfig
from quicksave.saving.dist_save import DistContext
from quicksave.saving.engine import AsyncSaver
from quicksave.saving.handle import SaveHandle
from quicksave.saving.staging import Deferred

logger = logging.getLogger("quicksave")


@dataclass
class _Pending:
    index: int  # of its record in manager.metrics
    record: SaveRecord
    handle: SaveHandle
    begin: float  # time.monotonic() when the manager's save() started


class AsyncWriter:
    """Submits the manager's full checkpoints to an ``AsyncSaver`` and tracks them.

    Call order (training thread): ``submit`` + ``track`` per checkpoint → ``poll`` on
    every ``save()`` call (and ``drain`` before a load or a synchronous write) →
    ``close``. The hooks run inside ``optimizer.step()``.

    Args:
        config: the engine's configuration (built from the manager's config).
        states: the manager's states; models and optimizers are found among them.
        collect: returns the full state dict (used once, to prepare the staging pool).
        rank: this process's rank (named in errors).
        dist_context: several ranks: where their saves coordinate (plan cache, commit
            records); None for one rank.

    Raises:
        CheckpointError: the worker process could not be started.
    """

    def __init__(
        self,
        config: EngineConfig,
        states: Mapping[str, Any],
        collect: Callable[[], dict[str, Any]],
        rank: int = 0,
        dist_context: DistContext | None = None,
    ) -> None:
        self.config = config
        self._collect = collect
        self._optimizers: list[torch.optim.Optimizer] = []
        for state in states.values():
            if isinstance(state, OptimizerState):
                self._optimizers += [o for o in state.optimizers if o not in self._optimizers]
        self._pending: dict[int, _Pending] = {}
        self._errors: list[CheckpointError] = []  # raised in optimizer hooks, reported later
        # The last errors poll() returned: the engine can hold a failure that a handle
        # also reports, and each must reach the trainer once.
        self._returned: collections.deque[CheckpointError] = collections.deque(maxlen=64)
        self._stepped: set[int] = set()
        self._watch = WriterWatch(self._optimizers)
        self._prepared = False
        # the optimizers' first-step state the pool was planned from, until checked
        self._predicted: list[Predicted] | None = None
        # the worker starts now, not at save 1
        self.saver = AsyncSaver(config, rank=rank, dist_context=dist_context)
        self._pre_hooks: list[RemovableHandle] = [
            o.register_step_pre_hook(self._before_step) for o in self._optimizers
        ]
        self._post_hooks: list[RemovableHandle] = [
            o.register_step_post_hook(self._after_step) for o in self._optimizers
        ]

    # ------------------------------------------------------------------- hooks
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The step is about to change parameters and moments: the background copy of the
        # last save must be finished. A failure is reported by the next save(), not here:
        # optimizer.step() is no place for a checkpoint error.
        try:
            self.saver.maybe_wait_for_staging()
        except CheckpointError as e:
            self._errors.append(e)
        self._watch.before_step(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._watch.after_step(optimizer)
        if self._prepared and self._predicted is None:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self._optimizers):
            if self._predicted is not None:
                self._check_prediction(background=True)
            self.prepare()

    def prepare(self, background: bool = True) -> None:
        """Build the staging pool for the full state ahead of the first save (once):
        in the background during training, in the foreground at start-up."""
        if self._prepared:
            if not background:
                # A build already started in the background (e.g. by the step hook that
                # DCP's optimizer-state initialisation fires inside load()): at start-up
                # it is finished here, before training resumes.
                self.saver.wait_prepared()
            return
        self._prepared = True  # first: collect() may step an optimizer (DCP's state init)
        try:
            self.saver.prepare(self._collect(), background=background)
        except Exception as e:  # noqa: BLE001 - an optimisation; save() reports real errors
            logger.debug("quicksave: staging pool not prepared ahead: %s", e)

    def prepare_if_due(self, background: bool = True) -> None:
        """Prepare now if the state is complete: there are no optimizers, or every
        optimizer already holds state (it has stepped, or a checkpoint was loaded into
        it); or if the state every optimizer's first step creates is known
        (``optimizer_layout.py``): the pool is then planned with stand-ins of that state.
        Otherwise the first step of every optimizer prepares, in the background.

        Args:
            background: False at start-up (the manager's construction, ``load()``): the
                pool is then built before this returns, when no training step waits.
        """
        complete = all(o.state for o in self._optimizers)
        if complete and self._predicted is not None:
            self._check_prediction(background)  # e.g. load() filled the state
        if complete:
            self.prepare(background)
        elif not self._prepared and not self.saver.distributed:
            # (several ranks: the first save plans, collectively)
            with stand_ins(self._optimizers) as predicted:
                if predicted is None:
                    return  # not known: the first steps prepare
                self.prepare(background)  # collects the stand-ins' names and shapes
            self._predicted = predicted

    def _check_prediction(self, background: bool) -> None:
        """Every optimizer holds its real state now: if it is not the predicted one, the
        pool planned from the prediction is planned again from the real state."""
        predicted, self._predicted = self._predicted, None
        if predicted is not None and not matches(self._optimizers, predicted):
            logger.debug("quicksave: optimizer state unlike its prediction; planning again")
            self._prepared = False
            self.prepare(background)

    # -------------------------------------------------------------------- save
    def deferred(self) -> Deferred | None:
        """Which tensors the background copy may take (overlap mode): those only the
        manager's optimizers write (``overlap.WriterWatch``), as they are now."""
        if self.config.staging != "overlap":
            return None
        return self._watch.deferred()

    def submit(
        self,
        state_dict: dict[str, Any],
        path: str,
        step: int,
        metadata: dict[str, Any],
        *,
        local: bool = False,
        in_place: int = 0,
    ) -> SaveHandle | None:
        """Start the save (engine ``save()``); None if skipped by backpressure.
        ``local``: this rank's own snapshot (the memory tier's; see the engine's
        ``save``, and its ``in_place``): not tracked here, its caller follows the handle.

        Raises:
            CheckpointError: bad input, or the engine refused the save.
        """
        deferred = self.deferred()

        def save() -> SaveHandle | None:
            return self.saver.save(
                state_dict,
                path,
                step=step,
                deferred=deferred,
                user_metadata=metadata,
                local=local,
                in_place=in_place,
            )

        try:
            return save()
        except CheckpointError as e:
            if not any(p.handle.exception() is e for p in self._pending.values()):
                raise
            # An earlier save's failure that arrived just now; poll() reports it.
            if self.saver.distributed:
                # Every rank skipped this save together (its planning said so): a retry
                # would run the planning collective on this rank alone.
                return None
            # One rank: this save is independent of it.
            return save()

    def track(self, index: int, record: SaveRecord, handle: SaveHandle, begin: float) -> None:
        """Follow a submitted save until ``poll`` sees it finish."""
        self._pending[record.step] = _Pending(index, record, handle, begin)

    @property
    def in_flight_steps(self) -> set[int]:
        """Steps submitted and not yet seen finished by ``poll``."""
        return set(self._pending)

    def maybe_wait_for_staging(self) -> None:
        """Block until the background copy of the last save is done.

        Raises:
            CheckpointError: that copy failed.
        """
        self.saver.maybe_wait_for_staging()

    # ---------------------------------------------------------------- finalize
    def poll(self) -> tuple[list[tuple[int, SaveRecord]], list[CheckpointError]]:
        """Collect finished saves without waiting.

        Returns:
            (index, final record) of each save finished since the last poll, oldest
            first, and the errors not reported yet (each error is returned once).
        """
        errors, self._errors = self._errors, []
        finished: list[tuple[int, SaveRecord]] = []
        for step, p in sorted(self._pending.items()):
            if not p.handle.done():
                continue
            del self._pending[step]
            try:
                result = p.handle.wait(0)
            except AlreadyCommittedError as e:
                # the writer found the step committed already (saved again after a
                # resume): a skip, as a synchronous save's check would have made it
                logger.info(
                    "quicksave: step %d already has a committed checkpoint at %s; skipped",
                    p.record.step,
                    p.record.path,
                )
                finished.append((p.index, dataclasses.replace(p.record, status="skipped")))
                self._returned.append(e)  # the engine may hold it too: never a failure
                continue
            except CheckpointError as e:
                failed = dataclasses.replace(p.record, status="failed", error=str(e))
                finished.append((p.index, failed))
                errors.append(e)
                continue
            offset = p.handle.started - p.begin  # the manager's save() began earlier
            finished.append(
                (
                    p.index,
                    dataclasses.replace(
                        p.record,
                        bytes=result.bytes,
                        staging_s=result.staging_s + offset,
                        durable_s=result.durable_s + offset,
                        write_s=result.write_s,
                        commit_s=result.commit_s,
                        status="committed",
                        trainer_cpu_s=result.trainer_cpu_s,
                        worker_cpu_s=result.worker_cpu_s,
                        bytes_copied=result.bytes_copied,
                        bytes_hashed=result.bytes_hashed,
                        bytes_referred=result.bytes_referred,
                        spans=result.spans,
                    ),
                )
            )
        while True:  # failures the engine holds that no handle reported (each once)
            try:
                self.saver.finalize(blocking=False)
                break
            except CheckpointError as e:
                errors.append(e)
        unique: list[CheckpointError] = []
        for e in errors:
            if not any(e is u for u in unique) and not any(e is r for r in self._returned):
                unique.append(e)
        self._returned.extend(unique)
        return finished, unique

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every save in flight (then ``poll``).

        Returns:
            True if none is left in flight.
        """
        deadline = time.monotonic() + timeout
        try:
            self.saver.maybe_wait_for_staging()
        except CheckpointError as e:
            self._errors.append(e)
        for p in list(self._pending.values()):
            try:
                p.handle.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return False
            except CheckpointError:
                pass  # the handle keeps it: poll() reports it
        return True

    def close(self, timeout: float) -> tuple[list[tuple[int, SaveRecord]], list[CheckpointError]]:
        """Wait for saves in flight (up to ``timeout`` s), stop the worker, remove the
        hooks. Returns what ``poll`` returns; a save still in flight at the deadline
        is abandoned (never committed) and reported as an error."""
        done = self.drain(timeout)
        finished, errors = self.poll()
        for p in self._pending.values():
            error = CheckpointError(
                f"the save of step {p.record.step} was still being written after "
                f"close_timeout_s={timeout:g} s; it was abandoned and not committed",
                path=p.record.path,
                rank=self.saver.rank,
            )
            failed = dataclasses.replace(p.record, status="failed", error=str(error))
            finished.append((p.index, failed))
            errors.append(error)
        self._pending.clear()
        for hook in self._pre_hooks + self._post_hooks:
            hook.remove()
        self._pre_hooks, self._post_hooks = [], []
        self.saver.close(abort=not done)
        return finished, errors
