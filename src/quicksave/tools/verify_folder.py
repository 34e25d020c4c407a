"""Verify every checkpoint in a folder: ``quicksave verify <run folder>`` (or a parent of
run folders, or a bucket), one verdict per checkpoint as it is reached.

The folder is listed by :func:`quicksave.loading.catalog.list_checkpoints` (the same search as
``quicksave ls``); each committed quicksave checkpoint is then verified byte for byte by
:func:`quicksave.loading.verify.verify_checkpoint`. What cannot be verified is reported as
skipped, with why: an uncommitted save (in progress, or left by a crash), a stock DCP
checkpoint (it has no checksums), or a checkpoint deleted since it was listed (a live
run's retention). Nothing is written or deleted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from quicksave.commit import CheckpointKind, classify
from quicksave.errors import CheckpointError, CheckpointNotFoundError, NotCommittedError
from quicksave.loading.catalog import CheckpointInfo, list_checkpoints
from quicksave.loading.verify import verify_checkpoint
from quicksave.loading.verify_report import VerifyReport
from quicksave.storage import Location, StorageOptions, parse_location


@dataclass(frozen=True)
class Verdict:
    """What verifying one checkpoint of a folder found.

    Attributes:
        info: the checkpoint, as listed.
        report: the byte-for-byte check (None when skipped or failed to run).
        skipped: why it was not verified (not a failure), else None.
        error: why it could not be verified (a failure: unreadable, unreachable), else
            None.
    """

    info: CheckpointInfo
    report: VerifyReport | None = None
    skipped: str | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Corrupt, or not verifiable for a reason other than the skips above."""
        return self.error is not None or (self.report is not None and not self.report.ok)


def folder_checkpoints(
    root: str | os.PathLike[str] | Location, *, storage: StorageOptions | None = None
) -> list[CheckpointInfo] | None:
    """The checkpoints to verify when ``root`` is a folder of them (a run folder, a
    parent of runs, a bucket); None when ``root`` is a checkpoint itself (committed or
    not), is missing, or holds none: then it is verified (or refused) as one.

    Raises:
        CheckpointError: an object store cannot be reached (named).
    """
    loc = parse_location(root, what="checkpoint folder", options=storage)
    if classify(loc) is not CheckpointKind.NOT_CHECKPOINT:
        return None
    try:
        infos = list_checkpoints(loc)
    except CheckpointNotFoundError:  # a file, not a folder
        return None
    return infos or None


def verify_each(
    infos: list[CheckpointInfo],
    progress: bool = False,
    *,
    storage: StorageOptions | None = None,
) -> Iterator[Verdict]:
    """Verify each of ``infos`` in turn (as listed by :func:`folder_checkpoints`).

    Args:
        infos: the checkpoints.
        progress: a progress bar per checkpoint, on stderr.
        storage: how to reach an object store.

    Yields:
        One :class:`Verdict` per checkpoint, in order, once it is verified.

    Example::

        infos = folder_checkpoints("s3://bucket/run-7") or []
        bad = [v for v in verify_each(infos) if v.failed]
    """
    for info in infos:
        if not info.committed:
            yield Verdict(info, skipped="uncommitted (a save in progress, or left by a crash)")
            continue
        if info.format != "quicksave":
            yield Verdict(info, skipped="a stock DCP checkpoint: it has no checksums to verify")
            continue
        try:
            report = verify_checkpoint(info.path, progress, storage=storage)
        except (CheckpointNotFoundError, NotCommittedError):
            yield Verdict(info, skipped="deleted or moved since it was listed")
        except CheckpointError as e:
            yield Verdict(info, error=str(e))
        else:
            yield Verdict(info, report=report)
