"""Reading a local file's bytes that are not in the page cache with ``O_DIRECT``.

A buffered read of a cold file costs the CPU twice over: the kernel fills a page-cache
page, then copies it to the caller (and later evicts it). With ``O_DIRECT`` the device
writes into the caller's memory, so a restore of a checkpoint that is not cached is
bounded by the disk, not by those copies. ``O_DIRECT`` needs the file offset, the
length and the memory address aligned (:data:`ALIGN`): where the destination's address
agrees with the file offset the bytes go straight there, otherwise through a small
aligned buffer per thread, from which they are copied while still in the CPU's cache
(and handed to ``seen``, a checksum's ``update``, on the same pass).

Bytes already in the page cache are read buffered (a copy from memory beats any
device): :meth:`ColdReader.resident` asks the kernel (``mincore``,
:mod:`quicksave.storage.pages`) before each range.
On a filesystem without ``O_DIRECT`` (tmpfs) or where the reopen fails, every read is
buffered, as before.

Torch-free: the worker process imports the storage layer.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable

from quicksave.storage.pages import Libc, libc

ALIGN = 4096  # O_DIRECT: offsets, lengths and addresses (covers 512 and 4096 devices)
BOUNCE = 4 << 20  # one thread's aligned buffer: fits the CPU's cache with its copy
DIRECT_MAX = 64 << 20  # a straight read into the destination, at most, per call
COLD_MIN = 1 << 20  # ranges shorter than this are read buffered (no reopen, no check)

Seen = Callable[[memoryview], object]


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class ColdReader:
    """``O_DIRECT`` reads of one open local file (``fd``, kept by its owner), each
    thread through its own aligned buffer; closed by :meth:`close`.

    Call order: :meth:`resident` (is the range cached?) → :meth:`read_into` for a range
    that is not; any thread, concurrently.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self._libc: Libc | None = None  # loaded by the first range worth asking about
        self._direct: int | None = None  # the O_DIRECT descriptor, opened on first use
        self._off = not sys.platform.startswith("linux") or not hasattr(os, "O_DIRECT")
        self._lock = threading.Lock()
        self._local = threading.local()
        self._buffers: list[mmap.mmap] = []

    def resident(self, offset: int, length: int) -> bool:
        """Whether ``offset .. offset+length`` is best read buffered: cached (or small,
        or ``O_DIRECT`` is not available here)."""
        if self._off or length < COLD_MIN:
            return True
        if self._libc is None:
            self._libc = libc()
            if self._libc is None:
                self._off = True
                return True
        counts = self._libc.resident_pages(self.fd, offset, length)
        return counts is None or counts[0] == counts[1]

    def read_into(self, view: memoryview, offset: int, seen: Seen | None) -> int:
        """Fill ``view`` from ``offset`` with ``O_DIRECT``, handing each piece to
        ``seen`` as it lands; returns the bytes read: fewer where the file ends, or
        where the filesystem refused ``O_DIRECT`` (then every later read of this file
        is left to the caller's buffered reads)."""
        got = 0
        while got < len(view):
            fd = self._direct_fd()
            if fd is None:
                break
            try:
                n = self._piece(fd, view[got:], offset + got, seen)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._off = True  # alignment refused (another block size): buffered
                break
            if n == 0:
                break
            got += n
        return got

    def _piece(self, fd: int, dest: memoryview, pos: int, seen: Seen | None) -> int:
        """Some bytes of ``dest`` from ``pos``: straight into it when its address agrees
        with ``pos`` (at most ``DIRECT_MAX``), else through this thread's buffer."""
        if pos % ALIGN == 0 and len(dest) >= ALIGN and _address(dest) % ALIGN == 0:
            k = min(len(dest) - len(dest) % ALIGN, DIRECT_MAX)
            n = os.preadv(fd, [dest[:k]], pos)
            if n and seen is not None:
                seen(dest[:n])
            return n
        buf = self._buffer()
        start = pos - pos % ALIGN
        skip = pos - start
        want = min(len(dest) + skip, len(buf))
        want += -want % ALIGN
        n = os.preadv(fd, [buf[:want]], start)
        n = max(0, min(n - skip, len(dest)))
        if n:
            piece = buf[skip : skip + n]
            ctypes.memmove(_address(dest), _address(piece), n)  # without the GIL
            if seen is not None:
                seen(piece)
        return n

    def _direct_fd(self) -> int | None:
        if self._off:
            return None
        if self._direct is None:
            with self._lock:
                if self._direct is None and not self._off:
                    try:  # the same open file, not the path again (it may have changed)
                        self._direct = os.open(
                            f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC
                        )
                    except OSError:
                        self._off = True
        return None if self._off else self._direct

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, BOUNCE, flags=mmap.MAP_PRIVATE)
            with self._lock:
                self._buffers.append(buf)
        return memoryview(buf)

    def close(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        self._local = threading.local()
        for buf in self._buffers:
            try:
                buf.close()
            except BufferError:  # a view of it still alive elsewhere: freed with it
                pass
        self._buffers.clear()
