"""Cold reads of local files (``storage/cold_read.py``): ``O_DIRECT`` straight into an
aligned destination or through a per-thread buffer, the same bytes whatever the offset,
length and address; every piece handed to ``seen`` in order; short only where the file
ends; buffered reads where ``O_DIRECT`` is refused. Through a checkpoint's member and a
whole load, a cold chunk is checked like any other."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest
import torch

import quicksave
from quicksave.errors import CorruptCheckpointError
from quicksave.storage import cold_read
from quicksave.storage.checkpoint_dir import CheckpointDir
from quicksave.storage.cold_read import ALIGN, ColdReader
from quicksave.storage.location import parse_location

SIZE = 3 * cold_read.BOUNCE + 12_345  # several buffers' worth, a ragged end


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(SIZE)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold, where the fs can
    finally:
        os.close(fd)
    return str(path), data


def _read(path: str, view: memoryview, offset: int) -> tuple[int, bytes]:
    fd = os.open(path, os.O_RDONLY)
    reader = ColdReader(fd, os.path.getsize(path))
    pieces: list[bytes] = []
    try:
        got = reader.read_into(view, offset, lambda p: pieces.append(bytes(p)))
    finally:
        reader.close()
        os.close(fd)
    return got, b"".join(pieces)


@pytest.mark.parametrize(
    "offset, length, shift",
    [
        (0, SIZE, 0),  # aligned file and memory: straight into the destination
        (0, SIZE, 64),  # memory off the page (a torch allocation): through the buffer
        (4096 * 3, 2 * cold_read.BOUNCE, 0),
        (777, cold_read.BOUNCE + 5, 0),  # unaligned offset, aligned memory
        (777, cold_read.BOUNCE + 5, 777),  # both off by the same: straight after the head
        (SIZE - 100, 100, 3),
    ],
)
def test_cold_read_gives_the_file_bytes(data_file, offset, length, shift):
    path, data = data_file
    memory = mmap.mmap(-1, length + shift + ALIGN, flags=mmap.MAP_PRIVATE)
    view = memoryview(memory)[shift : shift + length]
    got, seen = _read(path, view, offset)
    assert got == length
    assert bytes(view) == data[offset : offset + length]
    assert seen == data[offset : offset + length]  # every piece, once, in order
    del view
    memory.close()


def test_cold_read_is_short_only_where_the_file_ends(data_file):
    path, data = data_file
    view = memoryview(bytearray(1000))
    got, seen = _read(path, view, SIZE - 300)
    assert got == 300
    assert bytes(view[:300]) == data[-300:] == seen


def test_refused_o_direct_leaves_the_read_to_buffered_reads(data_file, monkeypatch):
    path, data = data_file

    real_open = os.open

    def refuse(path, flags, *args, **kwargs):  # as tmpfs does
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    got, _ = _read(path, memoryview(bytearray(10)), 0)
    assert got == 0  # nothing read with O_DIRECT ...
    d = CheckpointDir(parse_location(str(Path(path).parent)))
    member = d.open("blob")
    try:  # ... and the member reads it all, buffered
        view = memoryview(bytearray(SIZE))
        pieces: list[bytes] = []
        assert member.read_into(view, 0, lambda p: pieces.append(bytes(p))) == SIZE
        assert bytes(view) == data == b"".join(pieces)
    finally:
        member.close()
        d.close()


def _evict(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def test_a_cold_load_of_large_tensors_is_exact(tmp_path):
    torch.manual_seed(0)
    src = {"a": torch.randn(1024, 1025), "b": torch.randn(3_000_000), "c": torch.randn(7)}
    quicksave.save({"s": src}, tmp_path / "ck")
    _evict(tmp_path / "ck")
    dest = {k: torch.zeros_like(v) for k, v in src.items()}
    quicksave.load({"s": dest}, tmp_path / "ck")
    for k, v in src.items():
        assert torch.equal(dest[k], v), k


def test_a_damaged_byte_in_a_cold_chunk_is_caught(tmp_path):
    t = torch.randn(2_000_000)
    quicksave.save({"s": {"t": t}}, tmp_path / "ck")
    (data,) = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors"]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    _evict(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as e:
        quicksave.load({"s": {"t": torch.zeros_like(t)}}, tmp_path / "ck")
    assert e.value.fqn == "s.t"
