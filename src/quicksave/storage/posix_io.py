"""Writing a file image on a POSIX filesystem: large ``pwrite`` calls, optional
``O_DIRECT`` from page-aligned memory, xxh3-64 of every chunk on the same pass, ``fsync``."""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Iterable

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError
from quicksave.storage.backend import PAGE

WRITE_PIECE = 64 << 20  # bytes per pwrite: large enough to stream, small enough to hash in cache


def os_error(e: OSError, path: str, rank: int) -> CheckpointError:
    name = errno.errorcode.get(e.errno or 0, "EIO")
    return CheckpointError(
        f"writing checkpoint data failed: {name} ({e.strerror})", path=path, rank=rank
    )


def _pace(rate: float | None, done: int, began: float) -> None:
    """Sleep until ``done`` bytes written since ``began`` (``time.monotonic``) are not
    ahead of ``rate`` bytes/s (None: no pacing)."""
    if rate and done:
        ahead = done / rate - (time.monotonic() - began)
        if ahead > 0:
            time.sleep(ahead)


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
    aligned = (size + PAGE - 1) // PAGE * PAGE
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
            _pace(rate, pos, began)
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
    o_direct: bool = False,
    rate: float | None = None,
) -> dict[str, str]:
    """Create the file ``path`` of ``size`` bytes from ``(name, offset, bytes)`` pieces
    written where they go with large ``pwrite`` calls, straight from the caller's memory
    (the gaps stay holes, read back as zeros); return the xxh3-64 of every named piece,
    hashed on the same pass. The iterable may produce each piece only when asked (a
    tensor's bytes, kept alive until the next piece is asked for).

    With ``o_direct``, the whole pages of a piece whose memory lies on the same page
    offsets as its place in the file (a staging pool's image) are written with
    ``O_DIRECT``: no page-cache copy and no writeback, which cost the writer process
    several times a direct write's CPU. The partial pages at a piece's two ends, and a
    piece whose memory is not so aligned, go through the page cache; one ``fsync``
    covers both. Falls back to buffered writes where the filesystem refuses ``O_DIRECT``.
    ``rate`` paces the writes as in :func:`write_image`."""
    digests: dict[str, str] = {}
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise os_error(e, path, rank) from e
    writer = _PieceWriter(path, fd, flags, o_direct and hasattr(os, "O_DIRECT"), rate)
    try:
        for name, offset, view in pieces:
            h = xxhash.xxh3_64() if name is not None else None
            lo, hi = writer.direct_span(view, offset)
            for a, b, direct in ((0, lo, False), (lo, hi, True), (hi, len(view), False)):
                pos = a
                while pos < b:
                    piece = view[pos : min(pos + WRITE_PIECE, b)]
                    if h is not None:
                        h.update(piece)
                    writer.write(piece, offset + pos, direct)
                    pos += len(piece)
            if h is not None:
                digests[name] = hexdigest(h.intdigest())
        os.ftruncate(fd, size)
        if fsync:
            os.fsync(fd)  # the inode: the direct writes' allocations and the cache's pages
    except OSError as e:
        raise os_error(e, path, rank) from e
    finally:
        writer.close()
    return digests


DIRECT_MIN = 64 << 10  # a piece's aligned middle written with O_DIRECT from this size


class _PieceWriter:
    """``pwrite`` for :func:`write_pieces`: through the file's buffered descriptor, or
    through a second one opened with ``O_DIRECT`` (on first use) for page-aligned spans;
    paced to ``rate`` bytes/s over all the bytes written."""

    def __init__(self, path: str, fd: int, flags: int, direct: bool, rate: float | None):
        self.path, self.fd, self.flags = path, fd, flags
        self.direct = direct
        self.dfd: int | None = None
        self.rate, self.done, self.began = rate, 0, time.monotonic()

    def direct_span(self, view: memoryview, offset: int) -> tuple[int, int]:
        """The part ``[lo, hi)`` of ``view`` to write with ``O_DIRECT``: its whole pages
        in the file, if the memory there is page-aligned too (else empty)."""
        if not self.direct or len(view) < DIRECT_MIN:
            return 0, 0
        try:
            address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):  # read-only or not contiguous: buffered
            return 0, 0
        lo = -offset % PAGE
        if (address + lo) % PAGE:
            return 0, 0
        hi = lo + (len(view) - lo) // PAGE * PAGE
        return (lo, hi) if hi - lo >= DIRECT_MIN else (0, 0)

    def write(self, data: memoryview, at: int, direct: bool) -> None:
        _pace(self.rate, self.done, self.began)
        fd = self._direct_fd() if direct else self.fd
        written = 0
        while written < len(data):
            try:
                written += os.pwrite(fd, data[written:], at + written)
            except OSError as e:
                if fd == self.fd or e.errno != errno.EINVAL:
                    raise
                self.direct = False  # O_DIRECT taken at open, refused for writes
                fd = self.fd
        self.done += len(data)

    def _direct_fd(self) -> int:
        """The ``O_DIRECT`` descriptor (opened now if need be), else the buffered one
        where the filesystem refuses ``O_DIRECT``."""
        if self.dfd is None and self.direct:
            try:
                self.dfd = os.open(self.path, self.flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        return self.dfd if self.direct and self.dfd is not None else self.fd

    def close(self) -> None:
        if self.dfd is not None:
            os.close(self.dfd)
        os.close(self.fd)
