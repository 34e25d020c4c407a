"""quicksave as a Lightning ``CheckpointIO``: ``Trainer(plugins=[QuicksaveCheckpointIO()])``.

Every checkpoint path Lightning names (``.../epoch=1-step=8.ckpt``, ``.../last.ckpt``)
becomes a quicksave checkpoint *directory* at that path, holding the whole checkpoint
dict Lightning builds (model ``state_dict``, ``optimizer_states``, ``lr_schedulers``,
``loops``, ``callbacks``, hyper-parameters, ...): tensors as raw bytes, everything else
as typed JSON, nothing pickled. Guide: docs/integrations/lightning.md.

Call order (Lightning's strategy drives it; the single-device and DDP strategies call
the first two on global rank 0 only, so nothing here makes a collective):

1. ``save_checkpoint(checkpoint, path)`` — from ``ModelCheckpoint`` or
   ``trainer.save_checkpoint``. A committed checkpoint already at ``path`` (``last.ckpt``,
   re-saved every epoch) is replaced atomically. With ``async_save=True`` it returns once
   the tensors are staged; the checkpoint is written and committed in the background,
   and meanwhile an empty directory holds its name, so that ``ModelCheckpoint``, which
   picks ``name-v1.ckpt`` when it sees ``name.ckpt`` taken, never saves twice to one
   path (the commit's rename replaces the placeholder; a failed save removes it).
2. ``remove_checkpoint(path)`` — top-k retention; waits for a save in flight to ``path``.
   A ``step-<N>`` checkpoint that another one of its folder refers to (incremental
   saves, FORMAT.md §9) is kept until none does (:meth:`QuicksaveCheckpointIO.
   remove_checkpoint`).
3. ``load_checkpoint(path)`` — every rank, when resuming (``fit(ckpt_path=...)``); waits
   for a save to ``path`` in flight in this process, whichever plugin started it
   (:mod:`._lightning_process`).
4. ``teardown()`` — end of ``fit``/``validate``/...: waits for every save in flight and
   raises the first that failed.

``LightningModule.load_from_checkpoint`` reads a file with ``torch.load``; for a quicksave
checkpoint use :func:`load_from_checkpoint` here (or :func:`read_checkpoint` for the dict).
OmegaConf ``DictConfig`` / ``ListConfig`` hyper-parameters come back as such
(:mod:`._lightning_configs`).

Works with the ``lightning`` package and with ``pytorch_lightning`` (the class derives
from the ``CheckpointIO`` of each one installed). Importing this module imports
Lightning; ``import quicksave`` does not.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import quicksave
from quicksave.commit import CheckpointKind, classify, open_strategy, strategy_class
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    IncompatibleStateError,
    rank_of_this_process,
)
from quicksave.integrations._lightning_configs import encode_configs, encode_order
from quicksave.integrations._lightning_process import PROCESS
from quicksave.integrations._lightning_read import load_from_checkpoint, read_checkpoint
from quicksave.loading.run_folder import committed_kinds
from quicksave.manager.references import BaseCache, referenced
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.storage import StorageOptions, parse_location

__all__ = ["QuicksaveCheckpointIO", "load_from_checkpoint", "read_checkpoint"]

logger = logging.getLogger("quicksave")
_STEP_NAME = re.compile(r"step-(\d+)")


def _checkpoint_io_bases() -> tuple[type, ...]:
    """Lightning's ``CheckpointIO`` ABC of each installed package (``lightning``,
    ``pytorch_lightning``'s ``lightning_fabric``): their Trainers check ``isinstance``
    against their own."""
    bases = []
    for module in (
        "lightning.fabric.plugins.io.checkpoint_io",
        "lightning_fabric.plugins.io.checkpoint_io",
    ):
        try:
            bases.append(importlib.import_module(module).CheckpointIO)
        except ImportError:
            continue
    if not bases:
        raise ImportError(
            "quicksave.integrations.lightning needs Lightning: pip install 'quicksave[lightning]' "
            "(or pytorch_lightning)"
        )
    return tuple(bases)


_HINTS = {
    "hyper_parameters": (
        "Lightning stores what save_hyperparameters() recorded: keep hyper-parameters to "
        "numbers, strings, bytes, tensors, lists, tuples and dicts (pass the others as "
        "strings, or leave them out with save_hyperparameters(ignore=[...]))"
    ),
    "hparams_type": (
        "Lightning records the hyper-parameters' container type as a class; quicksave "
        "stores OmegaConf's DictConfig and ListConfig by name, and no other class "
        "(that would need pickle): save_hyperparameters() with a dict or an OmegaConf "
        "config"
    ),
    "callbacks": (
        "a callback's state_dict() returned it: make the callback's state numbers, "
        "strings, tensors, lists and dicts"
    ),
}
_DEFAULT_HINT = (
    "every value in a Lightning checkpoint must be a tensor or a number, string, bytes, "
    "list, tuple, set or dict of those (quicksave never pickles): convert it in the "
    "state_dict() / on_save_checkpoint() that puts it there"
)


def _explained(e: IncompatibleStateError, path: str) -> IncompatibleStateError:
    """``e`` with what to do about it in a Lightning checkpoint, and the path."""
    top = (e.fqn or "").split(".", 1)[0]
    hint = _HINTS.get(top, _DEFAULT_HINT)
    return IncompatibleStateError(
        f"{e.message}; {hint}", path=e.path or path, fqn=e.fqn, rank=e.rank
    )


def _step_of(checkpoint: Mapping[str, Any]) -> int | None:
    step = checkpoint.get("global_step")
    return step if type(step) is int and step >= 0 else None


class QuicksaveCheckpointIO(*_checkpoint_io_bases()):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that writes quicksave checkpoints.

    Args:
        async_save: return from ``save_checkpoint`` once the tensors are staged (copied
            into the saver's staging pool); a worker writes and commits the checkpoint in
            the background. ``teardown()`` waits for every save and raises the first
            failure; a failure also surfaces at the next ``save_checkpoint``. A re-save,
            load or removal of a path first waits for the save in flight to it.
        engine: the async engine's configuration (``async_save`` only). Default:
            a worker process, two saves in flight (``ModelCheckpoint`` saves a top-k
            checkpoint and ``last.ckpt`` back to back), blocking staging. With
            ``engine.incremental`` on, only checkpoints named ``step-<N>`` refer to
            earlier ones (``ModelCheckpoint(filename="step-{step}",
            auto_insert_metric_name=False)`` and ``FILE_EXTENSION = ""``); others are
            saved full (logged once).
        thread_count: data files (and writer threads) per checkpoint (synchronous saves).
        storage: how to reach an object store (``s3://``, ``msc://`` paths).

    Raises (from its methods): ``quicksave.CheckpointError`` subclasses naming the path,
    the key (fqn) and the rank.

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import ModelCheckpoint
        from quicksave.integrations.lightning import QuicksaveCheckpointIO

        trainer = Trainer(
            plugins=[QuicksaveCheckpointIO(async_save=True)],
            callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)],
        )
        trainer.fit(model, ckpt_path="last")
    """

    def __init__(
        self,
        *,
        async_save: bool = False,
        engine: EngineConfig | None = None,
        thread_count: int = 2,
        storage: StorageOptions | None = None,
    ) -> None:
        super().__init__()
        self.async_save = async_save
        self.engine = engine if engine is not None else EngineConfig(max_in_flight=2)
        if self.engine.incremental.enabled and not async_save:
            raise CheckpointError(
                "QuicksaveCheckpointIO: engine.incremental is the async engine's; "
                "synchronous saves write every byte: use async_save=True"
            )
        self.thread_count = thread_count
        self.storage = storage
        # built on the first async save (rank 0), by engine mode: a location in this
        # process's memory (memory://) is written by a thread of it, not a worker process
        self._savers: dict[str, AsyncSaver] = {}
        self._bases = BaseCache()  # what each step-<N> checkpoint refers to, as read
        self._kept: set[str] = set()  # removals put off: another checkpoint refers to it
        self._named_full = False  # logged once: a name that cannot be a base
        # The saves in flight (async, and sync ones running in another thread, as
        # Lightning's AsyncCheckpointIO makes them) are the process's: PROCESS.saves.

    # Configuration only travels (e.g. to the processes of strategy="ddp_spawn"): the
    # saver and the saves in flight belong to this process.
    def __getstate__(self) -> dict[str, Any]:
        return {
            "async_save": self.async_save,
            "engine": self.engine,
            "thread_count": self.thread_count,
            "storage": self.storage,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    # ---------------------------------------------------------------- CheckpointIO
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Save ``checkpoint`` as a quicksave checkpoint directory at ``path``,
        replacing a committed checkpoint there atomically (local paths).

        Args:
            checkpoint: the dict Lightning built.
            path: the checkpoint's path (a directory is created there).
            storage_options: None, or a ``quicksave.storage.StorageOptions`` for this save.

        Raises:
            IncompatibleStateError: a value cannot be stored without pickle (naming its
                key and the path), before any I/O; nothing is written.
            CheckpointExistsError: something that is not a quicksave checkpoint is at
                ``path`` (e.g. a ``torch.save`` file), or a checkpoint is already at an
                object-store ``path`` (no atomic replace there).
            CheckpointError: the save (or, in async mode, an earlier one) failed.
        """
        storage = self._storage(storage_options)
        loc = parse_location(path, options=storage)
        target = loc.url
        if not isinstance(checkpoint, Mapping):
            raise IncompatibleStateError(
                f"a Lightning checkpoint is a dict, got {type(checkpoint).__name__}",
                path=target,
                rank=rank_of_this_process(),
            )
        checkpoint = encode_order(encode_configs(checkpoint))
        self._settle(target)
        self._kept.discard(target)  # saved again: Lightning's again, not a removal put off
        try:
            if self.async_save:
                self._save_async(checkpoint, loc, target)
            else:
                self._save_sync(checkpoint, loc, target, storage)
        except IncompatibleStateError as e:
            raise _explained(e, target) from None
        except CheckpointExistsError as e:
            if not strategy_class(loc).atomic_replace and e.path == target:
                e.message += (
                    "; an object store has no atomic replace, and ModelCheckpoint("
                    "save_last=True) saves last.ckpt again every epoch: checkpoint to a "
                    "local directory (and copy it with 'quicksave convert'), or "
                    "save_last=False"
                )
                e.args = (e.message,)
            raise

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Read the whole checkpoint at ``path`` back into the dict that was saved.

        Tensors come back on the CPU unless ``map_location`` (a device, a device string,
        a ``{saved location: new location}`` dict or ``torch.load``'s callable) says
        otherwise; dict keys with their saved types (the optimizers' int parameter ids
        stay ints). ``weights_only`` is accepted and ignored: nothing is unpickled, which
        is as safe as ``torch.load(weights_only=True)``.

        Raises:
            CheckpointNotFoundError: nothing is at ``path`` (also a ``FileNotFoundError``).
            CheckpointError: ``path`` is not a quicksave checkpoint (e.g. a file written
                by Lightning's TorchCheckpointIO), or it is corrupt, or its save (in
                flight in this process) failed.
        """
        target = parse_location(path, options=self.storage).url
        self._settle(target)
        # (the path as given: a missing one is named as the user wrote it)
        return read_checkpoint(path, map_location, storage=self.storage)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the quicksave checkpoint at ``path`` (after any save in flight to it).

        A ``step-<N>`` checkpoint that another committed checkpoint of its folder
        refers to (FORMAT.md §9, closed over references as the manager's retention:
        :mod:`quicksave.manager.references`), or, with incremental saves, the newest one
        while a save to its folder is in flight (its manifest is not written yet), is kept
        (logged) and removed by a later call, or ``teardown()``, once nothing refers to
        it any more, newest first.
        A symbolic link (``ModelCheckpoint(save_last="link")``) is unlinked, its target
        kept; an empty directory (the placeholder of an async save that never
        committed) is removed. Nothing at ``path`` is not an error. Locally the
        directory is first renamed to a temporary name, so it is never half-deleted
        under its own name.

        Raises:
            CheckpointError: ``path`` holds something that is not a quicksave checkpoint
                (nothing is deleted), or it could not be removed.
        """
        loc = parse_location(path, options=self.storage)
        target = loc.url
        self._settle(target)
        if self._referred_to(loc):
            self._kept.add(target)
            logger.info("quicksave: kept %s: a checkpoint beside it refers to it", target)
            return
        self._kept.discard(target)
        self._remove(loc)
        self._sweep()

    def _sweep(self) -> None:
        """Remove the checkpoints put off that nothing refers to any more, newest first
        (one may refer to an older one)."""
        for url in sorted(self._kept, key=_step_key, reverse=True):
            put_off = parse_location(url, options=self.storage)
            if not self._referred_to(put_off):
                self._kept.discard(url)
                self._remove(put_off)

    def _referred_to(self, loc: Any) -> bool:
        """Whether ``loc``, a committed ``step-<N>`` checkpoint, is one that another
        committed checkpoint of its folder refers to (directly or through others), or
        the newest one while a save of this plugin to that folder is in flight (an
        incremental save refers only to the newest step committed, and to what that
        one refers to: FORMAT.md §9)."""
        name = _STEP_NAME.fullmatch(loc.name)
        if name is None:
            return False
        step, folder = int(name.group(1)), loc.parent()
        kinds = committed_kinds(folder)
        if step not in kinds:
            return False
        if (
            step == max(kinds)
            and self.engine.incremental.enabled
            and any(
                not handle.done() and parse_location(other, options=self.storage).parent() == folder
                for other, handle in PROCESS.saves.owned(self)
            )
        ):
            return True  # the newest step: the base of a save in flight (or its holders')
        return step in referenced(folder, kinds, set(kinds) - {step}, None, self._bases)

    def _remove(self, loc: Any) -> None:
        target = loc.url
        rank = rank_of_this_process()
        with open_strategy(loc) as s:
            if s.unlink(loc) or s.release(loc):  # a link alone (save_last="link"), or
                return  # the empty placeholder of an async save that failed or died
            kind = s.classify(loc)
            if kind is CheckpointKind.MISSING:
                return
            if kind is not CheckpointKind.QUICKSAVE:
                raise CheckpointError(
                    f"refusing to delete: this is not a quicksave checkpoint ({kind.value}); "
                    "remove it yourself if it should go",
                    path=target,
                    rank=rank,
                )
            if not s.remove(loc) or s.classify(loc) is CheckpointKind.QUICKSAVE:
                raise CheckpointError("could not remove the checkpoint", path=target, rank=rank)

    def teardown(self) -> None:
        """Wait for every save in flight, stop the async worker, and raise the first
        failure (naming the others)."""
        errors: list[BaseException] = []
        for target, _ in PROCESS.saves.owned(self):
            try:
                self._settle(target)
            except CheckpointError as e:
                errors.append(e)
        try:  # every save has ended: the removals put off that nothing needs now
            self._sweep()
        except CheckpointError as e:
            errors.append(e)
        savers, self._savers = self._savers, {}
        for saver in savers.values():
            try:
                saver.close()
            except CheckpointError as e:
                errors.append(e)
        _raise_first(errors)

    # ---------------------------------------------------------------- internals
    def _storage(self, storage_options: Any | None) -> StorageOptions | None:
        if storage_options is None:
            return self.storage
        if isinstance(storage_options, StorageOptions):
            return storage_options
        raise TypeError(
            "QuicksaveCheckpointIO.save_checkpoint(storage_options=...) takes a "
            f"quicksave.storage.StorageOptions or None, got {type(storage_options).__name__}"
        )

    def _save_sync(
        self,
        checkpoint: Mapping[str, Any],
        loc: Any,
        target: str,
        storage: StorageOptions | None,
    ) -> None:
        with PROCESS.saves.running(target):
            quicksave.save(
                checkpoint,
                loc,
                step=_step_of(checkpoint),
                thread_count=self.thread_count,
                storage=storage,
                overwrite=strategy_class(loc).atomic_replace,  # refused where there is none
                no_dist=True,  # Lightning saves from rank 0 alone
            )

    def _save_async(self, checkpoint: Mapping[str, Any], loc: Any, target: str) -> None:
        self._raise_finished()
        engine = self.engine
        if loc.process_local and engine.mode == "process":
            engine = dataclasses.replace(engine, mode="thread")
        saver = self._savers.get(engine.mode)
        if saver is None:
            saver = self._savers[engine.mode] = AsyncSaver(engine, rank=rank_of_this_process() or 0)
        strategy = strategy_class(loc)
        step = _step_of(checkpoint)
        if engine.incremental.enabled and loc.name != f"step-{step}" and not self._named_full:
            self._named_full = True
            logger.warning(
                "quicksave: %s is saved full: incremental saves refer only to checkpoints "
                "named step-<N> (ModelCheckpoint(filename='step-{step}', "
                "auto_insert_metric_name=False), FILE_EXTENSION = ''); logged once",
                target,
            )
        overwrite = strategy.atomic_replace
        if overwrite and engine.incremental.enabled:  # (an overwrite is a full save)
            overwrite = classify(loc) is not CheckpointKind.MISSING
        handle = saver.save(checkpoint, loc, step=step, overwrite=overwrite)
        if handle is None:  # skipped by EngineConfig(backpressure="skip")
            return
        PROCESS.saves.add(self, target, handle)
        # Until the commit, the name looks taken to ModelCheckpoint's fs.exists check
        # (else it would save the next checkpoint of that name to the same path, and
        # the second save would replace the first).
        strategy.reserve(loc)

    def _settle(self, target: str) -> None:
        """Wait until no save to ``target`` is in flight (in this process); raise its
        failure, after removing the placeholder of a failed async save."""
        try:
            PROCESS.saves.settle(self, target)
        except CheckpointError:
            loc = parse_location(target, options=self.storage)
            strategy_class(loc).release(loc)
            raise

    def _raise_finished(self) -> None:
        """Forget finished async saves; raise the first that failed."""
        errors = []
        for target, handle in PROCESS.saves.owned(self):
            if handle.done():
                try:
                    self._settle(target)
                except CheckpointError as e:
                    errors.append(e)
        _raise_first(errors)


def _step_key(url: str) -> int:
    name = _STEP_NAME.fullmatch(url.rstrip("/").rsplit("/", 1)[-1])
    return -1 if name is None else int(name.group(1))


def _raise_first(errors: list[BaseException]) -> None:
    if not errors:
        return
    first = errors[0]
    if len(errors) > 1 and isinstance(first, CheckpointError):
        first.message += " (also failed: " + "; ".join(str(e) for e in errors[1:]) + ")"
        first.args = (first.message,)
    raise first
