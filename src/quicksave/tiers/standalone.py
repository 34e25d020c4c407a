"""What the object-store tier uploads of an incremental checkpoint (FORMAT.md §9): a
self-contained copy, byte for byte the checkpoint a full save of the same state would
have written, so that nothing on the store refers to anything.

A referring checkpoint's data file has the layout of a full one, with holes where its
referenced chunks lie; each referenced chunk's bytes are at the same offset of the file
of the same name in the checkpoint holding them (the depth-1 rule). The copy of such a
file is the local file with every hole filled from its holder: read through the one
reader of chunk references (:class:`~quicksave.loading.chunks.ChunkFiles`: the holder
must be a committed checkpoint beside it, and each chunk's xxh3-64 is checked as it is
read), into a private mapping of the file (only the filled pages take memory: at most
the referenced bytes of one file). Its manifest is the local one without ``base``
(format version 1): the same chunks, files and checksums.

Why not upload the bases instead: a store has no sparse objects, so a referring file
costs its full size in transfer and storage either way, and a copy that refers to
nothing needs no base on the store, no retention of bases there, and stays loadable
whatever the store's retention deletes.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

from quicksave.format.manifest import ChunkEntry, Manifest
from quicksave.loading.checkpoint import require_committed
from quicksave.loading.chunks import ChunkFiles, check_chunk_within, read_chunk_into
from quicksave.storage import Location
from quicksave.storage.backend import Backend

Refs = list[tuple[str, ChunkEntry]]  # (fqn, chunk) of the referenced chunks of one file


def references_by_file(manifest: Manifest) -> dict[str, Refs]:
    """The referenced chunks of ``manifest`` (those with a ``base``), by data file."""
    out: dict[str, Refs] = {}
    for fqn, tensor in sorted(manifest.tensors.items()):
        for chunk in tensor.chunks:
            if chunk.base is not None:
                out.setdefault(chunk.file, []).append((fqn, chunk))
    return out


def standalone(manifest: Manifest) -> Manifest:
    """``manifest`` with no chunk referring to another checkpoint (format version 1)."""
    tensors = {
        fqn: dataclasses.replace(
            t, chunks=tuple(dataclasses.replace(c, base=None) for c in t.chunks)
        )
        for fqn, t in manifest.tensors.items()
    }
    return dataclasses.replace(manifest, tensors=tensors)


def upload_filled(
    backend: Backend, key: str, checkpoint: Location, name: str, refs: Refs, rank: int
) -> None:
    """Upload the data file ``name`` of the local committed ``checkpoint`` as the
    object ``key`` of ``backend``, its referenced chunks ``refs`` filled in from the
    checkpoints holding them (see the module docstring).

    Raises:
        CorruptCheckpointError: a holder is not a committed checkpoint, its file is
            missing or short, or a chunk's bytes fail its xxh3-64 (naming the holder's
            file, this checkpoint and the tensor).
        CheckpointError: the upload failed.
    """
    source = require_committed(checkpoint, rank=rank)
    local = os.path.join(checkpoint.key, name)
    with open(local, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for fqn, entry in refs:
            check_chunk_within(entry, size, local, fqn, rank)
        with (
            mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as image,
            ChunkFiles(source, None, rank=rank) as files,
        ):
            for fqn, entry in refs:
                where = files.where(fqn, entry)
                held = files.open(where, fqn, rank)
                # through a buffer of its own: no view of the mapping outlives this loop
                # (an error's frames would hold it, and the mapping could not close)
                chunk = bytearray(entry.length)
                with files.naming(where):
                    read_chunk_into(
                        held, memoryview(chunk), entry, path=files.url(where), fqn=fqn, rank=rank
                    )
                image[entry.offset : entry.offset + entry.length] = chunk
            view = memoryview(image)
            try:
                backend.put(key, view)
            finally:
                view.release()
