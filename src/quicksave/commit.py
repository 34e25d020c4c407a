"""Commit: a checkpoint becomes visible all at once, or not at all.

Local filesystem protocol (docs/FORMAT.md, "Commit"):

1. every rank writes its data files under ``<parent>/<name>.tmp-<token>/`` and fsyncs them;
2. the coordinator writes ``.metadata`` and then ``manifest.json`` there, fsyncs both and
   the directory;
3. the coordinator renames the directory to ``<parent>/<name>`` and fsyncs ``<parent>``.

A directory is a committed quicksave checkpoint iff its name has no ``.tmp-`` (nor
``.corrupt-``, quarantined) marker and it holds ``manifest.json``, or (the DCP layout,
docs/FORMAT.md §8) no ``manifest.json`` but a ``.metadata`` that ends with the layout's
footer. Anything else is invisible: never listed as committed, never loaded, never
counted as latest, never kept by retention.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Mapping

from quicksave.errors import CheckpointError, CheckpointExistsError
from quicksave.format import DCP_METADATA_NAME, MANIFEST_NAME
from quicksave.format.dcp_layout import PROBE_SIZE, has_footer
from quicksave.storage.backend import Backend
from quicksave.storage.checkpoint_dir import CheckpointDir, read_range
from quicksave.storage.location import Location, parse_location

logger = logging.getLogger(__name__)

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


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def temp_path_for(final: str, token: str) -> str:
    final = os.path.normpath(os.path.abspath(final))
    return os.path.join(os.path.dirname(final), f"{os.path.basename(final)}{TMP_MARK}{token}")


def is_temp_name(name: str) -> bool:
    return TMP_MARK in os.path.basename(os.path.normpath(name))


def final_name(name: str) -> str:
    """The checkpoint name a directory name stands for: ``step-5`` for ``step-5`` and
    for its temporaries ``step-5.tmp-<token>`` (a base name, not a path)."""
    return name.split(TMP_MARK, 1)[0]


def quarantine_path(final: str) -> str:
    """Where a committed checkpoint that failed its checks is moved: beside it, under a
    name that is never committed and never cleaned up."""
    final = os.path.normpath(os.path.abspath(final))
    return f"{final}{QUARANTINE_MARK}{new_token()}"


def classify(
    path: str | os.PathLike[str] | Location, backend: Backend | None = None
) -> CheckpointKind:
    """What ``path`` is, from the names present; no file is parsed, except that the
    last bytes of a ``.metadata`` without ``manifest.json`` beside it are read to tell
    a DCP-layout quicksave checkpoint from a stock DCP one (:func:`metadata_has_footer`).
    On an object store a prefix with no object under it is MISSING, and only its
    manifest (or DCP-layout ``.metadata``) commits it.

    Args:
        path: a path, URL or Location.
        backend: an open backend serving it (default: one is opened for the call).
    """
    loc = parse_location(path)
    if loc.is_local:
        path = loc.key
        try:
            names = set(os.listdir(path))
        except FileNotFoundError:  # missing, or vanished while listed (retention, clean-up)
            return CheckpointKind.MISSING
        except NotADirectoryError:  # a file, or a parent that is a file
            if os.path.lexists(path):
                return CheckpointKind.NOT_CHECKPOINT
            return CheckpointKind.MISSING
    else:
        b = backend if backend is not None else loc.open()
        try:
            names = set(b.children(loc.key))
        finally:
            if backend is None:
                b.close()
        if not names:
            return CheckpointKind.MISSING
    return kind_of(loc.name, names, lambda: metadata_has_footer(loc, backend))


def metadata_has_footer(path: str | Location, backend: Backend | None = None) -> bool:
    """Whether the ``.metadata`` of the directory ``path`` claims the DCP layout
    (:func:`~quicksave.format.dcp_layout.has_footer` on its last bytes; one small ranged
    read). False when it is missing, not a regular file or unreadable: then it is
    whatever the names say (a stock DCP checkpoint), and its readers report the rest.
    """
    try:
        with CheckpointDir(path, backend) as d:
            f = d.open(DCP_METADATA_NAME, what="DCP metadata")
            try:
                n = min(PROBE_SIZE, f.size)
                tail = read_range(f, f.size - n, n, path=d.member_url(DCP_METADATA_NAME))
            finally:
                f.close()
    except (OSError, CheckpointError):
        return False
    return has_footer(tail)


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


# What a save onto a committed checkpoint is told: the way to replace one, where there is
# one (the entry points that take ``overwrite``), else the alternatives.
EXISTS_LOCAL = (
    "a committed checkpoint already exists here; quicksave never overwrites one unless "
    "asked: pass overwrite=True (quicksave.save, StorageWriter, AsyncSaver.save on one "
    "rank) to replace it atomically, or choose another path or delete it first"
)
EXISTS_ON_STORE = (
    "a committed checkpoint already exists under this prefix; quicksave never overwrites "
    "one, and an object store has no atomic replace for overwrite=True: choose another "
    "prefix or delete it first"
)


def check_target(
    final: str | Location,
    rank: int | None = None,
    backend: Backend | None = None,
    *,
    replace: bool = False,
) -> None:
    """Raise unless a checkpoint can be committed at ``final``: nothing there, or an
    empty directory (an object store: no object under the prefix), or with ``replace``
    also a committed checkpoint (local paths only: :func:`publish` exchanges it
    atomically). Checked before any byte is written, so that a save onto a file or a
    full directory fails at once instead of after writing everything.

    Raises:
        CheckpointError: ``replace`` on an object store (no atomic replace there: the
            new objects would mix with the old checkpoint's under one manifest).
        CheckpointExistsError: a committed checkpoint (unless ``replace``), a file, a
            non-empty directory or a prefix holding objects is at ``final``.
    """
    loc = parse_location(final)
    if replace and not loc.is_local:
        raise CheckpointError(
            "overwrite=True is not supported on an object store: it has no atomic "
            "replace (the new objects would land beside the old checkpoint's, under its "
            "manifest); save to a new prefix instead",
            path=loc.url,
            rank=rank,
        )
    kind = classify(loc, backend)
    if kind is CheckpointKind.MISSING:
        return
    if replace and kind in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP):
        return
    if kind in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP):
        raise CheckpointExistsError(
            EXISTS_LOCAL if loc.is_local else EXISTS_ON_STORE, path=loc.url, rank=rank
        )
    if not loc.is_local:  # a prefix that holds objects but no commit
        raise CheckpointExistsError(
            "objects of an uncommitted save are under this prefix (a save that crashed "
            "or is still running); quicksave never replaces them: choose another path, or "
            "let a CheckpointManager clean them up",
            path=loc.url,
            rank=rank,
        )
    final = loc.key
    if os.path.isdir(final) and not os.path.islink(final):
        try:
            empty = not os.listdir(final)
        except OSError:
            empty = False
        if empty:
            return
        what = "a directory that is not empty (not a committed checkpoint)"
    else:
        what = "a file" if not os.path.islink(final) else "a symbolic link"
    raise CheckpointExistsError(
        f"{what} is in the way; quicksave never replaces it: choose another path or remove it",
        path=final,
        rank=rank,
    )


def make_temp_dir(final: str, token: str, *, replace: bool = False) -> str:
    """Create the temporary directory a checkpoint is written into (``replace``: a
    committed checkpoint at ``final`` is allowed, see :func:`check_target`)."""
    final = os.path.normpath(os.path.abspath(final))
    parent = os.path.dirname(final)
    check_target(final, replace=replace)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = temp_path_for(final, token)
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create checkpoint directory: {e.strerror}", path=final
        ) from e
    return tmp


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

    ``replace`` (DCP's ``overwrite=True``, for ``FileSystemWriterAsync``): a committed
    checkpoint already at ``final`` is replaced atomically: the two directories swap
    places in one ``renameat2(RENAME_EXCHANGE)``, then the old one is deleted, so
    ``final`` always holds a whole checkpoint. Where the filesystem cannot exchange (NFS,
    some FUSE filesystems, non-Linux), the old one is first renamed to
    ``<final>.replaced-<token>``, a name that is never listed, loaded or cleaned up, and
    deleted only once the new one is in place: a crash between the two renames leaves
    nothing at ``final`` but the old checkpoint whole beside it (a warning says so).
    Anything else at ``final`` is refused as without ``replace``.

    Raises:
        CheckpointError: the temporary directory is not whole or is gone.
        CheckpointExistsError: something already exists at ``final`` (a committed
            checkpoint, unless ``replace``).
    """
    final = os.path.normpath(os.path.abspath(final))
    check_whole(tmp, expected, final)
    fsync_path(tmp)
    if replace and classify(final) in (CheckpointKind.QUICKSAVE, CheckpointKind.DCP):
        if not _rename_exchange(tmp, final):
            old = f"{final}{REPLACED_MARK}{new_token()}"
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
        raise CheckpointExistsError(
            f"cannot commit: {e.strerror}; the written data stays in {tmp}", path=final
        ) from e
    fsync_path(os.path.dirname(final))


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


def commit_on_store(
    backend: Backend, prefix: str, final: str, expected: Mapping[str, int], manifest: bytes
) -> None:
    """Commit a checkpoint on an object store: check that every object of ``expected``
    (name -> size) is under ``prefix`` with its size (one listing), then write the
    manifest. Objects appear whole or not at all, so the manifest's presence is the
    commit: nothing under a prefix without one is ever listed, loaded or kept.

    Raises:
        CheckpointError: an object is missing or of another size (nothing committed).
        CheckpointExistsError: a manifest appeared under ``prefix`` meanwhile.
    """
    base = prefix.rstrip("/") + "/"
    present = {o.key[len(base) :]: o.size for o in backend.list(base)}
    for name, size in sorted(expected.items()):
        got = present.get(name)
        if got != size:
            state = "missing" if got is None else f"{got} bytes, expected {size}"
            raise CheckpointError(
                f"cannot commit: object {name} is {state} (deleted by another process?); "
                "nothing was committed",
                path=final,
            )
    if MANIFEST_NAME in present:
        raise CheckpointExistsError(
            "cannot commit: another save committed a checkpoint here meanwhile", path=final
        )
    backend.put(base + MANIFEST_NAME, memoryview(manifest))


def remove_tree(path: str) -> bool:
    """Delete a directory (or file) so that it is never half-deleted under its name:
    rename it to a fresh ``.tmp-del`` temporary first, then delete that. Returns False
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
    """Delete ``*.tmp-*`` entries directly under ``root`` (left by crashed saves), each
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
