"""``CheckpointManager``: when, where and what to save, how many to keep, how to resume.

Wiring only: the decisions come from policy objects (``policies.py``), the state from
``Stateful`` wrappers (``states.py``), the bytes go through the async engine
(``async_writer.py``) or ``quicksave.save`` / ``quicksave.load``, and visibility rules
from ``commit.py``.

One ``save(step)`` goes through these states, in this order::

    finalize (async: collect finished saves without waiting; a failure raises here)
    → decide (SavePolicy, then ranks agree) → collect (state_dict() of every state)
    → write (one hand-off: ``_write``; async modes return after staging, or at once in
    overlap mode) → commit (in the writer: rename of ``step-<N>.tmp-*`` to ``step-<N>``)
    → retain (RetentionPolicy over the committed steps, once a commit is seen; deletes
    on the coordinator only, never a step in flight)

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
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import api
from ..commit import classify, final_name, is_temp_name
from ..dist.saving import DistContext
from ..engine import SaveHandle
from ..errors import (
    CheckpointError,
    IncompatibleStateError,
)
from ..model_record import cast_floating, floating_dtype, model_record
from ..storage import Location, parse_location
from ..storage.backend import Backend
from .async_writer import AsyncWriter
from .config import CheckpointConfig
from .folder import (
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
from .interval import IntervalAgreement, agree_any_due, needs_agreement
from .lease import WriterLease, clean_folder, take_writer_lease
from .policies import EveryNSeconds, EveryNSteps, KeepLatestK, RetentionPolicy, SavePolicy
from .records import SaveRecord, log_committed
from .states import (
    ModelState,
    PerRankLoad,
    PerRankState,
    check_states,
    payload_bytes,
)

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
    ``load()`` or ``close()``. ``metrics`` holds one :class:`SaveRecord` per checkpoint,
    completed when it commits. The manager adds step hooks to the optimizers of its
    :class:`OptimizerState` states (removed by ``close()``); a loop that changes
    parameters otherwise must call :meth:`maybe_wait_for_staging` first.

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
        logger.info(
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
        path = self.export_path(step)
        if classify(self._where(path), self._backend()) in COMMITTED:
            logger.info("quicksave: export of step %d already exists; skipped", step)
        else:
            self._save_one(step, path, "export", time.monotonic(), cast)
        return path

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
        saves that finished (cheaply, without waiting) and raises the failure of an
        earlier one. A full checkpoint returns after staging (in overlap mode, before
        parameters and optimizer states are copied: the next ``optimizer.step()``
        waits for that copy) and commits in the background.

        Args:
            step: the training step just completed (an int >= 0).
            force: save even if the interval has not been reached.

        Returns:
            True if this call wrote (async modes: started) a checkpoint or an export of
            ``step``; False if none was due, or ``backpressure="skip"`` skipped it.

        Raises:
            CheckpointError: invalid step, manager closed or read-only (names why:
                e.g. the process holding the folder's writer lease), the write failed
                (nothing of this step became visible), or an earlier asynchronous save
                failed (then this call saves nothing; the next call saves normally).

        Example::

            manager.save(train_state.step)
        """
        begin = time.monotonic()
        self._check_open()
        check_step(step, self.folder)
        if not self.config.enabled:
            return False
        self._check_writable()
        failures: list[CheckpointError] = []
        if self._writer is not None:
            self._writer.prepare_if_due()
            if self._world_size() > 1:
                # Several ranks: an earlier failure is raised after this call's save
                # (whose planning is collective), so that no rank leaves the others
                # waiting in it; every rank learns of a failure from its own writer.
                finished, failures = self._writer.poll()
                self._apply(finished)
            else:
                self._finalize()
        is_last = self.config.last_step is not None and step == self.config.last_step
        decision = self.save_policy.should_save(step, self._clock(), force or is_last)
        if not self._agree(step, decision, forced=force or is_last):
            self._raise_first(failures)
            return False
        wrote = False
        path = self.step_path(step)
        if classify(self._where(path), self._backend()) in COMMITTED:
            logger.info(
                "quicksave: step %d already has a committed checkpoint at %s; skipped", step, path
            )
        elif step in self._in_flight:
            logger.info("quicksave: step %d is being written already; skipped", step)
        elif self._save_one(step, path, "seed" if step == 0 else "full", begin):
            self.save_policy.saved(step, self._clock())
            wrote = True
        if is_last:
            if classify(self._where(self.export_path(step)), self._backend()) in COMMITTED:
                logger.info("quicksave: export of step %d already exists; skipped", step)
            else:
                self._save_one(step, self.export_path(step), "export", time.monotonic())
                wrote = True
        self._retain(protect={step})
        self._raise_first(failures)
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
        self._drain()
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
            stored = stored_metadata(
                self._where(path), allow_dcp_pickle=self.config.allow_dcp_pickle
            )
            states = {
                k: PerRankLoad(k, v, stored) if isinstance(v, PerRankState) else v
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
        logger.info(
            "quicksave: loaded step %d from %s in %.3f s", step, path, time.perf_counter() - begin
        )

    def close(self) -> None:
        """Finish: wait for saves in flight (up to ``close_timeout_s``), stop the
        worker, remove the optimizer hooks, and refuse further calls. Calling it again
        does nothing.

        Raises:
            CheckpointError: a save failed, or was still in flight at the timeout (it
                is abandoned, never committed); the manager is closed all the same.

        Example::

            manager.close()
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                finished, errors = self._writer.close(self.config.close_timeout_s)
                self._apply(finished)
                self._raise_first(errors)
        finally:
            if self._lease is not None:
                self._lease.release()
            if self._store is not None:
                self._store.close()
                self._store = None
        logger.debug("quicksave: manager for %s closed", self.folder)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way already: do not replace it with ours
            self.close()
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
        self._replace_uncommitted(path)
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
            log_committed(record)
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

    def _finalize(self) -> None:
        """Collect finished background saves without waiting; raise the first failure."""
        if self._writer is None:
            return
        finished, errors = self._writer.poll()
        self._apply(finished)
        self._raise_first(errors)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save in flight is committed (or has failed), without
        closing: before an evaluation, an export or a hand-off that must see the latest
        checkpoint on disk. Retention runs for what was committed. Each rank waits for
        its own saves (no collective).

        Args:
            timeout: seconds to wait at most; None: until the saves end (each is bounded
                by the worker's own save timeout, so this cannot hang forever).

        Raises:
            CheckpointError: a save failed (the first failure, naming its step), or saves
                were still in flight at ``timeout`` (named; they go on in the
                background and a later ``wait``, ``save`` or ``close`` collects them).

        Example::

            manager.save(step)
            manager.wait()  # step's checkpoint is committed now
            evaluate(manager.step_path(step))
        """
        self._check_open()
        self._drain(timeout)

    def _drain(self, timeout: float | None = None) -> None:
        """Wait for every save in flight (up to ``timeout``, default
        ``close_timeout_s``), then finalize."""
        if self._writer is None:
            return
        pending = sorted(self._in_flight)
        limit = self.config.close_timeout_s if timeout is None else timeout
        if timeout is None and pending:
            limit = max(limit, float(self.config.save_timeout_s) + 60.0)
        done = self._writer.drain(limit)
        self._finalize()
        if not done:
            left = sorted(self._in_flight)
            raise CheckpointError(
                f"saves of steps {left or pending} still in flight after {limit:g} s",
                path=self.folder,
                rank=self._rank(),
            )

    def _apply(self, finished: list[tuple[int, SaveRecord]]) -> None:
        committed = False
        for index, record in finished:
            self.metrics[index] = record
            if record.status == "committed":
                log_committed(record)
                committed = True
                if record.kind == "full" and (self._last_good or -1) < record.step:
                    self._last_good = record.step
            else:
                logger.error(
                    "quicksave: the checkpoint of step %d was not committed (%s)",
                    record.step,
                    record.path,
                )
        if committed:
            self._retain(protect=set())

    def _raise_first(self, errors: list[CheckpointError]) -> None:
        """Raise the failures collected at once as one error (the first one's type),
        naming every failed save: none may reach the trainer as a log line only."""
        if not errors:
            return
        if len(errors) == 1:
            raise errors[0]
        first = errors[0]
        names = ", ".join(_checkpoint_name(e.path) for e in errors)
        others = "; ".join(str(e) for e in errors[1:])
        raise type(first)(
            f"{len(errors)} checkpoints were not committed ({names}): {first.message} "
            f"(also: {others})",
            path=first.path,
            fqn=first.fqn,
            rank=first.rank,
        ) from first

    # ---------------------------------------------------------------- retention

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
            bounded = self._folder.bounded(self.config.save_timeout_s)  # never a hang
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


def _checkpoint_name(path: str | None) -> str:
    """``step-12`` for an error's path: the checkpoint, its temporary, or a file in it."""
    if path is None:
        return "?"
    for part in reversed(os.path.normpath(path).split(os.sep)[-2:]):
        if is_temp_name(part):
            return final_name(part)
    return os.path.basename(os.path.normpath(path))


def _default_save_policy(config: CheckpointConfig) -> SavePolicy:
    if config.interval_type == "seconds":
        return EveryNSeconds(config.interval)
    return EveryNSteps(int(config.interval))
