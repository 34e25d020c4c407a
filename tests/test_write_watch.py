"""The kernel's write tracking (``saving/write_watch.py``): every CPU write to a watched
range through this process's page tables is reported once — through torch in place,
``.data``, numpy, DLPack, ``ctypes.memmove``, ``read()``, another thread, a huge page —
an untouched range is not; a write on a page two watches share reaches both; a range
no longer registered says None (taken as written); a fork's child neither breaks nor
hides the parent's writes; two watchers never share a page."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from quicksave.saving.write_watch import WriteWatch

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not WriteWatch().available(), reason="the kernel offers no async write-protect (< 6.7)"
)


@pytest.fixture
def ww() -> Iterator[WriteWatch]:
    w = WriteWatch()
    assert w.available()
    yield w
    w.close()


def _zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros on pages of their own (a private anonymous mapping): unlike a heap
    allocation, no allocator metadata or neighbour shares their edge pages, so no write
    but the test's lands there."""
    m = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=dtype)  # (the tensor keeps the mapping alive)


def _range(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel() * t.element_size()


def _watched(ww: WriteWatch, t: torch.Tensor) -> int:
    r = _range(t)
    assert ww.private_anonymous([r]) == [True]
    wid = ww.watch(*r)
    assert wid is not None
    assert ww.written(wid) is False  # nothing yet
    return wid


def _memmove(t: torch.Tensor) -> None:
    src = ctypes.create_string_buffer(b"\x01" * 16)
    ctypes.memmove(t.data_ptr() + 3 * 4096 + 8, src, 16)


def _dlpack(t: torch.Tensor) -> None:
    torch.from_dlpack(t.__dlpack__())[12345] = 7.0


WRITES = {
    "in place": lambda t: t[5].add_(1.0),
    ".data": lambda t: t.data.__setitem__(70000, 2.0),
    "numpy": lambda t: t.numpy().__setitem__(100000, 3.0),
    "dlpack": _dlpack,
    "memmove": _memmove,
    "last byte": lambda t: t[-1].fill_(9.0),
}


@pytest.mark.parametrize("how", list(WRITES))
def test_every_way_of_writing_is_reported_once(ww: WriteWatch, how: str) -> None:
    t = _zeros(MIB)  # 4 MiB
    r = _watched(ww, t)
    WRITES[how](t)
    assert ww.written(r) is True
    assert ww.written(r) is False  # re-protected by the scan: reported once
    WRITES[how](t)  # a write after the scan: reported at the next one
    assert ww.written(r) is True


def test_an_untouched_range_and_its_written_neighbour(ww: WriteWatch) -> None:
    t = _zeros(2 * MIB)
    left, right = t[:MIB], t[MIB:]  # (they may share a page at the boundary)
    rl, rr = _watched(ww, left), _watched(ww, right)
    right[MIB // 2] = 1.0  # far from it
    assert ww.written(rl) is False
    assert ww.written(rr) is True
    _ = left.sum()  # reads are not writes
    assert ww.written(rl) is False


@pytest.mark.parametrize("first", ["left", "right"])
def test_a_write_on_a_shared_page_is_reported_to_both_watches(ww: WriteWatch, first: str) -> None:
    """Two ranges sharing a page (neighbours off page boundaries): a write there is
    reported to both, whichever scans first (its scan re-protects the page)."""
    t = _zeros(2 * MIB + 16)
    left, right = t[: MIB + 8], t[MIB + 8 :]  # the boundary 32 bytes past a page's start
    assert (left.data_ptr() + left.numel() * 4) % 4096 != 0
    ids = {"left": _watched(ww, left), "right": _watched(ww, right)}
    right[0] = 1.0  # on the shared page, in right's bytes
    second = "right" if first == "left" else "left"
    assert ww.written(ids[first]) is True  # (left: the page is shared, conservatively)
    assert ww.written(ids[second]) is True
    assert ww.written(ids["left"]) is False and ww.written(ids["right"]) is False


def test_two_watches_of_the_same_range_both_see_a_write(ww: WriteWatch) -> None:
    t = _zeros(MIB)
    a, b = _watched(ww, t), _watched(ww, t)
    t[1234] = 1.0
    assert ww.written(a) is True
    assert ww.written(b) is True
    ww.unwatch(a)  # b shares every page: they stay registered for it
    t[99] = 1.0
    assert ww.written(b) is True


def test_a_kernel_write_by_read_into_the_buffer_works_and_is_reported(
    ww: WriteWatch, tmp_path
) -> None:
    """``read()`` into watched memory: the kernel's own write (copy_to_user) resolves
    the protection like a user write (no EFAULT) and is reported."""
    path = tmp_path / "src.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    t = _zeros(MIB, torch.uint8)
    r = _watched(ww, t)
    with open(path, "rb", buffering=0) as f:
        assert f.readinto(memoryview(t.numpy())[8192 : 8192 + 16384]) == 16384
    assert ww.written(r) is True
    assert t[8192 + 300].item() == 300 % 256


def test_a_write_from_another_thread_is_reported(ww: WriteWatch) -> None:
    t = _zeros(MIB)
    r = _watched(ww, t)
    th = threading.Thread(target=lambda: t[MIB - 1].fill_(1.0))
    th.start()
    th.join()
    assert ww.written(r) is True


def test_a_large_range_past_one_scan_vector_is_scanned_whole(ww: WriteWatch) -> None:
    """More written runs than one PAGEMAP_SCAN vector holds: the scan continues, and
    re-protects every page written (none is reported again)."""
    t = _zeros(16 * MIB // 4)
    r = _watched(ww, t)
    per_page = 4096 // 4
    t[:: 2 * per_page] = 1.0  # every other page: 2048 separate runs
    assert ww.written(r) is True
    assert ww.written(r) is False
    t[-1] = 2.0  # the last page, past the first vector's worth
    assert ww.written(r) is True


def test_an_unregistered_range_is_none_and_so_after_unwatch_and_close(ww: WriteWatch) -> None:
    t = _zeros(MIB)
    r = _range(t)
    assert ww.written(12345) is None  # unknown id
    wid = _watched(ww, t)
    ww.unwatch(wid)
    assert ww.written(wid) is None
    wid = ww.watch(*r)
    assert wid is not None
    ww.close()
    assert not ww.available()
    assert ww.written(wid) is None and ww.watch(*r) is None
    t[0] = 1.0  # no registration left: an ordinary write


def test_memory_freed_and_reused_at_the_same_address_is_never_clean(ww: WriteWatch) -> None:
    """A tensor freed and a new one at its address: never reported clean (its pages
    unmapped: no longer registered; reused in place: written)."""
    t = torch.zeros(8 * MIB // 4)
    r = _watched(ww, t)
    where = _range(t)
    del t
    u = torch.zeros(8 * MIB // 4)
    # unmapped and mapped anew (None), or reused in place and zeroed (True)
    assert _range(u) != where or ww.written(r) is not False
    u.fill_(1.0)
    assert _range(u) != where or ww.written(r) is not False


def test_a_forked_child_does_not_break_and_parent_writes_are_still_seen(
    ww: WriteWatch,
) -> None:
    t = _zeros(MIB)
    r = _watched(ww, t)
    pid = os.fork()
    if pid == 0:  # the child: writes its copy (not registered there), then leaves
        try:
            t.numpy()[:] = 5.0
            # its inherited descriptors watch the parent: here, nothing is ever clean
            mine = not ww.available() and ww.written(r) is None and ww.watch(*_range(t)) is None
            os._exit(0 if float(t[7]) == 5.0 and mine else 3)
        finally:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ww.written(r) is False  # the child's writes went to its own pages
    assert float(t[7]) == 0.0
    t[7] = 1.0
    assert ww.written(r) is True


def _huge_kib() -> int:
    """This process's memory mapped by transparent huge pages (KiB)."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_transparent_huge_pages_are_tracked_and_stay_whole(ww: WriteWatch) -> None:
    """Blocks whose edges fall inside huge pages, watched together: each huge page
    stays one (the mapping is split at the run's ends only), and a write to a huge page
    is reported for the block it hit."""
    size = 16 * MIB
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(m, dtype=torch.uint8)
        t.fill_(1)  # populated (as huge pages where the kernel gives them: not everywhere)
        huge = _huge_kib()
        step = 3 * MIB // 2  # (edges mid huge page)
        blocks = [t[i : i + step] for i in range(0, size, step)]  # the mapping, whole
        ids = ww.watch_many([_range(b) for b in blocks])
        assert None not in ids
        assert _huge_kib() >= huge  # none split
        blocks[2][MIB] = 2
        assert ww.written_many(ids) == {w: i == 2 for i, w in enumerate(ids)}  # type: ignore[misc]
        assert ww.written_many(ids) == dict.fromkeys(ids, False)
        del t, blocks
    finally:
        ww.close()  # (unregister before the mapping goes)
        m.close()


def test_shared_and_file_memory_is_not_private_anonymous(ww: WriteWatch, tmp_path) -> None:
    shared = torch.zeros(MIB).share_memory_()
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * MIB)
    mapped = torch.from_file(str(path), shared=False, size=MIB, dtype=torch.uint8)
    private = torch.zeros(MIB)
    answers = ww.private_anonymous([_range(shared), _range(mapped), _range(private)])
    assert answers == [False, False, True]


def test_written_many_scans_adjacent_blocks_at_once_and_hands_on_shared_pages(
    ww: WriteWatch,
) -> None:
    m = mmap.mmap(-1, 8 * MIB + 8192, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.float32)  # (its own pages: nobody else writes)
    t.fill_(0.0)
    blocks = [t[1 + i * MIB // 4 : 1 + (i + 1) * MIB // 4] for i in range(8)]  # off pages
    ids = [_watched(ww, b) for b in blocks]
    blocks[2][5000] = 1.0  # (20 KB in: on pages of its own)
    blocks[5][MIB // 8] = 1.0
    got = ww.written_many([*ids, 999])
    assert got == {**{w: i in (2, 5) for i, w in enumerate(ids)}, 999: None}
    blocks[3][0] = 1.0  # on the page block 2's last bytes share
    assert ww.written_many([ids[2]]) == {ids[2]: True}  # (shared: conservatively)
    assert ww.written_many(ids) == {w: i == 3 for i, w in enumerate(ids)}  # handed on
    ww.close()  # (before the mapping goes)
    del t, blocks
    m.close()


def test_a_failed_probe_is_unavailable_logged_once_and_watches_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from quicksave.saving import write_watch

    monkeypatch.setattr(write_watch, "_NR_USERFAULTFD", {})  # as on another platform
    w = WriteWatch()
    with caplog.at_level("INFO", logger=write_watch.__name__):
        assert not w.available() and not w.available()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "kernel write tracking unavailable" in m]) == 1, said
    t = torch.zeros(1024)
    assert w.watch(*_range(t)) is None
    assert w.written_many([1, 2]) == {1: None, 2: None}
    w.unwatch(1)
    w.close()


def test_two_watchers_in_one_process_never_share_a_page(ww: WriteWatch) -> None:
    """Two savers' watchers: the kernel gives a page to one userfaultfd only (the other
    is refused and hashes), so neither's scan can take a write the other needs."""
    other = WriteWatch()
    try:
        assert other.available()
        t = _zeros(MIB)
        r = _watched(ww, t)
        assert other.watch(*_range(t)) is None  # (EBUSY: registered by ww)
        assert other.watch(*_range(t[: MIB // 2])) is None
        t[10] = 1.0
        assert ww.written(r) is True
        m = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        u = torch.frombuffer(m, dtype=torch.uint8)  # (no page shared with t)
        assert other.watch(*_range(u)) is not None  # memory of its own: fine
        other.close()
        del u
        m.close()
    finally:
        other.close()
