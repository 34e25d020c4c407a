"""Stage: hold the system's recently freed pages while a staging pool is allocated.

:func:`shield_free_pages` is entered around a pool's allocation (``StagingPool`` with
``populate=True``, in the process that builds the pool; no other rank is involved) and
left right after it, so that the pool takes fresh pages and the pages a training loop
frees and takes again at every step go back to it (see the function).
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterator

import torch

_HEADROOM = 1 << 30  # memory a page shield always leaves available to everyone else


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


_SHIELD_CHUNK = 64 << 20  # pages held per step of a shield
_PROBE = 16 << 20  # bytes faulted in to time recently freed pages


def _fault_in(view: torch.Tensor, start: int, stop: int) -> float:
    """Write one byte per page of ``view[start:stop]``; return the seconds it took."""
    t0 = time.perf_counter()
    view[start : stop : mmap.PAGESIZE].fill_(1)
    return time.perf_counter() - t0


@contextlib.contextmanager
def shield_free_pages(nbytes: int) -> Iterator[int]:
    """Hold the system's recently freed pages (up to ``nbytes``) while a pool is
    allocated, then give them back; yields the bytes held.

    The kernel hands out the most recently freed pages first, and those are the pages a
    training loop frees and takes again at every step (gradients, activations). A pool
    allocated without this shield takes them, and the next training steps get pages
    that have sat free long enough to be cold: on a VM with free-page reporting
    (virtio-balloon) the host has taken them back, and every first touch of such a page
    costs a host fault, so the steps after a pool is built slow down with no more
    (guest) page faults than usual (docs/benchmarks.md, "Training-loop overhead on three
    model shapes", has the figures). Held by this shield, the recycled pages stay out of the
    pool's reach, the pool takes (and pays for) fresh pages, and once the shield is
    released the recycled pages are the first ones handed out again.

    The shield takes pages 64 MiB at a time and stops at the first step whose pages
    fault in 3× slower than recently freed ones (timed first, on 16 MiB): from there on
    it would only hold cold pages, which training does not use, and pay their faults.
    It never takes memory that would leave less than 1 GiB available.
    """
    limit = min(nbytes, max(0, _available_bytes() - nbytes - _HEADROOM))
    limit -= limit % mmap.PAGESIZE
    if limit < 2 * _SHIELD_CHUNK:
        yield 0
        return
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    held = mmap.mmap(-1, limit, flags=flags)
    pages = torch.frombuffer(held, dtype=torch.uint8)
    size = 0
    try:
        probe = mmap.mmap(-1, _PROBE, flags=flags | getattr(mmap, "MAP_POPULATE", 0))
        probe.close()  # freed just now: the next fault-in of that size takes these pages
        hot = _fault_in(pages, 0, _PROBE) * (_SHIELD_CHUNK / _PROBE)
        size = _PROBE
        while size < limit:
            stop = min(limit, size + _SHIELD_CHUNK)
            took = _fault_in(pages, size, stop) * _SHIELD_CHUNK / (stop - size)
            size = stop
            if took > 3 * hot:
                break  # cold pages from here on: every recycled page is held
        yield size
    finally:
        del pages
        held.close()
