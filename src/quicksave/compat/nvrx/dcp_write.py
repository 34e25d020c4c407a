"""Writing one data file of the DCP layout (``quicksave.format.dcp_layout``): each item as
DCP's ``FileSystemWriter`` writes it (the same bytes), recording where every tensor's raw
bytes landed and their digests, for the manifest.

Called by ``FileSystemWriterAsync``'s write function (in the checkpoint worker, or in the
trainer when called directly), once per data file: :func:`write_dcp_file` into a stream
the caller opened; the caller then builds the manifest from the returned
``DcpFileWritten`` and, on the coordinator, writes ``.metadata`` with
``quicksave.format.dcp_layout.encode_metadata``. No collective.

Torch is imported only when a tensor is written (the worker stays torch-free at start).
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from quicksave.checksum import hexdigest
from quicksave.errors import CheckpointError, IncompatibleStateError
from quicksave.format.dcp_layout import DcpFileWritten, DcpItemWritten

if TYPE_CHECKING:
    import torch

KEEP_WRITE_BYTES = 64 << 10  # torch.save's writes up to this size are kept (zip structure)

_BYTE_TYPES = (bytes, bytearray, memoryview, io.BytesIO)


class _Out:
    """The caller's stream, written in full, counting the position."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.pos = 0

    def write(self, view: memoryview) -> None:
        done, n = 0, len(view)
        while done < n:
            wrote = self.stream.write(view[done:] if done else view)
            if wrote is None:  # a buffered stream that says nothing: it took it all
                wrote = n - done
            if wrote <= 0:
                raise CheckpointError(f"the output stream accepted no bytes at byte {self.pos}")
            done += wrote
        self.pos += n


class _Sink:
    """The file object ``torch.save`` writes one item to. Passes every write straight
    on (torch hands the tensor's payload as a view of its memory: it is never copied),
    and remembers each write's place and, for writes up to ``KEEP_WRITE_BYTES``, its
    bytes: the zip structure that tells where ``data/0`` is, and everything that the
    file's outside-chunks digest covers."""

    def __init__(self, out: _Out) -> None:
        self.out = out
        self.start = out.pos
        self.offsets: list[int] = []  # relative to the item's start
        self.lengths: list[int] = []
        self.kept: list[bytes | None] = []
        self.error: BaseException | None = None

    @property
    def length(self) -> int:
        return self.out.pos - self.start

    def write(self, data: Any) -> int:
        try:
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            n = len(view)
            if n:
                self.offsets.append(self.length)
                self.lengths.append(n)
                self.kept.append(bytes(view) if n <= KEEP_WRITE_BYTES else None)
                self.out.write(view)
            return n
        except BaseException as e:  # torch turns it into a RuntimeError: keep the cause
            self.error = e
            raise

    def flush(self) -> None:
        pass  # one flush of the caller's stream at the end of the file

    def read(self, offset: int, length: int, key: str) -> bytes:
        """Bytes ``offset..offset+length`` of the item, from the kept writes."""
        if offset < 0 or length < 0 or offset + length > self.length:
            _bad_archive(key, f"bytes {offset}..{offset + length} lie outside the archive")
        out = bytearray()
        i = bisect.bisect_right(self.offsets, offset) - 1
        pos = offset
        end = offset + length
        while pos < end:
            kept = self.kept[i]
            if kept is None:
                _bad_archive(key, f"byte {pos} of the zip structure is in a large write")
            lo = pos - self.offsets[i]
            take = min(end - pos, self.lengths[i] - lo)
            out += kept[lo : lo + take]
            pos += take
            i += 1
        return bytes(out)

    def hash_outside(self, hasher: xxhash.xxh3_64, raw: int, raw_end: int, key: str) -> None:
        """Feed every byte of the item outside ``raw..raw_end`` to ``hasher``."""
        for at, n, kept in zip(self.offsets, self.lengths, self.kept, strict=True):
            for lo, hi in ((at, min(at + n, raw)), (max(at, raw_end), at + n)):
                if hi <= lo:
                    continue
                if kept is None:
                    _bad_archive(key, f"torch.save wrote {n} bytes at once outside the tensor data")
                hasher.update(kept[lo - at : hi - at])


def _bad_archive(key: str, why: str) -> Any:
    raise CheckpointError(
        f"cannot place the tensor's data in the torch.save archive: {why} (an unexpected "
        "torch serialization format)",
        fqn=key,
    )


_EOCD = 0x06054B50
_EOCD64 = 0x06064B50
_EOCD64_LOCATOR = 0x07064B50
_CENTRAL = 0x02014B50
_LOCAL = 0x04034B50
_U32_MAX = 0xFFFFFFFF


