"""quicksave.format.dcp_layout: the DCP layout's data files and ``.metadata`` (FORMAT.md §8).

``write_dcp_file`` must write DCP's bytes exactly (compared with a real
``FileSystemWriter``), place every chunk's raw bytes, never copy a payload, and cover
every other byte with the file's digest; the footer must round-trip and refuse what
does not add up.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter

from helpers.state import raw
from quicksave.compat.nvrx import dcp_write
from quicksave.compat.nvrx.dcp_write import write_dcp_file
from quicksave.errors import CheckpointError, CorruptCheckpointError, IncompatibleStateError
from quicksave.format.dcp_layout import (
    FOOTER_MAGIC,
    FOOTER_SIZE,
    DcpFileWritten,
    Footer,
    encode_metadata,
    has_footer,
    parse_footer,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def hex64(data: bytes | memoryview) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def outside_digest(data: bytes, written: DcpFileWritten) -> str:
    """Independently: xxh3-64 of the file's bytes outside every tensor's raw range."""
    spans = sorted(
        (w.raw_offset, w.raw_offset + w.raw_length)
        for w in written.items.values()
        if w.raw_offset is not None
    )
    pieces, pos = [], 0
    for lo, hi in spans:
        pieces.append(data[pos:lo])
        pos = hi
    pieces.append(data[pos:])
    return hex64(b"".join(pieces))


def tensors_of_many_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).half(),
        "i64": torch.arange(-3, 6, dtype=torch.int64).reshape(3, 3),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(2, 2, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "one": torch.ones(1, 1, 1, dtype=torch.int16),
    }
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            out[name] = torch.randn(6, generator=g).to(dtype)
    return out


# --------------------------------------------------------------------------- vs DCP


def test_bytes_match_dcp_filesystem_writer(tmp_path: Path) -> None:
    """Items fed in DCP's order (byte items first, then tensors in plan order) give the
    very bytes of DCP's own ``__0_0.distcp``, and the places its .metadata records."""
    state = {**tensors_of_many_dtypes(), "step": 12, "cfg": {"lr": 0.5, "name": "x"}}
    dcp.save(
        state,
        storage_writer=FileSystemWriter(tmp_path, thread_count=1, single_file_per_rank=True),
        no_dist=True,
    )
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    data = (tmp_path / "__0_0.distcp").read_bytes()
    with open(tmp_path / ".metadata", "rb") as f:
        md = pickle.load(f)  # DCP's own file, written just now by this test
    placed = sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)
    flat = {**state, "cfg.lr": 0.5, "cfg.name": "x"}
    items = []
    for index, info in placed:
        value = flat[index.fqn]
        if isinstance(value, torch.Tensor):
            items.append((index.fqn, value))
        else:  # DCP's byte item: torch.save of the value, taken as is
            items.append((index.fqn, data[info.offset : info.offset + info.length]))
    kinds = [isinstance(v, torch.Tensor) for _, v in items]
    assert kinds == sorted(kinds), "DCP writes byte items first"

    out = io.BytesIO()
    written = write_dcp_file(out, items, fsync=False)

    assert out.getvalue() == data
    assert written.size == len(data)
    for index, info in placed:
        w = written.items[index.fqn]
        assert (w.item_offset, w.item_length) == (info.offset, info.length)
        value = flat[index.fqn]
        if isinstance(value, torch.Tensor):
            assert data[w.raw_offset : w.raw_offset + w.raw_length] == bytes(raw(value).numpy())
            assert w.raw_length == value.numel() * value.element_size()
        else:
            assert w.raw_offset is w.raw_length is w.xxh3_64 is None
    assert written.xxh3_64 == outside_digest(data, written)


@pytest.mark.parametrize("name", sorted(tensors_of_many_dtypes()))
def test_tensor_item_is_a_torch_save_archive_holding_the_raw_bytes(name: str) -> None:
    t = tensors_of_many_dtypes()[name]
    out = io.BytesIO()
    written = write_dcp_file(
        out, [("head", b"\x00bytes before"), (name, t), ("tail", io.BytesIO(b"z" * 5))], fsync=False
    )
    data = out.getvalue()
    w = written.items[name]
    item = data[w.item_offset : w.item_offset + w.item_length]
    loaded = torch.load(io.BytesIO(item), weights_only=True)
    assert loaded.dtype == t.dtype and loaded.shape == t.shape
    assert torch.equal(raw(loaded), raw(t))
    payload = data[w.raw_offset : w.raw_offset + w.raw_length]
    assert payload == bytes(raw(t).numpy())
    assert w.xxh3_64 == hex64(payload)
    assert (w.raw_offset - w.item_offset) % 64 == 0  # torch aligns records in its archive
    assert written.items["tail"].item_offset == w.item_offset + w.item_length
    assert data[-5:] == b"zzzzz" and data[:13] == b"\x00bytes before"
    assert written.xxh3_64 == outside_digest(data, written)


