"""quicksave as torchtitan's checkpoint backend.

torchtitan (>= 0.3) builds its checkpointer from ``Trainer.Config.checkpoint``, a
``BaseCheckpointManager.Config``: ``config.checkpoint.build(...)`` constructs the class
that *declares* that config. :class:`QuicksaveCheckpointManager` implements torchtitan's
``BaseCheckpointManager`` contract and declares its own ``Config``, so putting a
``QuicksaveCheckpointManager.Config`` there makes every torchtitan trainer checkpoint
through quicksave::

    from quicksave.integrations.torchtitan import QuicksaveCheckpointManager

    config = Trainer.Config(
        ...,
        checkpoint=QuicksaveCheckpointManager.Config(
            enable=True, folder="checkpoint", interval=500, keep_latest_k=3,
            async_mode="async_with_pinned_mem",
        ),
    )

It keeps torchtitan's folder (``<dump_folder>/<folder>/step-<N>``), state layout
(:mod:`._torchtitan_layout`: checkpoints convert both ways with stock torchtitan) and
options (interval, keep_latest_k, load_step, exclude_from_loading, load_only,
initial_load_path, model-only seed and last step); it adds atomic commits, checksums,
skipping a corrupt newest checkpoint at load, one writer per folder and quicksave's
asynchronous engine (``async_mode``: ``"disabled"``, ``"async"``, or
``"async_with_pinned_mem"`` for overlapped staging). Hugging Face import/export is
refused. Details: docs/integrations/torchtitan.md.

The folder itself (writer lease, clean-up of leftovers, listing, saves in flight,
fallback load, retention, failure agreement) is a
:class:`~quicksave.manager.session.CheckpointSession`, as for ``CheckpointManager``;
this module is torchtitan's contract and rules on top of it, its options are
:mod:`._torchtitan_config`.

Order of calls (torchtitan's trainer, every rank alike): build (the coordinator takes
the folder's writer lease) → ``load(step)`` → per step ``maybe_wait_for_staging()``
before ``optimizers.step()``, then ``save(step, last_step)`` → ``close()``.
Collectives, all on the checkpointer's own gloo group unless noted: at build, creating
that group and one all-reduce (does every rank write?); at each load one all-gather
(every rank's verdict on the checkpoint) before DCP's load collectives (default group);
DCP's planning in each synchronous save (default group); the engine's planning
all-reduce in each asynchronous save, whose commit records go through the default store.

Importing this module imports torchtitan; ``import quicksave`` never does.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
import torch.nn as nn

from quicksave.integrations._torchtitan_config import TitanCheckpointConfig

try:
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "quicksave.integrations.torchtitan needs torchtitan >= 0.3 "
        "(pip install 'quicksave[torchtitan]')"
    ) from e

from quicksave import api
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.integrations import _torchtitan_layout as layout
from quicksave.loading.checkpoint import Checkpoint, require_committed
from quicksave.manager.async_writer import AsyncWriter
from quicksave.manager.folder import check_step
from quicksave.manager.records import SaveRecord
from quicksave.manager.session import CheckpointSession
from quicksave.manager.states import ModelState, payload_bytes
from quicksave.saving.handle import SaveHandle
from quicksave.storage import Location, parse_location

__all__ = ["QuicksaveCheckpointManager"]

logger = logging.getLogger("quicksave")


class QuicksaveCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager, writing and reading through quicksave.

    Built by torchtitan's trainer from :class:`QuicksaveCheckpointManager.Config`
    (``config.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=...,
    states=..., sd_adapter=..., base_folder=...)``), on every rank alike; the arguments
    are those of torchtitan's own ``CheckpointManager``.

    Args:
        config: torchtitan's checkpoint options plus quicksave's (see ``Config``).
        dataloader: torchtitan's data loader (each data-parallel rank saves its own
            ``dp_rank_<r>`` entry), or None.
        model_parts: the model (or its pipeline stages).
        optimizers: torchtitan's ``OptimizersContainer``.
        lr_schedulers: torchtitan's ``LRSchedulersContainer``.
        states: further ``Stateful`` objects by name (the trainer passes
            ``{"train_state": trainer}``); the model, optimizer, data loader and LR
            scheduler are added to it, as torchtitan does.
        sd_adapter: unused (Hugging Face conversion is refused).
        base_folder: the trainer's dump folder; ``config.folder`` is relative to it
            unless absolute or a URL (``s3://``, ``msc://``).

    Attributes:
        folder: the checkpoint folder (absolute path or URL).
        session: the folder's :class:`~quicksave.manager.session.CheckpointSession`
            (its lease, listing, saves in flight, fallback load and retention).
        metrics: one :class:`~quicksave.SaveRecord` per checkpoint written.
        read_only_reason: why ``save()`` raises (``load_only``, or another live job
            holds the folder's writer lease), or None.

    Raises:
        CheckpointError: bad options, the folder cannot be created, the worker cannot
            start.
        IncompatibleStateError: a model key collides with a state's name.

    Example::

        checkpointer = QuicksaveCheckpointManager.Config(enable=True, interval=10).build(
            dataloader=dataloader, model_parts=[model], optimizers=optimizers,
            lr_schedulers=lr_schedulers, states={"train_state": train_state},
            sd_adapter=None, base_folder="outputs",
        )
        checkpointer.load()
    """

    Config = TitanCheckpointConfig

    def __init__(
        self,
        config: TitanCheckpointConfig,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self._handles: dict[int, SaveHandle] = {}  # saves in flight, by step
        self._closed = False
        if not self.enable:
            return
        self.config = config
        self._qs = config.quicksave_config(layout.join_folder(base_folder, config.folder))
        session = self.session = CheckpointSession(self._qs)  # (only when enabled)
        self.folder = session.folder
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.metrics: list[SaveRecord] = session.metrics
        if session.world_size() > 1:
            session.checkpoint_group()  # now, on every rank alike (creating it is collective)
        self.read_only_reason = session.take_folder(
            read_only="checkpoint.load_only is set" if config.load_only else None,
            hint="use another folder, stop that job, or set checkpoint.load_only",
        )
        if self.read_only_reason is None and self._qs.async_mode != "disabled":
            torch_optimizers = layout.torch_optimizers(optimizers)
            hooks: dict[str, Any] = {MODEL: ModelState(model_parts)}
            if torch_optimizers:
                hooks[OPTIMIZER] = layout.OptimizerHooks(model_parts, torch_optimizers)
            session.writer = AsyncWriter(
                session.writer_config(self._qs.engine_config()),
                hooks,
                lambda: self._full_state(),
                rank=session.rank() or 0,
                dist_context=session.dist_context() if session.world_size() > 1 else None,
            )
            session.writer.prepare_if_due(background=False)
        logger.info(
            "quicksave: torchtitan checkpoints in %s (interval %d, keep_latest_k %d, %s)",
            self.folder,
            config.interval,
            config.keep_latest_k,
            "read-only: " + self.read_only_reason
            if self.read_only_reason is not None
            else f"async_mode {config.async_mode}",
        )

    # ------------------------------------------------------------ torchtitan contract

    @property
    def save_future(self) -> SaveHandle | None:  # type: ignore[override]
        """The newest save still in flight (a :class:`~quicksave.SaveHandle`), or None:
        torchtitan's ``maybe_wait_for_saving()`` waits for every one of them."""
        handles = getattr(self, "_handles", None)
        return handles[max(handles)] if handles else None

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save the checkpoint of ``curr_step`` if it is due (torchtitan's rules: every
        ``interval`` steps, step 1 with ``enable_first_step_checkpoint``, and the last
        step); every call first collects the saves that finished in the background.

        Returns:
            True if a checkpoint of ``curr_step`` was written (async: started).

        Raises:
            CheckpointError: the save failed (nothing of it became visible), an earlier
                background save failed, or this manager does not write (names why).
        """
        self._check_open()
        session = self.session
        check_step(curr_step, self.folder)
        begin = time.monotonic()
        failures = self._collect_finished()
        if session.world_size() == 1:
            _raise_first(failures)
            failures = []
        # Several ranks: an earlier failure is raised after this step's save, whose
        # planning is collective, so that no rank leaves the others waiting in it.
        if not self._should_save(curr_step, last_step):
            _raise_first(failures)
            return False
        if self.read_only_reason is not None:
            raise CheckpointError(
                f"this checkpointer does not write checkpoints: {self.read_only_reason}",
                path=self.folder,
                rank=session.rank(),
            )
        kind = "full"
        if last_step and self.config.last_save_model_only:
            kind = "seed" if curr_step == 0 else "export"
        with torch.no_grad():
            # The last step's checkpoint is written synchronously, as torchtitan does.
            wrote = self._save_step(curr_step, kind, begin, synchronous=last_step)
        session.housekeep(protect={curr_step})
        _raise_first(failures)
        return wrote

    def _load(self, step: int = -1) -> bool:
        """Restore the states from ``step`` (-1: the newest committed checkpoint that
        passes its checks; older ones are tried if it is corrupt, and a writing
        coordinator moves it aside as ``step-<N>.corrupt-*``). With no checkpoint in
        the folder, ``initial_load_path`` is loaded if set. Step 0 (the seed) restores
        the model only; ``exclude_from_loading`` names states left as they are.

        Returns:
            True if something was loaded, False on a fresh start.

        Raises:
            CheckpointNotFoundError / NotCommittedError: ``step`` has no committed
                checkpoint (the committed steps are named).
            CorruptCheckpointError: the checkpoint is corrupt, or none passes.
            IncompatibleStateError: the checkpoint does not fit the states (keys named).
            CheckpointError: it is a model-only checkpoint, or a save in flight failed.
        """
        self._check_open()
        session = self.session
        self._drain()
        with torch.no_grad():
            if step != -1:
                check_step(step, self.folder)
                self._refuse_stock_dcp(step)
                self._load_step(step, session.require_committed(step))
                return True
            if not self.committed_steps():
                self._refuse_stock_dcp(None)
                return self._initial_load()
            return session.load_newest(self._load_step) is not None

    def _maybe_wait_for_staging(self) -> None:
        if self.session.writer is not None:
            self.session.writer.maybe_wait_for_staging()

    def _wait_for_saving(self) -> None:
        self._drain()

    def _close(self) -> None:
        """Wait for the saves in flight (up to ``close_timeout_s``), stop the worker,
        release the folder. A failed save raises here, unless an exception is already
        being handled (torchtitan closes the trainer on its way out): then it is logged."""
        if self._closed or not self.enable:
            return
        self._closed = True
        session = self.session
        try:
            errors = session.close_writer(self.config.close_timeout_s)
            self._handles.clear()
            session.housekeep()
            if sys.exc_info()[1] is not None:
                for e in errors:
                    logger.error("quicksave: closing the checkpointer after an error: %s", e)
            else:
                _raise_first(errors)
        finally:
            session.release()

    # ------------------------------------------------------------ queries

    def step_path(self, step: int) -> str:
        """The directory (or URL) of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return self.session.step_path(step)

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint in the folder, ascending (stock DCP ones
        only with ``allow_dcp``); temporaries and quarantined ones are not listed."""
        return self.session.committed_steps()

    # ------------------------------------------------------------ save path

    def _should_save(self, step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or step % self.config.interval == 0

    def _save_step(self, step: int, kind: str, begin: float, *, synchronous: bool) -> bool:
        """Write the ``kind`` checkpoint of ``step`` to ``step-<step>``; False if it
        exists already, is in flight, or backpressure skipped it."""
        session = self.session
        path = session.step_path(step)
        if step in session.in_flight:
            logger.info("quicksave: step %d is being written already; skipped", step)
            return False
        writer = session.writer
        if synchronous or writer is None:
            # A synchronous write waits for the store anyway; an asynchronous one leaves
            # these checks to its writer (a committed step found there is a skip): the
            # training thread never waits on the store.
            if session.is_committed(path):
                logger.info("quicksave: step %d already has a committed checkpoint; skipped", step)
                return False
            self._drain()  # a synchronous write never runs beside a save in flight
            session.replace_uncommitted(path)
        elif not session.claim(path):
            logger.warning(
                "quicksave: step %d not saved: a failed earlier save's leftover at %s is "
                "being removed right now",
                step,
                path,
            )
            return False
        if kind == "full":
            state = self._full_state()
        else:
            state = layout.model_state(self.states, getattr(torch, self.config.export_dtype))
        nbytes = payload_bytes(state)
        metadata: dict[str, Any] = {layout.KIND_KEY: kind, "trainer": "torchtitan"}
        if kind != "full":
            metadata["export_dtype"] = self.config.export_dtype
        if synchronous or writer is None:
            written = time.monotonic()
            api.save(
                state,
                path,
                step=step,
                thread_count=self.config.thread_count,
                user_metadata=metadata,
            )
            now = time.monotonic()
            session.committed(SaveRecord.synchronous(step, kind, path, nbytes, begin, written, now))
            return True
        try:
            handle = writer.submit(state, path, step, metadata)
        except BaseException:
            session.unclaim(path)
            raise
        if handle is None:
            session.unclaim(path)
            return False  # backpressure="skip" (logged by the engine)
        record = SaveRecord(
            step,
            kind,
            path,
            nbytes,
            time.monotonic() - begin,
            status="in_flight",
            mode=self._qs.async_mode,
        )
        session.track(record, handle, begin)
        self._handles[step] = handle
        return True

    def _full_state(self) -> dict[str, Any]:
        """torchtitan's layout (``_torchtitan_layout.full_state``)."""
        return layout.full_state(self.states, self.folder, self.session.rank())

    # ------------------------------------------------------------ load path

    def _initial_load(self) -> bool:
        path = self.config.initial_load_path
        if not path:
            logger.info("quicksave: no checkpoint in %s; a fresh start", self.folder)
            return False
        logger.info("quicksave: no checkpoint in %s; loading initial_load_path", self.folder)
        self._load_path(parse_location(path), model_only=self.config.initial_load_model_only)
        return True

    def _refuse_stock_dcp(self, step: int | None) -> None:
        """Without ``allow_dcp`` stock DCP checkpoints do not count; rather than start
        afresh beside them (or report "not found"), say what to do."""
        if self.config.allow_dcp:
            return
        session = self.session
        ours = set(session.committed_steps())
        stock = [s for s in session.committed_steps(allow_dcp=True) if s not in ours]
        if step is not None:
            stock = [s for s in stock if s == step]
        if stock:
            raise CheckpointNotFoundError(
                f"the folder holds stock torch.distributed.checkpoint checkpoints (e.g. "
                f"written by torchtitan's own CheckpointManager) of steps {stock}, which "
                "count only with --checkpoint.allow_dcp (their .metadata pickle is then "
                "read by a restricted unpickler), or convert them first "
                "(docs/integrations/torchtitan.md)",
                path=self.folder,
                rank=session.rank(),
            )

    def _load_step(self, step: int, checkpoint: Checkpoint) -> None:
        """Load ``checkpoint``, the committed checkpoint of ``step`` as the session
        classified it."""
        begin = time.perf_counter()
        self._load_path(checkpoint, model_only=step == 0)
        self.session.loaded(step)  # the writer plans now: optimizer states exist
        seconds = time.perf_counter() - begin
        logger.info("quicksave: loaded step %d from %s in %.3f s", step, checkpoint.url, seconds)

    def _load_path(self, target: Location | Checkpoint, *, model_only: bool) -> None:
        """Load the checkpoint at ``target`` (classified here once, unless it is a
        classified checkpoint already) into the states, torchtitan's way: the model
        (and unless ``model_only`` the other states but ``exclude_from_loading``).

        Every rank checks the checkpoint against its states first, and the ranks agree
        on the outcome (one all-gather) before the load's collectives: a check that
        fails on one rank only (its own data loader entry is missing) fails them all."""
        session = self.session
        dest: dict[str, Any] = {}
        failure: CheckpointError | None = None
        loc = target.location if isinstance(target, Checkpoint) else target
        checkpoint = target
        try:
            checkpoint = require_committed(target, allow_dcp=True)
            stored, kind = layout.read_stored(
                checkpoint, allow_dcp_pickle=self.config.allow_dcp_pickle
            )
            dest = layout.load_destination(
                self.states,
                stored,
                kind,
                model_only=model_only,
                excluded=self.config.exclude_from_loading,
                path=loc.url,
                rank=session.rank(),
            )
        except CheckpointError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - reported on every rank, raised below
            failure = CheckpointError(f"{type(e).__name__}: {e}", path=loc.url, rank=session.rank())
        failure = session.agree_failure(failure)
        if failure is not None:
            raise failure
        # The key sets are checked; strict=False lets the checkpoint hold more (other
        # ranks' data loader entries, excluded states, the rest of a full step 0).
        api.load(dest, checkpoint, strict=False, allow_dcp_pickle=self.config.allow_dcp_pickle)
        self.states[MODEL].load_state_dict(dest)  # filled in place; this runs the hooks

    # ------------------------------------------------------------ background saves

    def _collect_finished(self) -> list[CheckpointError]:
        """Records of the saves finished in the background (without waiting), then
        retention if one committed; returns their failures."""
        session = self.session
        errors = session.poll()
        self._forget_finished()
        session.housekeep()
        return errors

    def _drain(self) -> None:
        """Wait for every save in flight, then raise the first failure."""
        session = self.session
        errors = session.drain()
        self._forget_finished()
        session.housekeep()
        _raise_first(errors)

    def _forget_finished(self) -> None:
        in_flight = self.session.in_flight
        self._handles = {s: h for s, h in self._handles.items() if s in in_flight}

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this checkpointer is closed", path=self.folder)


def _raise_first(errors: list[CheckpointError]) -> None:
    if not errors:
        return
    if len(errors) > 1:
        for e in errors[1:]:
            logger.error("quicksave: also failed: %s", e)
    raise errors[0]
