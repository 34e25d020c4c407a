"""Opening a checkpoint's files for reading without trusting the checkpoint.

Every file of a checkpoint that quicksave reads (the manifest, data files, ``.metadata``,
per-rank parts, a stock DCP directory's files) is opened here. A checkpoint may come
from anywhere, so a file is read only if it is a **regular file inside the checkpoint
directory**:

- its name is a plain name (no ``/``, no ``..``, no NUL, not empty), so it cannot
  point outside the directory;
- it is not a symbolic link (``O_NOFOLLOW``), so it cannot point outside either;
- it is not a FIFO, a device or a socket: those could block a reader forever
  (a FIFO with no writer) or never end (``/dev/zero``). The type is checked with
  ``lstat`` before opening (a device is never even opened) and again with ``fstat``
  on the open descriptor, which was opened with ``O_NONBLOCK`` so that opening
  cannot block either;
- it is read up to its ``fstat`` size and no further, bounded by the caller's cap.

Torch-free: the worker process imports it.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from quicksave.errors import CorruptCheckpointError
from quicksave.format.naming import bad_member_name

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)
READ_BLOCK = 16 << 20


def member_path(directory: str, name: str, *, fqn: str | None = None) -> str:
    """``directory/name`` for a file name taken from a checkpoint.

    Raises:
        CorruptCheckpointError: ``name`` is not a plain name (it could leave the
            directory); names the directory and the fqn.
    """
    why = bad_member_name(name)
    if why is not None:
        raise CorruptCheckpointError(
            f"file name {name!r} is not a plain name inside the checkpoint ({why})",
            path=directory,
            fqn=fqn,
        )
    return os.path.join(directory, name)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


@dataclass(frozen=True)
class RegularFile:
    """An open regular file: its descriptor (the caller closes it) and its size."""

    fd: int
    size: int


def open_regular(
    path: str,
    *,
    what: str = "file",
    fqn: str | None = None,
    rank: int | None = None,
) -> RegularFile:
    """Open ``path`` for reading if, and only if, it is a regular file (not a symbolic
    link, FIFO, device or socket). Never blocks.

    Args:
        path: the file (its directory part is trusted: the caller built it).
        what: how errors call the file (``"data file"``, ``"manifest"`` ...).
        fqn, rank: named in errors.

    Returns:
        A :class:`RegularFile`; the caller closes ``fd``.

    Raises:
        FileNotFoundError: nothing at ``path`` (callers word "missing" themselves).
        CorruptCheckpointError: anything else that is not an openable regular file.
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(
            f"cannot open {what}: {e.strerror}", path=path, fqn=fqn, rank=rank
        ) from None
    if not stat.S_ISREG(before.st_mode):
        raise CorruptCheckpointError(
            f"{what} is {_kind(before.st_mode)}, not a regular file; refusing to read it",
            path=path,
            fqn=fqn,
            rank=rank,
        )
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else None
        message = (
            f"{what} is {why}, not a regular file; refusing to read it"
            if why
            else f"cannot open {what}: {e.strerror}"
        )
        raise CorruptCheckpointError(message, path=path, fqn=fqn, rank=rank) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (
            before.st_dev,
            before.st_ino,
        ):
            raise CorruptCheckpointError(
                f"{what} changed while being opened (now {_kind(st.st_mode)}); refusing to read it",
                path=path,
                fqn=fqn,
                rank=rank,
            )
        if _OPEN_FLAGS & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return RegularFile(fd, st.st_size)


def read_regular(
    path: str,
    max_bytes: int,
    *,
    what: str = "file",
    too_large: str | None = None,
    fqn: str | None = None,
    rank: int | None = None,
) -> bytes:
    """All bytes of the regular file ``path``: at most its size when opened, and
    refused unread if that size exceeds ``max_bytes``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        CorruptCheckpointError: not a regular file, too large (message ``too_large``
            if given), or unreadable.
    """
    f = open_regular(path, what=what, fqn=fqn, rank=rank)
    try:
        if f.size > max_bytes:
            raise CorruptCheckpointError(
                too_large or f"{what} is {f.size} bytes, more than the limit of {max_bytes}",
                path=path,
                fqn=fqn,
                rank=rank,
            )
        return read_at(f.fd, 0, f.size, path=path, what=what, fqn=fqn, rank=rank)
    finally:
        os.close(f.fd)


def read_at(
    fd: int,
    offset: int,
    length: int,
    *,
    path: str,
    what: str = "file",
    fqn: str | None = None,
    rank: int | None = None,
) -> bytes:
    """Up to ``length`` bytes of ``fd`` from ``offset`` (fewer only at end of file)."""
    buf = bytearray(length)
    view = memoryview(buf)
    got = 0
    try:
        while got < length:
            n = os.preadv(fd, [view[got : got + READ_BLOCK]], offset + got)
            if n == 0:
                break
            got += n
    except OSError as e:
        raise CorruptCheckpointError(
            f"cannot read {what}: {e.strerror}", path=path, fqn=fqn, rank=rank
        ) from None
    finally:
        view.release()
    del buf[got:]
    return bytes(buf)
