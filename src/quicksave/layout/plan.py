"""Plan: where every byte of a rank's chunks goes. Pure functions, frozen dataclasses.

Nothing here does I/O or talks to other ranks. Because the whole file layout (names,
headers, byte offsets) is fixed here, before any byte is written, the global manifest is
known at plan time and only checksums remain to be filled in after writing.

Data file layout (docs/FORMAT.md): a valid safetensors file whose header is padded with
spaces so that data starts at a multiple of ``alignment``; every chunk starts at a
multiple of ``alignment``; the gaps are covered by zero-filled ``U8`` padding entries,
since safetensors requires the data region to be covered without holes.

With ``dcp_compat`` every chunk whose dtype the torch legacy format can store is
preceded, right up to its first byte, by its deterministic legacy ``torch.save`` prefix
(:mod:`.format.torch_legacy`), a ``U8`` entry named ``__torch_legacy_K__``: prefix plus
chunk is then a ``torch.save`` item that DCP's stock ``FileSystemReader`` loads.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass

import xxhash

from quicksave.checksum import hexdigest
from quicksave.format import ALIGNMENT, FORMAT_NAME, FORMAT_VERSION
from quicksave.format.dtypes import dtype_from_name, element_size, safetensors_code
from quicksave.format.manifest import PlannedChunk
from quicksave.format.torch_legacy import TORCH_LEGACY_PREFIX, legacy_prefix_for

PAD_PREFIX = "__quicksave_pad_"


@dataclass(frozen=True)
class ItemSpec:
    """One chunk of one tensor that a rank must write."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str  # manifest dtype name, e.g. "bfloat16"
    nbytes: int

    @property
    def key(self) -> str:
        """The name of this chunk inside the safetensors file."""
        return chunk_key(self.fqn, self.offsets, self.sizes, self.global_shape)


def planned_chunk(spec: ItemSpec) -> PlannedChunk:
    """The manifest's record of a chunk a rank holds (``ItemSpec`` minus its byte count)."""
    return PlannedChunk(spec.fqn, spec.offsets, spec.sizes, spec.global_shape, spec.dtype)


def item_spec_of(chunk: PlannedChunk) -> ItemSpec:
    """The ``ItemSpec`` of a recorded chunk (byte count from its dtype and sizes)."""
    nbytes = math.prod(chunk.sizes) * element_size(dtype_from_name(chunk.dtype))
    return ItemSpec(
        chunk.fqn, tuple(chunk.offsets), tuple(chunk.sizes), tuple(chunk.shape), chunk.dtype, nbytes
    )


@dataclass(frozen=True)
class EntryLayout:
    item: ItemSpec
    offset: int  # absolute byte offset in the file
    length: int


@dataclass(frozen=True)
class FileLayout:
    name: str
    rank: int
    header: bytes  # the bytes [0, data_start): length prefix + JSON + space padding
    data_start: int
    size: int
    entries: tuple[EntryLayout, ...]
    # (absolute offset, bytes) written with the header: the torch legacy prefixes
    # (dcp_compat layouts; empty otherwise)
    fixed: tuple[tuple[int, bytes], ...] = ()

    @property
    def header_xxh3_64(self) -> str:
        return hexdigest(xxhash.xxh3_64_intdigest(self.header))

    @property
    def payload_bytes(self) -> int:
        return sum(e.length for e in self.entries)


@dataclass(frozen=True)
class RankLayout:
    rank: int
    files: tuple[FileLayout, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def chunk_key(fqn: str, offsets, sizes, global_shape) -> str:
    if tuple(sizes) == tuple(global_shape) and not any(offsets):
        return fqn
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def data_file_name(rank: int, index: int) -> str:
    return f"rank-{rank:05d}-{index:02d}.safetensors"


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _split_among_files(items: list[ItemSpec], n_files: int) -> list[list[ItemSpec]]:
    """Longest-processing-time split, so the writer threads get similar byte counts.

    Within a file, a stable, readable order (by name, then offsets), with the tensors
    that the rank holds in several chunks (an incremental save's row blocks,
    ``saving/block_split.py``) after those it holds whole: the chunks written at every
    save lie together, so a save that refers to unchanged blocks (FORMAT.md §9) writes
    its file in a few long runs instead of one per gap (each costs the writer a direct
    write and an extent of its own)."""
    n_files = max(1, min(n_files, len(items)))
    bins: list[list[ItemSpec]] = [[] for _ in range(n_files)]
    loads = [0] * n_files
    for item in sorted(items, key=lambda it: (-it.nbytes, it.fqn, it.offsets)):
        i = loads.index(min(loads))
        bins[i].append(item)
        loads[i] += item.nbytes
    counts = Counter(it.fqn for it in items)
    return [sorted(b, key=lambda it: (counts[it.fqn] > 1, it.fqn, it.offsets)) for b in bins]


def layout_file(
    name: str,
    rank: int,
    items: list[ItemSpec],
    alignment: int = ALIGNMENT,
    dcp_compat: bool = False,
) -> FileLayout:
    """Lay out one data file; ``dcp_compat``: put each chunk's torch legacy prefix (where
    its dtype has one) right before it, so stock DCP readers load the file."""
    header: dict[str, object] = {
        "__metadata__": {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "rank": str(rank),
        }
    }
    placed: list[tuple[ItemSpec, int]] = []
    fixed: list[tuple[int, bytes]] = []
    cur = 0
    for n_pad, item in enumerate(items):
        prefix = legacy_prefix_for(item.dtype, item.sizes) if dcp_compat else None
        n_prefix = len(prefix) if prefix is not None else 0
        start = _align(cur + n_prefix, alignment)
        if start - n_prefix > cur:
            header[f"{PAD_PREFIX}{n_pad}__"] = {
                "dtype": "U8",
                "shape": [start - n_prefix - cur],
                "data_offsets": [cur, start - n_prefix],
            }
        if prefix is not None:
            header[f"{TORCH_LEGACY_PREFIX}{n_pad}__"] = {
                "dtype": "U8",
                "shape": [n_prefix],
                "data_offsets": [start - n_prefix, start],
            }
            fixed.append((start - n_prefix, prefix))
        code = safetensors_code(dtype_from_name(item.dtype))
        shape = list(item.sizes) if code is not None else [item.nbytes]
        header[item.key] = {
            "dtype": code or "U8",
            "shape": shape,
            "data_offsets": [start, start + item.nbytes],
        }
        placed.append((item, start))
        cur = start + item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    data_start = _align(8 + len(text), alignment)
    text += b" " * (data_start - 8 - len(text))
    head = struct.pack("<Q", len(text)) + text
    entries = tuple(EntryLayout(item, data_start + start, item.nbytes) for item, start in placed)
    return FileLayout(
        name=name,
        rank=rank,
        header=head,
        data_start=data_start,
        size=data_start + cur,
        entries=entries,
        fixed=tuple((data_start + off, b) for off, b in fixed),
    )


def layout_rank(
    rank: int,
    items: list[ItemSpec],
    n_files: int = 1,
    alignment: int = ALIGNMENT,
    dcp_compat: bool = False,
) -> RankLayout:
    """Lay out ``items`` of ``rank`` into up to ``n_files`` data files (none if no items);
    ``dcp_compat``: see :func:`layout_file`."""
    if not items:
        return RankLayout(rank, ())
    groups = _split_among_files(items, n_files)
    files = tuple(
        layout_file(data_file_name(rank, i), rank, g, alignment, dcp_compat)
        for i, g in enumerate(groups)
    )
    return RankLayout(rank, files)
