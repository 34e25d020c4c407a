"""``quicksave.async_save``: one asynchronous save in the quicksave format."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from quicksave.saving.config import EngineConfig
from quicksave.saving.engine import AsyncSaver
from quicksave.saving.handle import SaveHandle
from quicksave.storage import StorageOptions, parse_location

logger = logging.getLogger("quicksave")


def async_save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int | None = None,
    saver: AsyncSaver | None = None,
    user_metadata: dict[str, Any] | None = None,
    config: EngineConfig | None = None,
    storage: StorageOptions | None = None,
) -> SaveHandle | None:
    """Save ``state_dict`` to the checkpoint directory ``path`` in the background.

    Returns once the tensors are staged (copied into the saver's staging pool: training may
    mutate them right away); the worker then writes, checksums, fsyncs and commits the
    checkpoint, which becomes visible only when complete.

    Without ``saver``, a one-shot :class:`AsyncSaver` is built for this save and closed
    (its worker stopped, its pool freed) once the save completes. That costs, per call, a
    worker start-up (a fresh interpreter importing torch: seconds of CPU, in the
    background) and a fresh staging pool (every page faulted in, paid before this
    returns). For repeated saves, hold an ``AsyncSaver`` and pass it: its
    worker and pool are reused, and a save costs about one memcpy of the state.

    Args:
        state_dict: names to tensors, ``Stateful`` objects, nested dicts/lists, values
            (one rank's plain tensors: use ``quicksave.save`` for DTensor/ShardedTensor).
        path: the checkpoint directory to create; it must not hold a committed one.
        step: recorded in the manifest.
        saver: the AsyncSaver to use (and keep open); default: a one-shot saver.
        user_metadata: JSON-serializable dict stored in the manifest.
        config: configuration of the one-shot saver (ignored with ``saver``).
        storage: how to reach an object store (``s3://``, ``msc://`` paths); overrides
            the saver's ``EngineConfig.storage``.

    Returns:
        A SaveHandle (``done()``, ``wait(timeout)`` → SaveResult, or raises the save's
        CheckpointError), or None if ``saver`` skipped the save (``backpressure="skip"``).

    Raises:
        CheckpointError: bad input (checked before any I/O), an existing committed
            checkpoint at ``path``, or an earlier failed save of ``saver``.

    Example::

        saver = AsyncSaver()
        handle = quicksave.async_save(model.state_dict(), "ckpt/step-100", step=100, saver=saver)
        ...  # training goes on
        handle.wait()
    """
    checked = parse_location(path, options=storage)  # a bad location: before a worker starts
    if storage is not None:
        path = checked
    if saver is not None:
        return saver.save(state_dict, path, step=step, user_metadata=user_metadata)
    one_shot = AsyncSaver(config)
    try:
        handle = one_shot.save(state_dict, path, step=step, user_metadata=user_metadata)
    except BaseException:
        one_shot.close(abort=True)
        raise
    if handle is None:  # cannot happen with an idle saver; keep the contract anyway
        one_shot.close()
        return None
    threading.Thread(
        target=_close_when_done,
        args=(one_shot, handle),
        name="quicksave-async-save",
        daemon=True,
    ).start()
    return handle


def _close_when_done(saver: AsyncSaver, handle: SaveHandle) -> None:
    # Someone must poll the worker for the result: this thread does (the handle's own
    # wait()/done() may poll too; the saver's lock orders them), then closes the saver.
    try:
        handle.wait()
    except BaseException:  # noqa: BLE001 - the error stays in the handle for its owner
        pass
    try:
        saver.close()
    except Exception:  # noqa: BLE001 - a background thread: log, never raise
        logger.exception("quicksave: closing the one-shot saver of %s failed", handle.path)
