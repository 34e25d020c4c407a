"""``CheckpointManager``: when, where and what to save, how many to keep, how to resume.

Wiring only: the decisions come from policy objects (``policies.py``, asked alike on
every rank by ``schedule.py``), the state from ``Stateful`` wrappers (``states.py``),
the folder (its lease, listing, failures, fallback load, retention) is a
:class:`~quicksave.manager.session.CheckpointSession`, and the bytes go through
``step_io.py``: the async engine (``async_writer.py``) or ``quicksave.save`` /
``quicksave.load``.

One ``save(step)`` goes through these states, in this order::

    poll (async: collect finished saves without waiting; no I/O, nothing raised)
    → decide (SavePolicy, then ranks agree; not due: return, see below)
    → settle (failures so far and the coordinator's look at the target, alike on
    every rank: ``failures.py``) → collect (state_dict() of every state)
    → write (one hand-off: ``StepIO``; async modes return after staging, or at once in
    overlap mode) → settle (this call's own failures) → commit (in the writer: rename
    of its temporary ``.quicksave.step-<N>.tmp-*`` to ``step-<N>``) → housekeep
    (after a commit was seen: RetentionPolicy over the committed steps and failed
    saves' leftovers; on the coordinator only, never a step in flight; never raises)

A ``save()`` with nothing due only polls (and housekeeps after a commit): it talks to no
other rank and raises nothing, except with one rank, where every call settles. Failures
are acted on (``on_save_error``) only where every rank settles them alike: a due
``save()``, ``export()``, ``wait()``, ``load()``, ``close()``.

Seed (step 0) and export checkpoints are always written synchronously with
``quicksave.save``, after every save in flight has committed (so they never race with
one). The folder's layout and who may delete in it: ``session.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from quicksave.errors import CheckpointError
from quicksave.manager.async_writer import AsyncWriter
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.folder import check_step
from quicksave.manager.folder_checks import check_not_behind
from quicksave.manager.memory_tier import LoadRecord, MemoryTier, load_from_memory
from quicksave.manager.policies import (
    RetentionPolicy,
    SavePolicy,
)
from quicksave.manager.records import SaveRecord
from quicksave.manager.schedule import SaveSchedule
from quicksave.manager.session import CheckpointSession
from quicksave.manager.states import check_states
from quicksave.manager.step_io import StepIO
from quicksave.manager.upload_tier import UploadTier, load_from_store, newer_steps
from quicksave.manager.verbosity import show_logs
from quicksave.saving.model_record import floating_dtype

logger = logging.getLogger("quicksave")


class CheckpointManager:
    """Saves and restores a training job's state in ``config.folder``.

    Every rank of ``process_group`` builds one with the same config and the same state
    names, and makes the same ``save`` / ``load`` calls.

    Args:
        config: see :class:`CheckpointConfig`.
        states: names to ``Stateful`` objects (``state_dict()`` + ``load_state_dict()``):
            :class:`ModelState`, :class:`OptimizerState`, :class:`TrainState`,
            :class:`RNGState`, LR schedulers, stateful data loaders, ... A list or tuple
            of such objects is stored as one :class:`StatefulList`. Step-0 (seed) and
            export checkpoints hold the :class:`ModelState` entries (or, without any,
            the entry named ``"model"``).
        process_group: the ranks that checkpoint together (default: the world).
        clock: monotonic seconds for ``interval_type="seconds"``; inject one in tests.
        save_policy: replaces the policy built from ``interval`` / ``interval_type``.
        retention: replaces the policy built from ``keep_latest_k``.

    Async modes (``config.async_mode``, default ``"process"``): one engine per manager,
    its worker started here; ``save()`` returns after staging (at once for parameters
    and optimizer states with ``staging="overlap"``), the checkpoint commits in the
    background, and errors surface as ``CheckpointError`` from a later ``save()``,
    ``wait()``, ``load()`` or ``close()``, on every rank at the same call (or are logged
    and counted: ``on_save_error="log"``, :attr:`failed_saves`). ``metrics`` holds one
    :class:`SaveRecord` per checkpoint, completed when it commits. The manager adds step
    hooks to the optimizers of its :class:`OptimizerState` states (removed by
    ``close()``); a loop that changes parameters otherwise must call
    :meth:`maybe_wait_for_staging` first.

    Read-only managers (``config.read_only``, or another live process holds the
    folder's writer lease): ``load()`` and the listings work; nothing in the folder is
    created, cleaned or deleted, no worker is started, and ``save()`` raises.

    Raises:
        CheckpointError: bad config, ``folder`` is a file or cannot be created, or the
            worker process cannot be started.
        IncompatibleStateError: a state is not ``Stateful`` (names it as fqn).

    Example::

        manager = CheckpointManager(
            CheckpointConfig(folder="ckpt", interval=100, keep_latest_k=3),
            {"model": ModelState(model), "optimizer": OptimizerState(model, optim),
             "lr_scheduler": scheduler, "train_state": train_state},
        )
        start = manager.load() or 0
        for step in range(start + 1, steps + 1):
            ...
            manager.save(step)
        manager.close()
    """

    def __init__(
        self,
        config: CheckpointConfig,
        states: Mapping[str, Any],
        process_group: dist.ProcessGroup | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        save_policy: SavePolicy | None = None,
        retention: RetentionPolicy | None = None,
    ) -> None:
        if not isinstance(config, CheckpointConfig):
            raise CheckpointError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        self.config = config
        self.session = CheckpointSession(config, process_group, retention=retention)
        self.folder = self.session.folder
        self.process_group = process_group
        self.states = check_states(states)
        self.metrics: list[SaveRecord] = self.session.metrics
        self._io = StepIO(config, self.session, self.states)
        self.schedule = SaveSchedule(config, save_policy, clock)
        self._closed = False
        self._placed = False  # load() was called, or a save was checked against the folder
        self._shown = show_logs(config.log_level)  # undone by close()
        self.memory_tier: MemoryTier | None = None  # config.memory's (memory_tier.py)
        self.last_load: LoadRecord | None = None  # what the last load() restored
        self.upload_tier: UploadTier | None = None  # config.upload's (upload_tier.py)
        if not config.enabled:
            return
        session = self.session
        if session.world_size() > 1:
            self.schedule.agree_across(session.checkpoint_group)  # time-based: ranks vote
        session.take_folder(
            read_only="it was built with read_only=True" if config.read_only else None,
            hint="use another folder, stop that job, or pass read_only=True to only load",
        )
        if session.read_only_reason is None and config.async_mode != "disabled":
            ctx = session.dist_context() if session.world_size() > 1 else None
            session.writer = AsyncWriter(
                session.writer_config(config.engine_config()),
                self.states,
                lambda: self._io.collect("full"),
                rank=session.rank() or 0,
                dist_context=ctx,
            )
            session.writer.prepare_if_due(background=False)  # start-up: build it now
        try:
            if config.memory is not None:
                self.memory_tier = MemoryTier(config, session, self._io)
            if config.upload is not None:
                self.upload_tier = UploadTier(config, session)
        except BaseException:
            self._close(agree=False)  # the writer and the folder's lease taken above
            raise
        logger.log(
            session.info_level(),
            "quicksave: checkpointing to %s (%s, %s, %s)",
            self.folder,
            self.save_policy,
            self.retention,
            "read-only"
            if self.read_only_reason is not None
            else "synchronous"
            if session.writer is None
            else f"async_mode {config.async_mode}, staging {config.staging}",
        )

    @property
    def save_policy(self) -> SavePolicy:
        """When to save (the schedule's policy)."""
        return self.schedule.policy

    @save_policy.setter
    def save_policy(self, policy: SavePolicy) -> None:
        self.schedule.policy = policy

    @property
    def retention(self) -> RetentionPolicy:
        """Which committed checkpoints retention keeps (the session's policy)."""
        return self.session.retention

    @retention.setter
    def retention(self, policy: RetentionPolicy) -> None:
        self.session.retention = policy

    @property
    def read_only_reason(self) -> str | None:
        """Why ``save()`` raises (``read_only``, or another live process holds the
        folder's writer lease), or None: this manager writes."""
        return self.session.read_only_reason

    # ---------------------------------------------------------------- public API

    def step_path(self, step: int) -> str:
        """The directory of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return self.session.step_path(step)

    def export_path(self, step: int) -> str:
        """The directory of the model export of ``step``: ``<folder>/export-step-<step>``."""
        return self.session.export_path(step)

    def export(self, step: int, *, dtype: str | torch.dtype | None = None) -> str | None:
        """Export the model as it is now to ``export-step-<step>``: the model states
        only (its :class:`ModelState` entries, or the state named ``"model"``), floating
        tensors cast to ``dtype``, written synchronously after the saves in flight have
        committed. Any step, saved or not; ``save(last_step)`` calls it by itself. Every
        rank calls it alike (several ranks write it together).

        ``quicksave.export_hf(manager.export_path(step), out_dir)`` (or ``quicksave
        convert --to hf``) then writes it for Hugging Face's ``from_pretrained``; it reads
        a full ``step-<N>`` checkpoint's model as well.

        Args:
            step: the step to label the export with (an int >= 0).
            dtype: a torch floating dtype or its name; default ``config.export_dtype``.

        Returns:
            The export's path or URL (also when it existed already: it is not written
            again, and that is logged); None if the manager is disabled.

        Raises:
            CheckpointError: bad ``step`` or ``dtype``, manager closed or read-only, an
                earlier save failed, or the write failed (nothing became visible).
            IncompatibleStateError: no state is a ``ModelState`` or named ``"model"``.

        Example::

            manager.save(step)
            if step % 10_000 == 0:
                manager.export(step, dtype="bfloat16")
        """
        self._check_open()
        check_step(step, self.folder)
        cast = None if dtype is None else floating_dtype(dtype, "export dtype")
        if not self.config.enabled:
            return None
        self._check_writable()
        self._io.write_export(step, cast)
        self.session.settle()
        self.session.housekeep(protect={step}, wait=True)
        return self.export_path(step)

    @property
    def failed_saves(self) -> int:
        """Saves (and exports) that failed since the manager was built, as every rank
        settled them alike (``on_save_error="log"`` counts them and goes on)."""
        return self.session.ledger.total

    @property
    def consecutive_failures(self) -> int:
        """Failed saves settled since the newest commit; with ``on_save_error="log"``,
        reaching ``max_consecutive_failures`` raises."""
        return self.session.ledger.consecutive

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint in ``folder`` (quicksave, and stock DCP
        with ``config.allow_dcp``), ascending. Temporaries, quarantined checkpoints and
        directories without their commit are not listed."""
        return self.session.committed_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def save(self, step: int, force: bool = False) -> bool:
        """Save a checkpoint of ``step`` if the save policy says so (or ``force``).

        Step 0 gives a seed checkpoint (the model only). At ``config.last_step`` the
        checkpoint is always written and the model is also exported (weights only, in
        ``export_dtype``) to ``export-step-<N>``. A step that already has a committed
        checkpoint (e.g. saved again after a resume), or one still being written, is
        skipped with a log message. Once a checkpoint commits, the retention policy
        deletes old committed checkpoints.

        Async modes: call it after every step, saving or not: each call collects the
        saves that finished (cheaply, without waiting). A full checkpoint returns after
        staging (in overlap mode, before parameters and optimizer states are copied:
        the next ``optimizer.step()`` waits for that copy) and commits in the background.

        A failed save (``config.on_save_error``): with ``"raise"`` (default) its
        ``CheckpointError`` is raised on every rank at the same call: this one if it
        failed here, else the next call that settles (with one rank the next call; with
        several the next due ``save()``, ``export()``, ``wait()``, ``load()`` or
        ``close()``). Whether the call that raises an earlier failure saved its own
        step: with one rank it did not (the failure is raised before it writes
        anything; ``save(step)`` again saves that step); with several it did (every
        rank writes its step first, async: hands it to the writer, where it commits
        unless it fails too, and then every rank raises alike, so that none is left
        waiting in the save's collectives). With ``"log"`` it is logged and counted
        (:attr:`failed_saves`) and saving goes on, until ``max_consecutive_failures``
        in a row raise. A call with nothing due talks to no other rank and does no I/O
        that can raise.

        A manager that has not called :meth:`load` refuses (``CheckpointError``, on
        every rank, nothing written) a first due step below the newest committed one
        in its folder: a new run in an old run's folder, whose checkpoints a resume
        would pass over and retention would delete first.

        Args:
            step: the training step just completed (an int >= 0).
            force: save even if the interval has not been reached.

        Returns:
            True if this call wrote (async modes: started) a checkpoint or an export of
            ``step``; False if none was due, or ``backpressure="skip"`` skipped it.

        Raises:
            CheckpointError: invalid step, manager closed or read-only (names why:
                e.g. the process holding the folder's writer lease), a step below the
                folder's newest before any ``load()`` (see above), or a save failed
                (see above; nothing of a failed save becomes visible).

        Example::

            manager.save(train_state.step)
        """
        begin = time.monotonic()
        self._check_open()
        check_step(step, self.folder)
        if not self.config.enabled:
            return False
        self._check_writable()
        session = self.session
        if session.writer is not None:
            session.writer.prepare_if_due()
        session.poll()
        if self.upload_tier is not None:
            self.upload_tier.poll()  # committed steps due for upload: to its thread
        if session.world_size() == 1:
            session.settle()  # one rank: an earlier failure is raised before this call writes
        is_last = self.config.last_step is not None and step == self.config.last_step
        if not self.schedule.due(step, forced=force or is_last):
            memory = self.memory_tier
            if memory is not None and memory.due(step):
                memory.save(step)  # this rank's own snapshot: no collective
            session.housekeep()  # no I/O here: asks the housekeeping thread, if due
            return False
        if not self._placed:  # a new run in an old run's folder? (folder_checks.py)
            self._placed = check_not_behind(step, session)
        kind = "seed" if step == 0 else "full"
        wrote = False
        session.outcome_vote.take()  # only this call's save vote may settle this call
        if step in session.in_flight:
            logger.info("quicksave: step %d is being written already; skipped", step)
        elif self._io.write_step(step, kind, begin):
            self.schedule.saved(step)
            wrote = True
        if is_last:
            wrote = self._io.write_export(step, None) or wrote
            session.outcome_vote.take()  # the export's outcome too: settle with a collective
        # earlier failures and this call's, alike on every rank (several ranks: on the
        # save's vote when it carried them, else with a collective of its own)
        session.settle()
        # (a synchronous save waits for the store anyway: its housekeeping too)
        session.housekeep(protect={step}, wait=session.writer is None)
        return wrote

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory held by the staging pools of the async modes now (0 for
        synchronous saves): about the bytes of the state (the file images: data plus
        headers and 4 KiB alignment), built when the manager is constructed if the state
        is complete."""
        writer = self.session.writer
        return writer.saver.staging_bytes if writer is not None else 0

    def maybe_wait_for_staging(self) -> None:
        """Block until the background copy of the last checkpoint is done (overlap
        mode). The manager's optimizer hooks call it before each step; call it yourself
        before changing parameters or optimizer states in any other way (e.g. an
        optimizer the manager does not know, weight clipping, EMA, ``load_state_dict``).

        Raises:
            CheckpointError: the background copy failed (the checkpoint is not written).

        Example::

            manager.save(step)
            manager.maybe_wait_for_staging()
            with torch.no_grad():
                model.weight.clamp_(-1, 1)
        """
        if self.session.writer is not None:
            self.session.writer.maybe_wait_for_staging()

    def load(self, step: int = -1, *, strict: bool = True) -> int | None:
        """Restore every state from the checkpoint of ``step`` (default: the newest
        committed one that passes its checks). A step-0 (seed) checkpoint restores the
        model only.

        With ``step=-1``, a committed checkpoint that turns out to be corrupt (a bad
        manifest, a missing or truncated file, a checksum mismatch) or that vanished
        meanwhile is logged and skipped, and the next older one is tried; a writing
        manager also quarantines a corrupt one (``step-<N>.corrupt-<token>``) so that
        its step can be saved again. The states are then wholly overwritten by the
        checkpoint that loads. Stock DCP folders count only with ``config.allow_dcp``.

        Args:
            step: the step to load, or -1 for the newest committed checkpoint.
            strict: True (default): the checkpoint's names must be exactly the states'
                (a missing or unexpected key raises ``IncompatibleStateError`` naming
                them). False: load the names present in both and leave the others as
                they are, e.g. a stock DCP checkpoint written by another trainer
                (torchtitan) whose extra entries these states do not have. Shapes and
                dtypes of the names loaded are checked either way.

        Returns:
            The step restored, or None if ``step`` is -1 and there is no committed
            checkpoint (or the manager is disabled).

        Saves in flight are waited for first (up to ``close_timeout_s``), so the newest
        committed checkpoint is really the newest, and nothing is still being copied
        from the states that the load overwrites.

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no checkpoint.
            NotCommittedError: ``step`` was given and its checkpoint was never committed.
            CorruptCheckpointError: ``step`` was given and its checkpoint is corrupt, or
                no committed checkpoint passes its checks (each is named).
            IncompatibleStateError: the checkpoint does not fit the states (with
                ``strict``, its keys differ; no fallback then: an older checkpoint would
                not fit either).
            CheckpointError: a save in flight failed.

        Example::

            start = manager.load() or 0
            manager.load(step=1000, strict=False)  # e.g. a folder written by torchtitan
        """
        self._check_open()
        if not self.config.enabled:
            return None
        try:
            self.session.drain()
        finally:
            if self.read_only_reason is None:
                self.session.settle()
        begin = time.perf_counter()
        if step != -1:
            check_step(step, self.folder)
            checkpoint = self.session.require_committed(step)
            self._io.load_step(step, checkpoint, strict=strict)
            self._placed = True
            self.last_load = LoadRecord.now(step, "folder", begin, self._io.pending)
            return step
        upload = self.upload_tier  # the object store's steps newer than the folder's
        stored = newer_steps(upload) if upload is not None else []
        memory = self.memory_tier
        floor = stored[-1] if stored else -1
        if memory is not None and (loaded := load_from_memory(memory, strict, floor)) is not None:
            self._placed = True
            # "memory", or "peer" where this rank fetched its snapshot from a peer
            self.last_load = LoadRecord.now(loaded, memory.source, begin, self._io.pending)
            return loaded
        if upload is not None and (loaded := load_from_store(upload, self._io, strict, stored)):
            self._placed = True
            self.last_load = LoadRecord.now(loaded, "object-store", begin, self._io.pending)
            return loaded
        loaded = self.session.load_newest(
            lambda candidate, checkpoint: self._io.load_step(candidate, checkpoint, strict=strict)
        )
        self._placed = True
        if loaded is None:
            logger.info("quicksave: no committed checkpoint in %s; starting fresh", self.folder)
        else:
            self.last_load = LoadRecord.now(loaded, "folder", begin, self._io.pending)
        return loaded

    def close(self) -> None:
        """Finish: wait for saves in flight (up to ``close_timeout_s``), stop the
        worker, remove the optimizer hooks, and refuse further calls. Calling it again
        does nothing.

        Several ranks: every rank calls it (a failure is settled alike on all of them,
        as in ``save()``), except on the way out of an exception (``with`` block), when
        each rank closes alone and a failure is logged.

        Raises:
            CheckpointError: a save failed, or was still in flight at the timeout (it
                is abandoned, never committed); the manager is closed all the same.

        Example::

            manager.close()
        """
        self._close(agree=True)

    def _close(self, agree: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self._io.join_optimizer_load()
            except CheckpointError as e:  # the optimizers were never stepped on it
                logger.error("quicksave: closing: %s", e)
            if self.memory_tier is not None:  # (its snapshots in flight need the writer)
                self.memory_tier.close(job_done=agree)
            self.session.close_writer(self.config.close_timeout_s)
            if self.upload_tier is not None:  # the upload in flight, and the newest due
                self.upload_tier.close()
            self.session.housekeep()
            if self.config.enabled and self.read_only_reason is None:
                self.session.settle(agree=agree)
        finally:
            self.session.release()
            if self._shown is not None:
                self._shown.undo()
                self._shown = None
        logger.debug("quicksave: manager for %s closed", self.folder)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way already: do not replace it with ours
            self._close(agree=False)  # the other ranks may not get here
        except CheckpointError as e:
            logger.error("quicksave: closing the manager after an error: %s", e)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save in flight is committed (or has failed), without
        closing: before an evaluation, an export or a hand-off that must see the latest
        checkpoint on disk. Retention runs for what was committed. Each rank waits for
        its own saves; then the failures are settled alike on every rank (as in
        ``save()``: several ranks all call it).

        Args:
            timeout: seconds to wait at most; None: until the saves end (each is bounded
                by the worker's own save timeout, so this cannot hang forever).

        Raises:
            CheckpointError: a save failed (``on_save_error="raise"``; the first
                failure, naming its step), or saves were still in flight at ``timeout``
                (named; they go on in the background and a later ``wait``, ``save`` or
                ``close`` collects them).

        Example::

            manager.save(step)
            manager.wait()  # step's checkpoint is committed now
            evaluate(manager.step_path(step))
        """
        self._check_open()
        try:
            self.session.drain(timeout)
        finally:
            self.session.settle()
        self.session.housekeep(wait=True)
        if self.memory_tier is not None:  # its snapshots too (their failures are logged)
            self.memory_tier.poll(self.config.close_timeout_s if timeout is None else timeout)

    def _check_writable(self) -> None:
        if self.read_only_reason is not None:
            raise CheckpointError(
                f"this manager does not write checkpoints: {self.read_only_reason}",
                path=self.folder,
                rank=self.session.rank(),
            )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                "this CheckpointManager is closed", path=self.folder, rank=self.session.rank()
            )
        self._io.join_optimizer_load()  # a resume's optimizer states, streamed in
