"""The checkpoint folder: which steps it holds committed, and how entries leave it.

Plain functions over a folder path (no manager state), used by the manager::

    <folder>/step-<N>/         committed (manifest.json, or a stock DCP .metadata)
    <folder>/step-<N>.tmp-*/   being written, or left by a crash
    <folder>/export-step-<N>/  model export

Only committed directories count: ``committed_steps`` is what "latest", ``load()`` and
retention see.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

import torch.distributed.checkpoint as dcp

from ..commit import CheckpointKind, classify, clean_stale_temporaries, new_token, temp_path_for
from ..errors import CheckpointError, CheckpointNotFoundError, NotCommittedError
from ..reader import StorageReader
from .policies import RetentionPolicy

logger = logging.getLogger("quicksave")

STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


def committed_steps(folder: str) -> list[int]:
    """Steps with a committed checkpoint in ``folder`` (quicksave or stock DCP),
    ascending. Temporaries and directories without their commit are not listed."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = STEP_DIR.fullmatch(name)
        if m and classify(os.path.join(folder, name)) in COMMITTED:
            steps.append(int(m.group(1)))
    return sorted(steps)


def prepare_folder(folder: str, rank: int | None, coordinator: bool) -> None:
    """Create ``folder``; on the coordinator, remove temporaries left by a crash.

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
    if coordinator:
        # Safe only now: this job has not started a save, and one job owns a folder.
        for name in clean_stale_temporaries(folder):
            logger.info("quicksave: removed stale temporary %s", os.path.join(folder, name))


def delete_checkpoint(path: str) -> None:
    """Delete a checkpoint directory (logs, never raises)."""
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


def apply_retention(folder: str, retention: RetentionPolicy, keep: set[int]) -> None:
    """Delete the committed checkpoints ``retention`` chooses, except the newest one and
    the steps in ``keep`` (in flight, or just written): those are refused even if the
    policy picks them. Call on the coordinator only."""
    committed = committed_steps(folder)
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
    Call on the coordinator only."""
    if classify(path) is CheckpointKind.UNCOMMITTED:
        logger.warning("quicksave: replacing uncommitted leftover %s", path)
        delete_checkpoint(path)


def require_committed(folder: str, path: str, step: int, rank: int | None) -> None:
    """Raise unless ``path`` (the checkpoint of ``step`` in ``folder``) is committed.

    Raises:
        CheckpointNotFoundError: nothing there, or not a checkpoint.
        NotCommittedError: a checkpoint that was never committed.
    """
    kind = classify(path)
    if kind in COMMITTED:
        return
    if kind is CheckpointKind.MISSING:
        raise CheckpointNotFoundError(
            f"no checkpoint of step {step}; committed steps: {committed_steps(folder)}",
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


def stored_metadata(path: str) -> dict[str, Any]:
    """Names and storage metadata of what a committed checkpoint holds (from its
    manifest, or from DCP's .metadata for a stock DCP directory)."""
    if classify(path) is CheckpointKind.DCP:
        reader: Any = dcp.FileSystemReader(path)
    else:
        reader = StorageReader(path)
    return dict(reader.read_metadata().state_dict_metadata)


def check_step(step: object, folder: str) -> None:
    """Raise CheckpointError unless ``step`` is an int >= 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be an integer >= 0, got {step!r}", path=folder)
