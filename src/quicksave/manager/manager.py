"""``CheckpointManager``: when, where and what to save, how many to keep, how to resume.

Wiring only: the decisions come from policy objects (``policies.py``), the state from
``Stateful`` wrappers (``states.py``), the bytes go through ``quicksave.save`` /
``quicksave.load``, and visibility rules from ``commit.py``.

One ``save(step)`` goes through these states, in this order::

    decide (SavePolicy, then ranks agree) → collect (state_dict() of every state)
    → write (one hand-off to the engine: ``_write``; synchronous for now) → commit
    (inside the engine: rename of ``step-<N>.tmp-*`` to ``step-<N>``) → retain
    (RetentionPolicy over the committed steps; deletes on the coordinator only)

Layout of ``folder``::

    step-<N>/           full checkpoint of step N (N not zero-padded, like torchtitan)
    step-0/             seed checkpoint: the model only
    export-step-<N>/    model weights only, in ``export_dtype``, written at ``last_step``
    *.tmp-*/            being written, or left by a crash (deleted at start-up)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import api
from ..commit import CheckpointKind, classify, clean_stale_temporaries, new_token, temp_path_for
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompatibleStateError,
    NotCommittedError,
)
from ..reader import StorageReader
from .config import IMPLEMENTED_ASYNC_MODES, CheckpointConfig
from .policies import EveryNSeconds, EveryNSteps, KeepLatestK, RetentionPolicy, SavePolicy
from .states import (
    ModelState,
    PerRankLoad,
    PerRankState,
    cast_floating,
    check_states,
    payload_bytes,
)

logger = logging.getLogger("quicksave")

_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
_COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


@dataclass(frozen=True)
class SaveRecord:
    """What one checkpoint written by the manager cost.

    Attributes:
        step: the training step.
        kind: ``"full"``, ``"seed"`` (step 0, model only) or ``"export"``.
        path: the committed checkpoint directory.
        bytes: tensor payload of this rank (sum of its local tensors' sizes).
        blocking_s: wall seconds ``save()`` held the training loop for it.
    """

    step: int
    kind: str
    path: str
    bytes: int
    blocking_s: float


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

    Raises:
        CheckpointError: bad config, ``folder`` is a file or cannot be created, or an
            async mode that is not available yet.
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
        self.folder = os.path.abspath(config.folder)
        self.process_group = process_group
        self.states = check_states(states)
        if config.async_mode not in IMPLEMENTED_ASYNC_MODES:
            raise CheckpointError(
                f"async_mode {config.async_mode!r} is not available yet: asynchronous saving "
                "arrives with the async engine (next issue); use async_mode='disabled'",
                path=self.folder,
            )
        self._clock = clock
        self.save_policy: SavePolicy = save_policy or _default_save_policy(config)
        self.retention: RetentionPolicy = retention or KeepLatestK(config.keep_latest_k)
        self.metrics: list[SaveRecord] = []
        # Steps whose write has started but not committed; always empty while saves are
        # synchronous, filled by the async modes (retention never touches them).
        self._in_flight: set[int] = set()
        self._closed = False
        if not config.enabled:
            return
        if self._world_size() > 1 and isinstance(self.save_policy, EveryNSeconds):
            raise CheckpointError(
                "interval_type='seconds' with several ranks needs the ranks to agree on "
                "when to save, which comes in a later release; use interval_type='steps'",
                path=self.folder,
                rank=self._rank(),
            )
        self._prepare_folder()
        logger.info(
            "quicksave: checkpointing to %s (%s, %s)", self.folder, self.save_policy, self.retention
        )

    # ---------------------------------------------------------------- public API

    def step_path(self, step: int) -> str:
        """The directory of the checkpoint of ``step``: ``<folder>/step-<step>``."""
        return os.path.join(self.folder, f"step-{step}")

    def export_path(self, step: int) -> str:
        """The directory of the model export of ``step``: ``<folder>/export-step-<step>``."""
        return os.path.join(self.folder, f"export-step-{step}")

    def committed_steps(self) -> list[int]:
        """Steps with a committed checkpoint in ``folder`` (quicksave or stock DCP),
        ascending. Temporaries and directories without their commit are not listed."""
        if not os.path.isdir(self.folder):
            return []
        steps = []
        for name in os.listdir(self.folder):
            m = _STEP_DIR.fullmatch(name)
            if m and classify(os.path.join(self.folder, name)) in _COMMITTED:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def save(self, step: int, force: bool = False) -> bool:
        """Save a checkpoint of ``step`` if the save policy says so (or ``force``).

        Step 0 gives a seed checkpoint (the model only). At ``config.last_step`` the
        checkpoint is always written and the model is also exported (weights only, in
        ``export_dtype``) to ``export-step-<N>``. A step that already has a committed
        checkpoint (e.g. saved again after a resume) is skipped with a log message.
        Afterwards the retention policy deletes old committed checkpoints.

        Args:
            step: the training step just completed (an int >= 0).
            force: save even if the interval has not been reached.

        Returns:
            True if this call wrote a checkpoint (or an export) of ``step``.

        Raises:
            CheckpointError: invalid step, manager closed, or the write failed (nothing
                of this step became visible).

        Example::

            manager.save(train_state.step)
        """
        self._check_open()
        _check_step(step, self.folder)
        if not self.config.enabled:
            return False
        is_last = self.config.last_step is not None and step == self.config.last_step
        decision = self.save_policy.should_save(step, self._clock(), force or is_last)
        if not self._agree(decision):
            return False
        wrote = False
        path = self.step_path(step)
        if classify(path) in _COMMITTED:
            logger.info(
                "quicksave: step %d already has a committed checkpoint at %s; skipped", step, path
            )
        else:
            kind = "seed" if step == 0 else "full"
            self._save_one(step, path, kind)
            self.save_policy.saved(step, self._clock())
            wrote = True
        if is_last:
            if classify(self.export_path(step)) in _COMMITTED:
                logger.info("quicksave: export of step %d already exists; skipped", step)
            else:
                self._save_one(step, self.export_path(step), "export")
                wrote = True
        self._retain(protect={step})
        return wrote

    def load(self, step: int = -1) -> int | None:
        """Restore every state from the checkpoint of ``step`` (default: the newest
        committed one). A step-0 (seed) checkpoint restores the model only.

        Args:
            step: the step to load, or -1 for the newest committed checkpoint.

        Returns:
            The step restored, or None if ``step`` is -1 and there is no committed
            checkpoint (or the manager is disabled).

        Raises:
            CheckpointNotFoundError: ``step`` was given and has no checkpoint.
            NotCommittedError: ``step`` was given and its checkpoint was never committed.
            CheckpointError: the checkpoint does not fit the states or is corrupt
                (see :func:`quicksave.load`).

        Example::

            start = manager.load() or 0
        """
        self._check_open()
        if not self.config.enabled:
            return None
        if step == -1:
            latest = self.latest_step()
            if latest is None:
                logger.info("quicksave: no committed checkpoint in %s; starting fresh", self.folder)
                return None
            step = latest
        else:
            _check_step(step, self.folder)
            self._require_committed(step)
        path = self.step_path(step)
        states = self._model_states() if step == 0 else self.states
        begin = time.perf_counter()
        if any(isinstance(v, PerRankState) for v in states.values()):
            stored = _stored_metadata(path)
            states = {
                k: PerRankLoad(k, v, stored) if isinstance(v, PerRankState) else v
                for k, v in states.items()
            }
        api.load(states, path, process_group=self.process_group)
        logger.info(
            "quicksave: loaded step %d from %s in %.3f s", step, path, time.perf_counter() - begin
        )
        return step

    def close(self) -> None:
        """Finish: wait for outstanding work (none while saves are synchronous) and
        refuse further calls. Calling it again does nothing.

        Example::

            manager.close()
        """
        if self._closed:
            return
        self._closed = True
        logger.debug("quicksave: manager for %s closed", self.folder)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- save path

    def _save_one(self, step: int, path: str, kind: str) -> None:
        begin = time.perf_counter()
        state_dict = self._collect(kind)
        nbytes = payload_bytes(state_dict)
        self._replace_uncommitted(path)
        self._write(state_dict, path, step, kind)
        record = SaveRecord(step, kind, path, nbytes, time.perf_counter() - begin)
        self.metrics.append(record)
        logger.info(
            "quicksave: saved %s checkpoint of step %d (%d bytes) to %s in %.3f s",
            kind,
            step,
            nbytes,
            path,
            record.blocking_s,
        )

    def _collect(self, kind: str) -> dict[str, Any]:
        """The state dict to write, taken now (the async modes stage it from here)."""
        if kind == "full":
            return {name: state.state_dict() for name, state in self.states.items()}
        models = {name: state.state_dict() for name, state in self._model_states().items()}
        if kind == "export":
            dtype = self.config.export_torch_dtype
            models = {name: cast_floating(sd, dtype) for name, sd in models.items()}
        return models

    def _write(self, state_dict: dict[str, Any], path: str, step: int, kind: str) -> None:
        """The one hand-off to the engine: write ``state_dict`` to ``path`` and commit it.

        Synchronous: returns once the checkpoint is committed. Asynchronous modes
        replace this with a submit that returns after staging and adds ``step`` to
        ``_in_flight`` until its commit.
        """
        metadata: dict[str, Any] = {"checkpoint_kind": kind}
        if kind == "export":
            metadata["export_dtype"] = self.config.export_dtype
        api.save(
            state_dict,
            path,
            step=step,
            process_group=self.process_group,
            thread_count=self.config.thread_count,
            user_metadata=metadata,
        )

    # ---------------------------------------------------------------- retention

    def _retain(self, protect: set[int]) -> None:
        if not self._is_coordinator():
            return
        committed = self.committed_steps()
        if not committed:
            return
        keep = self._in_flight | protect | {committed[-1]}
        for step in self.retention.to_delete(committed, self._in_flight | protect):
            if step in keep or step not in committed:
                # A policy must never pick these; refuse rather than lose a checkpoint.
                logger.warning(
                    "quicksave: retention chose step %d, which must be kept; ignored", step
                )
                continue
            self._delete(self.step_path(step))

    def _delete(self, path: str) -> None:
        # Rename first, so that a checkpoint is never half-deleted while still looking
        # committed; a crash mid-delete leaves a temporary, removed at next start-up.
        doomed = temp_path_for(path, f"del{new_token()}")
        try:
            os.rename(path, doomed)
        except OSError as e:
            logger.warning("quicksave: could not delete old checkpoint %s: %s", path, e.strerror)
            return
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info("quicksave: deleted old checkpoint %s", path)

    def _replace_uncommitted(self, path: str) -> None:
        """A ``step-<N>`` directory with quicksave data but no manifest can never be
        loaded (a non-atomic copy, a damaged disk); it would block the commit rename."""
        if classify(path) is CheckpointKind.UNCOMMITTED and self._is_coordinator():
            logger.warning("quicksave: replacing uncommitted leftover %s", path)
            self._delete(path)

    # ---------------------------------------------------------------- helpers

    def _agree(self, decision: bool) -> bool:
        """Where all ranks will agree on a save decision (they must, or the save's
        collectives deadlock). Step-based policies decide alike on every rank; the
        multi-rank agreement for time-based ones comes in a later release."""
        return decision

    def _prepare_folder(self) -> None:
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise CheckpointError(
                "checkpoint folder is a file, not a directory; choose another folder",
                path=self.folder,
                rank=self._rank(),
            )
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint folder: {e.strerror}",
                path=self.folder,
                rank=self._rank(),
            ) from e
        if self._is_coordinator():
            # Safe only now: this job has not started a save, and one job owns a folder.
            for name in clean_stale_temporaries(self.folder):
                logger.info(
                    "quicksave: removed stale temporary %s", os.path.join(self.folder, name)
                )

    def _model_states(self) -> dict[str, Any]:
        models = {k: v for k, v in self.states.items() if isinstance(v, ModelState)}
        if not models and "model" in self.states:
            models = {"model": self.states["model"]}
        if not models:
            raise IncompatibleStateError(
                "seed (step 0) and export checkpoints hold the model only, but no state is a "
                "ModelState or named 'model'",
                path=self.folder,
                rank=self._rank(),
            )
        return models

    def _require_committed(self, step: int) -> None:
        path = self.step_path(step)
        kind = classify(path)
        if kind in _COMMITTED:
            return
        if kind is CheckpointKind.MISSING:
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step}; committed steps: {self.committed_steps()}",
                path=path,
                rank=self._rank(),
            )
        if kind is CheckpointKind.UNCOMMITTED:
            raise NotCommittedError(
                f"the checkpoint of step {step} was never committed (a save was interrupted); "
                "it cannot be loaded",
                path=path,
                rank=self._rank(),
            )
        raise CheckpointNotFoundError(
            f"not a checkpoint (no manifest.json) for step {step}", path=path, rank=self._rank()
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


def _default_save_policy(config: CheckpointConfig) -> SavePolicy:
    if config.interval_type == "seconds":
        return EveryNSeconds(config.interval)
    return EveryNSteps(int(config.interval))


def _stored_metadata(path: str) -> dict[str, Any]:
    """Names and storage metadata of what a committed checkpoint holds (from its
    manifest, or from DCP's .metadata for a stock DCP directory)."""
    if classify(path) is CheckpointKind.DCP:
        reader: Any = dcp.FileSystemReader(path)
    else:
        reader = StorageReader(path)
    return dict(reader.read_metadata().state_dict_metadata)


def _check_step(step: object, folder: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}", path=folder)
