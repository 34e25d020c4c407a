"""A data file's safetensors header, parsed with bounds and compared with the manifest.

FORMAT.md §3: every data file MUST be a valid safetensors file. ``quicksave verify``
proves it: the 8-byte length ``N`` fits the file, ``8 + N`` is the manifest's
``data_start``, the header is JSON within :mod:`.strict_json`'s limits, every entry's
dtype code is known, its ``data_offsets`` lie inside the data region and match its
shape, the entries tile the data region without holes or overlaps (as safetensors
requires), and every chunk the manifest places in the file has its entry at the same
bytes. Torch-free.

Besides chunks and zero padding (``__quicksave_pad_K__``), a file laid out for stock DCP
readers holds torch legacy prefixes (``__torch_legacy_K__``, ``U8``), each ending where a
chunk of the manifest starts; the verifier compares their bytes with the prefix it
recomputes from that chunk's dtype and sizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from quicksave.errors import CorruptCheckpointError
from quicksave.format import strict_json
from quicksave.format.dtype_names import SAFETENSORS_CODE_SIZES
from quicksave.format.torch_legacy import TORCH_LEGACY_PREFIX

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
PAD_PREFIX = "__quicksave_pad_"
_INT_LIMIT = 1 << 63


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors header; ``start``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class ExpectedChunk:
    """What the manifest says one entry of the file must be."""

    key: str  # entry name: the fqn, or ``fqn@o0,o1,...`` for a piece
    fqn: str
    offset: int  # absolute
    length: int
    dtype: str  # safetensors code


def header_length(prefix: bytes, file_size: int, path: str) -> int:
    """``N`` from the file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"safetensors header: the file has {file_size} bytes, fewer than the 8-byte "
            "header length",
            path=path,
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CorruptCheckpointError(
            f"safetensors header: claims {n} bytes, but the file has {file_size} "
            f"(and headers are at most {MAX_HEADER_BYTES})",
            path=path,
        )
    return n


def _bad(message: str, path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"safetensors header: {message}", path=path)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and 0 <= v < _INT_LIMIT for v in value)


def parse_header(text: bytes, file_size: int, path: str) -> tuple[dict[str, str], list[Entry]]:
    """Parse the JSON header (bytes ``8 .. 8+N``) of a safetensors file of
    ``file_size`` bytes. Returns ``(__metadata__, entries sorted by start)``.

    Raises:
        CorruptCheckpointError: anything that makes the file invalid safetensors.
    """
    data_start = 8 + len(text)
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"not UTF-8: {e}", path) from None
    doc = strict_json.loads(decoded, what="safetensors header", path=path)
    if not isinstance(doc, dict):
        raise _bad("not a JSON object", path)
    strict_json.check_depth(doc, what="safetensors header", path=path)
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad("__metadata__ must map strings to strings", path)
    entries = []
    for name, e in doc.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _bad(f"entry {name!r} must have exactly dtype, shape and data_offsets", path)
        code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in SAFETENSORS_CODE_SIZES:
            raise _bad(f"entry {name!r} has unknown dtype {str(code)[:20]!r}", path)
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            raise _bad(f"entry {name!r}: shape and data_offsets must be integers ≥ 0", path)
        lo, hi = offsets
        numel = 1
        for d in shape:
            numel *= d
        if lo > hi or data_start + hi > file_size:
            raise _bad(
                f"entry {name!r}: data_offsets [{lo}, {hi}] do not lie inside the data "
                f"region (bytes {data_start}..{file_size})",
                path,
            )
        if hi - lo != numel * SAFETENSORS_CODE_SIZES[code]:
            raise _bad(
                f"entry {name!r}: data_offsets [{lo}, {hi}] hold {hi - lo} bytes, its "
                f"shape {shape} of {code} needs {numel * SAFETENSORS_CODE_SIZES[code]}",
                path,
            )
        entries.append(Entry(name, code, tuple(shape), data_start + lo, data_start + hi))
    entries.sort(key=lambda x: (x.start, x.end))
    pos = data_start
    for x in entries:
        if x.start != pos:
            what = "a hole" if x.start > pos else "an overlap"
            raise _bad(f"{what} in the data region at byte {min(pos, x.start)}", path)
        pos = x.end
    if pos != file_size:
        raise _bad(f"the entries end at byte {pos}, the file at {file_size}", path)
    return metadata, entries


def mismatches(
    metadata: dict[str, str],
    entries: list[Entry],
    rank: int | None,
    expected: list[ExpectedChunk],
) -> list[tuple[str | None, str]]:
    """``(fqn, message)`` for every way the header disagrees with the manifest: the
    ``__metadata__`` (format, version, rank), a chunk without its entry or at other
    bytes or with another dtype code, and entries the manifest does not know."""
    out: list[tuple[str | None, str]] = []
    want_meta = {"format": "quicksave", "format_version": "1", "rank": str(rank)}
    if metadata != want_meta:
        out.append((None, f"__metadata__ is {metadata}, expected {want_meta}"))
    by_name = {x.name: x for x in entries}
    for c in expected:
        x = by_name.pop(c.key, None)
        if x is None:
            out.append((c.fqn, f"no header entry {c.key!r} for this chunk"))
        elif (x.start, x.end - x.start, x.dtype) != (c.offset, c.length, c.dtype):
            out.append(
                (
                    c.fqn,
                    f"header entry {c.key!r} is {x.dtype} at bytes {x.start}..{x.end}; the "
                    f"manifest says {c.dtype} at {c.offset}..{c.offset + c.length}",
                )
            )
    chunk_starts = {c.offset for c in expected}
    for x in by_name.values():
        if x.name.startswith(TORCH_LEGACY_PREFIX) and x.dtype == "U8":
            if x.end not in chunk_starts:
                out.append(
                    (
                        None,
                        f"torch legacy prefix entry {x.name!r} does not end where a chunk starts",
                    )
                )
        elif not (x.name.startswith(PAD_PREFIX) and x.dtype == "U8"):
            out.append((None, f"header entry {x.name!r} is not in the manifest"))
    return out


def legacy_prefixes(entries: list[Entry]) -> dict[int, int]:
    """Chunk start -> start of the torch legacy prefix entry that ends there."""
    return {
        x.end: x.start
        for x in entries
        if x.name.startswith(TORCH_LEGACY_PREFIX) and x.dtype == "U8" and x.end > x.start
    }
