"""What the rewritten copies of Lightning's tests call to read a checkpoint.

``run_lightning_tests.py`` rewrites, in the quicksave modes only, ``torch.load(...)``,
``pl_load(...)`` (Lightning's ``cloud_io._load``) and ``Cls.load_from_checkpoint(...)`` in
the copied test files into calls of :func:`torch_load` and :func:`load_from_checkpoint`
here. Each reads a path that is not a regular file (a quicksave checkpoint is a directory)
the documented way, with ``quicksave.integrations.lightning``'s ``read_checkpoint`` and
``load_from_checkpoint``; a regular file (one the test wrote with ``torch.save`` itself)
goes to the original call unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from quicksave.commit import CheckpointKind, classify
from quicksave.integrations import lightning as qs_lightning

_torch_load = torch.load


def _is_file(f: Any) -> bool:
    if not isinstance(f, (str, os.PathLike)):
        return True  # a file object or a buffer: torch's
    path = os.fspath(f)
    return "://" not in path and os.path.isfile(path)


def isfile(path: Any) -> bool:
    """``os.path.isfile(path)``, or a committed quicksave checkpoint is at ``path`` (the
    checkpoint Lightning names ``path`` is a directory with quicksave)."""
    return os.path.isfile(path) or classify(os.fspath(path)) is CheckpointKind.QUICKSAVE


def torch_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.load(f, ...)`` for a file; quicksave's reader for a checkpoint directory
    (``weights_only`` and the other ``torch.load`` options do not apply: nothing is
    unpickled)."""
    if _is_file(f):
        return _torch_load(f, map_location, *args, **kwargs)
    return qs_lightning.read_checkpoint(f, map_location)


def load_from_checkpoint(
    cls: Any,
    checkpoint_path: Any,
    map_location: Any = None,
    hparams_file: Any = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(...)`` (Lightning's signature) for a quicksave checkpoint
    through ``quicksave.integrations.lightning.load_from_checkpoint``. ``weights_only`` has
    no meaning there (nothing is unpickled)."""
    if _is_file(checkpoint_path):
        return cls.load_from_checkpoint(
            checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs
        )
    return qs_lightning.load_from_checkpoint(
        cls, checkpoint_path, map_location, hparams_file=hparams_file, strict=strict, **kwargs
    )
