"""Writing a file image on a POSIX filesystem: large ``pwrite`` calls, optional
``O_DIRECT`` from page-aligned memory, xxh3-64 of every chunk on the same pass, ``fsync``."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError

WRITE_PIECE = 64 << 20  # bytes per pwrite: large enough to stream, small enough to hash in cache


def os_error(e: OSError, path: str, rank: int) -> CheckpointError:
    name = errno.errorcode.get(e.errno or 0, "EIO")
    return CheckpointError(
        f"writing checkpoint data failed: {name} ({e.strerror})", path=path, rank=rank
    )


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


def write_image(
    path: str,
    image: memoryview,
    size: int,
    entries: list[tuple[str, int, int]],
    *,
    rank: int,
    fsync: bool = True,
    o_direct: bool = False,
    rate: float | None = None,
) -> dict[str, str]:
    """Write a file whose exact bytes are ``image[:size]`` (a staged file image) and return
    the xxh3-64 of every ``(key, offset, length)`` entry, hashed piece by piece as written.

    ``rate`` (bytes/s) paces the writes: after each piece the writer sleeps until the
    bytes written so far are not ahead of ``rate`` (None: as fast as the disk goes).

    With ``o_direct`` the file is written with ``O_DIRECT`` (the page cache is bypassed: no
    kernel copy, less CPU taken from training) in page-aligned pieces of ``image``, which
    must then extend to a multiple of 4096 bytes past ``size``; the file is truncated to
    ``size`` afterwards. Falls back to buffered writes where the filesystem refuses it.
    """
    aligned = (size + 4095) // 4096 * 4096
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = o_direct and hasattr(os, "O_DIRECT") and len(image) >= aligned
    try:
        fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise os_error(e, path, rank) from e
        direct = False
        fd = os.open(path, flags, 0o644)
    digests: dict[str, str] = {}
    todo = sorted(entries, key=lambda e: e[1])
    hashers = {key: xxhash.xxh3_64() for key, _, _ in todo}
    end = aligned if direct else size
    began = time.monotonic()
    try:
        pos = 0
        while pos < end:
            if rate and pos:
                ahead = pos / rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)
            stop = min(pos + WRITE_PIECE, end)
            for key, off, length in todo:
                lo, hi = max(off, pos), min(off + length, stop)
                if lo < hi:
                    hashers[key].update(image[lo:hi])
            while pos < stop:
                try:
                    pos += os.pwrite(fd, image[pos:stop], pos)
                except OSError as e:
                    if not direct or e.errno != errno.EINVAL:
                        raise
                    # the filesystem takes O_DIRECT at open but not for writes: go buffered
                    os.close(fd)
                    fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                    direct, end = False, size
                    stop = min(stop, end)
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        raise os_error(e, path, rank) from e
    finally:
        os.close(fd)
    for key, _, _ in todo:
        digests[key] = hexdigest(hashers[key].intdigest())
    return digests


def write_pieces(
    path: str,
    size: int,
    pieces: Iterable[tuple[str | None, int, memoryview]],
    *,
    rank: int,
    fsync: bool = True,
) -> dict[str, str]:
    """Create the file ``path`` of ``size`` bytes from ``(name, offset, bytes)`` pieces
    written where they go with large ``pwrite`` calls, straight from the caller's memory
    (the gaps stay holes, read back as zeros); return the xxh3-64 of every named piece,
    hashed on the same pass. The iterable may produce each piece only when asked (a
    tensor's bytes, kept alive until the next piece is asked for)."""
    digests: dict[str, str] = {}
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644
        )
    except OSError as e:
        raise os_error(e, path, rank) from e
    try:
        for name, offset, view in pieces:
            h = xxhash.xxh3_64() if name is not None else None
            pos = 0
            while pos < len(view):
                piece = view[pos : pos + WRITE_PIECE]
                if h is not None:
                    h.update(piece)
                written = 0
                while written < len(piece):
                    written += os.pwrite(fd, piece[written:], offset + pos + written)
                pos += len(piece)
            if h is not None:
                digests[name] = hexdigest(h.intdigest())
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)
    except OSError as e:
        raise os_error(e, path, rank) from e
    finally:
        os.close(fd)
    return digests