def test_parameters_are_saved_detached_as_dcp_does() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    a, b = io.BytesIO(), io.BytesIO()
    write_dcp_file(a, [("p", p)], fsync=False)
    write_dcp_file(b, [("p", p.detach())], fsync=False)
    assert a.getvalue() == b.getvalue()
    assert not torch.load(io.BytesIO(a.getvalue()), weights_only=True).requires_grad


# --------------------------------------------------------------------------- no copies


class AddressStream:
    """Discards the bytes; records each write's length and memory address."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int]] = []

    def write(self, data) -> int:
        view = memoryview(data)
        addr = np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0
        self.writes.append((view.nbytes, addr))
        return view.nbytes

    def flush(self) -> None:
        pass


def test_a_large_payload_goes_to_the_stream_from_the_tensor_memory_uncopied() -> None:
    t = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    stream = AddressStream()
    tracemalloc.start()
    try:
        written = write_dcp_file(stream, [("big", t)], fsync=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (t.nbytes, t.data_ptr()) in stream.writes  # one write, straight from the tensor
    assert peak < 4 << 20, f"{peak} bytes allocated while writing a 64 MiB tensor"
    w = written.items["big"]
    assert (w.raw_length, w.xxh3_64) == (t.nbytes, hex64(bytes(raw(t).numpy())))


@pytest.mark.slow
def test_zip64_archive_of_a_tensor_over_4_gib() -> None:
    """torch writes zip64 fields (local header, central directory, end records) for a
    record over 4 GiB; the record is still found. Untouched pages read as zeros."""
    t = torch.empty((4 << 30) + 4096, dtype=torch.uint8)
    stream = AddressStream()
    written = write_dcp_file(stream, [("x", b"12345"), ("huge", t)], fsync=False)
    w = written.items["huge"]
    assert w.raw_length == t.nbytes
    assert w.raw_offset == w.item_offset + 704  # data.pkl, format records, then data/0
    assert (t.nbytes, t.data_ptr()) in stream.writes
    assert written.size == sum(n for n, _ in stream.writes)


# --------------------------------------------------------------------------- streams


class Trickle(io.RawIOBase):
    """A raw stream that takes at most 1000 bytes per write (and says so)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b)[:1000]
        self.data += view
        return len(view)


def test_short_writes_are_continued() -> None:
    items = [("a", b"x" * 2500), ("t", torch.arange(3000, dtype=torch.int32))]
    whole, trickle = io.BytesIO(), Trickle()
    write_dcp_file(whole, items, fsync=False)
    write_dcp_file(trickle, items, fsync=False)
    assert bytes(trickle.data) == whole.getvalue()


class Failing(io.BytesIO):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.left = after

    def write(self, b) -> int:
        self.left -= 1
        if self.left < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(b)


def test_a_stream_error_inside_torch_save_comes_out_as_itself() -> None:
    with pytest.raises(OSError) as info:
        write_dcp_file(Failing(3), [("t", torch.ones(10))], fsync=False)
    assert info.value.errno == errno.ENOSPC


def test_fsync_uses_fileno_and_skips_streams_without_one(tmp_path: Path, monkeypatch) -> None:
    synced = []
    monkeypatch.setattr(dcp_write.os, "fsync", synced.append)
    with open(tmp_path / "f", "wb") as f:
        written = write_dcp_file(f, [("t", torch.ones(2))], fsync=True)
        assert synced == [f.fileno()]
    assert (tmp_path / "f").stat().st_size == written.size
    write_dcp_file(io.BytesIO(), [("t", torch.ones(2))], fsync=True)  # fileno unsupported
    write_dcp_file(AddressStream(), [("t", torch.ones(2))], fsync=True)  # no fileno at all
    assert len(synced) == 1


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "value, why",
    [
        (torch.ones(3, 4).t(), "not contiguous"),
        (torch.arange(10.0)[2:], "not contiguous"),  # storage offset
        (torch.arange(10.0)[:4], "not contiguous"),  # storage larger than the chunk
        (torch.randn(3, dtype=torch.complex64).conj(), "lazy conjugate"),
        (torch.ones(2).to_sparse(), "not a dense tensor"),
        (7, "not int"),
        ([1, 2], "not list"),
    ],
)
def test_unsuitable_values_are_refused_before_anything_is_written(value, why: str) -> None:
    out = io.BytesIO()
    with pytest.raises(IncompatibleStateError) as info:
        write_dcp_file(out, [("fine", torch.ones(2)), ("bad", value)], fsync=False)
    assert why in info.value.message and info.value.fqn == "bad"
    assert out.getvalue() == b""


def test_duplicate_keys_are_refused() -> None:
    out = io.BytesIO()
    with pytest.raises(CheckpointError, match="same key twice") as info:
        write_dcp_file(out, [("k", b"1"), ("k", torch.ones(1))], fsync=False)
    assert info.value.fqn == "k" and out.getvalue() == b""


# --------------------------------------------------------------------------- zip parsing


def sink_holding(archive: bytes) -> dcp_write._Sink:
    sink = dcp_write._Sink(dcp_write._Out(io.BytesIO()))
    sink.write(archive)
    return sink


