"""What a directory or prefix is, from the names in it: committed, being written,
quarantined, a stock DCP checkpoint or nothing of ours. Pure: no I/O here (the one
question that needs a read, whether a ``.metadata`` claims the DCP layout, is asked
through a callable the caller passes).

Naming (docs/FORMAT.md, "Commit"): ``<name>.tmp-<token>`` is a save being written (or a
crashed one's), ``<name>.corrupt-<token>`` a checkpoint that failed its checks and was
moved aside, ``<name>.replaced-<token>`` one being replaced where directories cannot be
exchanged. None of them is ever listed, loaded, counted as latest or kept by retention.
"""

from __future__ import annotations

import enum
import os
import uuid
from collections.abc import Callable

from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME

TMP_MARK = ".tmp-"
QUARANTINE_MARK = ".corrupt-"
# A checkpoint being replaced where the filesystem cannot exchange two directories
# (``publish(replace=True)``): moved here first, deleted once the new one is in place.
REPLACED_MARK = ".replaced-"


class CheckpointKind(enum.Enum):
    QUICKSAVE = "quicksave"  # committed quicksave checkpoint (either layout)
    DCP = "dcp"  # committed stock torch.distributed.checkpoint directory
    UNCOMMITTED = "uncommitted"  # temporary or partial: never loaded
    MISSING = "missing"
    NOT_CHECKPOINT = "not-checkpoint"


COMMITTED = (CheckpointKind.QUICKSAVE, CheckpointKind.DCP)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def is_temp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(os.path.normpath(name))


def final_name(name: str) -> str:
    """The checkpoint name a directory name stands for: ``step-5`` for ``step-5`` and
    for its temporaries ``step-5.tmp-<token>`` (a base name, not a path)."""
    return name.split(TMP_MARK, 1)[0]


def kind_of(base: str, names: set[str], footer: Callable[[], bool]) -> CheckpointKind:
    """The kind of a directory named ``base`` holding ``names`` (not empty).

    Args:
        footer: says whether its ``.metadata`` claims the DCP layout; called only for a
            directory that would otherwise be a stock DCP one (usually
            ``lambda: metadata_has_footer(path, backend)``).
    """
    has_quicksave_data = any(
        (n.startswith("rank-") and n.endswith(".safetensors")) or n.startswith("part-rank-")
        for n in names
    )
    if TMP_MARK in base or QUARANTINE_MARK in base or REPLACED_MARK in base:
        return CheckpointKind.UNCOMMITTED
    if MANIFEST_NAME in names:
        return CheckpointKind.QUICKSAVE
    if has_quicksave_data:
        return CheckpointKind.UNCOMMITTED
    if DCP_METADATA_NAME in names:
        return CheckpointKind.QUICKSAVE if footer() else CheckpointKind.DCP
    return CheckpointKind.NOT_CHECKPOINT
