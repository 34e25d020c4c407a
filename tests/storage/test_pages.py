"""The kernel's pages through libc: a cached file's pages counted, an evicted file's
gone, and memory faulted in with its contents kept (a load may be writing it)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import pytest

from quicksave.storage.pages import cached_pages, evict_file, libc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, madvise")


def test_a_written_file_is_cached_and_an_evicted_one_is_not(tmp_path):
    lib = libc()
    assert lib is not None
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 * mmap.PAGESIZE + 7))
    assert cached_pages(path, lib) == (6, 6)
    evict_file(path)
    resident, total = cached_pages(path, lib)
    assert total == 6
    assert resident == 0 or _filesystem(path) == "tmpfs"  # (tmpfs has no disk to drop to)
    (tmp_path / "empty").write_bytes(b"")
    assert cached_pages(tmp_path / "empty", lib) == (0, 0)


def _filesystem(path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fs = line.split()[:3]
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(
                best
            ):
                best, kind = point, fs
    return kind


def test_populate_keeps_the_memory_s_contents():
    lib = libc()
    assert lib is not None
    size = 64 * mmap.PAGESIZE
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    data = os.urandom(size // 2)
    memory[: len(data)] = data  # half written, half never touched
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    lib.populate(address + 100, size - 200)  # unaligned ends: the whole pages inside
    assert memory[: len(data)] == data
    assert memory[len(data) :] == bytes(size - len(data))