def zip_with(name: str, payload: bytes, method: int = zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        z.writestr("archive/data.pkl", b"pickle")
        z.writestr(name, payload)
        z.writestr("archive/version", b"3\n")
    return buf.getvalue()


def test_the_record_is_found_in_any_plain_zip() -> None:
    archive = zip_with("archive/data/0", b"PAYLOAD!")
    start = dcp_write._data_record_start(sink_holding(archive), 8, "k")
    assert archive[start : start + 8] == b"PAYLOAD!"


@pytest.mark.parametrize(
    "archive, nbytes, why",
    [
        (zip_with("archive/data/0", b"A" * 100, zipfile.ZIP_DEFLATED), 100, "compressed"),
        (zip_with("archive/data/1", b"PAYLOAD!"), 8, "0 records"),
        (zip_with("archive/data/0", b"PAYLOAD!"), 9, "holds 8 bytes, the tensor 9"),
        (b"not a zip archive at all.....", 4, "no zip end-of-central-directory"),
        (b"PK", 4, "shorter than a zip end record"),
    ],
)
def test_an_unexpected_archive_is_refused_clearly(archive: bytes, nbytes: int, why: str) -> None:
    with pytest.raises(CheckpointError, match=why) as info:
        dcp_write._data_record_start(sink_holding(archive), nbytes, "model.w")
    assert info.value.fqn == "model.w"
    assert "unexpected torch serialization format" in info.value.message


# --------------------------------------------------------------------------- .metadata


def test_metadata_is_pickle_manifest_footer() -> None:
    p = pickle.dumps({"a": 1}, protocol=pickle.HIGHEST_PROTOCOL)
    m = b'{"format":"quicksave"}\n'
    blob = encode_metadata(p, m)
    assert blob[: len(p)] == p and blob[len(p) : len(p) + len(m)] == m
    tail = blob[-FOOTER_SIZE:]
    assert (
        tail
        == FOOTER_MAGIC
        + struct.pack("<QQQ", len(p), len(m), xxhash.xxh3_64_intdigest(p))
        + FOOTER_MAGIC
    )
    assert parse_footer(tail, len(blob), "/c/.metadata") == Footer(
        len(p), len(m), xxhash.xxh3_64_intdigest(p)
    )
    assert pickle.load(io.BytesIO(blob)) == {"a": 1}  # what DCP's reader does
    assert has_footer(blob[-80:]) and not has_footer(p)


def test_encode_refuses_a_pickle_that_does_not_stop_or_an_empty_manifest() -> None:
    with pytest.raises(CheckpointError, match="STOP"):
        encode_metadata(b"\x80\x05K\x01", b"{}")
    with pytest.raises(CheckpointError, match="1 to"):
        encode_metadata(pickle.dumps(1), b"")


def footer(len_p: int, len_m: int, digest: int = 0, magic=FOOTER_MAGIC, end=FOOTER_MAGIC) -> bytes:
    return magic + struct.pack("<QQQ", len_p, len_m, digest) + end


@pytest.mark.parametrize(
    "tail, size, why",
    [
        (footer(10, 20), 71, "do not add up"),
        (footer(10, 20), 69, "do not add up"),
        (footer(10, 20, magic=b"QSDCPMF0"), 70, "magic"),
        (footer(10, 20, end=b"XSDCPMF1"), 70, "magic"),
        (footer(10, (1 << 30) + 1), 10 + (1 << 30) + 1 + 40, "more than the 1 GiB limit"),
        (footer(1 << 63, 20), (1 << 63) + 60, "do not add up"),
        (footer(0, 30), 70, "empty pickle or manifest"),
        (footer(10, 20)[1:], 39, "fewer than its 40-byte footer"),
    ],
)
def test_a_footer_that_does_not_add_up_is_corruption(tail: bytes, size: int, why: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=why) as info:
        parse_footer(tail, size, "/c/.metadata")
    assert info.value.path == "/c/.metadata"


def test_has_footer_survives_a_damaged_magic_and_a_short_cut() -> None:
    blob = encode_metadata(pickle.dumps(1), b"{}")
    damaged = blob[:-1] + b"X"
    assert has_footer(damaged[-80:]) and has_footer(blob[:-32][-80:])
    assert not has_footer(pickle.dumps({"k": "v" * 100}))


def test_manifest_entries_from_what_was_written() -> None:
    written = write_dcp_file(
        io.BytesIO(), [("obj", b"x" * 3), ("w", torch.ones(2, 2))], fsync=False
    )
    w = written.items["w"]
    chunk = w.chunk_entry("__0_0.distcp", [0, 0], torch.Size([2, 2]))
    assert (chunk.offsets, chunk.sizes, chunk.offset, chunk.length, chunk.xxh3_64) == (
        (0, 0),
        (2, 2),
        w.raw_offset,
        16,
        w.xxh3_64,
    )
    entry = written.file_entry(rank=3)
    assert (entry.size, entry.xxh3_64, entry.rank, entry.data_start) == (
        written.size,
        written.xxh3_64,
        3,
        None,
    )
    with pytest.raises(CheckpointError, match="no tensor chunk"):
        written.items["obj"].chunk_entry("__0_0.distcp", [], [])
