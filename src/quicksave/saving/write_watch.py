"""The kernel's own write tracking of this process's memory (Linux ≥ 6.7): which pages
of a range were written since they were last protected.

A userfaultfd in *async write-protect* mode (``UFFD_FEATURE_WP_ASYNC``) marks the pages
of a registered range write-protected (``UFFDIO_WRITEPROTECT``); the first write to
such a page after that is resolved by the kernel itself (no handler thread, no signal:
the writer only takes a minor fault) and clears the page's mark. The ``PAGEMAP_SCAN``
ioctl on ``/proc/self/pagemap`` reports the pages whose mark is gone and puts it back,
atomically, page by page. Every CPU write through this process's page tables is seen:
any thread, any kernel, ``.data``, numpy and DLPack views, ``read()`` into the buffer.
Not seen: writes that do not go through them (DMA into pinned memory, another process
writing shared memory) — callers watch private anonymous, unpinned memory only
(:meth:`WriteWatch.private_anonymous`). A page discarded (``MADV_DONTNEED``) reads as
zeros without counting as written: callers hold the memory they watch.

Call order (one thread, the owner's): :meth:`WriteWatch.available` (probes once) →
:meth:`WriteWatch.watch` a range (register, protect) → :meth:`WriteWatch.written` at
each check (reports and re-protects) → :meth:`WriteWatch.unwatch` / :meth:`close`
(closing the descriptor drops every registration). Constants and layouts are those of
the kernel's UAPI headers ``linux/userfaultfd.h`` and ``linux/fs.h``.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import os
import sys

log = logging.getLogger(__name__)

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 64  # page_region entries per PAGEMAP_SCAN call


def _iowr(kind: int, nr: int, size: int, read_only: bool = False) -> int:
    """An ioctl request number (``_IOWR`` / ``_IOR`` of asm-generic/ioctl.h)."""
    direction = 2 if read_only else 3  # _IOC_READ (2) | _IOC_WRITE (1)
    return (direction << 30) | (size << 16) | (kind << 8) | nr


class _Range(ctypes.Structure):
    _fields_ = (("start", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Api(ctypes.Structure):
    _fields_ = (
        ("api", ctypes.c_uint64),
        ("features", ctypes.c_uint64),
        ("ioctls", ctypes.c_uint64),
    )


class _Register(ctypes.Structure):
    _fields_ = (("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64))


class _WriteProtect(ctypes.Structure):
    _fields_ = (("range", _Range), ("mode", ctypes.c_uint64))


class _PageRegion(ctypes.Structure):
    _fields_ = (
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("categories", ctypes.c_uint64),
    )


class _ScanArg(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    )


_UFFDIO_API = _iowr(_UFFD_API, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(_UFFD_API, 0x00, ctypes.sizeof(_Register))
_UFFDIO_UNREGISTER = _iowr(_UFFD_API, 0x01, ctypes.sizeof(_Range), read_only=True)
_UFFDIO_WRITEPROTECT = _iowr(_UFFD_API, 0x06, ctypes.sizeof(_WriteProtect))
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_ScanArg))


class WriteWatch:
    """Watches ranges of this process's memory for writes (one userfaultfd, one
    ``/proc/self/pagemap`` descriptor, opened by :meth:`available`).

    Not thread-safe: one owner thread calls every method. Ranges are widened to whole
    pages, so a write to a neighbour on a shared page counts (never the reverse).
    """

    def __init__(self) -> None:
        self._probed = False
        self._uffd = -1
        self._pagemap = -1
        self._libc: ctypes.CDLL | None = None
        self._page = 4096
        self._vec = (_PageRegion * _REGIONS)()
        self._why = ""

    # ------------------------------------------------------------------ setup
    def available(self) -> bool:
        """Whether the kernel tracks writes for this process (probed once: False on
        non-Linux, kernels without ``UFFD_FEATURE_WP_ASYNC`` or ``PAGEMAP_SCAN``, no
        permission, any error; the reason is logged once at info)."""
        if not self._probed:
            self._probed = True
            try:
                self._open()
            except OSError as e:
                self._why = str(e)
                self.close()
                log.info("kernel write tracking unavailable, hashing instead: %s", e)
        return self._uffd >= 0

    def _open(self) -> None:
        nr = _NR_USERFAULTFD.get(os.uname().machine) if sys.platform == "linux" else None
        if nr is None:
            raise OSError(errno.ENOSYS, f"no userfaultfd on {sys.platform}/{os.uname().machine}")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
        libc.ioctl.restype = ctypes.c_int
        self._libc = libc
        flags = os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY
        fd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(flags))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"userfaultfd(): {os.strerror(e)}")
        self._uffd = int(fd)
        want = _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED
        api = _Api(_UFFD_API, want, 0)
        self._ioctl(self._uffd, _UFFDIO_API, api, "UFFDIO_API (WP_ASYNC | WP_UNPOPULATED)")
        if api.features & want != want:
            raise OSError(errno.ENOTSUP, f"userfaultfd features {api.features:#x} lack WP_ASYNC")
        self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self._page = os.sysconf("SC_PAGE_SIZE")
        # a scan of an unregistered range must fail with EPERM: PAGEMAP_SCAN is there
        probe = ctypes.create_string_buffer(2 * self._page)
        start, end = self._pages(ctypes.addressof(probe), self._page)
        arg = self._scan_arg(start, end)
        if self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg)) >= 0:
            raise OSError(errno.ENOTSUP, "PAGEMAP_SCAN accepted an unregistered range")
        e = ctypes.get_errno()
        if e != errno.EPERM:
            raise OSError(e, f"PAGEMAP_SCAN: {os.strerror(e)}")

    def _ioctl(self, fd: int, request: int, arg: ctypes.Structure, what: str) -> None:
        assert self._libc is not None
        if self._libc.ioctl(fd, request, ctypes.byref(arg)) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    def _pages(self, ptr: int, nbytes: int) -> tuple[int, int]:
        """``[ptr, ptr + nbytes)`` widened to whole pages."""
        page = self._page
        return ptr // page * page, -(-(ptr + nbytes) // page) * page

    def _scan_arg(self, start: int, end: int) -> _ScanArg:
        return _ScanArg(
            size=ctypes.sizeof(_ScanArg),
            flags=_PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC,
            start=start,
            end=end,
            vec=ctypes.addressof(self._vec),
            vec_len=_REGIONS,
            category_mask=_PAGE_IS_WRITTEN,
            return_mask=_PAGE_IS_WRITTEN,
        )

    # ------------------------------------------------------------------ ranges
    def private_anonymous(self, ranges: list[tuple[int, int]]) -> list[bool]:
        """For each ``(ptr, nbytes)``: whether its pages all lie in private anonymous
        mappings (``/proc/self/maps``, read once), where every write goes through this
        process's page tables (not a file's pages, not memory shared with another
        process)."""
        spans: list[tuple[int, int, bool]] = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, _, hi = fields[0].partition("-")
                private = fields[1][3:4] == "p"
                spans.append((int(lo, 16), int(hi, 16), private and fields[4] == "0"))
        starts = [s[0] for s in spans]
        out = []
        for ptr, nbytes in ranges:
            start, end = self._pages(ptr, nbytes)
            i = bisect.bisect_right(starts, start) - 1
            ok = i >= 0
            at = start
            while ok and at < end:  # adjacent spans must cover [start, end)
                ok = i < len(spans) and spans[i][0] <= at < spans[i][1] and spans[i][2]
                if ok:
                    at = spans[i][1]
                    i += 1
            out.append(bool(ok))
        return out

    def watch(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` (whole pages) for async write-protect and
        protect it (again): :meth:`written` then reports writes made from now on.
        False: not watched (the kernel refused; the range may be unregistered)."""
        if not self.available() or nbytes <= 0:
            return False
        start, end = self._pages(ptr, nbytes)
        try:
            reg = _Register(_Range(start, end - start), _REGISTER_MODE_WP, 0)
            self._ioctl(self._uffd, _UFFDIO_REGISTER, reg, "UFFDIO_REGISTER")
            wp = _WriteProtect(_Range(start, end - start), _WRITEPROTECT_MODE_WP)
            self._ioctl(self._uffd, _UFFDIO_WRITEPROTECT, wp, "UFFDIO_WRITEPROTECT")
        except OSError as e:
            log.debug("not watching %#x+%d: %s", ptr, nbytes, e)
            return False
        return True

    def written(self, ptr: int, nbytes: int) -> bool | None:
        """Whether any page of ``[ptr, ptr + nbytes)`` was written since it was last
        protected; the pages written are protected again (atomically with the report).
        None: the range is not (any more) watched, or the scan failed — callers take
        it as written."""
        if not self.available() or nbytes <= 0:
            return None
        assert self._libc is not None
        start, end = self._pages(ptr, nbytes)
        found = False
        while start < end:
            arg = self._scan_arg(start, end)
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                log.debug("PAGEMAP_SCAN %#x+%d: %s", ptr, nbytes, os.strerror(ctypes.get_errno()))
                return None
            found = found or n > 0
            if arg.walk_end <= start:
                return None  # (no progress: never loop forever)
            start = arg.walk_end  # (the vector filled up: scan and re-protect the rest)
        return found

    def unwatch(self, ptr: int, nbytes: int) -> None:
        """Stop watching the range (whole pages: a neighbour sharing a page is then
        unwatched too, and its next :meth:`written` says None)."""
        if self._uffd < 0 or nbytes <= 0:
            return
        start, end = self._pages(ptr, nbytes)
        try:
            self._ioctl(self._uffd, _UFFDIO_UNREGISTER, _Range(start, end - start), "unregister")
        except OSError as e:
            log.debug("UFFDIO_UNREGISTER %#x+%d: %s", ptr, nbytes, e)

    def close(self) -> None:
        """Close both descriptors: every registration goes (idempotent). A later
        :meth:`available` stays False."""
        for fd in (self._uffd, self._pagemap):
            if fd >= 0:
                os.close(fd)
        self._uffd = self._pagemap = -1
        self._probed = True