def _zip64_fields(extra: bytes, wanted: int, key: str) -> list[int]:
    """The first ``wanted`` 8-byte values of the zip64 extended-information field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if tag == 0x0001:
            if len(body) < 8 * wanted:
                break
            return list(struct.unpack_from(f"<{wanted}Q", body))
        pos += 4 + size
    return _bad_archive(key, "a zip64 size or offset lacks its extended-information field")


def _data_record_start(sink: _Sink, nbytes: int, key: str) -> int:
    """The offset, in the item, of the ``data/0`` record's payload, found through the
    zip structure: end of central directory (zip64 if needed), the central directory
    entry named ``<archive>/data/0``, then its local header's name and extra lengths.

    Raises:
        CheckpointError: the archive is not as expected: no single ``data/0`` record,
            compressed, of another size than the tensor's ``nbytes``.
    """
    total = sink.length
    if total < 22:
        _bad_archive(key, "the archive is shorter than a zip end record")
    sig, _, _, _, count, cd_size, cd_offset, comment = struct.unpack(
        "<IHHHHIIH", sink.read(total - 22, 22, key)
    )
    if sig != _EOCD or comment:
        _bad_archive(key, "no zip end-of-central-directory record at the archive's end")
    if total >= 42:
        loc_sig, _, eocd64_at, _ = struct.unpack("<IIQI", sink.read(total - 42, 20, key))
        if loc_sig == _EOCD64_LOCATOR:
            rec = sink.read(eocd64_at, 56, key)
            if struct.unpack_from("<I", rec)[0] != _EOCD64:
                _bad_archive(key, "the zip64 end record is not where its locator says")
            count, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    cd = sink.read(cd_offset, cd_size, key)
    found: list[tuple[int, int, int, int, bytes]] = []
    pos = 0
    for _ in range(count):
        if pos + 46 > len(cd) or struct.unpack_from("<I", cd, pos)[0] != _CENTRAL:
            _bad_archive(key, "a damaged zip central directory")
        method, _, _, _, comp, size, n_name, n_extra, n_comment = struct.unpack_from(
            "<HHHIIIHHH", cd, pos + 10
        )
        (local,) = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46 : pos + 46 + n_name]
        extra = cd[pos + 46 + n_name : pos + 46 + n_name + n_extra]
        pos += 46 + n_name + n_extra + n_comment
        if name.partition(b"/")[2] != b"data/0" or name.startswith(b"/"):
            continue
        big = [v for v in (size, comp, local) if v == _U32_MAX]
        if big:  # zip64: the 8-byte values follow in this order, for each one that is full
            values = iter(_zip64_fields(extra, len(big), key))
            size = next(values) if size == _U32_MAX else size
            comp = next(values) if comp == _U32_MAX else comp
            local = next(values) if local == _U32_MAX else local
        found.append((method, comp, size, local, name))
    if len(found) != 1:
        _bad_archive(key, f"{len(found)} records named <archive>/data/0, expected one")
    method, comp, size, local, name = found[0]
    if method != 0 or comp != size:
        _bad_archive(key, f"the data/0 record is compressed (method {method})")
    if size != nbytes:
        _bad_archive(key, f"the data/0 record holds {size} bytes, the tensor {nbytes}")
    header = sink.read(local, 30, key)
    (sig,) = struct.unpack_from("<I", header)
    (local_method,) = struct.unpack_from("<H", header, 8)
    n_name, n_extra = struct.unpack_from("<HH", header, 26)
    if sig != _LOCAL or local_method != 0:
        _bad_archive(key, "the data/0 record's local header is damaged or compressed")
    if sink.read(local + 30, n_name, key) != name:
        _bad_archive(key, "the data/0 record's local header names another record")
    start = local + 30 + n_name + n_extra
    if start + nbytes > cd_offset:
        _bad_archive(key, "the data/0 record's payload runs into the central directory")
    return start


def _checked_tensor(key: str, value: Any) -> torch.Tensor:
    """``value`` detached (as DCP's writer saves it), if its storage is exactly the
    chunk: torch.save writes the whole storage, so anything more would not be the
    chunk's raw bytes."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise IncompatibleStateError(
            f"a DCP item is a CPU torch.Tensor or bytes / bytearray / memoryview / "
            f"io.BytesIO, not {type(value).__name__}",
            fqn=key,
        )
    t = value.detach()
    why = None
    if type(t) is not torch.Tensor:
        why = f"a {type(t).__name__} (a tensor subclass); pass its local plain tensor"
    elif t.device.type != "cpu":
        why = f"on {t.device}; copy it to the CPU first"
    elif t.layout != torch.strided or t.is_quantized:
        why = f"not a dense tensor ({t.layout}{', quantized' if t.is_quantized else ''})"
    elif t.is_conj() or t.is_neg():
        why = "a lazy conjugate or negative view; call .resolve_conj()/.resolve_neg()"
    elif (
        not t.is_contiguous()
        or t.storage_offset() != 0
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        why = (
            "not contiguous with a storage of exactly its own bytes (a view or a slice); "
            "call .clone() (or .contiguous()) first"
        )
    if why is not None:
        raise IncompatibleStateError(f"cannot write this tensor as a DCP item: {why}", fqn=key)
    return t


def _byte_item(key: str, value: bytes | bytearray | memoryview | io.BytesIO) -> memoryview:
    view = value.getbuffer() if isinstance(value, io.BytesIO) else memoryview(value)
    if not view.c_contiguous:
        raise IncompatibleStateError("a byte item must be contiguous", fqn=key)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def write_dcp_file(stream: Any, items: Sequence[tuple[str, Any]], *, fsync: bool) -> DcpFileWritten:
    """Write one DCP-layout data file: ``items`` in order, each as DCP's
    ``FileSystemWriter`` writes it (the same bytes: a tensor is ``torch.save(tensor)``,
    a byte item its bytes as they are).

    Args:
        stream: a binary file object opened for writing at the start of a new file by
            the caller (``open(path, "wb")`` or a user's ``open_file(path, "wb")``); only
            ``write``, ``flush`` and, for ``fsync``, ``fileno`` are used. Not closed.
        items: ``(key, value)`` pairs; keys are unique. ``value`` is a byte item
            (``bytes``, ``bytearray``, ``memoryview``, ``io.BytesIO``: DCP's ``BYTE_IO``
            items, i.e. ``torch.save(obj)`` bytes) or a CPU ``torch.Tensor`` that is
            contiguous with storage offset 0 and a storage of exactly its bytes (DCP's
            writer clones any other). To match DCP's file byte for byte, pass byte
            items first, then tensors in plan order, as its writer does.
        fsync: fsync the file after the last write (skipped when the stream has no
            ``fileno``: a stream that is no OS file).

    Returns:
        A :class:`DcpFileWritten`: per key, the item's place and, for tensors, the raw
        bytes' place and xxh3-64; the file's size and the xxh3-64 of its bytes outside
        the tensors' raw bytes.

    Raises:
        IncompatibleStateError: a value that is not a byte item or a suitable tensor
            (checked before it is written), naming its key as ``fqn``.
        CheckpointError: a duplicate key, or an archive whose ``data/0`` record cannot
            be placed (another torch serialization format), naming the key.
        OSError: as raised by the stream (also from inside ``torch.save``).

    Example::

        with open(os.path.join(tmp, "__0_0.distcp"), "wb") as f:
            written = write_dcp_file(f, [("step", blob), ("w", weight)], fsync=True)
        chunk_offset = written.items["w"].raw_offset
    """
    if sys.byteorder != "little":
        raise CheckpointError("the DCP layout stores little-endian bytes; this host is not")
    checked: list[tuple[str, memoryview | torch.Tensor]] = []
    seen: set[str] = set()
    for key, value in items:  # every input checked before the first byte is written
        if key in seen:
            raise CheckpointError("the same key twice in one DCP data file", fqn=key)
        seen.add(key)
        if isinstance(value, _BYTE_TYPES):
            checked.append((key, _byte_item(key, value)))
        else:
            checked.append((key, _checked_tensor(key, value)))
    out = _Out(stream)
    outside = xxhash.xxh3_64()
    written: dict[str, DcpItemWritten] = {}
    for key, value in checked:
        if isinstance(value, memoryview):
            written[key] = DcpItemWritten(key, out.pos, len(value))
            out.write(value)
            outside.update(value)
        else:
            written[key] = _write_tensor(out, key, value, outside)
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()
    if fsync:
        try:
            fd = stream.fileno()
        except (AttributeError, io.UnsupportedOperation, OSError):
            fd = None  # not an OS file (a store's stream): nothing to fsync
        if fd is not None:
            os.fsync(fd)
    return DcpFileWritten(out.pos, hexdigest(outside.intdigest()), written)


def _write_tensor(out: _Out, key: str, t: torch.Tensor, outside: xxhash.xxh3_64) -> DcpItemWritten:
    import torch

    from quicksave.checksum import tensor_view

    sink = _Sink(out)
    try:
        torch.save(t, sink)
    except BaseException:
        if sink.error is not None:
            raise sink.error from None
        raise
    nbytes = t.numel() * t.element_size()
    raw = _data_record_start(sink, nbytes, key)
    sink.hash_outside(outside, raw, raw + nbytes, key)
    digest = hexdigest(xxhash.xxh3_64_intdigest(tensor_view(t)))
    return DcpItemWritten(key, sink.start, sink.length, sink.start + raw, nbytes, digest)
