"""The manager's states to and from one step's checkpoint: collect the states, hand them
to the engine (or ``quicksave.save``) and record the outcome in the session; load a
committed step back into the states.

Call order (inside one due ``CheckpointManager.save()`` or ``export()``, every rank
alike): :meth:`StepIO.write_step` / :meth:`StepIO.write_export` → the session
notes the failure or the record → the manager settles (``CheckpointSession.settle``).
Inside ``CheckpointManager.load()``, every rank alike: :meth:`StepIO.load_step` (the
load's collectives run on the manager's ``process_group``).
A write never raises a ``CheckpointError`` of its own: it becomes that save's failure
in the session's ledger, so that every rank acts on it at the same settling call.

Kinds: ``"full"`` (every state; asynchronous in the async modes), ``"seed"`` (step 0:
the model states only) and ``"export"`` (the model states, floating tensors cast to the
export dtype); seed and export checkpoints are written synchronously after the saves
in flight have committed, so they never race with one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from quicksave import api
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    IncompatibleStateError,
)
from quicksave.loading.checkpoint import Checkpoint
from quicksave.manager.config import CheckpointConfig
from quicksave.manager.failures import Key
from quicksave.manager.folder import quarantine
from quicksave.manager.folder_checks import explain_load_mismatch
from quicksave.manager.records import SaveRecord
from quicksave.manager.session import CheckpointSession
from quicksave.manager.states import ModelState, PerRankLoad, PerRankState, payload_bytes
from quicksave.manager.streamed_load import OptimizerStream, load_streamed
from quicksave.saving.handle import SaveHandle
from quicksave.saving.model_record import cast_floating, model_record
from quicksave.trace import phase

logger = logging.getLogger("quicksave")


class StepIO:
    """Writes a step's checkpoint or export of ``states`` into ``session``'s folder,
    and loads a step's checkpoint into them.

    Args:
        config: the manager's config (thread count, export dtype, storage options).
        session: the folder's session (paths, writer, records, ledger).
        states: the manager's states by name (checked ``Stateful`` objects).
    """

    def __init__(
        self, config: CheckpointConfig, session: CheckpointSession, states: Mapping[str, Any]
    ) -> None:
        self.config = config
        self.session = session
        self.states = states
        self.pending: OptimizerStream | None = None  # a resume's optimizer states, streaming

    def _streamed_failed(self, path: str, error: BaseException) -> None:
        """The optimizers' states of ``path`` failed their checks after ``load()``
        returned: a writer moves the checkpoint aside (as a corrupt one found by the
        load itself), so that the next resume takes the newest whole one."""
        session = self.session
        if isinstance(error, CorruptCheckpointError) and session.lease is not None:
            quarantine(session.where(path), str(error), session.backend())

    def join_optimizer_load(self) -> None:
        """Wait for the optimizer states a resume streams in (``streamed_load.py``).

        Raises:
            CheckpointError: that load failed (raised once).
        """
        stream, self.pending = self.pending, None
        if stream is not None:
            stream.wait()

    def model_state_names(self) -> list[str]:
        """The states that hold the model: the ModelState ones, else one named "model"."""
        names = [k for k, v in self.states.items() if isinstance(v, ModelState)]
        return names or (["model"] if "model" in self.states else [])

    def model_states(self) -> dict[str, Any]:
        """The model states (seed and export checkpoints hold these only).

        Raises:
            IncompatibleStateError: no state is a ``ModelState`` or named ``"model"``.
        """
        models = {k: self.states[k] for k in self.model_state_names()}
        if not models:
            raise IncompatibleStateError(
                "seed (step 0) and export checkpoints hold the model only, but no state is a "
                "ModelState or named 'model'",
                path=self.session.folder,
                rank=self.session.rank(),
            )
        return models

    def collect(self, kind: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The state dict to write, taken now (the async modes stage it from here)."""
        if kind == "full":
            return {name: state.state_dict() for name, state in self.states.items()}
        models = {name: state.state_dict() for name, state in self.model_states().items()}
        if kind == "export":
            models = cast_floating(models, dtype or self.config.export_torch_dtype)
        return models

    def write_step(self, step: int, kind: str, begin: float) -> bool:
        """Write the ``kind`` (``"full"`` or ``"seed"``) checkpoint of ``step`` to
        ``step-<step>``; False if skipped (backpressure, or committed already) or if it
        failed (noted in the ledger). ``begin``: ``time.monotonic()`` when the
        ``save()`` call started."""
        path = self.session.step_path(step)
        return self._write_one((step, kind), path, lambda: self._save_one(step, path, kind, begin))

    def write_export(self, step: int, dtype: torch.dtype | None) -> bool:
        """Write the model export of ``step`` to ``export-step-<step>`` (``dtype``:
        default ``config.export_dtype``); False if it exists already or failed."""
        path = self.session.export_path(step)
        return self._write_one(
            (step, "export"),
            path,
            lambda: self._save_one(step, path, "export", time.monotonic(), dtype),
        )

    def _write_one(self, key: Key, path: str, write: Callable[[], bool]) -> bool:
        """Run one write of this call (``write()``: False if skipped). No store call
        here: the writer checks the target before it writes (a committed checkpoint
        there is a skip, logged; anything else in the way fails the save), and
        housekeeping (its own thread) leaves ``path`` alone while the save runs. A
        ``CheckpointError`` becomes that save's failure in the ledger, settled by the
        call's next settle alike on every rank, instead of leaving this rank alone."""
        session = self.session
        ledger = session.ledger
        ledger.attempting(key)
        if not session.claim(path):
            ledger.failed(
                key,
                CheckpointError(
                    "a failed earlier save's leftover at this path is being removed right "
                    "now; this save was not made (the next one is)",
                    path=path,
                    rank=session.rank(),
                ),
            )
            return False
        wrote = False
        t0 = time.monotonic()
        try:
            wrote = write()
            return wrote
        except CheckpointExistsError as e:
            if self.session.is_committed(path):
                step, kind = key
                logger.info(
                    "quicksave: %s; skipped",
                    f"export of step {step} already exists"
                    if kind == "export"
                    else f"step {step} already has a committed checkpoint at {path}",
                )
            else:
                self.session.write_failed(key, path, e, time.monotonic() - t0)
        except CheckpointError as e:
            self.session.write_failed(key, path, e, time.monotonic() - t0)
        finally:
            if not (wrote and session.writer is not None and key[1] == "full"):
                session.unclaim(path)  # (a save in flight is unclaimed when it ends)
        return False

    def _save_one(
        self, step: int, path: str, kind: str, begin: float, dtype: torch.dtype | None = None
    ) -> bool:
        """Collect and write one checkpoint; False if the engine skipped it (backpressure).
        ``begin``: ``time.monotonic()`` when the ``save()`` call started; ``dtype``: an
        export's dtype (default ``config.export_dtype``)."""
        session = self.session
        asynchronous = session.writer is not None and kind == "full"
        if not asynchronous:
            session.drain()  # a synchronous write never runs beside a save in flight
            # (it waits for the store anyway; an asynchronous save's writer does this)
            try:
                session.replace_uncommitted(path)
            except CheckpointError as e:  # the write's own check decides
                logger.warning("quicksave: could not check %s before writing it: %s", path, e)
        cpu0 = time.process_time()
        with phase("save.state_dict"):
            state_dict = self.collect(kind, dtype)
        nbytes = payload_bytes(state_dict)
        written = time.monotonic()
        handle = self._write(state_dict, path, step, kind, dtype)
        now = time.monotonic()
        if not asynchronous:
            record = SaveRecord.synchronous(
                step,
                kind,
                path,
                nbytes,
                begin,
                written,
                now,
                trainer_cpu_s=time.process_time() - cpu0,
                worker_cpu_s=0.0,
                bytes_copied=0,
                bytes_hashed=nbytes,
            )
            session.committed(record)  # committed by this call
            return True
        if handle is None:
            return False  # skipped by backpressure="skip" (the engine logged it)
        record = SaveRecord(
            step, kind, path, nbytes, now - begin, status="in_flight", mode=self.config.async_mode
        )
        session.track(record, handle, begin)
        logger.debug("quicksave: step %d handed to the writer in %.3f s", step, now - begin)
        return True

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
        # which states are the model, and its tied keys: for exports (saving/model_record.py)
        metadata.update(model_record(state_dict, self.model_state_names()))
        writer = self.session.writer
        if writer is not None and kind == "full":
            return writer.submit(state_dict, path, step, metadata)
        api.save(
            state_dict,
            path,
            step=step,
            process_group=self.session.process_group,
            thread_count=self.config.thread_count,
            user_metadata=metadata,
            storage=self.config.storage,
        )
        return None

    def load_step(self, step: int, checkpoint: Checkpoint, *, strict: bool = True) -> None:
        """Load ``checkpoint``, the committed checkpoint of ``step`` as the session
        classified it, into the states (step 0, the seed: the model states only;
        ``strict``: see ``CheckpointManager.load``), then tell the session
        (:meth:`CheckpointSession.loaded`)."""
        path = self.session.step_path(step)
        states = self.model_states() if step == 0 else self.states
        begin = time.perf_counter()
        if any(isinstance(v, PerRankState) for v in states.values()):
            # (each learns the checkpoint's entries from the metadata the load reads)
            states = {
                k: PerRankLoad(k, v) if isinstance(v, PerRankState) else v
                for k, v in states.items()
            }

        def load(part: Mapping[str, Any], leave: tuple[str, ...]) -> None:
            api.load(
                part,
                checkpoint,
                strict=strict,
                process_group=self.session.process_group,
                allow_dcp_pickle=self.config.allow_dcp_pickle,
                storage=self.config.storage,
                leave=leave,
            )

        # the optimizers' states stream in behind where the load has no collective
        stream = self.config.stream_load and self.session.world_size() == 1
        try:
            self.pending = load_streamed(
                states,
                load,
                checkpoint,
                stream=stream,
                on_done=lambda: self.session.loaded(step),
                on_error=lambda error: self._streamed_failed(path, error),
            )
        except IncompatibleStateError as e:  # another writer's checkpoint? say so
            pickle = self.config.allow_dcp_pickle
            if strict and (better := explain_load_mismatch(e, self.session, step, states, pickle)):
                raise better from e
            raise
        logger.log(
            self.session.info_level(),
            "quicksave: resumed from %s step %d in %.3f s",
            path,
            step,
            time.perf_counter() - begin,
        )
