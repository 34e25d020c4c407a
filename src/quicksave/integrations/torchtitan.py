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
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

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
from quicksave.commit import classify
from quicksave.errors import (
    CheckpointError,
    CheckpointNotFoundError,
)
from quicksave.integrations import _torchtitan_layout as layout
from quicksave.manager.async_writer import AsyncWriter
from quicksave.manager.config import CheckpointConfig
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
)
from quicksave.manager.interval import agree_any_due
from quicksave.manager.lease import WriterLease, clean_folder, take_writer_lease
from quicksave.manager.policies import KeepLatestK
from quicksave.manager.records import SaveRecord, log_committed
from quicksave.manager.states import ModelState, payload_bytes
from quicksave.ranks.saving import DistContext
from quicksave.saving.handle import SaveHandle
from quicksave.storage import Location, parse_location
from quicksave.storage.backend import Backend

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

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint options (``BaseCheckpointManager.Config``) and
        quicksave's. Every field is a torchtitan CLI flag (``--checkpoint.<field>``)."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: save() returns once committed. ``async``: once staged; written
        in the background. ``async_with_pinned_mem``: parameters and optimizer states
        are staged during the next forward/backward too."""

        async_worker: Literal["process", "thread"] = "process"
        """Who writes in the async modes: a worker process per rank, or a thread."""

        thread_count: int = 2
        """Data files (and writer threads) per rank."""

        allow_dcp: bool = False
        """Also list and load stock DCP ``step-<N>`` folders (e.g. written by stock
        torchtitan): their ``.metadata`` pickle is read by a restricted unpickler."""

        allow_dcp_pickle: bool = False
        """Unpickle stock DCP metadata without restriction (trusted folders only)."""

        save_timeout_s: float = 900.0
        """A save still being written after this long has failed."""

        commit_timeout_s: float = 120.0
        """Several ranks: how long the commit waits for every rank's files."""

        close_timeout_s: float = 300.0
        """How long ``close()`` (and a load, a last-step save) waits for saves."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            for name in ("last_save_in_hf", "initial_load_in_hf"):
                if getattr(self, name):
                    raise CheckpointError(
                        f"checkpoint.{name} is not supported by QuicksaveCheckpointManager: "
                        "Hugging Face safetensors are not quicksave checkpoints. Use "
                        "torchtitan's stock CheckpointManager for Hugging Face import/export, "
                        "or export a quicksave checkpoint with "
                        "`quicksave convert --to safetensors CKPT OUT`"
                    )
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            self.quicksave_config()  # validates the quicksave options now

        def quicksave_config(self, folder: str | None = None) -> CheckpointConfig:
            """The equivalent :class:`~quicksave.CheckpointConfig` (engine, timeouts,
            retention), for ``folder`` (default: ``self.folder``)."""
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise CheckpointError(
                    "checkpoint.async_mode must be 'disabled', 'async' or "
                    f"'async_with_pinned_mem', got {self.async_mode!r}"
                )
            return CheckpointConfig(
                folder=folder or self.folder,
                keep_latest_k=self.keep_latest_k,
                export_dtype=self.export_dtype,
                thread_count=self.thread_count,
                async_mode="disabled" if self.async_mode == "disabled" else self.async_worker,
                staging="overlap" if self.async_mode == "async_with_pinned_mem" else "blocking",
                save_timeout_s=self.save_timeout_s,
                commit_timeout_s=self.commit_timeout_s,
                close_timeout_s=self.close_timeout_s,
                read_only=self.load_only,
                allow_dcp=self.allow_dcp,
                allow_dcp_pickle=self.allow_dcp_pickle,
            )

    def __init__(
        self,
        config: Config,
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
        self._writer: AsyncWriter | None = None
        self._handles: dict[int, SaveHandle] = {}  # saves in flight, by step
        self._lease: WriterLease | None = None
        self._closed = False
        if not self.enable:
            return
        self.config = config
        self._qs = config.quicksave_config(layout.join_folder(base_folder, config.folder))
        self._folder: Location = parse_location(self._qs.folder, what="checkpoint folder")
        self.folder = self._folder.url
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
        self.metrics: list[SaveRecord] = []
        self._group: dist.ProcessGroup | None = None  # the checkpoint group (_checkpoint_group)
        self._last_good: int | None = None  # newest step known to pass its checks
        self._retention = KeepLatestK(config.keep_latest_k)
        if self._world_size() > 1:
            self._checkpoint_group()  # now, on every rank alike (creating it is collective)
        self.read_only_reason = self._take_folder()
        if self.read_only_reason is None and self._qs.async_mode != "disabled":
            torch_optimizers = layout.torch_optimizers(optimizers)
            hooks: dict[str, Any] = {MODEL: ModelState(model_parts)}
            if torch_optimizers:
                hooks[OPTIMIZER] = layout.OptimizerHooks(model_parts, torch_optimizers)
            self._writer = AsyncWriter(
                self._qs.engine_config(),
                hooks,
                lambda: self._full_state(),
                rank=self._rank() or 0,
                dist_context=self._dist_context() if self._world_size() > 1 else None,
            )
            self._writer.prepare_if_due(background=False)
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
        check_step(curr_step, self.folder)
        begin = time.monotonic()
        failures = self._collect_finished()
        if self._world_size() == 1:
            self._raise_first(failures)
            failures = []
        # Several ranks: an earlier failure is raised after this step's save, whose
        # planning is collective, so that no rank leaves the others waiting in it.
        if not self._should_save(curr_step, last_step):
            self._raise_first(failures)
            return False
        if self.read_only_reason is not None:
            raise CheckpointError(
                f"this checkpointer does not write checkpoints: {self.read_only_reason}",
                path=self.folder,
                rank=self._rank(),
            )
        kind = "full"
        if last_step and self.config.last_save_model_only:
            kind = "seed" if curr_step == 0 else "export"
        with torch.no_grad():
            # The last step's checkpoint is written synchronously, as torchtitan does.
            wrote = self._save_step(curr_step, kind, begin, synchronous=last_step)
        self._retain(protect={curr_step})
        self._raise_first(failures)
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
        self._drain()
        with torch.no_grad():
            if step != -1:
                check_step(step, self.folder)
                self._refuse_stock_dcp(step)
                require_committed(
                    self._folder,
                    self._folder.child(f"step-{step}"),
                    step,
                    self._rank(),
                    allow_dcp=self.config.allow_dcp,
                )
                self._load_step(step)
                return True
            candidates = list(reversed(self.committed_steps()))
            if not candidates:
                self._refuse_stock_dcp(None)
                return self._initial_load()
            on_corrupt = None
            if self._lease is not None:  # a writer moves a corrupt checkpoint aside

                def on_corrupt(candidate: int, why: str) -> None:
                    quarantine(self._folder.child(f"step-{candidate}"), why, self._deleter())

            folder, rank = self.folder, self._rank()
            return (
                load_newest(self.committed_steps, self._load_step, on_corrupt, folder, rank)
                is not None
            )

    def _maybe_wait_for_staging(self) -> None:
        if self._writer is not None:
            self._writer.maybe_wait_for_staging()

    def _wait_for_saving(self) -> None:
        self._drain()

    def _close(self) -> None:
        """Wait for the saves in flight (up to ``close_timeout_s``), stop the worker,
        release the folder. A failed save raises here, unless an exception is already
        being handled (torchtitan closes the trainer on its way out): then it is logged."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                finished, errors = self._writer.close(self.config.close_timeout_s)
                self._apply(finished)
                if sys.exc_info()[1] is not None:
                    for e in errors:
                        logger.error("quicksave: closing the checkpointer after an error: %s", e)
                else:
                    self._raise_first(errors)
        finally:
            if self._lease is not None:
                self._lease.release()
                self._lease = None

    # ------------------------------------------------------------ queries

    def step_path(self, step: int) -> str:
        """The directory (or URL) of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return self._folder.child(f"step-{step}").url

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint in the folder, ascending (stock DCP ones
        only with ``allow_dcp``); temporaries and quarantined ones are not listed."""
        return committed_steps(self._folder, allow_dcp=self.config.allow_dcp)

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
        path = self.step_path(step)
        if classify(self._folder.child(f"step-{step}")) in COMMITTED:
            logger.info("quicksave: step %d already has a committed checkpoint; skipped", step)
            return False
        if self._writer is not None and step in self._writer.in_flight_steps:
            logger.info("quicksave: step %d is being written already; skipped", step)
            return False
        if synchronous or self._writer is None:
            self._drain()  # a synchronous write never runs beside a save in flight
        if self._lease is not None:
            replace_uncommitted(self._folder.child(f"step-{step}"), self._deleter())
        if kind == "full":
            state = self._full_state()
        else:
            state = layout.model_state(self.states, getattr(torch, self.config.export_dtype))
        nbytes = payload_bytes(state)
        metadata: dict[str, Any] = {layout.KIND_KEY: kind, "trainer": "torchtitan"}
        if kind != "full":
            metadata["export_dtype"] = self.config.export_dtype
        if synchronous or self._writer is None:
            written = time.monotonic()
            api.save(
                state,
                path,
                step=step,
                thread_count=self.config.thread_count,
                user_metadata=metadata,
            )
            now = time.monotonic()
            if kind == "full" and (self._last_good or -1) < step:
                self._last_good = step
            record = SaveRecord(
                step, kind, path, nbytes, now - begin, now - begin, now - begin, now - written
            )
            self.metrics.append(record)
            log_committed(record)
            return True
        handle = self._writer.submit(state, path, step, metadata)
        if handle is None:
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
        self._writer.track(len(self.metrics), record, handle, begin)
        self._handles[step] = handle
        self.metrics.append(record)
        return True

    def _full_state(self) -> dict[str, Any]:
        """torchtitan's layout (``_torchtitan_layout.full_state``)."""
        return layout.full_state(self.states, self.folder, self._rank())

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
        ours = set(self.committed_steps())
        stock = [s for s in committed_steps(self._folder, allow_dcp=True) if s not in ours]
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
                rank=self._rank(),
            )

    def _load_step(self, step: int) -> None:
        loc = self._folder.child(f"step-{step}")
        begin = time.perf_counter()
        self._load_path(loc, model_only=step == 0)
        self._last_good = step
        if self._writer is not None:
            self._writer.prepare_if_due(background=False)  # optimizer states exist now
        seconds = time.perf_counter() - begin
        logger.info("quicksave: loaded step %d from %s in %.3f s", step, loc.url, seconds)

    def _load_path(self, loc: Location, *, model_only: bool) -> None:
        """Load the checkpoint at ``loc`` into the states, torchtitan's way: the model
        (and unless ``model_only`` the other states but ``exclude_from_loading``).

        Every rank checks the checkpoint against its states first, and the ranks agree
        on the outcome (one all-gather) before the load's collectives: a check that
        fails on one rank only (its own data loader entry is missing) fails them all."""
        dest: dict[str, Any] = {}
        failure: CheckpointError | None = None
        try:
            stored, kind = layout.read_stored(loc, allow_dcp_pickle=self.config.allow_dcp_pickle)
            dest = layout.load_destination(
                self.states,
                stored,
                kind,
                model_only=model_only,
                excluded=self.config.exclude_from_loading,
                path=loc.url,
                rank=self._rank(),
            )
        except CheckpointError as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - reported on every rank, raised below
            failure = CheckpointError(f"{type(e).__name__}: {e}", path=loc.url, rank=self._rank())
        failure = self._agree_on_failure(failure)
        if failure is not None:
            raise failure
        # The key sets are checked; strict=False lets the checkpoint hold more (other
        # ranks' data loader entries, excluded states, the rest of a full step 0).
        api.load(dest, loc.url, strict=False, allow_dcp_pickle=self.config.allow_dcp_pickle)
        self.states[MODEL].load_state_dict(dest)  # filled in place; this runs the hooks

    # ------------------------------------------------------------ background saves

    def _collect_finished(self) -> list[CheckpointError]:
        """Records of the saves finished in the background (without waiting); returns
        their failures."""
        if self._writer is None:
            return []
        finished, errors = self._writer.poll()
        self._apply(finished)
        return errors

    def _drain(self) -> None:
        """Wait for every save in flight, then raise the first failure."""
        if self._writer is None:
            return
        limit = max(self.config.close_timeout_s, self.config.save_timeout_s + 60.0)
        done = self._writer.drain(limit)
        self._raise_first(self._collect_finished())
        if not done:
            raise CheckpointError(
                f"saves of steps {sorted(self._writer.in_flight_steps)} still in flight "
                f"after {limit:g} s",
                path=self.folder,
                rank=self._rank(),
            )

    def _apply(self, finished: list[tuple[int, SaveRecord]]) -> None:
        committed = False
        for index, record in finished:
            self.metrics[index] = record
            self._handles.pop(record.step, None)
            if record.status == "committed":
                log_committed(record)
                committed = True
                if (self._last_good or -1) < record.step:
                    self._last_good = record.step
            else:
                logger.error("quicksave: the checkpoint of step %d was not committed", record.step)
        if committed:
            self._retain(protect=set())

    def _raise_first(self, errors: list[CheckpointError]) -> None:
        if not errors:
            return
        if len(errors) > 1:
            for e in errors[1:]:
                logger.error("quicksave: also failed: %s", e)
        raise errors[0]

    def _retain(self, protect: set[int]) -> None:
        """keep_latest_k: delete the oldest committed checkpoints (lease holder only,
        and only once a checkpoint is known to load or was committed by us)."""
        if self._lease is None or self._last_good is None:
            return
        in_flight = self._writer.in_flight_steps if self._writer is not None else set()
        keep = in_flight | protect | {self._last_good}
        names = {f"step-{s}" for s in keep}
        stale, deleter = self._qs.storage.stale_after_s, self._deleter()
        # what a store lease's previous holder left, once the lease says it may go
        clean_folder(self._lease, self._folder, stale, backend=deleter, keep=names, deferred=True)
        apply_retention(
            self._folder,
            self._retention,
            keep,
            allow_dcp=self.config.allow_dcp,
            backend=deleter,
        )

    # ------------------------------------------------------------ ownership, ranks

    def _take_folder(self) -> str | None:
        """Create the folder; on the coordinator take its writer lease and remove what
        crashed saves left. Returns why this checkpointer is read-only, or None. Several
        ranks agree on it (one all-reduce), so that none waits for the others in a save
        they refuse."""
        if self.config.load_only:
            return "checkpoint.load_only is set"
        rank = self._rank()
        create_folder(self._folder, rank)
        reason: str | None = None
        if (rank or 0) == 0:
            hint = "use another folder, stop that job, or set checkpoint.load_only"
            self._lease, reason = take_writer_lease(self._folder, hint)
            if self._lease is not None:
                stale = self._qs.storage.stale_after_s
                clean_folder(self._lease, self._folder, stale, backend=self._deleter())
        if self._world_size() > 1:
            if agree_any_due(reason is not None, self._checkpoint_group()).wait():
                reason = reason or "the coordinator could not take the folder's writer lease"
        return reason

    def _deleter(self) -> Backend | None:
        """What the lease holder deletes through on a store: the lease's backend, each
        deletion preceded by the lease's re-check (None for a local folder)."""
        return self._lease.guard(None) if self._lease is not None else None

    def _agree_on_failure(self, failure: CheckpointError | None) -> CheckpointError | None:
        """Several ranks: every rank's failure (or None) to every rank (one
        all-gather on the checkpoint group); returns the lowest failing rank's failure
        (it names its rank) on every rank alike, so that all ranks take the same branch
        (raise, or try the next checkpoint) and none waits in a collective the others
        left. One rank: ``failure``."""
        if self._world_size() == 1:
            return failure
        gathered: list[CheckpointError | None] = [None] * self._world_size()
        dist.all_gather_object(gathered, failure, group=self._checkpoint_group())
        return next((f for f in gathered if f is not None), None)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this checkpointer is closed", path=self.folder)

    def _rank(self) -> int | None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    def _world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of its own for checkpoint collectives, with ``commit_timeout_s``
        as its timeout (a rank that never arrives fails the others instead of hanging
        them). Created once, at construction, by every rank alike."""
        if self._group is None:
            self._group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self.config.commit_timeout_s)
            )
        return self._group

    def _dist_context(self) -> DistContext:
        group = self._checkpoint_group()
        return DistContext(
            group=group,
            store=dist.distributed_c10d._get_default_store(),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            coordinator=0,
            commit_timeout_s=self.config.commit_timeout_s,
        )
