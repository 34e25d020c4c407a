"""``posix_io.write_pieces`` (an incremental checkpoint's data file, the synchronous
writer's): every piece lands where it goes, the gaps read back as zeros, every named
piece's xxh3-64 is that of its bytes. With ``o_direct``, the whole pages of a piece whose
memory sits on the same page offsets as its place in the file go through ``O_DIRECT``
and nothing else does; a filesystem that refuses ``O_DIRECT`` (at open or at write) gets
the same file through the page cache; ``rate`` paces the writes."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

import quicksave.storage.posix_io as posix_io
from quicksave.checksum import hexdigest
from quicksave.storage.posix_io import DIRECT_MIN, PAGE, write_pieces

SIZE = 64 * PAGE + 1234  # a ragged end, past the last piece: a hole


def _image() -> tuple[mmap.mmap, memoryview]:
    """Page-aligned memory holding the file's image (as a staging pool does)."""
    memory = mmap.mmap(-1, SIZE + PAGE, flags=mmap.MAP_PRIVATE)
    view = memoryview(memory)
    view[:SIZE] = os.urandom(SIZE)
    return memory, view


# (name, start, end) of the pieces: a small header, a piece with ragged ends on both
# sides, one starting on a page, a hole between, one too small for O_DIRECT
SPANS = [
    ("header", 0, 100),
    ("ragged", 1000, 1000 + 20 * PAGE + 333),
    ("paged", 24 * PAGE, 44 * PAGE + 7),
    (None, 45 * PAGE + 5, 45 * PAGE + 5 + DIRECT_MIN - 1),
]


def _expected(view: memoryview) -> bytes:
    out = bytearray(SIZE)
    for _, a, b in SPANS:
        out[a:b] = view[a:b]
    return bytes(out)


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, int, int]]:
    """Every pwrite as (through O_DIRECT, offset, length)."""
    writes: list[tuple[bool, int, int]] = []
    real = os.pwrite

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        n = real(fd, data, offset)
        writes.append((direct, offset, n))
        return n

    monkeypatch.setattr(posix_io.os, "pwrite", pwrite)
    return writes


def _direct_allowed(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def _write(path: Path, view: memoryview, shift: int = 0, **kw) -> dict[str, str]:
    pieces = [(name, a, view[a + shift : b + shift]) for name, a, b in SPANS]
    return write_pieces(str(path), SIZE, pieces, rank=3, **kw)


def _check(path: Path, view: memoryview, digests: dict[str, str]) -> None:
    assert path.read_bytes() == _expected(view)
    assert digests == {
        name: hexdigest(xxhash.xxh3_64_intdigest(view[a:b])) for name, a, b in SPANS if name
    }


def test_aligned_pieces_write_their_whole_pages_directly(tmp_path, monkeypatch):
    if not _direct_allowed(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT: nothing to test here")
    memory, view = _image()
    writes = _record_writes(monkeypatch)
    _check(tmp_path / "f", view, _write(tmp_path / "f", view, o_direct=True))
    direct = [(a, a + n) for d, a, n in writes if d]
    # exactly the whole pages of the two large pieces, nothing of the small ones
    assert _merged(direct) == _whole_pages(SPANS[1:3])
    for d, a, n in writes:
        if d:
            assert a % PAGE == 0 and n % PAGE == 0
    buffered = sum(n for d, _, n in writes if not d)
    assert buffered == sum(b - a for _, a, b in SPANS) - sum(b - a for a, b in direct)
    del view
    memory.close()


def _whole_pages(spans: list[tuple[str | None, int, int]]) -> list[tuple[int, int]]:
    return [(-(-a // PAGE) * PAGE, b // PAGE * PAGE) for _, a, b in spans]


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@pytest.mark.parametrize("o_direct", [False, True])
def test_memory_off_its_file_offsets_goes_through_the_page_cache(tmp_path, monkeypatch, o_direct):
    memory, view = _image()
    # the image 64 bytes past a page boundary, always (a heap buffer lands there by
    # chance about once in 256 runs, and then its pages would rightly go direct)
    off, shifted = _image()
    shifted[64 : 64 + SIZE] = view[:SIZE]
    writes = _record_writes(monkeypatch)
    digests = _write(tmp_path / "f", shifted, shift=64, o_direct=o_direct)
    _check(tmp_path / "f", view, digests)
    assert writes and not any(d for d, _, _ in writes)
    del view, shifted
    memory.close()
    off.close()


def test_read_only_memory_goes_through_the_page_cache(tmp_path, monkeypatch):
    memory, view = _image()
    writes = _record_writes(monkeypatch)
    pieces = [(name, a, view.toreadonly()[a:b]) for name, a, b in SPANS]
    digests = write_pieces(str(tmp_path / "f"), SIZE, pieces, rank=0, o_direct=True)
    _check(tmp_path / "f", view, digests)
    assert not any(d for d, _, _ in writes)
    del pieces, view
    memory.close()


def test_a_filesystem_refusing_o_direct_at_open_gets_the_same_file(tmp_path, monkeypatch):
    memory, view = _image()
    real = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(path, flags, *args)

    monkeypatch.setattr(posix_io.os, "open", refusing)
    writes = _record_writes(monkeypatch)
    _check(tmp_path / "f", view, _write(tmp_path / "f", view, o_direct=True))
    assert not any(d for d, _, _ in writes)
    del view
    memory.close()


def test_a_filesystem_refusing_direct_writes_gets_the_same_file(tmp_path, monkeypatch):
    if not _direct_allowed(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT at open already")
    memory, view = _image()
    real = os.pwrite
    refused: list[int] = []

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(posix_io.os, "pwrite", refusing)
    _check(tmp_path / "f", view, _write(tmp_path / "f", view, o_direct=True))
    assert len(refused) == 1  # tried once, then buffered for the rest
    del view
    memory.close()


def test_another_write_error_names_the_file_and_rank(tmp_path, monkeypatch):
    memory, view = _image()

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(posix_io.os, "pwrite", full)
    with pytest.raises(posix_io.CheckpointError, match="ENOSPC") as info:
        _write(tmp_path / "f", view, o_direct=True)
    assert str(tmp_path / "f") in str(info.value) and "rank=3" in str(info.value)
    del info, view
    memory.close()


def test_a_paced_write_takes_its_bytes_over_the_rate(tmp_path, monkeypatch):
    memory, view = _image()
    now, slept = [1000.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    # posix_io's own view of the time module only (other threads keep the real clock)
    monkeypatch.setattr(posix_io, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    monkeypatch.setattr(posix_io, "WRITE_PIECE", 8 * PAGE)
    rate = 1 << 20
    writes = _record_writes(monkeypatch)
    _check(tmp_path / "f", view, _write(tmp_path / "f", view, o_direct=True, rate=rate))
    total = sum(b - a for _, a, b in SPANS)
    # due when the bytes before the last write are: no write runs ahead of the rate
    assert sum(slept) == pytest.approx((total - writes[-1][2]) / rate)
    del view
    memory.close()
