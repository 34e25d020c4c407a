"""The kernel's pages, through libc (ctypes; the stdlib's ``mmap`` has no ``mincore``
and no ``MADV_POPULATE_WRITE``): which pages of a file are in the page cache, dropping
a file from it, and faulting fresh anonymous memory in before it is used.

- :meth:`Libc.resident_pages` (``mincore``): how much of a file's range is cached. A
  cold read (:mod:`.cold_read`) asks it before each range; a benchmark, after evicting.
- :func:`evict_file` (``fsync`` + ``posix_fadvise(DONTNEED)``): a file out of the page
  cache (a dirty page cannot be dropped, hence the write-back first); no root needed.
- :meth:`Libc.populate` (``madvise(MADV_POPULATE_WRITE)``): every page of a range of
  this process's memory faulted in, writable, contents kept, without the GIL (a
  ctypes call). A fresh job's optimizer state is new memory: its first touch costs
  the kernel one fault per page (about 0.4 s of CPU per GiB on a VM); taken ahead, on
  a thread, while the load waits on the disk, it is not taken later, beside the
  training thread's first forward and backward.

Torch-free: the worker process imports the storage layer.
"""

from __future__ import annotations

import ctypes
import mmap
import os

_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: bit 0 of each page's byte
_MADV_POPULATE_WRITE = 23  # Linux 5.14+ (older kernels: EINVAL, nothing done)


class Libc:
    """``mmap`` / ``mincore`` / ``munmap`` / ``madvise`` of the process's libc.

    Raises (on construction):
        OSError, AttributeError: no such libc here (see :func:`libc`).
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: libc's
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.lib = lib

    def resident_pages(self, fd: int, offset: int, length: int) -> tuple[int, int] | None:
        """How many pages of ``fd``'s ``offset .. offset+length`` are in the page cache,
        and how many pages the range spans; None when the kernel cannot tell."""
        page = mmap.PAGESIZE
        start = offset - offset % page
        size = offset + length - start
        if size <= 0:
            return 0, 0
        addr = self.lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            if self.lib.mincore(addr, size, vec) != 0:
                return None
            return pages - vec.raw[:pages].translate(_LOW_BIT).count(0), pages
        finally:
            self.lib.munmap(addr, size)

    def populate(self, address: int, length: int) -> bool:
        """Fault in, writable, the whole pages of this process's memory inside
        ``address .. address+length`` (their contents kept: safe while another thread
        writes them); False where the kernel cannot (before Linux 5.14)."""
        page = mmap.PAGESIZE
        start = address + -address % page
        end = address + length - (address + length) % page
        if end <= start:
            return True
        return self.lib.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0


def libc() -> Libc | None:
    """The process's :class:`Libc`, or None where ctypes cannot reach one."""
    try:
        return Libc()
    except (OSError, AttributeError):
        return None


def evict_file(path: str | os.PathLike[str]) -> None:
    """Write ``path``'s dirty pages back, then drop all its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_pages(path: str | os.PathLike[str], lib: Libc) -> tuple[int, int] | None:
    """The pages of the file ``path`` in the page cache, and all its pages (``(0, 0)``
    for an empty file); None when the kernel cannot tell."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return lib.resident_pages(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
