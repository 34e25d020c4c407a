"""``CheckpointManager``: when, where and what to save, how many to keep, how to resume.

Wiring only: the decisions come from policy objects (``policies.py``), the state from
``Stateful`` wrappers (``states.py``), the bytes go through the async engine
(``async_writer.py``) or ``quicksave.save`` / ``quicksave.load``, and visibility rules
from ``commit.py``.

One ``save(step)`` goes through these states, in this order::

    poll (async: collect finished saves without waiting; no I/O, nothing raised)
    → decide (SavePolicy, then ranks agree; not due: return, see below)
    → settle (failures so far and the coordinator's look at the target, alike on
    every rank: ``failures.py``) → collect (state_dict() of every state)
    → write (one hand-off: ``_write``; async modes return after staging, or at once in
    overlap mode) → settle (this call's own failures) → commit (in the writer: rename
    of ``step-<N>.tmp-*`` to ``step-<N>``) → housekeep (after a commit was seen:
    RetentionPolicy over the committed steps and failed saves' leftovers; on the
    coordinator only, never a step in flight; never raises)

A ``save()`` with nothing due only polls (and housekeeps after a commit): it talks to no
other rank and raises nothing, except with one rank, where every call settles. Failures
are acted on (``on_save_error``) only where every rank settles them alike: a due
``save()``, ``export()``, ``wait()``, ``load()``, ``close()``.

Seed (step 0) and export checkpoints are always written synchronously with
``quicksave.save``, after every save in flight has committed (so they never race with
one); full checkpoints with ``world_size > 1`` too, until the engine is distributed.

Layout of ``folder``::

    step-<N>/           full checkpoint of step N (N not zero-padded, like torchtitan)
    step-0/             seed checkpoint: the model only
    export-step-<N>/    model weights only, in ``export_dtype``: at ``last_step``, or export()
    *.tmp-*/            being written, or left by a crash (deleted at start-up)
    step-<N>.corrupt-*/ failed its checks at load(): moved aside by the writer, kept
    .quicksave-lock     the writer lease (lease.py; on an object store
                        .quicksave-lease.json, with a heartbeat: store_lease.py)

Ownership: one job writes a folder. The coordinator of a writing manager holds the
folder's writer lease (``lease.py``) from construction to ``close()``; only the lease
holder deletes anything (clean-up of crashed saves' temporaries, retention, quarantine).
A manager built while another live process holds the lease is read-only: it loads, and
its ``save()`` raises, naming the holder. ``CheckpointConfig(read_only=True)`` asks for
that from the start (eval scripts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from quicksave import api
from quicksave.commit import classify
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    IncompatibleStateError,
)
from quicksave.manager.async_writer import AsyncWriter
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.failures import FailureLedger, Key, log_verdict
from quicksave.manager.folder import (
    COMMITTED,
    apply_retention,
    check_step,
    committed_steps,
    create_folder,
    load_newest,
    quarantine,
    replace_uncommitted,
    require_committed,
    stored_metadata,
)
from quicksave.manager.interval import (
    IntervalAgreement,
    agree_any_due,
    agree_reports,
    needs_agreement,
)
from quicksave.manager.lease import WriterLease, clean_folder, take_writer_lease
from quicksave.manager.policies import (
    EveryNSeconds,
    EveryNSteps,
    KeepLatestK,
    RetentionPolicy,
    SavePolicy,
)
from quicksave.manager.records import SaveRecord, log_committed
from quicksave.manager.states import (
    ModelState,
    PerRankLoad,
    PerRankState,
    check_states,
    payload_bytes,
)
from quicksave.manager.verbosity import show_logs
from quicksave.ranks.saving import DistContext
from quicksave.saving.handle import SaveHandle
from quicksave.saving.model_record import cast_floating, floating_dtype, model_record
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend

logger = logging.getLogger("quicksave")

_stored_metadata = stored_metadata  # the old private name, kept for callers


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
        self._folder = parse_location(
            config.folder, what="checkpoint folder", options=config.storage
        )
        self.folder = self._folder.url
        self.process_group = process_group
        self.states = check_states(states)
        self._clock = clock
        self.save_policy: SavePolicy = save_policy or _default_save_policy(config)
        self.retention: RetentionPolicy = retention or KeepLatestK(config.keep_latest_k)
        self.metrics: list[SaveRecord] = []
        self._writer: AsyncWriter | None = None
        self._closed = False
        self._group: dist.ProcessGroup | None = None  # see _checkpoint_group
        self._interval: IntervalAgreement | None = None
        self._lease: WriterLease | None = None  # held by a writing coordinator
        self._store: Backend | None = None  # an object store's backend (see _backend)
        self.read_only_reason: str | None = None  # why save() is refused, if it is
        self._last_good: int | None = None  # newest step known to pass its checks
        self._ledger = FailureLedger(
            config.on_save_error, config.max_consecutive_failures, self.folder
        )
        self._housekeeping_due = False  # a commit was seen: retention may delete now
        self._leftovers: set[str] = set()  # failed saves' paths, for housekeeping
        self._shown = show_logs(config.log_level)  # undone by close()
        if not config.enabled:
            return
        if self._world_size() > 1 and needs_agreement(self.save_policy):
            # Time-based answers differ between ranks: they vote (interval.py).
            group = self._checkpoint_group()
            self._interval = IntervalAgreement(
                config.interval_check_steps, lambda due: agree_any_due(due, group)
            )
        self.read_only_reason = self._take_folder()
        if self.read_only_reason is None and config.async_mode != "disabled":
            ctx = self._dist_context() if self._world_size() > 1 else None
            self._writer = AsyncWriter(
                config.engine_config(),
                self.states,
                lambda: self._collect("full"),
                rank=self._rank() or 0,
                dist_context=ctx,
            )
            self._writer.prepare_if_due(background=False)  # start-up: build it now
        logger.log(
            self._info(),
            "quicksave: checkpointing to %s (%s, %s, %s)",
            self.folder,
            self.save_policy,
            self.retention,
            "read-only"
            if self.read_only_reason is not None
            else "synchronous"
            if self._writer is None
            else f"async_mode {config.async_mode}, staging {config.staging}",
        )

    # ---------------------------------------------------------------- public API

    def step_path(self, step: int) -> str:
        """The directory of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return self._folder.child(f"step-{step}").url

    def export_path(self, step: int) -> str:
        """The directory of the model export of ``step``: ``<folder>/export-step-<step>``."""
        return self._folder.child(f"export-step-{step}").url

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
        self._export_one(step, cast)
        self._settle()
        self._housekeep(protect={step})
        return self.export_path(step)

    @property
    def failed_saves(self) -> int:
        """Saves (and exports) that failed since the manager was built, as every rank
        settled them alike (``on_save_error="log"`` counts them and goes on)."""
        return self._ledger.total

    @property
    def consecutive_failures(self) -> int:
        """Failed saves settled since the newest commit; with ``on_save_error="log"``,
        reaching ``max_consecutive_failures`` raises."""
        return self._ledger.consecutive

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint in ``folder`` (quicksave, and stock DCP
        with ``config.allow_dcp``), ascending. Temporaries, quarantined checkpoints and
        directories without their commit are not listed."""
        return committed_steps(
            self._folder, allow_dcp=self.config.allow_dcp, backend=self._backend()
        )

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
        ``close()``); an earlier failure is raised before this call writes anything.
        With ``"log"`` it is logged and counted (:attr:`failed_saves`) and saving goes
        on, until ``max_consecutive_failures`` in a row raise. A call with nothing due
        talks to no other rank and does no I/O that can raise.

        Args:
            step: the training step just completed (an int >= 0).
            force: save even if the interval has not been reached.

        Returns:
            True if this call wrote (async modes: started) a checkpoint or an export of
            ``step``; False if none was due, or ``backpressure="skip"`` skipped it.

        Raises:
            CheckpointError: invalid step, manager closed or read-only (names why:
                e.g. the process holding the folder's writer lease), or a save failed
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
        if self._writer is not None:
            self._writer.prepare_if_due()
        self._poll()
        if self._world_size() == 1:
            self._settle()  # one rank: an earlier failure is raised before this call writes
        is_last = self.config.last_step is not None and step == self.config.last_step
        decision = self.save_policy.should_save(step, self._clock(), force or is_last)
        if not self._agree(step, decision, forced=force or is_last):
            self._housekeep()
            return False
        kind = "seed" if step == 0 else "full"
        path = self.step_path(step)
        wrote = False
        if step in self._in_flight:
            logger.info("quicksave: step %d is being written already; skipped", step)
        elif self._write_one((step, kind), path, lambda: self._save_one(step, path, kind, begin)):
            self.save_policy.saved(step, self._clock())
            wrote = True
        if is_last:
            wrote = self._export_one(step, None) or wrote
        self._settle()  # earlier failures and this call's, alike on every rank
        self._housekeep(protect={step})
        return wrote

    @property
    def staging_bytes(self) -> int:
        """Bytes of host memory held by the staging pools of the async modes now (0 for
        synchronous saves): about the bytes of the state, built when the manager is
        constructed if the state is complete (issue 12: at most 1.05× of it)."""
        return self._writer.saver.staging_bytes if self._writer is not None else 0

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
        if self._writer is not None:
            self._writer.maybe_wait_for_staging()

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
            self._drain()
        finally:
            if self.read_only_reason is None:
                self._settle()
        if step != -1:
            check_step(step, self.folder)
            path = self.step_path(step)
            require_committed(
                self._folder, self._where(path), step, self._rank(), allow_dcp=self.config.allow_dcp
            )
            self._load_step(step, strict=strict)
            return step
        on_corrupt = None
        if self._lease is not None:  # a writer moves a corrupt checkpoint aside

            def on_corrupt(candidate: int, why: str) -> None:
                quarantine(self._where(self.step_path(candidate)), why, self._backend())

        loaded = load_newest(
            self.committed_steps,
            lambda candidate: self._load_step(candidate, strict=strict),
            on_corrupt,
            self.folder,
            self._rank(),
        )
        if loaded is None:
            logger.info("quicksave: no committed checkpoint in %s; starting fresh", self.folder)
        return loaded

    def _load_step(self, step: int, *, strict: bool = True) -> None:
        """Load the committed checkpoint of ``step`` into the states (``strict``: see
        :meth:`load`)."""
        path = self.step_path(step)
        states = self._model_states() if step == 0 else self.states
        begin = time.perf_counter()
        if any(isinstance(v, PerRankState) for v in states.values()):
            # (each learns the checkpoint's entries from the metadata the load reads)
            states = {
                k: PerRankLoad(k, v) if isinstance(v, PerRankState) else v
                for k, v in states.items()
            }
        api.load(
            states,
            path,
            strict=strict,
            process_group=self.process_group,
            allow_dcp_pickle=self.config.allow_dcp_pickle,
            storage=self.config.storage,
        )
        self._last_good = step
        if self._writer is not None:
            self._writer.prepare_if_due(background=False)  # optimizer states exist now
        logger.log(
            self._info(),
            "quicksave: resumed from %s step %d in %.3f s",
            path,
            step,
            time.perf_counter() - begin,
        )

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
            if self._writer is not None:
                finished, errors = self._writer.close(self.config.close_timeout_s)
                self._apply(finished, errors)
            self._housekeep()
            if self.config.enabled and self.read_only_reason is None:
                self._settle(agree=agree)
        finally:
            if self._lease is not None:
                self._lease.release()
            if self._store is not None:
                self._store.close()
                self._store = None
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

    # ---------------------------------------------------------------- save path

    def _save_one(
        self, step: int, path: str, kind: str, begin: float, dtype: torch.dtype | None = None
    ) -> bool:
        """Collect and write one checkpoint; False if the engine skipped it (backpressure).
        ``begin``: ``time.monotonic()`` when the ``save()`` call started; ``dtype``: an
        export's dtype (default ``config.export_dtype``)."""
        asynchronous = self._writer is not None and kind == "full"
        if not asynchronous:
            self._drain()  # a synchronous write never runs beside a save in flight
        cpu0 = time.process_time()
        state_dict = self._collect(kind, dtype)
        nbytes = payload_bytes(state_dict)
        written = time.monotonic()
        handle = self._write(state_dict, path, step, kind, dtype)
        now = time.monotonic()
        if not asynchronous:
            if kind == "full" and (self._last_good or -1) < step:
                self._last_good = step  # committed by this call
            record = SaveRecord(
                step,
                kind,
                path,
                nbytes,
                now - begin,
                now - begin,
                now - begin,
                now - written,
                trainer_cpu_s=time.process_time() - cpu0,
                worker_cpu_s=0.0,
                bytes_copied=0,
                bytes_hashed=nbytes,
            )
            self.metrics.append(record)
            log_committed(record, self._info())
            self._housekeeping_due = True
            if kind == "full":
                self._ledger.committed(step)
            return True
        if handle is None:
            return False  # skipped by backpressure="skip" (the engine logged it)
        assert self._writer is not None
        record = SaveRecord(
            step, kind, path, nbytes, now - begin, status="in_flight", mode=self.config.async_mode
        )
        self._writer.track(len(self.metrics), record, handle, begin)
        self.metrics.append(record)
        logger.debug("quicksave: step %d handed to the writer in %.3f s", step, now - begin)
        return True

    def _collect(self, kind: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The state dict to write, taken now (the async modes stage it from here)."""
        if kind == "full":
            return {name: state.state_dict() for name, state in self.states.items()}
        models = {name: state.state_dict() for name, state in self._model_states().items()}
        if kind == "export":
            models = cast_floating(models, dtype or self.config.export_torch_dtype)
        return models

    def _write(
        self,
        state_dict: dict[str, Any],
        path: str,
        step: int,
        kind: str,
        dtype: torch.dtype | None = None,
    ) -> SaveHandle | None:
        """The one hand-off to the engine: write ``state_dict`` to ``path`` and commit it.

        Full checkpoints in an async mode: submitted to the engine (parameters and
        optimizer states deferred in overlap mode); returns its handle once staged, or
        None if backpressure skipped it. Otherwise synchronous: returns None once the
        checkpoint is committed.
        """
        metadata: dict[str, Any] = {"checkpoint_kind": kind}
        if kind == "export":
            metadata["export_dtype"] = (
                self.config.export_dtype if dtype is None else str(dtype).removeprefix("torch.")
            )
        # which states are the model, and its tied keys: for exports (model_record.py)
        metadata.update(model_record(state_dict, self._model_state_names()))
        if self._writer is not None and kind == "full":
            return self._writer.submit(state_dict, path, step, metadata)
        api.save(
            state_dict,
            path,
            step=step,
            process_group=self.process_group,
            thread_count=self.config.thread_count,
            user_metadata=metadata,
            storage=self.config.storage,
        )
        return None

    # ---------------------------------------------------------------- finalize

    @property
    def _in_flight(self) -> set[int]:
        """Steps being written in the background (retention never touches them)."""
        return self._writer.in_flight_steps if self._writer is not None else set()

    def _poll(self) -> None:
        """Collect the background saves that finished, without waiting: records, commit
        lines, the ledger. No I/O; raises nothing (failures are settled later)."""
        if self._writer is not None:
            finished, errors = self._writer.poll()
            self._apply(finished, errors)

    def _write_one(self, key: Key, path: str, write: Callable[[], bool]) -> bool:
        """Run one write of this call (``write()``: False if skipped). The coordinator
        first removes an uncommitted leftover at ``path``. A ``CheckpointError`` becomes
        that save's failure in the ledger, settled by the call's next ``_settle`` alike
        on every rank, instead of leaving this rank alone; a committed checkpoint found
        at ``path`` is a skip (logged), not a failure."""
        self._ledger.attempting(key)
        try:
            self._replace_uncommitted(path)
        except CheckpointError as e:  # the write's own check decides, alike on every rank
            logger.warning("quicksave: could not check %s before writing it: %s", path, e)
        try:
            return write()
        except CheckpointExistsError as e:
            if self._is_committed(path):
                step, kind = key
                logger.info(
                    "quicksave: %s; skipped",
                    f"export of step {step} already exists"
                    if kind == "export"
                    else f"step {step} already has a committed checkpoint at {path}",
                )
            else:
                self._ledger.failed(key, e)
        except CheckpointError as e:
            self._ledger.failed(key, e)
        return False

    def _is_committed(self, path: str) -> bool:
        try:
            return classify(self._where(path), self._backend()) in COMMITTED
        except CheckpointError:
            return False

    def _export_one(self, step: int, dtype: torch.dtype | None) -> bool:
        path = self.export_path(step)
        return self._write_one(
            (step, "export"),
            path,
            lambda: self._save_one(step, path, "export", time.monotonic(), dtype),
        )

    def _settle(self, *, agree: bool = True) -> None:
        """A settling point: every rank's failures so far combined alike on every rank
        (several ranks: one collective, ``agree_reports``; ``agree=False``: this rank
        alone), then acted on: logged, or raised (``on_save_error``)."""
        report = self._ledger.report()
        if agree and self._world_size() > 1:
            reports = agree_reports(report, self._checkpoint_group(), self._rank() or 0)
        else:
            reports = [report]
        verdict = self._ledger.settle(reports)
        for failure in verdict.failures:
            step, kind = failure.key
            if step is not None and self._lease is not None:
                self._leftovers.add(
                    self.export_path(step) if kind == "export" else self.step_path(step)
                )
        log_verdict(verdict, self.config.on_save_error, self._is_coordinator())
        if verdict.raise_error is not None:
            raise verdict.raise_error

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
            self._drain(timeout)
        finally:
            self._settle()
        self._housekeep()

    def _drain(self, timeout: float | None = None) -> None:
        """Wait for every save in flight (up to ``timeout``, default
        ``close_timeout_s``), then poll. Raises only if saves are still in flight."""
        if self._writer is None:
            return
        pending = sorted(self._in_flight)
        limit = self.config.close_timeout_s if timeout is None else timeout
        if timeout is None and pending:
            limit = max(limit, float(self.config.save_timeout_s) + 60.0)
        done = self._writer.drain(limit)
        self._poll()
        if not done:
            left = sorted(self._in_flight)
            raise CheckpointError(
                f"saves of steps {left or pending} still in flight after {limit:g} s",
                path=self.folder,
                rank=self._rank(),
            )

    def _apply(self, finished: list[tuple[int, SaveRecord]], errors: list[CheckpointError]) -> None:
        """Take in what a poll of the writer returned (records, commit lines, the
        ledger); a commit makes housekeeping due."""
        for index, record in finished:
            self.metrics[index] = record
            if record.status == "committed":
                log_committed(record, self._info())
                self._housekeeping_due = True
                if record.kind == "full" and (self._last_good or -1) < record.step:
                    self._last_good = record.step
            else:
                logger.warning(
                    "quicksave: the checkpoint of step %d was not committed (%s)",
                    record.step,
                    record.path,
                )
        self._ledger.note(finished, errors)

    # ---------------------------------------------------------------- retention

    def _housekeep(self, protect: set[int] | None = None) -> None:
        """On the lease holder, once a commit was seen (the store answers): remove what
        failed saves left, then apply retention. Never raises: a failure is logged, and
        the work is tried again after the next commit (not at every call, which would
        stall each step on a store that is down)."""
        if self._lease is None or not self._housekeeping_due:
            return
        self._housekeeping_due = False
        try:
            busy = {self.step_path(s) for s in self._in_flight}
            for path in sorted(self._leftovers - busy):
                self._replace_uncommitted(path)
                self._leftovers.discard(path)
            self._retain(protect or set())
        except (CheckpointError, OSError) as e:
            logger.warning(
                "quicksave: retention or clean-up in %s failed on rank %s (%s); nothing is "
                "lost, it runs again after the next commit",
                self.folder,
                self._rank() or 0,
                e,
            )

    def _retain(self, protect: set[int]) -> None:
        if self._lease is None:  # only the lease holder deletes
            return
        clean_folder(  # what a store lease's previous holder left (once, when due)
            self._lease,
            self._folder,
            self.config.storage.stale_after_s,
            backend=self._backend(),
            keep={f"step-{s}" for s in self._in_flight | protect},
            deferred=True,
        )
        if self._last_good is None:
            # No checkpoint is known to pass yet (nothing loaded, nothing of ours
            # committed): the newest one may be torn, and deleting the older ones could
            # leave nothing loadable if our own save then fails.
            return
        keep = self._in_flight | protect | {self._last_good}
        apply_retention(
            self._folder,
            self.retention,
            keep,
            allow_dcp=self.config.allow_dcp,
            backend=self._backend(),
        )

    def _replace_uncommitted(self, path: str) -> None:
        if self._lease is not None:
            replace_uncommitted(self._where(path), self._backend())

    # ---------------------------------------------------------------- ownership

    def _take_folder(self) -> str | None:
        """Create the folder and, on the coordinator, take its writer lease and clean
        up what crashed saves left. Returns why this manager is read-only, or None.

        Several ranks: every rank learns whether the coordinator got the lease (one
        all-reduce on the checkpoint group, at construction only), so that all refuse
        ``save()`` alike instead of waiting for each other in a save's collectives.
        """
        rank = self._rank()
        if self.config.read_only:
            return "it was built with read_only=True"
        reason: str | None = None
        create_folder(self._folder, rank)
        if self._is_coordinator():
            hint = "use another folder, stop that job, or pass read_only=True to only load"
            self._lease, reason = take_writer_lease(self._folder, hint)
            if self._lease is not None:
                stale = self.config.storage.stale_after_s
                clean_folder(self._lease, self._folder, stale, backend=self._backend())
        if self._world_size() > 1:
            # The same one-integer MAX vote as the interval agreement: "any rank is
            # read-only" (only the coordinator can be, for the lease).
            any_read_only = agree_any_due(reason is not None, self._checkpoint_group()).wait()
            if any_read_only and reason is None:
                reason = "the coordinator could not take the folder's writer lease (see its log)"
        if reason is not None:
            logger.warning(
                "quicksave: %s is read-only for this manager (load() works, save() raises): %s",
                self.folder,
                reason,
            )
        return reason

    # ---------------------------------------------------------------- helpers

    def _backend(self) -> Backend | None:
        """The manager's own backend for an object-store folder, opened once (a new S3
        client costs ~0.3 s: not per save) and closed by ``close()``; None locally."""
        if self._folder.is_local:
            return None
        if self._store is None:
            # Never a hang, and a call of the training thread (a pre-check, retention)
            # ends well within the checkpoint group's timeout: the other ranks may be
            # waiting for this one in the next settling collective.
            budget = min(self.config.save_timeout_s, self.config.commit_timeout_s / 2)
            bounded = self._folder.bounded(budget)
            self._store = bounded.open(rank=self._rank() or 0)
            if self._lease is not None:  # every deletion re-checks the lease first
                self._store = self._lease.guard(self._store)
        return self._store

    def _where(self, path: str) -> Location:
        """The location of ``path`` (a step's path or URL), reached with the config's
        storage options."""
        return parse_location(path, options=self.config.storage)

    def _agree(self, step: int, decision: bool, forced: bool) -> bool:
        """Where all ranks agree on a save decision (they must, or the save's
        collectives deadlock). One rank, or a step-based policy: every rank decides
        alike, ``decision`` as is, no collective. A time-based policy with several
        ranks: the ranks' votes are combined by :class:`IntervalAgreement` (one
        asynchronous all-reduce every ``interval_check_steps`` steps); ``forced``
        (``force`` or ``last_step``) saves are taken alike by every rank, without it."""
        if self._interval is None:
            return decision
        return self._interval.decide(step, decision, forced)

    def _model_state_names(self) -> list[str]:
        """The states that hold the model: the ModelState ones, else one named "model"."""
        names = [k for k, v in self.states.items() if isinstance(v, ModelState)]
        return names or (["model"] if "model" in self.states else [])

    def _model_states(self) -> dict[str, Any]:
        models = {k: self.states[k] for k in self._model_state_names()}
        if not models:
            raise IncompatibleStateError(
                "seed (step 0) and export checkpoints hold the model only, but no state is a "
                "ModelState or named 'model'",
                path=self.folder,
                rank=self._rank(),
            )
        return models

    def _check_writable(self) -> None:
        if self.read_only_reason is not None:
            raise CheckpointError(
                f"this manager does not write checkpoints: {self.read_only_reason}",
                path=self.folder,
                rank=self._rank(),
            )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(
                "this CheckpointManager is closed", path=self.folder, rank=self._rank()
            )

    def _rank(self) -> int | None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group)
        return None

    def _world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def _is_coordinator(self) -> bool:
        return (self._rank() or 0) == 0

    def _info(self) -> int:
        """The level of the lines every rank would log alike (resume, commit): INFO on
        the coordinator, DEBUG on the others (``log_level="info"`` shows one line)."""
        return logging.INFO if self._is_coordinator() else logging.DEBUG

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group of this manager's checkpoint collectives (the interval
        agreement's votes, the saves' planning): its own group, over the ranks of
        ``process_group``, so that checkpoint collectives never queue behind training
        ones, and with ``commit_timeout_s`` as its timeout, so that a rank that never
        arrives fails the others' save instead of hanging them. Created once (every rank
        builds its manager at the same point, so every rank creates it alike)."""
        if self._group is None:
            ranks = (
                None
                if self.process_group is None
                else dist.get_process_group_ranks(self.process_group)
            )
            self._group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=timedelta(seconds=self.config.commit_timeout_s),
            )
        return self._group

    def _dist_context(self) -> DistContext:
        """Where this manager's multi-rank saves coordinate: the checkpoint group for
        the one planning collective, and the default store for the commit records."""
        group = self._checkpoint_group()
        return DistContext(
            group=group,
            store=dist.distributed_c10d._get_default_store(),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            coordinator=0,
            commit_timeout_s=self.config.commit_timeout_s,
        )


def _default_save_policy(config: CheckpointConfig) -> SavePolicy:
    if config.interval_type == "seconds":
        return EveryNSeconds(config.interval)
    return EveryNSteps(int(config.interval))
