"""The cold page cache of the benchmarks: a folder's files dropped from it
(:func:`evict`) and how much of them is in it afterwards (:func:`cached_fraction`,
:func:`resident_bytes`), built on :mod:`quicksave.storage.pages` (the same ``mincore``
that a cold load asks before each range). No root needed; only the folder's pages leave
the cache, not the whole machine's (``drop_caches``).

Torch-free.
"""

from __future__ import annotations

import mmap
import os

from quicksave.storage.pages import cached_pages, evict_file, libc


def files_under(folder: str) -> list[str]:
    """Every regular file under ``folder`` (sorted), the checkpoint's bytes."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.join(root, n) for n in names]
    return sorted(p for p in out if os.path.isfile(p))


def evict(folder: str) -> None:
    """Write back, then drop from the page cache, every file under ``folder``."""
    for path in files_under(folder):
        evict_file(path)


def _cached(folder: str) -> tuple[int, int] | None:
    """Pages of ``folder``'s files in the page cache, and all their pages."""
    lib = libc()
    if lib is None:
        return None
    resident = total = 0
    for path in files_under(folder):
        counts = cached_pages(path, lib)
        if counts is None:
            return None
        resident, total = resident + counts[0], total + counts[1]
    return resident, total


def cached_fraction(folder: str) -> float | None:
    """The fraction of ``folder``'s file pages in the page cache (None: no ``mincore``)."""
    counts = _cached(folder)
    if counts is None:
        return None
    return counts[0] / counts[1] if counts[1] else 0.0


def resident_bytes(folder: str) -> int:
    """Bytes of ``folder``'s files in the page cache (whole pages).

    Raises:
        OSError: the kernel cannot tell (no ``mincore`` here).
    """
    counts = _cached(folder)
    if counts is None:
        raise OSError(f"cannot tell which pages of {folder} are cached (mincore)")
    return counts[0] * mmap.PAGESIZE
