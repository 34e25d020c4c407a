"""The DCP layout (docs/FORMAT.md §8): one directory that is both a stock
``torch.distributed.checkpoint`` checkpoint and a quicksave checkpoint.

Its files are exactly those DCP's ``FileSystemWriter`` writes:

- data files ``__{rank}_{i}.distcp``, byte for byte DCP's: a sequence of items, each a
  whole ``torch.save`` zip archive (a tensor chunk) or ``torch.save`` bytes (an object).
  A chunk's raw bytes are the archive's ``data/0`` record, stored uncompressed, so they
  lie at a known offset of the file: the manifest's chunk ``offset``;
- ``.metadata`` = ``P | M | F``: DCP's pickled ``Metadata`` (``pickle.load`` stops at
  its end), the manifest JSON (§2, with ``"layout": "dcp"``), and a 40-byte footer
  (:data:`FOOTER_MAGIC`, ``len(P)``, ``len(M)``, xxh3-64 of ``P``, the magic again).

This module is the layout's pure part (no I/O, no torch): the footer, and the records of
what a data file holds. Pieces, in the order a writer uses them:

1. ``quicksave.compat.nvrx.dcp_write.write_dcp_file`` writes one data file from
   ``(key, value)`` items and returns a :class:`DcpFileWritten`: every item's place
   (:class:`DcpItemWritten`), every chunk's raw range and digest, and the file's size and
   digest of the bytes outside its chunks (the manifest's file entry);
2. the writer builds the manifest (``Manifest(..., layout="dcp")``) and DCP's
   ``Metadata`` from those places, pickles the metadata, and
3. writes ``.metadata`` = :func:`encode_metadata` last, after every data file is
   durable (it is the commit, inside a temporary directory that is then renamed).

Readers use :func:`has_footer` (is this ``.metadata`` the layout's?) and
:func:`parse_footer` (where is ``M``?); they never unpickle ``P`` nor any item.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from quicksave.errors import CheckpointError, CorruptCheckpointError
from quicksave.format.manifest import MAX_MANIFEST_BYTES, ChunkEntry, FileEntry

FOOTER_MAGIC = b"QSDCPMF1"
FOOTER_SIZE = 40
PROBE_SIZE = 2 * FOOTER_SIZE  # how much of a .metadata's end has_footer looks at
_FOOTER = struct.Struct("<8sQQQ8s")
_INT_LIMIT = 1 << 63
_PICKLE_STOP = b"."


# --------------------------------------------------------------------------- .metadata


class Footer(NamedTuple):
    """The decoded footer ``F`` of a DCP-layout ``.metadata``."""

    pickle_length: int  # len(P): the manifest starts here
    manifest_length: int  # len(M)
    pickle_xxh3_64: int  # xxh3-64 (seed 0) of P


def encode_metadata(pickle_bytes: bytes, manifest_bytes: bytes) -> bytes:
    """The ``.metadata`` of a DCP-layout checkpoint: ``P | M | F``.

    Args:
        pickle_bytes: ``P``, DCP's ``Metadata`` pickled (``pickle.dumps``); its
            ``storage_data`` gives each chunk its whole ``torch.save`` item.
        manifest_bytes: ``M``, the manifest (``to_json_bytes`` of a manifest with
            ``layout="dcp"``).

    Returns:
        The bytes to write as ``.metadata``.

    Raises:
        CheckpointError: ``P`` does not end with the pickle's STOP opcode (``pickle.load``
            would read past it), or ``M`` is empty or larger than 1 GiB.

    Example::

        blob = encode_metadata(pickle.dumps(md), to_json_bytes(manifest))
    """
    if not pickle_bytes.endswith(_PICKLE_STOP):
        raise CheckpointError(
            "the DCP metadata pickle must end with the pickle STOP opcode ('.'), so that "
            "pickle.load stops before the manifest"
        )
    if not manifest_bytes or len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"the manifest is {len(manifest_bytes)} bytes; it must hold 1 to {MAX_MANIFEST_BYTES}"
        )
    footer = _FOOTER.pack(
        FOOTER_MAGIC,
        len(pickle_bytes),
        len(manifest_bytes),
        xxhash.xxh3_64_intdigest(pickle_bytes),
        FOOTER_MAGIC,
    )
    return b"".join((pickle_bytes, manifest_bytes, footer))


def has_footer(tail: bytes) -> bool:
    """Whether a ``.metadata`` claims the DCP layout: :data:`FOOTER_MAGIC` appears in
    ``tail``, its last :data:`PROBE_SIZE` bytes (or all of it if shorter).

    A probe, not a check: a footer damaged in one byte, or a file cut by up to 32
    bytes, still claims the layout, so that it is reported as a damaged quicksave
    checkpoint by :func:`parse_footer` rather than read as a stock DCP one. A stock
    DCP ``.metadata`` (a pickle, ending with its STOP opcode) never claims it.
    """
    return FOOTER_MAGIC in tail[-PROBE_SIZE:]


def parse_footer(tail: bytes, size: int, path: str) -> Footer:
    """Decode the footer of a DCP-layout ``.metadata`` from its last
    :data:`FOOTER_SIZE` bytes, before anything else of the file is read.

    Args:
        tail: the file's last ``FOOTER_SIZE`` bytes (fewer if the file is shorter).
        size: the file's size.
        path: the ``.metadata``'s path or URL, named in errors.

    Returns:
        The :class:`Footer`.

    Raises:
        CorruptCheckpointError: a magic is missing, ``len(P) + len(M) + 40`` is not the
            file's size, ``P`` or ``M`` is empty, or ``M`` claims more than 1 GiB.
    """
    if size < FOOTER_SIZE or len(tail) != FOOTER_SIZE:
        raise CorruptCheckpointError(
            f"DCP-layout metadata: the file has {size} bytes, fewer than its "
            f"{FOOTER_SIZE}-byte footer",
            path=path,
        )
    head, len_p, len_m, digest_p, end = _FOOTER.unpack(tail)
    if head != FOOTER_MAGIC or end != FOOTER_MAGIC:
        raise CorruptCheckpointError(
            "DCP-layout metadata: the footer's magic is damaged (the file is truncated or "
            "its last bytes were changed)",
            path=path,
        )
    if len_m > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"DCP-layout metadata: the footer claims a {len_m}-byte manifest, more than "
            "the 1 GiB limit; refusing to read it",
            path=path,
        )
    if len_p >= _INT_LIMIT or len_p + len_m + FOOTER_SIZE != size:
        raise CorruptCheckpointError(
            f"DCP-layout metadata: the footer's lengths (pickle {len_p}, manifest {len_m}, "
            f"footer {FOOTER_SIZE}) do not add up to the file's size {size} (truncated or "
            "extended?)",
            path=path,
        )
    if len_p == 0 or len_m == 0:
        raise CorruptCheckpointError(
            "DCP-layout metadata: the footer records an empty pickle or manifest", path=path
        )
    return Footer(len_p, len_m, digest_p)


# --------------------------------------------------------------------------- data files


@dataclass(frozen=True)
class DcpItemWritten:
    """Where ``write_dcp_file`` put one item (offsets are absolute in the file).

    Attributes:
        key: the item's key, as given.
        item_offset, item_length: the whole item (a ``torch.save`` archive, or the byte
            item): DCP's ``_StorageInfo(file, item_offset, item_length)``.
        raw_offset, raw_length: a tensor's raw bytes (the archive's ``data/0`` record):
            the manifest chunk's ``offset`` and ``length``. None for byte items.
        xxh3_64: xxh3-64 of the raw bytes (16 hex digits): the chunk's ``xxh3_64``.
            None for byte items.
    """

    key: str
    item_offset: int
    item_length: int
    raw_offset: int | None = None
    raw_length: int | None = None
    xxh3_64: str | None = None

    def chunk_entry(self, file: str, offsets: Sequence[int], sizes: Sequence[int]) -> ChunkEntry:
        """The manifest's chunk for this tensor item, the box ``offsets``..``offsets +
        sizes`` of its tensor, stored in ``file``.

        Raises:
            CheckpointError: this is a byte item (it has no raw bytes).
        """
        if self.raw_offset is None or self.raw_length is None or self.xxh3_64 is None:
            raise CheckpointError("a byte item is no tensor chunk", fqn=self.key)
        return ChunkEntry(
            tuple(offsets), tuple(sizes), file, self.raw_offset, self.raw_length, self.xxh3_64
        )


@dataclass(frozen=True)
class DcpFileWritten:
    """What ``write_dcp_file`` wrote.

    Attributes:
        size: bytes written (the file's size).
        xxh3_64: xxh3-64 of every byte outside the tensors' raw ranges, in file order:
            the manifest file entry's ``xxh3_64``.
        items: key -> :class:`DcpItemWritten`, in the order written.
    """

    size: int
    xxh3_64: str
    items: dict[str, DcpItemWritten]

    def file_entry(self, rank: int) -> FileEntry:
        """The manifest's entry for this data file, written by ``rank``."""
        return FileEntry(size=self.size, xxh3_64=self.xxh3_64, rank=rank)
