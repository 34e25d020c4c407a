"""Incremental checkpoints for tests: turn the committed checkpoint ``step-<M>`` of a run
folder into one whose chosen tensors refer to the earlier ``step-<N>`` for their bytes
(FORMAT.md §9), as the save side writes them: the same layout, the referenced chunks'
own bytes zeroed (a reader that ignored ``base`` would read zeros and fail their
checksums), the manifest rewritten and resealed through the format module's own
serialisation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from quicksave.format import MANIFEST_NAME
from quicksave.format.manifest import ChunkEntry, Manifest, to_json_bytes
from quicksave.format.manifest_parse import from_json_bytes


def manifest_of(checkpoint: Path) -> Manifest:
    return from_json_bytes((checkpoint / MANIFEST_NAME).read_bytes())


def _same_bytes(a: ChunkEntry, b: ChunkEntry) -> bool:
    return (a.offsets, a.sizes, a.file, a.offset, a.length, a.xxh3_64) == (
        b.offsets,
        b.sizes,
        b.file,
        b.offset,
        b.length,
        b.xxh3_64,
    )


def refer(
    checkpoint: Path, base: int, fqns: Iterable[str], *, drop_files: bool = False
) -> Manifest:
    """Make the chunks of ``fqns`` in ``checkpoint`` refer to the checkpoint ``step-<base>``
    beside it, which must hold the same chunks (same box, file, offset, length and
    checksum: the tensors did not change); a chunk that the base itself refers to
    further names the ultimate base (references are depth 1). ``drop_files``: a data
    file left holding no chunk of its own is deleted and no longer listed. Returns the
    new manifest.
    """
    m = manifest_of(checkpoint)
    held = manifest_of(checkpoint.parent / f"step-{base}")
    tensors = dict(m.tensors)
    for fqn in fqns:
        chunks = []
        for c in m.tensors[fqn].chunks:
            match = [b for b in held.tensors[fqn].chunks if _same_bytes(b, c)]
            assert match, f"step-{base} does not hold chunk {c.offsets} of {fqn} unchanged"
            target = base if match[0].base is None else match[0].base
            if c.base is None:
                with open(checkpoint / c.file, "r+b") as f:
                    f.seek(c.offset)
                    f.write(b"\0" * c.length)
            chunks.append(dataclasses.replace(c, base=target))
        tensors[fqn] = dataclasses.replace(m.tensors[fqn], chunks=tuple(chunks))
    new = dataclasses.replace(m, tensors=tensors)
    if drop_files:
        own = {c.file for t in tensors.values() for c in t.chunks if c.base is None}
        gone = {n for n, f in m.files.items() if f.data_start is not None and n not in own}
        for name in gone:
            (checkpoint / name).unlink()
        files = {n: f for n, f in m.files.items() if n not in gone}
        new = dataclasses.replace(new, files=files)
    (checkpoint / MANIFEST_NAME).write_bytes(to_json_bytes(new))
    return new


def damage_chunks(checkpoint: Path, fqn: str) -> None:
    """Overwrite the stored bytes of every chunk of ``fqn`` that ``checkpoint`` itself
    holds with 0xff (they then fail their checksums)."""
    for c in manifest_of(checkpoint).tensors[fqn].chunks:
        if c.base is None and c.length:
            with open(checkpoint / c.file, "r+b") as f:
                f.seek(c.offset)
                f.write(b"\xff" * c.length)


def unchanged(checkpoint: Path, base: int) -> list[str]:
    """The tensors of ``checkpoint`` whose every chunk ``step-<base>`` beside it holds
    unchanged (what an incremental save would refer to)."""
    m = manifest_of(checkpoint)
    held = manifest_of(checkpoint.parent / f"step-{base}").tensors
    return sorted(
        fqn
        for fqn, t in m.tensors.items()
        if fqn in held and all(any(_same_bytes(b, c) for b in held[fqn].chunks) for c in t.chunks)
    )
