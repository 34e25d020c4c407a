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
   the tensors are staged; the checkpoint is written and committed in the background.
2. ``remove_checkpoint(path)`` — top-k retention; waits for a save in flight to ``path``.
3. ``load_checkpoint(path)`` — every rank, when resuming (``fit(ckpt_path=...)``).
4. ``teardown()`` — end of ``fit``/``validate``/...: waits for every save in flight and
   raises the first that failed.

``LightningModule.load_from_checkpoint`` reads a file with ``torch.load``; for a quicksave
checkpoint use :func:`load_from_checkpoint` here.

Works with the ``lightning`` package and with ``pytorch_lightning`` (the class derives
from the ``CheckpointIO`` of each one installed). Importing this module imports
Lightning; ``import quicksave`` does not.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

import quicksave
from quicksave.commit import CheckpointKind, open_strategy, strategy_class
from quicksave.errors import (
    CheckpointError,
    CheckpointExistsError,
    IncompatibleStateError,
    rank_of_this_process,
)
from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.saving.handle import SaveHandle
from quicksave.storage import Location, StorageOptions, parse_location


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
        "Lightning records the hyper-parameters' container type (an OmegaConf config) "
        "as a class, which cannot be stored without pickle: save_hyperparameters() with "
        "a plain dict (e.g. OmegaConf.to_container(cfg))"
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
            checkpoint and ``last.ckpt`` back to back), blocking staging.
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
        self.thread_count = thread_count
        self.storage = storage
        self._saver: AsyncSaver | None = None  # built on the first async save (rank 0)
        self._in_flight: dict[str, SaveHandle] = {}  # async: final path -> its save
        # Synchronous saves running in some thread (Lightning's AsyncCheckpointIO calls
        # save_checkpoint from its own), per path: load/remove of that path waits.
        self._running: Counter[str] = Counter()
        self._cond = threading.Condition()

    # Configuration only travels (e.g. to the processes of strategy="ddp_spawn"): the
    # lock, the saver and the saves in flight belong to this process.
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
        self._settle(target)
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
            CheckpointNotFoundError: nothing is at ``path``.
            CheckpointError: ``path`` is not a quicksave checkpoint (e.g. a file written
                by Lightning's TorchCheckpointIO), or it is corrupt.
        """
        target = parse_location(path, options=self.storage).url
        self._settle(target)
        return read_checkpoint(target, map_location, storage=self.storage)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the quicksave checkpoint at ``path`` (after any save in flight to it).

        A symbolic link (``ModelCheckpoint(save_last="link")``) is unlinked, its target
        kept. Nothing at ``path`` is not an error. Locally the directory is first renamed
        to a temporary name, so it is never half-deleted under its own name.

        Raises:
            CheckpointError: ``path`` holds something that is not a quicksave checkpoint
                (nothing is deleted), or it could not be removed.
        """
        loc = parse_location(path, options=self.storage)
        target = loc.url
        self._settle(target)
        rank = rank_of_this_process()
        with open_strategy(loc) as s:
            if s.unlink(loc):  # ModelCheckpoint(save_last="link"): the link alone
                return
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
        for target in list(self._in_flight):
            try:
                self._settle(target)
            except CheckpointError as e:
                errors.append(e)
        saver, self._saver = self._saver, None
        if saver is not None:
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
        with self._cond:
            self._running[target] += 1
        try:
            quicksave.save(
                checkpoint,
                loc,
                step=_step_of(checkpoint),
                thread_count=self.thread_count,
                storage=storage,
                overwrite=strategy_class(loc).atomic_replace,  # refused where there is none
                no_dist=True,  # Lightning saves from rank 0 alone
            )
        finally:
            with self._cond:
                self._running -= Counter({target: 1})  # drops the path at zero
                self._cond.notify_all()

    def _save_async(self, checkpoint: Mapping[str, Any], loc: Any, target: str) -> None:
        self._raise_finished()
        if self._saver is None:
            self._saver = AsyncSaver(self.engine, rank=rank_of_this_process() or 0)
        handle = self._saver.save(
            checkpoint, loc, step=_step_of(checkpoint), overwrite=strategy_class(loc).atomic_replace
        )
        if handle is not None:  # None: skipped by EngineConfig(backpressure="skip")
            self._in_flight[target] = handle

    def _settle(self, target: str) -> None:
        """Wait until no save to ``target`` is in flight; raise its failure."""
        with self._cond:
            self._cond.wait_for(lambda: target not in self._running)
        handle = self._in_flight.pop(target, None)
        if handle is not None:
            handle.wait()

    def _raise_finished(self) -> None:
        """Forget finished async saves; raise the first that failed."""
        errors = []
        for target, handle in list(self._in_flight.items()):
            if handle.done():
                del self._in_flight[target]
                try:
                    handle.wait()
                except CheckpointError as e:
                    errors.append(e)
        _raise_first(errors)


def _raise_first(errors: list[BaseException]) -> None:
    if not errors:
        return
    first = errors[0]
    if len(errors) > 1 and isinstance(first, CheckpointError):
        first.message += " (also failed: " + "; ".join(str(e) for e in errors[1:]) + ")"
        first.args = (first.message,)
    raise first


# ---------------------------------------------------------------------- reading


def read_checkpoint(
    path: str | os.PathLike[str],
    map_location: Any | None = None,
    *,
    storage: StorageOptions | None = None,
) -> dict[str, Any]:
    """The Lightning checkpoint dict stored at ``path`` (what
    :meth:`QuicksaveCheckpointIO.load_checkpoint` returns).

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, CheckpointError: as
            ``quicksave.load_state``; a plain file gets a hint about TorchCheckpointIO.
    """
    loc = parse_location(path, options=storage)
    try:
        state = quicksave.load_state(loc, storage=storage)
    except CheckpointError as e:
        if _is_one_file(loc):
            e.message += (
                "; a Lightning checkpoint *file* was written by another CheckpointIO "
                "(TorchCheckpointIO: torch.save); load it with that one"
            )
            e.args = (e.message,)
        raise
    return _relocate(state, map_location)


def _is_one_file(loc: Location) -> bool:
    """Whether a single file (an object) is at ``loc``, not a checkpoint's folder."""
    try:
        backend = loc.open()
    except CheckpointError:
        return False
    try:
        return backend.stat(loc.key) is not None
    except CheckpointError:
        return False
    finally:
        backend.close()


def _relocate(value: Any, map_location: Any | None) -> Any:
    """Move every tensor in ``value`` as ``torch.load(map_location=...)`` would; the
    tensors were read onto the CPU, so ``"cpu"`` is their saved location."""
    if map_location is None:
        return value
    move = _mover(map_location)

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return move(v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(walk(x) for x in v)
        return v

    return walk(value)


def _mover(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    if isinstance(map_location, Mapping):
        to = map_location.get("cpu")
        if to is None:
            return lambda t: t
        device = torch.device(to)
        return lambda t: t.to(device)
    if callable(map_location):

        def call(t: torch.Tensor) -> torch.Tensor:
            out = map_location(t.untyped_storage(), "cpu")
            if out is None or getattr(out, "device", t.device) == t.device:
                return t
            return t.to(out.device)

        return call
    raise TypeError(
        "map_location must be None, a torch.device, a device string, a dict or a "
        f"callable (as for torch.load), got {type(map_location).__name__}"
    )


# ---------------------------------------------------------------- load_from_checkpoint


def _lightning_of(cls: type) -> tuple[Any, Any]:
    """The Lightning package ``cls`` belongs to (``lightning.pytorch`` or
    ``pytorch_lightning``) and its ``core.saving`` module."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        pl = sys.modules.get(package)
        if pl is None:
            continue
        if isinstance(cls, type) and issubclass(cls, (pl.LightningModule, pl.LightningDataModule)):
            return pl, importlib.import_module(f"{package}.core.saving")
    raise TypeError(
        f"load_from_checkpoint takes a LightningModule or LightningDataModule class, got {cls!r}"
    )


def load_from_checkpoint(
    cls: type,
    path: str | os.PathLike[str],
    map_location: Any | None = None,
    *,
    strict: bool | None = None,
    storage: StorageOptions | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a quicksave checkpoint.

    Builds the module as ``LightningModule.load_from_checkpoint`` does, through
    Lightning's own steps: the stored hyper-parameters (overridden by ``kwargs``) go to
    ``cls.__init__``, then ``configure_model()`` if overridden, ``on_load_checkpoint``,
    and the state dict is loaded (``strict``: default the module's ``strict_loading``);
    the module ends on the device of the stored tensors (after ``map_location``). A
    ``LightningDataModule`` class gets its hyper-parameters and ``load_state_dict``.

    Args:
        cls: the LightningModule (or LightningDataModule) class.
        path: a checkpoint written by :class:`QuicksaveCheckpointIO`.
        map_location: where the tensors go, as for ``torch.load`` (default: the CPU).
        strict: see ``LightningModule.load_from_checkpoint``.
        storage: how to reach an object store.
        **kwargs: hyper-parameters overriding the stored ones.

    Returns:
        The module, in train mode as Lightning leaves it (call ``.eval()`` to evaluate).

    Example::

        from quicksave.integrations.lightning import load_from_checkpoint
        model = load_from_checkpoint(MyModel, "ckpt/epoch=3-step=40.ckpt")
    """
    pl, saving = _lightning_of(cls)
    checkpoint = read_checkpoint(path, map_location, storage=storage)
    migrate = getattr(saving, "_pl_migrate_checkpoint", None)
    if migrate is not None:  # a checkpoint of an older Lightning: Lightning's migrations
        checkpoint = migrate(checkpoint, checkpoint_path=os.fspath(path))
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = (t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor))
    first = next(tensors, None)
    return model if first is None else model.to(first.device)
