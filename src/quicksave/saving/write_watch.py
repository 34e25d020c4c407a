"""The kernel's own write tracking of this process's memory (Linux ≥ 6.7): which pages
of a range were written since they were last protected.

The pages of a range registered with a userfaultfd in *async write-protect* mode
(``UFFD_FEATURE_WP_ASYNC``) carry a write-protect mark; the first write to a marked page
is resolved by the kernel itself (no handler thread, no signal: the writer only takes
a minor fault) and clears the mark. The ``PAGEMAP_SCAN`` ioctl on ``/proc/self/pagemap``
(``PM_SCAN_WP_MATCHING``) reports the pages without the mark — written since, or never
protected — and puts it back, atomically, page by page. Every CPU write through this
process's page tables is seen: any thread, any kernel, ``.data``, numpy and DLPack
views, ``read()`` into the buffer.
Not seen: writes that do not go through them (DMA into pinned memory, another process
writing shared memory) — callers watch private anonymous, unpinned memory only
(:meth:`WriteWatch.private_anonymous`). A page discarded (``MADV_DONTNEED``) reads as
zeros without counting as written: callers hold the memory they watch.

Call order (one thread, the owner's): :meth:`WriteWatch.available` (probes once) →
:meth:`WriteWatch.watch` a range (register, protect; returns the watch's id) →
:meth:`WriteWatch.written` of that id at each check (reports and re-protects) →
:meth:`WriteWatch.unwatch` / :meth:`close` (closing the descriptor drops every
registration). Ranges are widened to whole pages, so two watches may share a page (a
neighbour's edge, an alias): a write there is reported to both, whichever scans first.
Constants and layouts are those of the kernel's UAPI headers ``linux/userfaultfd.h``
and ``linux/fs.h``.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import logging
import mmap
import os
import sys
import weakref

log = logging.getLogger(__name__)

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFD_USER_MODE_ONLY = 1
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
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
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_ScanArg))


def _close_fds(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


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
        self._ids = itertools.count(1)
        self._ranges: dict[int, tuple[int, int]] = {}  # watch id -> its pages [start, end)
        self._starts: list[tuple[int, int]] = []  # (start, id), sorted
        self._longest = 0  # the longest range watched (bounds the overlap search)
        self._dirty: set[int] = set()  # watches written on a page another's scan took
        # the runs of the latest written_many's ids (unknown ids, [start, end, members]);
        # None once a watch comes or goes
        self._runs: tuple[tuple[int, ...], list[int], list[list]] | None = None
        self._pid = -1  # the process whose memory the descriptors watch
        self._finalizer: weakref.finalize | None = None

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
                self.close()
                log.info("kernel write tracking unavailable, hashing instead: %s", e)
        # (a forked child: the descriptors watch its parent's memory, never its own)
        return self._uffd >= 0 and os.getpid() == self._pid

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
        self._pid = os.getpid()
        # (an owner dropped unclosed: the registrations go with the descriptors)
        self._finalizer = weakref.finalize(self, _close_fds, self._uffd, self._pagemap)
        self._page = os.sysconf("SC_PAGE_SIZE")
        # a scan of an unregistered range must fail with EPERM: PAGEMAP_SCAN is there
        # (a fresh mapping of its own: no other watcher of this process registered it)
        probe = mmap.mmap(-1, self._page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            at = ctypes.c_char.from_buffer(probe)
            arg = self._scan_arg(ctypes.addressof(at), ctypes.addressof(at) + self._page)
            del at
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            e = ctypes.get_errno()
        finally:
            probe.close()
        if n >= 0:
            raise OSError(errno.ENOTSUP, "PAGEMAP_SCAN accepted an unregistered range")
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

    def watch(self, ptr: int, nbytes: int) -> int | None:
        """Register ``[ptr, ptr + nbytes)`` (whole pages) for async write-protect and
        protect it: :meth:`written` of the id returned then reports writes made from
        now on. None: not watched (the kernel refused: another userfaultfd has one of
        its pages, or the memory cannot be).

        Protection is by a scan that protects what it reports (not
        ``UFFDIO_WRITEPROTECT``): a page this range shares with another watch (a
        neighbour's edge page, an alias) may hold a write that watch has not seen yet,
        and the scan hands it on instead of wiping it."""
        return self.watch_many([(ptr, nbytes)])[0]

    def watch_many(self, ranges: list[tuple[int, int]]) -> list[int | None]:
        """:meth:`watch` of each ``(ptr, nbytes)``, registering and protecting each run
        of adjacent or overlapping ranges (a tensor's blocks) at once: the mapping is
        split only at the run's ends (a transparent huge page inside stays whole)."""
        out: list[int | None] = [None] * len(ranges)
        if not self.available():
            return out
        pages = sorted((*self._pages(p, n), i) for i, (p, n) in enumerate(ranges) if n > 0)
        runs: list[tuple[int, int, list[int]]] = []
        for s, e, i in pages:
            if runs and s <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], e), [*runs[-1][2], i])
            else:
                runs.append((s, e, [i]))
        for s, e, members in runs:
            try:
                self._ioctl(
                    self._uffd,
                    _UFFDIO_REGISTER,
                    _Register(_Range(s, e - s), _REGISTER_MODE_WP, 0),
                    "UFFDIO_REGISTER",
                )
            except OSError as err:
                log.debug("not watching %#x+%d: %s", s, e - s, err)
                if len(members) > 1:  # (each alone: a part may still be watched)
                    for i in members:
                        out[i] = self.watch(*ranges[i])
                continue
            wids = []
            for i in members:
                rs, re_ = self._pages(*ranges[i])
                wid = out[i] = next(self._ids)
                self._ranges[wid] = (rs, re_)
                self._runs = None
                bisect.insort(self._starts, (rs, wid))
                self._longest = max(self._longest, re_ - rs)
                wids.append(wid)
            # (pages never protected read as written: the scan protects them, and hands
            # a pending write on a page shared with another watch to that one)
            regions, whole = self._scan_span(s, e)
            self._deliver(regions, set(wids))
            if not whole:
                for i, wid in zip(members, wids, strict=True):
                    self._forget(wid)
                    out[i] = None
        return out

    def _scan_span(self, start: int, end: int) -> tuple[list[tuple[int, int]], bool]:
        """PAGEMAP_SCAN over the pages ``[start, end)``: the runs of pages written since
        protected (protected again, atomically), and whether the whole span was
        scanned (False: a page not registered, or the scan failed, at some point;
        the runs found before are still returned: they were protected again)."""
        assert self._libc is not None
        regions: list[tuple[int, int]] = []
        while start < end:
            arg = self._scan_arg(start, end)
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                log.debug("PAGEMAP_SCAN %#x: %s", start, os.strerror(ctypes.get_errno()))
                return regions, False
            regions.extend((r.start, r.end) for r in self._vec[:n])
            if arg.walk_end <= start:
                return regions, False  # (no progress: never loop forever)
            start = arg.walk_end  # (the vector filled up: scan and re-protect the rest)
        return regions, True

    def _deliver(self, regions: list[tuple[int, int]], asked: set[int]) -> set[int]:
        """The watches of ``asked`` that ``regions`` (written, now protected again)
        touch; every other watch they touch is marked written for its next check."""
        hit: set[int] = set()
        starts, ranges = self._starts, self._ranges
        for rs, re_ in regions:
            lo = bisect.bisect_left(starts, (rs - self._longest, -1))
            hi = bisect.bisect_left(starts, (re_, -1))  # (those before start below re_)
            for _, wid in starts[lo:hi]:
                if ranges[wid][1] > rs:
                    (hit if wid in asked else self._dirty).add(wid)
        return hit

    def written(self, wid: int) -> bool | None:
        """Whether any page of watch ``wid`` was written since it was last protected
        (by :meth:`watch` or the previous check); the pages written are protected
        again, atomically with the report. None: the range is not (any more)
        registered, the scan failed or ``wid`` is unknown — callers take it as
        written."""
        return self.written_many([wid])[wid]

    def written_many(self, wids: list[int]) -> dict[int, bool | None]:
        """:meth:`written` of each of ``wids``, with one scan per run of adjacent or
        overlapping ranges (a tensor's blocks: one scan for all of them)."""
        if not self.available():
            return dict.fromkeys(wids)
        key = tuple(wids)
        if self._runs is None or self._runs[0] != key:  # (a steady set: sorted once)
            unknown = [w for w in wids if w not in self._ranges]
            runs: list[list] = []  # [start, end, members]
            for s, e, wid in sorted((*self._ranges[w], w) for w in wids if w in self._ranges):
                if runs and s <= runs[-1][1]:
                    run = runs[-1]
                    run[1] = max(run[1], e)
                    run[2].append(wid)
                else:
                    runs.append([s, e, [wid]])
            self._runs = (key, unknown, runs)
        _, unknown, runs = self._runs
        out: dict[int, bool | None] = dict.fromkeys(unknown)
        for s, e, members in runs:
            regions, whole = self._scan_span(s, e)
            if whole and not regions and not self._dirty:
                out.update(dict.fromkeys(members, False))  # (nothing written: the usual)
                continue
            hit = self._deliver(regions, set(members))
            for wid in members:
                out[wid] = (wid in hit or wid in self._dirty) if whole else None
                self._dirty.discard(wid)  # (a write another watch's scan took for it)
        return out

    def _forget(self, wid: int) -> tuple[int, int] | None:
        rng = self._ranges.pop(wid, None)
        if rng is not None:
            self._runs = None
            self._starts.remove((rng[0], wid))
            self._dirty.discard(wid)
        return rng

    def _overlapping(self, wid: int) -> list[tuple[int, int, int]]:
        """The other watches sharing a page with ``wid``'s: (start, end, id)."""
        start, end = self._ranges[wid]
        lo = bisect.bisect_left(self._starts, (start - self._longest, -1))
        hi = bisect.bisect_left(self._starts, (end, -1))
        out = []
        for s, other in self._starts[lo:hi]:
            e = self._ranges[other][1]
            if other != wid and e > start:
                out.append((s, e, other))
        return out

    def unwatch(self, wid: int) -> None:
        """Stop watching ``wid``: its pages are unregistered, but those another watch
        shares (they stay registered for it)."""
        if wid not in self._ranges or not self.available():
            self._forget(wid)
            return
        start, end = self._ranges[wid]
        for s, e, _ in self._overlapping(wid):  # (pages another watch shares stay)
            if s <= start:
                start = max(start, e)
            if e >= end:
                end = min(end, s)
            if s > start and e < end:  # (one inside: keep it all)
                start = end
        self._forget(wid)
        if start >= end:
            return
        try:
            self._ioctl(self._uffd, _UFFDIO_UNREGISTER, _Range(start, end - start), "unregister")
        except OSError as e:
            log.debug("UFFDIO_UNREGISTER %#x: %s", start, e)

    def close(self) -> None:
        """Close both descriptors: every registration goes (idempotent). A later
        :meth:`available` stays False."""
        if self._finalizer is not None:
            self._finalizer()  # (closes both, once)
        elif self._uffd >= 0 or self._pagemap >= 0:
            _close_fds(self._uffd, self._pagemap)
        self._uffd = self._pagemap = -1
        self._probed = True
        self._ranges.clear()
        self._starts.clear()
        self._dirty.clear()
        self._runs = None
