"""Reading a Lightning checkpoint written by
:class:`~quicksave.integrations.lightning.QuicksaveCheckpointIO` back into the dict
Lightning saved (:func:`read_checkpoint`), and building a module from it
(:func:`load_from_checkpoint`); both are re-exported by
:mod:`quicksave.integrations.lightning`.

A path with a save still in flight in this process, by any ``QuicksaveCheckpointIO``,
is read once that save is done (:mod:`._lightning_process`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

import quicksave
from quicksave.errors import CheckpointError, CheckpointNotFoundError
from quicksave.integrations._lightning_configs import decode_configs, decode_order
from quicksave.integrations._lightning_process import PROCESS
from quicksave.storage import Location, StorageOptions, parse_location


def read_checkpoint(
    path: str | os.PathLike[str],
    map_location: Any | None = None,
    *,
    storage: StorageOptions | None = None,
) -> dict[str, Any]:
    """The Lightning checkpoint dict stored at ``path`` (what
    :meth:`QuicksaveCheckpointIO.load_checkpoint` returns), OmegaConf configs
    included. Waits first for a save to ``path`` in flight in this process.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, CheckpointError: as
            ``quicksave.load_state``; a plain file gets a hint about TorchCheckpointIO.
        CheckpointError: a save to ``path`` in flight in this process failed.
    """
    loc = parse_location(path, options=storage)
    PROCESS.saves.settle(None, loc.url)
    try:
        try:
            state = quicksave.load_state(loc, storage=storage)
        except CheckpointNotFoundError:
            # Not there (yet?): a save in flight in this process may be it under another
            # name (the same folder served over http://, a symlink): wait, look again.
            if not PROCESS.saves.wait_all():
                raise
            state = quicksave.load_state(loc, storage=storage)
    except CheckpointNotFoundError as e:
        # worded as Lightning's own (its users and tests match it), then quicksave's why
        raise CheckpointNotFoundError(
            f"Checkpoint file not found: {os.fspath(path)} ({e.message})",
            path=e.path,
            fqn=e.fqn,
            rank=e.rank,
        ) from e
    except CheckpointError as e:
        if _is_one_file(loc):
            e.message += (
                "; a Lightning checkpoint *file* was written by another CheckpointIO "
                "(TorchCheckpointIO: torch.save); load it with that one"
            )
            e.args = (e.message,)
        raise
    state = decode_configs(decode_order(state, loc.url), loc.url)
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
    hparams_file: str | os.PathLike[str] | None = None,
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
        hparams_file: a ``.yaml``/``.yml`` or ``.csv`` file of hyper-parameters that
            replace the stored ones (as ``LightningModule.load_from_checkpoint``: read
            with Lightning's own readers).
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
    if hparams_file is not None:
        checkpoint[key] = _hparams_from_file(saving, hparams_file)
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    tensors = (t for t in checkpoint.get("state_dict", {}).values() if isinstance(t, torch.Tensor))
    first = next(tensors, None)
    return model if first is None else model.to(first.device)


def _hparams_from_file(saving: Any, hparams_file: str | os.PathLike[str]) -> dict[str, Any]:
    """The hyper-parameters of ``hparams_file``, read by Lightning's own readers."""
    name = os.fspath(hparams_file)
    extension = name.rsplit(".", 1)[-1].lower()
    if extension == "csv":
        return saving.load_hparams_from_tags_csv(name)
    if extension in ("yml", "yaml"):
        return saving.load_hparams_from_yaml(name)
    raise CheckpointError(
        f"hparams_file must be a .csv, .yml or .yaml file, got {name!r}", path=name
    )
