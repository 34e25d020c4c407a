"""The checkpoint folder: which steps it holds committed, and how entries leave it.

Plain functions over a folder path (no manager state), used by the manager::

    <folder>/step-<N>/         committed (manifest.json, or a stock DCP .metadata)
    <folder>/step-<N>.tmp-*/   being written, or left by a crash
    <folder>/step-<N>.corrupt-*/  failed its checks at load; moved aside, kept
    <folder>/.quicksave-lock   the writer lease (lease.py)
    <folder>/export-step-<N>/  model export

Only committed directories count: ``committed_steps`` is what "latest", ``load()`` and
retention see.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..commit import (
    CheckpointKind,
    classify,
    clean_stale_temporaries,
    quarantine_path,
    remove_tree,
)
from ..dcp_reader import DCPReader
from ..errors import CheckpointError, CheckpointNotFoundError, NotCommittedError
from ..reader import StorageReader
from .policies import RetentionPolicy

logger = logging.getLogger("quicksave")

STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
MAX_STEP_NAME = 5 + 20  # "step-" and at most 20 digits: a step beyond int64 is no step
COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


def committed_steps(folder: str, *, allow_dcp: bool = True) -> list[int]:
    """Steps with a committed checkpoint in ``folder``, ascending: quicksave ones, and
    stock DCP ones if ``allow_dcp``. Temporaries, quarantined checkpoints and
    directories without their commit are not listed; a directory that vanishes while
    the folder is listed (retention, clean-up) is simply not listed."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    kinds = COMMITTED if allow_dcp else (CheckpointKind.QUICKSAVE,)
    steps = []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        if m and len(name) <= MAX_STEP_NAME and classify(os.path.join(folder, name)) in kinds:
            steps.append(int(m.group(1)))
    return sorted(steps)


def create_folder(folder: str, rank: int | None) -> None:
    """Create ``folder`` (and its parents) if missing.

    Raises:
        CheckpointError: ``folder`` is a file or cannot be created.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(
            "checkpoint folder is a file, not a directory; choose another folder",
            path=folder,
            rank=rank,
        )
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create checkpoint folder: {e.strerror}", path=folder, rank=rank
        ) from e


def clean_leftovers(folder: str) -> None:
    """Remove the temporaries of crashed saves. Only the holder of the folder's writer
    lease calls this (then no live job saves here; see lease.py)."""
    for name in clean_stale_temporaries(folder):
        logger.info("quicksave: removed stale temporary %s", os.path.join(folder, name))


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint directory (logs, never raises). It is moved to a temporary
    name first, so it is never half-deleted while still looking committed; a crash
    mid-delete leaves a temporary, removed at the next start-up."""
    if remove_tree(path):
        logger.info("quicksave: deleted old checkpoint %s", path)
    else:
        logger.warning("quicksave: could not delete old checkpoint %s", path)


def quarantine(path: str, why: str) -> str | None:
    """Move a committed checkpoint that failed its checks out of the way, to
    ``<name>.corrupt-<token>`` beside it: no longer listed, loaded or counted as the
    latest, never deleted by quicksave (kept for a person to look at), and its step can
    be saved again. Returns the new path, or None if it could not be moved (logged)."""
    moved = quarantine_path(path)
    try:
        os.rename(path, moved)
    except OSError as e:
        logger.error("quicksave: could not quarantine %s (%s): %s", path, why, e.strerror)
        return None
    logger.error("quicksave: quarantined %s as %s: %s", path, moved, why)
    return moved


def apply_retention(
    folder: str, retention: RetentionPolicy, keep: set[int], *, allow_dcp: bool = True
) -> None:
    """Delete the committed checkpoints ``retention`` chooses, except the newest one and
    the steps in ``keep`` (in flight, just written, the last one known good): those are
    refused even if the policy picks them. Call on the lease holder only."""
    committed = committed_steps(folder, allow_dcp=allow_dcp)
    if not committed:
        return
    for step in retention.to_delete(committed, set(keep)):
        if step in keep or step == committed[-1] or step not in committed:
            # A policy must never pick these; refuse rather than lose a checkpoint.
            logger.warning("quicksave: retention chose step %d, which must be kept; ignored", step)
            continue
        delete_checkpoint(os.path.join(folder, f"step-{step}"))


def replace_uncommitted(path: str) -> None:
    """A ``step-<N>`` directory with quicksave data but no manifest can never be loaded
    (a non-atomic copy, a damaged disk); it would block the commit rename: delete it.
    Call on the lease holder only."""
    if classify(path) is CheckpointKind.UNCOMMITTED:
        logger.warning("quicksave: replacing uncommitted leftover %s", path)
        delete_checkpoint(path)


def require_committed(
    folder: str, path: str, step: int, rank: int | None, *, allow_dcp: bool = True
) -> None:
    """Raise unless ``path`` (the checkpoint of ``step`` in ``folder``) is committed
    (a stock DCP one only if ``allow_dcp``).

    Raises:
        CheckpointNotFoundError: nothing there, or not a checkpoint, or a stock DCP
            checkpoint without ``allow_dcp``.
        NotCommittedError: a checkpoint that was never committed.
    """
    kind = classify(path)
    if kind is CheckpointKind.QUICKSAVE or (allow_dcp and kind is CheckpointKind.DCP):
        return
    if kind is CheckpointKind.DCP:
        raise CheckpointNotFoundError(
            f"the checkpoint of step {step} is a stock torch.distributed.checkpoint folder, "
            "whose metadata is a pickle; pass CheckpointConfig(allow_dcp=True) to load it",
            path=path,
            rank=rank,
        )
    if kind is CheckpointKind.MISSING:
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step}; committed steps: "
            f"{committed_steps(folder, allow_dcp=allow_dcp)}",
            path=path,
            rank=rank,
        )
    if kind is CheckpointKind.UNCOMMITTED:
        raise NotCommittedError(
            f"the checkpoint of step {step} was never committed (a save was interrupted); "
            "it cannot be loaded",
            path=path,
            rank=rank,
        )
    raise CheckpointNotFoundError(
        f"not a checkpoint (no manifest.json) for step {step}", path=path, rank=rank
    )


def stored_metadata(path: str, *, allow_dcp_pickle: bool = False) -> dict[str, Any]:
    """Names and storage metadata of what a committed checkpoint holds (from its
    manifest, or from DCP's .metadata for a stock DCP directory: through the
    restricted unpickler unless ``allow_dcp_pickle``)."""
    if classify(path) is CheckpointKind.DCP:
        reader: Any = DCPReader(path, allow_pickle=allow_dcp_pickle)
    else:
        reader = StorageReader(path)
    return dict(reader.read_metadata().state_dict_metadata)


def check_step(step: object, folder: str) -> None:
    """Raise CheckpointError unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}", path=folder)
