"""The rename protocol's file operations on a local filesystem (docs/FORMAT.md, "Commit").

1. every rank writes its data files under ``<parent>/.quicksave.<encoded name>.tmp-<token>/``
   (:func:`~quicksave.commit.kinds.temp_name`) and fsyncs them;
2. the coordinator writes ``.metadata`` and then ``manifest.json`` there, fsyncs both and
   the directory;
3. the coordinator renames the directory to ``<parent>/<name>`` and fsyncs ``<parent>``.

Used by :class:`~quicksave.commit.rename.RenameCommit` (the strategy callers hold) and by
the few writers of single files that commit by rename (a converted file, a published copy).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Mapping

from quicksave.commit.kinds import (
    QUARANTINE_MARK,
    REPLACED_MARK,
    final_name,
    hidden_name,
    is_temp_name,
    new_token,
    temp_name,
)
from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME

logger = logging.getLogger(__name__)


def temp_path_for(final: str, token: str) -> str:
    """The temporary beside ``final`` for a save (or a deletion) of it: a hidden name
    that no scan of the folder by name takes for ``final``
    (:func:`~quicksave.commit.kinds.temp_name`)."""
    final = os.path.normpath(os.path.abspath(final))
    return os.path.join(os.path.dirname(final), temp_name(os.path.basename(final), token))


def final_path_of(tmp: str) -> str:
    """The checkpoint a temporary (:func:`temp_path_for`) stands for, beside it: what an
    error about the temporary names, as the user knows it."""
    tmp = os.path.normpath(os.path.abspath(tmp))
    parent, name = os.path.split(tmp)
    return os.path.join(parent, final_name(name))


def quarantine_path(final: str) -> str:
    """Where a committed checkpoint that failed its checks is moved: beside it, under a
    name that is never committed and never cleaned up."""
    final = os.path.normpath(os.path.abspath(final))
    return f"{final}{QUARANTINE_MARK}{new_token()}"


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_whole(tmp: str, expected: Mapping[str, int], final: str) -> None:
    """Raise unless every file of ``expected`` (name -> byte size) is in ``tmp`` as a
    regular file of that size: the last check before a commit, so that a temporary
    directory damaged by anyone (a clean-up by another process, a full disk that
    truncated a file) fails the save loudly instead of committing what is left.

    Raises:
        CheckpointError: a file is missing, not a regular file, or of another size;
            nothing is committed.
    """
    for name, size in sorted(expected.items()):
        try:
            st = os.lstat(os.path.join(tmp, name))
        except OSError as e:
            raise CheckpointError(
                f"cannot commit: {name} is gone from the temporary directory {tmp} "
                f"({e.strerror}; removed by another process?); nothing was committed",
                path=final,
            ) from e
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointError(
                f"cannot commit: {name} in the temporary directory {tmp} is not the file "
                f"that was written ({st.st_size} bytes, expected {size}); nothing was committed",
                path=final,
            )


def publish(tmp: str, final: str, expected: Mapping[str, int], *, replace: bool = False) -> None:
    """Make the fully written ``tmp`` visible as ``final`` in one rename, after
    :func:`check_whole` of the files in ``expected`` (name -> size; every file the
    checkpoint must hold, the manifest included).

    The rename is what makes it safe against a concurrent clean-up too: clean-up moves
    a temporary away before deleting it (:func:`clean_stale_temporaries`), so either
    this rename or that one wins, never half of each.

    ``replace``: a committed checkpoint is at ``final`` (the caller classified it) and
    is replaced atomically: the two directories swap
    places in one ``renameat2(RENAME_EXCHANGE)``, then the old one is deleted, so
    ``final`` always holds a whole checkpoint. Where the filesystem cannot exchange (NFS,
    some FUSE filesystems, non-Linux), the old one is first renamed to
    ``.quicksave.<encoded name>.replaced-<token>`` beside it, a name that is never
    listed, loaded or cleaned up, and
    deleted only once the new one is in place: a crash between the two renames leaves
    nothing at ``final`` but the old checkpoint whole beside it (a warning says so).

    Raises:
        CheckpointError: the temporary directory is not whole or is gone.
        CheckpointExistsError: something already exists at ``final`` (a committed
            checkpoint, unless ``replace``).
    """
    final = os.path.normpath(os.path.abspath(final))
    check_whole(tmp, expected, final)
    fsync_path(tmp)
    if replace:
        if not _rename_exchange(tmp, final):
            parent, name = os.path.split(final)
            old = os.path.join(parent, hidden_name(name, REPLACED_MARK, new_token()))
            logger.warning(
                "quicksave: %s cannot exchange directories atomically; replacing %s by "
                "two renames (a crash between them leaves the old checkpoint at %s)",
                os.path.dirname(final),
                final,
                old,
            )
            os.rename(final, old)
            fsync_path(os.path.dirname(final))
            os.rename(tmp, final)
            tmp = old
        fsync_path(os.path.dirname(final))
        shutil.rmtree(tmp, ignore_errors=True)  # the replaced checkpoint, now at tmp
        return
    try:
        os.rename(tmp, final)  # atomic; fails if ``final`` is a non-empty directory
    except FileNotFoundError as e:
        raise CheckpointError(
            f"cannot commit: the temporary directory {tmp} was removed by another process; "
            "nothing was committed",
            path=final,
        ) from e
    except OSError as e:
        if e.errno == errno.EXDEV:  # e.g. an overlay or FUSE filesystem that will not
            _publish_by_copy(tmp, final)  # rename a directory: copy, commit last
            return
        raise CheckpointExistsError(
            f"cannot commit: {e.strerror}; the written data stays in {tmp}", path=final
        ) from e
    fsync_path(os.path.dirname(final))


def _publish_by_copy(tmp: str, final: str) -> None:
    """Where the filesystem refuses to rename ``tmp`` to ``final`` (``EXDEV``): copy the
    checkpoint into ``final`` (created now, or the empty directory an async save holds
    its name with), every data file first and fsynced, then ``.metadata`` and the
    manifest, last: until the manifest is there, ``final`` is an uncommitted directory
    that is never listed nor loaded (as on an object store), and a crash leaves it to
    clean-up. Then ``tmp`` is removed.

    Raises:
        CheckpointExistsError: something other than an empty directory is at ``final``.
    """
    logger.warning(
        "quicksave: %s refuses to rename %s (EXDEV); copying it to %s, its manifest last",
        os.path.dirname(final),
        tmp,
        final,
    )
    try:
        os.mkdir(final)
    except FileExistsError:
        if not os.path.isdir(final) or os.path.islink(final) or os.listdir(final):
            raise CheckpointExistsError(
                f"cannot commit: something is in the way; the written data stays in {tmp}",
                path=final,
            ) from None
    last = (DCP_METADATA_NAME, MANIFEST_NAME)
    names = sorted(os.listdir(tmp), key=lambda n: (last.index(n) if n in last else -1, n))
    for i, name in enumerate(names):
        if name in last and (i == 0 or names[i - 1] not in last):
            fsync_path(final)  # every data file is durable before the commit's files
        with (
            open(os.path.join(tmp, name), "rb") as src,
            open(os.path.join(final, name), "xb") as dst,  # never over another file
        ):
            shutil.copyfileobj(src, dst, 1 << 24)
            dst.flush()
            os.fsync(dst.fileno())
    fsync_path(final)
    fsync_path(os.path.dirname(final))
    shutil.rmtree(tmp, ignore_errors=True)


def _rename_exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux ``renameat2(..., RENAME_EXCHANGE)``); False
    where the platform or filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) == 0


def remove_tree(path: str) -> bool:
    """Delete a directory (or file) so that it is never half-deleted under its name:
    rename it to a fresh temporary (``.quicksave.<encoded name>.tmp-del<token>``) first,
    then delete that. Returns False
    if ``path`` was gone or could not be moved (nothing was deleted then).

    The rename also makes deletion race-free against a writer committing a temporary
    (:func:`publish`): only one of the two renames can take the directory.
    """
    path = os.path.normpath(os.path.abspath(path))
    parent, name = os.path.split(path)  # only the name: a parent may hold ".tmp-" too
    doomed = temp_path_for(os.path.join(parent, final_name(name)), f"del{new_token()}")
    try:
        os.rename(path, doomed)
    except OSError:
        return False
    if os.path.isdir(doomed) and not os.path.islink(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(doomed)
    return True


def clean_stale_temporaries(root: str) -> list[str]:
    """Delete the temporaries directly under ``root`` (left by crashed saves; ``*.tmp-*``:
    hidden ones, and those beside their checkpoint of earlier versions), each
    moved away before it is deleted (:func:`remove_tree`).

    Only the holder of the folder's writer lease may call this (the manager does at
    start-up, before its first save): then no live job saves into ``root``, and a
    writer that is still finishing (a dead trainer's worker) fails its commit instead
    of committing a half-deleted directory.
    """
    removed = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        if is_temp_name(name) and remove_tree(os.path.join(root, name)):
            removed.append(name)
    return removed
