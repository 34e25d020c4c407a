"""Commit: a checkpoint becomes visible all at once, or not at all.

Local filesystem protocol (docs/FORMAT.md, "Commit"):

1. every rank writes its data files under ``<parent>/<name>.tmp-<token>/`` and fsyncs them;
2. the coordinator writes ``.metadata`` and then ``manifest.json`` there, fsyncs both and
   the directory;
3. the coordinator renames the directory to ``<parent>/<name>`` and fsyncs ``<parent>``.

A directory is a committed quicksave checkpoint iff its name has no ``.tmp-`` marker and
it holds ``manifest.json``. Anything else is invisible: never listed as committed, never
loaded, never counted as latest, never kept by retention.
"""

from __future__ import annotations

import enum
import os
import shutil
import uuid

from .errors import CheckpointError, CheckpointExistsError
from .format import DCP_METADATA_NAME, MANIFEST_NAME

TMP_MARK = ".tmp-"


class CheckpointKind(enum.Enum):
    QUICKSAVE = "quicksave"  # committed quicksave checkpoint
    DCP = "dcp"  # committed stock torch.distributed.checkpoint directory
    UNCOMMITTED = "uncommitted"  # temporary or partial: never loaded
    MISSING = "missing"
    NOT_CHECKPOINT = "not-checkpoint"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_path_for(final: str, token: str) -> str:
    final = os.path.normpath(os.path.abspath(final))
    return os.path.join(os.path.dirname(final), f"{os.path.basename(final)}{TMP_MARK}{token}")


def is_temp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(os.path.normpath(name))


def classify(path: str) -> CheckpointKind:
    """What ``path`` is, from the files present (no file is parsed)."""
    if not os.path.exists(path):
        return CheckpointKind.MISSING
    if not os.path.isdir(path):
        return CheckpointKind.NOT_CHECKPOINT
    names = set(os.listdir(path))
    has_quicksave_data = any(n.startswith("rank-") and n.endswith(".safetensors") for n in names)
    if is_temp_name(path):
        return CheckpointKind.UNCOMMITTED
    if MANIFEST_NAME in names:
        return CheckpointKind.QUICKSAVE
    if has_quicksave_data:
        return CheckpointKind.UNCOMMITTED
    if DCP_METADATA_NAME in names:
        return CheckpointKind.DCP
    return CheckpointKind.NOT_CHECKPOINT


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """Create ``path`` (must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def make_temp_dir(final: str, token: str) -> str:
    """Create the temporary directory a checkpoint is written into."""
    final = os.path.normpath(os.path.abspath(final))
    parent = os.path.dirname(final)
    if classify(final) in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP):
        raise CheckpointExistsError(
            "a committed checkpoint already exists here; choose another path or delete it first",
            path=final,
        )
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = temp_path_for(final, token)
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create checkpoint directory: {e.strerror}", path=final
        ) from e
    return tmp


def publish(tmp: str, final: str) -> None:
    """Make the fully written ``tmp`` visible as ``final`` in one rename."""
    final = os.path.normpath(os.path.abspath(final))
    fsync_path(tmp)
    try:
        os.rename(tmp, final)  # atomic; fails if ``final`` is a non-empty directory
    except OSError as e:
        raise CheckpointExistsError(
            f"cannot commit: {e.strerror}; the written data stays in {tmp}", path=final
        ) from e
    fsync_path(os.path.dirname(final))


def clean_stale_temporaries(root: str) -> list[str]:
    """Delete ``*.tmp-*`` directories under ``root`` (left by crashed saves).

    Only call this when no save into ``root`` can be in flight (the manager does it at
    start-up, before its first save).
    """
    removed = []
    if not os.path.isdir(root):
        return removed
    for name in sorted(os.listdir(root)):
        if is_temp_name(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed
